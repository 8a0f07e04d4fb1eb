"""End to end: a group all-reduce with every codec on a real swarm of 4 processes (DHT, hivemind matchmaking,
moshpeer's TCP data plane). One swarm serves every codec (an averager per codec, see compression_swarm_worker.py).

Checked per group that formed: the result against the exact weighted mean within the codec's documented bound
(compression_bounds.py), identical bits on every member, and for arc-topk the same selected rows everywhere
(the top-k of the averaged sketch, seeded by the group id), unselected parameters untouched, and at most 3% of
the uncompressed bytes on the wire.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from averaging_swarm import AveragingSwarm
from compression_bounds import allreduce_error_bound, exact_mean
from compression_swarm_worker import peer_values, peer_weight

from moshpeer.compression import get_compression
from moshpeer.compression.arc_topk import select, sketch, to_rows

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "compression_swarm_worker.py"

PEERS = 4
NUMEL = (1 << 18) + 5  # odd: partial chunks, blocks and ARC rows
CHUNK_BYTES = 1 << 16
ROUND_TIMEOUT = 90.0  # the reply deadline of one round (matchmaking + data plane) on a loaded machine
ATTEMPTS = 3


@pytest.fixture(scope="module")
def swarm():
    with AveragingSwarm(PEERS, "--numel", str(NUMEL), "--chunk-bytes", str(CHUNK_BYTES), "--group-size", str(PEERS),
                        script=WORKER) as s:
        yield s


def run_round(swarm, tmp_path, codec: str, mode: str = "params", seed: int = 1):
    """Open `codec` on every worker, then one round everywhere; returns {worker index: (report, result)}.

    A round in which matchmaking left a worker out (it found no group while its mates counted it: hivemind's
    leader and follower can disagree when a loaded machine stalls an event loop past the request timeout; the
    mates report it absent) is run again on freshly opened averagers (a fresh EF21M state too), up to
    ATTEMPTS times: this file checks the codecs, test_averaging_swarm checks what such a round reports."""
    for attempt in range(1, ATTEMPTS + 1):
        swarm.all("opened", 60, cmd="open", codec=codec, mode=mode)
        for worker in swarm.workers:
            worker.send(cmd="round", seed=seed, path=str(tmp_path / f"{worker.index}.pt"))
        reports = {worker.index: worker.read_event("report", ROUND_TIMEOUT) for worker in swarm.workers}
        left_out = [k for k, report in reports.items() if not report["ok"]]
        if not left_out:
            break
        print(f"{codec}: attempt {attempt}: workers {left_out} found no group: "
              f"{[reports[k].get('error') for k in left_out]}")
    else:
        time.sleep(1.0)  # the workers' last log lines are still on their way
        log = "\n".join(f"--- worker {w.index}\n" + "\n".join(w.stderr_lines[-30:]) for w in swarm.workers)
        raise AssertionError(f"{codec}: workers {left_out} found no group in {ATTEMPTS} attempts\n{log}")
    for k, report in reports.items():
        assert report["chunks_lost"] == 0 and not report["departed"], report
    return {k: (report, torch.load(tmp_path / f"{k}.pt")) for k, report in reports.items()}


def groups_of(results) -> List[List[int]]:
    """Worker indices per group that formed, each ordered by position in the group (the partition order)."""
    by_id: Dict[str, List[int]] = {}
    for index, (report, _) in results.items():
        by_id.setdefault(report["group_id"], []).append(index)
    groups = [sorted(members, key=lambda k: results[k][0]["my_index"]) for members in by_id.values()]
    for members in groups:
        assert len(members) >= 2 and all(results[k][0]["group_size"] == len(members) for k in members)
    return groups


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int4", "int4-int8"])
def test_dense_codec_end_to_end(swarm, tmp_path, codec):
    results = run_round(swarm, tmp_path, codec)
    for members in groups_of(results):
        inputs = [peer_values(1, k, NUMEL) for k in members]
        weights = [peer_weight(k) for k in members]
        mean = exact_mean(inputs, weights)
        bound = allreduce_error_bound(codec, inputs, weights, CHUNK_BYTES // 4)
        first = results[members[0]][1]
        for k in members:
            result = results[k][1]
            error = (result.double() - mean).abs()
            worst = int(torch.argmax(error / bound))
            assert bool((error <= bound).all()), (
                f"{codec}, worker {k}, value {worst}: error {error[worst]:.3g} > bound {bound[worst]:.3g}")
            assert torch.equal(result, first), f"{codec}: worker {k} holds other values than worker {members[0]}"


def expected_rows(group_id_hex: str, inputs, weights, spec: str) -> torch.Tensor:
    """The rows every member must select: top-k of the weighted mean of the members' sketches."""
    sparsifier = get_compression(spec).sparsifier
    seed = int.from_bytes(bytes.fromhex(group_id_hex)[:8], "big") & 0x7FFFFFFF
    sketches = [sketch(to_rows(x, sparsifier.row_len), seed, sparsifier.rank).double() for x in inputs]
    average = sum(w * s for w, s in zip(weights, sketches)) / sum(weights)
    return select(average.float(), sparsifier.num_selected(NUMEL))


def row_mask(rows: torch.Tensor, row_len: int) -> torch.Tensor:
    mask = torch.zeros(math.ceil(NUMEL / row_len) * row_len, dtype=torch.bool)
    mask.view(-1, row_len)[rows] = True
    return mask[:NUMEL]


@pytest.mark.parametrize("mode", ["params", "ef"])
def test_arc_topk_end_to_end(swarm, tmp_path, mode):
    """params: selected rows averaged, the rest untouched; ef (EF21M, first step): the compressed average e_bar."""
    spec = "arc-topk:0.01"
    sparsifier = get_compression(spec).sparsifier
    results = run_round(swarm, tmp_path, spec, mode=mode)
    for members in groups_of(results):
        inputs = [peer_values(1, k, NUMEL) for k in members]
        weights = [peer_weight(k) for k in members]
        mean = exact_mean(inputs, weights)
        rows = expected_rows(results[members[0]][0]["group_id"], inputs, weights, spec)
        assert rows.numel() == sparsifier.num_selected(NUMEL)
        selected = row_mask(rows, sparsifier.row_len)
        tolerance = 1e-5 * (1.0 + mean.abs().max())
        first = results[members[0]][1]
        for k, original in zip(members, inputs):
            result = results[k][1]
            # The same rows on every member: exactly the selected ones hold the average ...
            assert float((result[selected].double() - mean[selected]).abs().max()) <= tolerance
            assert torch.equal(result[selected], first[selected]), f"worker {k}: other dense values"
            # ... and the others are what this mode leaves there.
            if mode == "params":
                assert torch.equal(result[~selected], original[~selected]), f"worker {k}: unselected rows changed"
            else:
                assert not bool(result[~selected].any()), f"worker {k}: e_bar is not zero outside the selection"
            # Traffic: sketch + selected rows, at most 3% of what the uncompressed all-reduce sends.
            group_size = len(members)
            dense_bytes = 2 * (group_size - 1) / group_size * NUMEL * 4
            assert results[k][0]["bytes_sent"] <= 0.03 * dense_bytes, results[k][0]["bytes_sent"] / dense_bytes
