"""A mistyped flag is reported before anything heavy loads: building the parsers of every subcommand imports
neither torch nor hivemind (seconds of imports on an idle machine, tens on a busy one), so
`moshpeer join --bogus-flag` fails at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moshpeer.cli.main import COMMANDS

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

# Every subcommand with a flag it does not know: exit code, and whether torch / hivemind got imported.
PROBE = """
import json, sys
from moshpeer.cli.main import COMMANDS, main
codes = {}
for command in COMMANDS:
    try:
        main([command, "--bogus-flag"])
    except SystemExit as e:
        codes[command] = e.code
print(json.dumps({"codes": codes, "heavy": sorted(m for m in ("torch", "hivemind") if m in sys.modules)}))
"""


def test_no_subcommand_parser_imports_torch_or_hivemind():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=ENV, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {command: 2 for command in COMMANDS}, out.stderr
    assert report["heavy"] == [], "building the parsers imported " + ", ".join(report["heavy"])


def test_join_with_a_bogus_flag_fails_at_once():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "moshpeer", "join", "--run-id", "x", "--bogus-flag"],
                         capture_output=True, text=True, env=ENV, timeout=60)
    elapsed = time.monotonic() - started
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "moshpeer: error: unrecognized arguments: --bogus-flag", out.stderr
    assert "Traceback" not in out.stderr
    assert elapsed < 5.0, f"{elapsed:.1f} s to reject a flag (was ~3 s idle when torch loaded first; < 0.3 s now)"
