"""bf16 and fp16 parameters through the real CLI (`moshpeer join --task gpt --device cpu`): two peers average
in fp32 buffers on the parameters' device and end every full round with identical half-precision parameters;
a bf16 peer's final checkpoint resumes bit for bit (bf16 state download: tests/swarm/test_devices.py). Micro-batch
gradients of half-precision parameters are accumulated in fp32 and cast back once. With CUDA (`cuda`
marker), the same GPT trains on the GPU through `moshpeer join --device cuda`."""

from __future__ import annotations

import pytest
import torch

from training_swarm import events, start_trainers, wait_event

from moshpeer.peer.optimizer import CollaborativeOptimizer

pytestmark = pytest.mark.timeout(300)

# A tiny GPT (one layer, width 16): what is under test is the dtype and device plumbing, not the model.
TINY_GPT = ("--task", "gpt", "--task-arg", "context=16", "--task-arg", "d_model=16", "--task-arg", "layers=1",
            "--task-arg", "max_bytes=100000", "--task-arg", "eval_windows=16",
            "--target-batch-size", "32", "--batch-size", "16", "--group-size", "2")


def gpt(dtype: str, device: str = "cpu") -> tuple:
    return (*TINY_GPT, "--task-arg", f"dtype={dtype}", "--device", device)


def assert_averaged_in_lockstep(peers, dtype: str, last_epoch: int = 10**9, device: str = "cpu") -> None:
    """Both peers trained `dtype` on `device` and averaged with each other; while every round so far was a
    round of both (no step alone, which would make their optimizer states differ), their digests match."""
    for peer in peers:
        (training,) = events(peer, "training")
        assert training["device"].startswith(device) and training["dtype"] == dtype, training
        assert any(e["ok"] and e["group_size"] == 2 for e in events(peer, "epoch")), peer.describe(20)
    by_epoch = [{e["epoch"]: e for e in events(peer, "epoch")} for peer in peers]
    epoch = 1
    while epoch <= last_epoch and all(epoch in e and e[epoch]["ok"] for e in by_epoch):
        a, b = by_epoch[0][epoch], by_epoch[1][epoch]
        assert a["params_digest"] == b["params_digest"], (epoch, a, b)
        assert a["loss"] == a["loss"] and b["loss"] == b["loss"]  # not NaN
        epoch += 1


@pytest.mark.swarm
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_peers_average_in_lockstep(swarm, dtype):
    run = f"half-{dtype}"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    peers = start_trainers(swarm, 2, run, boot.maddrs, *gpt(dtype), "--min-peers", "2", "--max-epochs", "3")
    for peer in peers:
        wait_event(peer, "done", timeout=240)
        assert peer.wait_exit(30) == 0, peer.describe()
        assert "Traceback" not in peer.stderr, peer.describe(40)
    assert_averaged_in_lockstep(peers, dtype)


@pytest.mark.swarm
def test_bf16_final_checkpoint_resumes_bit_for_bit(swarm, tmp_path):
    run = "bf16-ckpt"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    checkpoints = str(tmp_path / "ckpt")
    (first,) = start_trainers(swarm, 1, run, boot.maddrs, *gpt("bfloat16"), "--max-epochs", "2",
                              "--checkpoint-dir", checkpoints)
    wait_event(first, "done", timeout=180)
    assert first.wait_exit(30) == 0 and "Traceback" not in first.stderr, first.describe(40)
    (final,) = [e for e in events(first, "checkpoint") if e["kind"] == "final"]
    (again,) = start_trainers(swarm, 1, run, boot.maddrs, *gpt("bfloat16"), "--max-epochs", "3",
                              "--checkpoint-dir", checkpoints)
    resumed = wait_event(again, "resumed", timeout=120)
    assert resumed["params_digest"] == final["params_digest"] and resumed["epoch"] == final["epoch"] == 2
    done = wait_event(again, "done", timeout=120)
    assert done["epochs"] == 3 and again.wait_exit(30) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_accumulate_in_fp32(dht_node, dtype):
    """Two micro-batches of gradient 1.0 with 256 and 1 samples: the epoch's mean gradient is exactly 1.0. Summed
    in the parameters' dtype, 256 + 1 rounds to 256 in bf16 (8-bit mantissa) and the lone peer would step on
    256/257; fp16 (11 bits) needs 2048 + 1 to show it. So the step must take p from 0 to exactly -1."""
    big = 256 if dtype == torch.bfloat16 else 2048
    assert torch.tensor(big, dtype=dtype) + 1 == big  # the sum that a half-precision accumulator gets wrong
    dht = dht_node(run_ids=["half-acc"])
    model = torch.nn.Linear(1, 1, bias=False).to(dtype)
    torch.nn.init.zeros_(model.weight)
    opt = CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), run_id="half-acc", dht=dht, model=model,
                                 target_batch_size=big + 1, matchmaking_time=0.5, round_timeout=5.0,
                                 progress_refresh=0.2)
    try:
        assert all(acc.dtype == torch.float32 for acc in opt.grad_sums)
        for samples in (big, 1):
            model.weight.grad = torch.ones_like(model.weight)
            opt.step(batch_size=samples)
        assert opt.local_epoch == 1 and [r.error for r in opt.rounds] == ["alone"]
        assert model.weight.dtype == dtype and model.weight.item() == -1.0, model.weight
    finally:
        opt.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_trains_on_cuda_through_join(swarm, dtype):
    run = f"cuda-{dtype}"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    peers = start_trainers(swarm, 2, run, boot.maddrs, *gpt(dtype, "cuda"), "--min-peers", "2", "--max-epochs", "4")
    for peer in peers:
        wait_event(peer, "done", timeout=240)
        assert peer.wait_exit(30) == 0, peer.describe()
        assert "Traceback" not in peer.stderr, peer.describe(40)
    assert_averaged_in_lockstep(peers, dtype, device="cuda")
    losses = [e["loss"] for e in events(peers[0], "epoch")]
    assert losses[-1] < losses[0], losses
