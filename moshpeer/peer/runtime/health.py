"""Round health: how a peer's recent collaborative rounds went, in five numbers for its peer record."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from moshpeer.dht.records import MAX_HEALTH_ROUNDS

RECENT_ROUNDS = 20


def round_health(rounds: Sequence[Any], recent: int = RECENT_ROUNDS) -> Optional[Dict[str, Any]]:
    """The `round_health` record field from the last `recent` `CollaborativeRound`s (None before the first):
    how many there were, how many averaged with a group, and over those the mean share of chunks lost, the mean
    seconds per round (matchmaking + data plane) and the share of connections to group members that went over
    a relay (`RoundResult.relayed`: the members our chunks reached through a relay, ours or libp2p's)."""
    window = list(rounds)[-min(recent, MAX_HEALTH_ROUNDS):]
    if not window:
        return None
    averaged = [r for r in window if r.ok]
    n = max(len(averaged), 1)
    connections = sum(max(0, r.group_size - 1) for r in averaged)
    relayed = sum(len(r.result.relayed) for r in averaged)
    return {
        "rounds": len(window),
        "averaged": len(averaged),
        "lost_fraction": min(1.0, max(0.0, sum(float(r.lost_fraction) for r in averaged) / n)),
        "seconds": max(0.0, sum(float(r.matchmaking_s) + float(r.averaging_s) for r in averaged) / n),
        "relayed_fraction": min(1.0, relayed / connections) if connections else 0.0,
    }
