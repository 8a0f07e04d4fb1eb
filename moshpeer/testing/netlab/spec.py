"""What a netlab peer is given, parsed from flags or API values: rates, delays, CPU shares, sites."""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Union

from moshpeer.testing.netlab.commands import NetlabError

RateSpec = Union[None, float, str]
# Kinds of site a peer may sit behind (nat.py): none (a public address on the core router), or a router of
# its own that translates (cone: endpoint-independent mapping; symmetric: a new port per destination) or
# only filters (firewall); all three drop unsolicited inbound traffic.
SITE_KINDS = ("cone", "symmetric", "firewall")


def parse_rate(spec: RateSpec) -> Optional[float]:
    """A rate in Mbit/s from 100, "100", "100mbit", "1gbit", "500kbit"; None / "none" / 0 = unshaped.

    Raises NetlabError on anything else."""
    if spec is None:
        return None
    if isinstance(spec, (int, float)):
        value = float(spec)
    else:
        text = spec.strip().lower()
        if text in ("", "none", "0"):
            return None
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(kbit|mbit|gbit)?(?:/s|ps)?", text)
        if not match:
            raise NetlabError(f"bad rate {spec!r}: use e.g. 100, 100mbit, 1gbit or 500kbit")
        value = float(match.group(1)) * {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, None: 1.0}[match.group(2)]
    if value == 0:
        return None
    if not 0 < value < 1e6:
        raise NetlabError(f"bad rate {spec!r}: must be positive and below 1 Tbit/s")
    return value


def parse_ms(spec: Union[None, float, str]) -> float:
    """A duration in milliseconds from 100, "100", "100ms", "0.1s", "250us"; None = 0. NetlabError otherwise."""
    if spec is None:
        return 0.0
    if isinstance(spec, (int, float)):
        value = float(spec)
    else:
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s)?", spec.strip().lower())
        if not match:
            raise NetlabError(f"bad duration {spec!r}: use e.g. 100ms, 0.2s or 500us")
        value = float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3, None: 1.0}[match.group(2)]
    if not 0 <= value <= 10_000:
        raise NetlabError(f"bad duration {spec!r}: must be within 0 and 10 s")
    return value


def parse_share(spec: Union[None, float, str]) -> Optional[float]:
    """A CPU share (cores, e.g. 0.3) from 0.3 / "0.3" / "30%"; None / "none" = unlimited. NetlabError otherwise."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return None
    try:
        text = str(spec).strip()
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise NetlabError(f"bad CPU share {spec!r}: use e.g. 0.3 (cores) or 30%") from None
    if not 0.01 <= value <= 1024:
        raise NetlabError(f"bad CPU share {spec!r}: must be within 0.01 and 1024 cores")
    return value


def parse_site(spec: Optional[str]) -> Optional[str]:
    """A site label: None / "" / "-" / "public" = no site; else KIND or KIND-NAME (peers with the same label
    share one router), KIND one of SITE_KINDS. NetlabError otherwise."""
    if spec is None or spec.strip() in ("", "-", "public", "none"):
        return None
    label = spec.strip().lower()
    if label.split("-", 1)[0] not in SITE_KINDS or not re.fullmatch(r"[a-z0-9-]{1,24}", label):
        raise NetlabError(f"bad site {spec!r}: use - (public), or {', '.join(SITE_KINDS)}, optionally "
                          f"with a name (cone-a: peers with the same label share one router)")
    return label


def site_kind(label: str) -> str:
    return label.split("-", 1)[0]


def per_peer(values, peers: int, parse, what: str) -> List:
    """One value for every peer, or a sequence (or comma-separated string) of one per peer, each parsed."""
    if isinstance(values, str):
        values = values.split(",")
    if values is None or isinstance(values, (int, float)) or (isinstance(values, Sequence) and len(values) == 1):
        one = values[0] if isinstance(values, Sequence) and not isinstance(values, str) else values
        return [parse(one)] * peers
    if len(values) != peers:
        raise NetlabError(f"{len(values)} {what} values for {peers} peers: give one, or one per peer")
    return [parse(v) for v in values]


def parse_rates(text: str, peers: int) -> List[Optional[float]]:
    """"100" (every peer) or "100,100,10" (one per peer) -> Mbit/s per peer."""
    return per_peer(text, peers, parse_rate, "rate")
