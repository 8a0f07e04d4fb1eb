"""One round result: the data plane's `DataPlaneStats`, added up over a round's all-reduces, embedded in
`RoundResult`, whose attributes and `to_dict()` keys stay what readers (peer/, cli/, metrics, benchmarks)
know."""

from __future__ import annotations

import json

from moshpeer.averaging.report import DataPlaneStats, PhaseStats, RoundResult
from moshpeer.averaging.suspects import MemberEvidence

# The keys of `RoundResult.to_dict()` before the data plane's stats were embedded, in their order (plus
# `robust_too_few`, added after `nonfinite_averages` in session 10, `upload_paced_s`, in session 16, and
# `contributors`, in session 23, and `late`, in session 50).
KEYS = ["ok", "averaged", "group_id", "group_size", "my_index", "group_bits", "coordinates", "weight", "matchmaking_s",
        "compression", "error", "loss_budget", "loss_phase", "matchmaking_window_s", "round_deadline_s",
        "data_deadline_s", "upload_paced_s", "reduce", "gather", "departed", "absent", "relayed", "missing_chunks",
        "rejected_connections", "rejected_messages", "staged_bytes", "reduce_scatter_s", "all_gather_s", "total_s",
        "upload_bps", "part_sizes", "aggregation", "flagged", "distrusted", "contributors", "member_epochs",
        "members_diverged", "nonfinite_averages", "robust_too_few", "over_libp2p", "connections_kept", "late",
        "chunks_lost", "lost_fraction", "bytes_sent", "bytes_received"]


def stats(k: int) -> DataPlaneStats:
    return DataPlaneStats(
        reduce=PhaseStats(chunks_sent=k, chunks_received=k, chunks_expected=k + 1, chunks_lost=1, bytes_sent=10 * k),
        gather=PhaseStats(chunks_expected=2, chunks_lost=k, bytes_received=5 * k, seconds=0.5),
        departed=[k], late=[k], absent=[2], relayed=[k, 3], missing_chunks=[(k, 0)], rejected_connections=k,
        rejected_messages=1, staged_bytes=100, reduce_scatter_s=1.0, all_gather_s=0.5, total_s=1.5,
        upload_bps=None if k == 1 else 1e6 * k, nonfinite_averages=k, robust_too_few=k,
        evidence_by_index=[MemberEvidence(), MemberEvidence(2, k, k - 1), MemberEvidence(2)])


def test_two_allreduces_add_up():
    total = stats(1) + stats(2)
    assert total.reduce == PhaseStats(chunks_sent=3, chunks_received=3, chunks_expected=5, chunks_lost=2,
                                      bytes_sent=30)
    assert total.gather.chunks_lost == 3 and total.gather.seconds == 1.0
    assert total.departed == [1, 2] and total.late == [1, 2] and total.absent == [2] and total.relayed == [1, 2, 3]
    assert total.missing_chunks == [(1, 0), (2, 0)]
    assert (total.rejected_connections, total.rejected_messages, total.staged_bytes) == (3, 2, 200)
    assert (total.reduce_scatter_s, total.all_gather_s, total.total_s) == (2.0, 1.0, 3.0)
    assert total.upload_bps == 2e6 and total.nonfinite_averages == 3 and total.robust_too_few == 3
    assert total.evidence_by_index == [MemberEvidence(), MemberEvidence(4, 3, 1), MemberEvidence(4)]
    assert sum([stats(1)], DataPlaneStats()) == stats(1)  # adding to nothing changes nothing


def test_round_result_reads_the_embedded_stats_and_keeps_its_keys():
    result = RoundResult(ok=True, group_size=3, data=stats(2), flagged={"peerB": 2})
    assert result.reduce is result.data.reduce and result.departed == [2] and result.total_s == 1.5
    assert result.chunks_lost == 1 + 2 and result.lost_fraction == 3 / (3 + 2)
    assert result.bytes_sent == 20 and result.bytes_received == 10
    plain = result.to_dict()
    assert list(plain) == KEYS
    assert plain["flagged"] == {"peerB": 2} and plain["reduce"]["bytes_sent"] == 20 and plain["departed"] == [2]
    json.loads(result.to_json())
    assert list(RoundResult(ok=False, error="no group found").to_dict()) == KEYS
