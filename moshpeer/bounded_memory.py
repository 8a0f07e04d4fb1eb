"""`remember`: a dict used as a bounded memory of recent keys (peers refused, avoided, distrusted, ...).

Identities are cheap, so every table keyed by peer id that a stranger can make grow is bounded: the newest entry
goes last, and beyond the limit the oldest are forgotten (a dict keeps insertion order)."""

from __future__ import annotations

from typing import Any, Dict, Hashable


def remember(memory: Dict[Hashable, Any], key: Hashable, value: Any = None, *, limit: int) -> None:
    """Store `key` -> `value` as `memory`'s newest entry, then forget the oldest entries beyond `limit`."""
    memory.pop(key, None)
    memory[key] = value
    while len(memory) > limit:
        memory.pop(next(iter(memory)))
