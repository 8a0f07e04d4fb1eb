#!/usr/bin/env bash
# The README's test command under load: one busy process per core beside it, as on a shared CI machine or
# a laptop doing other work. Flaky tests show up here first. Extra arguments go to pytest, e.g.
#   tests/stress.sh -x                      # the fast lane under load, stop at the first failure
#   tests/stress.sh tests/swarm/test_training.py  # one file under load
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=()
stop_hogs() { if ((${#hogs[@]})); then kill "${hogs[@]}" 2>/dev/null || true; fi; }
trap stop_hogs EXIT INT TERM
for _ in $(seq "$(nproc)"); do
    (trap - EXIT INT TERM; while :; do :; done) &
    hogs+=($!)
done
python -m pytest -m "not slow and not swarm" -n auto -q "$@"  # the README's command
