"""Helpers for training tests: spawn training peers through the real CLI and read their JSON lines."""

from __future__ import annotations

import json
from typing import List, Sequence

from swarm import LOOPBACK, Proc, Swarm

# Local swarms on a loaded 2-core machine: generous matchmaking, bounded rounds.
FAST_TRAINING = ("--matchmaking-time", "1.0", "--round-timeout", "10", "--heartbeat", "1")


def events(proc: Proc, kind: str) -> List[dict]:
    """Every `{"event": kind, ...}` JSON line the process printed so far."""
    found = []
    for line in list(proc.stdout_lines):
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == kind:
                found.append(event)
    return found


def wait_event(proc: Proc, kind: str, timeout: float, predicate=lambda event: True) -> dict:
    """The first `kind` event satisfying `predicate`, waiting up to `timeout` seconds."""

    def matches(line: str) -> bool:
        if not line.startswith("{"):
            return False
        try:
            event = json.loads(line)
        except ValueError:
            return False
        return event.get("event") == kind and predicate(event)

    return json.loads(proc.wait_for_line(matches, timeout))


def start_trainers(swarm: Swarm, n: int, run_id: str, initial_peers: Sequence[str], *extra: str) -> List[Proc]:
    """Spawn `n` training peers (`moshpeer join`) on loopback; returns without waiting."""
    return [
        swarm.spawn("join", "--initial-peers", *initial_peers, "--run-id", run_id, "--host-maddrs", LOOPBACK,
                    *FAST_TRAINING, *extra, name=f"trainer{i}")
        for i in range(n)
    ]
