from moshpeer.cli.main import main

raise SystemExit(main())
