"""The training level's time model of the network: a group round's data plane (`group_round_seconds`),
matchmaking (`matchmaking_seconds`) and the synchronous baseline's all-reduce (`ring_allreduce_seconds`).
Pure functions of sizes, link speeds and round trips; compute time (samples / speed) and failures are modelled
where they happen (`moshpit_training.py`, `sync_training.py`, `swarm.py`).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

# Link speeds are line rates (as an ISP and Linux's tbf count them): a full TCP segment on Ethernet (MTU 1500, TCP
# timestamps) carries 1448 payload bytes in 1514 on the wire, 4.6% more. Session 14's netlab runs put real rounds
# at 1.19-1.27x a model without it (docs/simulation.md, "Round times on shaped links").
WIRE_BYTES_PER_PAYLOAD_BYTE = 1514 / 1448
# A round opens a fresh connection to every other member (kept connections carry few of a large swarm's rounds:
# link_reuse.py): a TCP connect and the handshake's HELLO / REPLY before the first frame.
CONNECTION_SETUP_RTTS = 2
# Linux's initial congestion window: 10 segments (RFC 6928) of 1448 payload bytes.
SEGMENT_BYTES = 1448
INITIAL_WINDOW_SEGMENTS = 10
MAX_INITIAL_WINDOW_SEGMENTS = 1024  # the most a config may ask for (what `ip route ... initcwnd` allows is more)
INITIAL_WINDOW_BYTES = INITIAL_WINDOW_SEGMENTS * SEGMENT_BYTES


def slow_start_seconds(nbytes: float, rate: float, rtt_s: float, initial_window: float = INITIAL_WINDOW_BYTES) -> float:
    """How much longer a fresh TCP connection takes to move `nbytes` than it would at `rate` from the first byte:
    slow start sends one window per round trip, doubling it from `initial_window` until it covers the path's
    bandwidth-delay product (`rate` * `rtt_s`), and only then runs at `rate`. 0 without a round trip.

    On netlab (4 peers, 100 Mbit/s, 4 MB each; docs/simulation.md), `group_round_seconds` with this term puts a
    round at 0.37 s over the link's bound at 50 ms and 1.80 s at 200 ms; measured with a fresh connection per
    round: 0.42-0.51 s and 1.72-1.77 s (sessions 48 and 49)."""
    if rtt_s <= 0 or nbytes <= 0:
        return 0.0
    bdp = rate * rtt_s
    window, sent, round_trips = float(initial_window), 0.0, 0
    while window < bdp and sent + window < nbytes:
        sent, window, round_trips = sent + window, 2 * window, round_trips + 1
    return max(round_trips * rtt_s - sent / rate, 0.0)


def group_round_seconds(numel: int, part_sizes: Sequence[int], uplinks: Sequence[float], downlinks: Sequence[float],
                        rtt_s: float, bytes_per_value: float,
                        initial_window: float = INITIAL_WINDOW_BYTES) -> Tuple[float, List[float]]:
    """Data-plane time of one group round and the bytes each member uploads.

    Member i uploads its contribution to every other part (numel - s_i values, reduce-scatter) and its averaged
    part to the n - 1 others ((n - 1) s_i, all-gather), and downloads as much. Chunks are pipelined (an owner
    sends a chunk back as soon as it is final), so the round lasts as long as the busiest link:
    max_i max(U_i / up_i, D_i / down_i) in wire bytes (`WIRE_BYTES_PER_PAYLOAD_BYTE`), plus one round trip per
    phase, plus fresh connections' cost: CONNECTION_SETUP_RTTS round trips before the first frame and the
    slowest member's slow start (`slow_start_seconds` of a contribution to one part at a fair share of its
    link, from `initial_window` bytes). With unlimited downlinks and no round trip this is the production model
    `partition.reduce_allgather_seconds` (the one `bandwidth_part_sizes` optimizes) times the wire overhead. The
    bytes returned are payload bytes.

    :raises ValueError: part sizes that do not fit the members, or a non-positive link speed
    """
    n = len(part_sizes)
    if n != len(uplinks) or n != len(downlinks) or sum(part_sizes) != numel:
        raise ValueError("part sizes, uplinks and downlinks must have one entry per member and sum to numel")
    if any(not b > 0 for b in list(uplinks) + list(downlinks)):
        raise ValueError("link speeds must be positive")
    if n == 1:
        return 0.0, [0.0]
    busiest = ramp = 0.0
    sent = []
    for s, up, down in zip(part_sizes, uplinks, downlinks):
        volume = (numel - s + (n - 1) * s) * bytes_per_value
        busiest = max(busiest, volume / up, volume / down)
        sent.append(volume)
        # Its reduce-scatter connections start cold, each with a fair share of its uplink (the all-gather then
        # runs on the same, warm, connections).
        contribution = (numel - s) / (n - 1) * bytes_per_value * WIRE_BYTES_PER_PAYLOAD_BYTE
        ramp = max(ramp, slow_start_seconds(contribution, min(up, down) / (n - 1), rtt_s, initial_window))
    return busiest * WIRE_BYTES_PER_PAYLOAD_BYTE + ramp + (2 + CONNECTION_SETUP_RTTS) * rtt_s, sent


def matchmaking_seconds(peers: int, rtt_s: float) -> float:
    """Matchmaking of one round: a DHT lookup of the group key (about log2 N hops) plus the join request and
    the leader's reply. A model, not production timing (hivemind's matchmaking is asynchronous)."""
    return (2 + math.ceil(math.log2(max(peers, 2)))) * rtt_s


def ring_allreduce_seconds(numel: int, peers: int, uplink: float, downlink: float, rtt_s: float,
                           bytes_per_value: float) -> float:
    """The synchronous baseline's all-reduce of `numel` values among `peers`: a ring's bandwidth term
    (2 (n - 1) / n of the vector through the slowest link) with a tree's latency term (2 log2 n round trips).
    Generous to the baseline: no real all-reduce has both."""
    if peers <= 1:
        return 0.0
    volume = 2 * (peers - 1) / peers * numel * bytes_per_value * WIRE_BYTES_PER_PAYLOAD_BYTE
    return volume / min(uplink, downlink) + 2 * math.ceil(math.log2(peers)) * rtt_s
