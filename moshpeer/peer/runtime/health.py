"""Round health: how a peer's recent collaborative rounds went, in four numbers for its peer record."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from moshpeer.dht.records import MAX_HEALTH_ROUNDS

RECENT_ROUNDS = 20


def round_health(rounds: Sequence[Any], recent: int = RECENT_ROUNDS) -> Optional[Dict[str, Any]]:
    """The `round_health` record field from the last `recent` `CollaborativeRound`s (None before the first):
    how many there were, how many averaged with a group, and over those the mean share of chunks lost and
    the mean seconds per round (matchmaking + data plane)."""
    window = list(rounds)[-min(recent, MAX_HEALTH_ROUNDS):]
    if not window:
        return None
    averaged = [r for r in window if r.ok]
    n = max(len(averaged), 1)
    return {
        "rounds": len(window),
        "averaged": len(averaged),
        "lost_fraction": min(1.0, max(0.0, sum(float(r.lost_fraction) for r in averaged) / n)),
        "seconds": max(0.0, sum(float(r.matchmaking_s) + float(r.averaging_s) for r in averaged) / n),
    }
