"""Helpers for training tests: spawn training peers through the real CLI and read their JSON lines."""

from __future__ import annotations

import json
from typing import List, Optional, Sequence, Tuple

from moshpeer.cli.plot import parse_event_line
from swarm import LOOPBACK, Proc, Swarm

# Local swarms on a loaded 2-core machine: generous matchmaking, bounded rounds.
FAST_TRAINING = ("--matchmaking-time", "1.0", "--round-timeout", "10", "--heartbeat", "1")


def timed_events(proc: Proc, kind: str) -> List[Tuple[float, dict]]:
    """Every `{"event": kind, ...}` JSON line the process printed so far, with the time.monotonic()
    at which it arrived here (one clock for every process of a swarm)."""
    found = []
    for received, line in proc.timed_stdout():
        event = parse_event_line(line)
        if event is not None and event.get("event") == kind:
            found.append((received, event))
    return found


def events(proc: Proc, kind: str) -> List[dict]:
    """Every `{"event": kind, ...}` JSON line the process printed so far."""
    return [event for _, event in timed_events(proc, kind)]


def wait_event(proc: Proc, kind: str, timeout: float, predicate=lambda event: True) -> dict:
    """The first `kind` event satisfying `predicate`, waiting up to `timeout` seconds."""

    def matches(line: str) -> bool:
        event = parse_event_line(line)
        return event is not None and event.get("event") == kind and predicate(event)

    return json.loads(proc.wait_for_line(matches, timeout))


def start_trainers(swarm: Swarm, n: int, run_id: str, initial_peers: Sequence[str], *extra: str,
                   first_seed: Optional[int] = None) -> List[Proc]:
    """Spawn `n` training peers (`moshpeer join`) on loopback; returns without waiting. With `first_seed`, trainer
    i reads the data in the order of seed `first_seed + i`. Without, the order comes from its peer id, a fresh
    one each run, and the final accuracy varies by about a point from run to run (0.912-0.935 in three runs of
    test_training_aux whose rounds all averaged): a test that compares the accuracy with one single-process
    reference must fix the seeds, or it reads that spread as a failure."""
    return [
        swarm.spawn("join", "--initial-peers", *initial_peers, "--run-id", run_id, "--host-maddrs", LOOPBACK,
                    *FAST_TRAINING, *(("--seed", str(first_seed + i)) if first_seed is not None else ()), *extra,
                    name=f"trainer{i}")
        for i in range(n)
    ]
