"""Devices and dtypes in one process: resolving `--device`, averaged buffers on the parameters' device,
the parameter spread across dtypes, and tasks that receive the device."""

from __future__ import annotations

import math

import pytest
import torch

from moshpeer.errors import UserError
from moshpeer.peer.strategies.averaged_buffers import flat_buffer_views, param_spread
from moshpeer.peer.device import resolve_device
from moshpeer.peer.tasks import load_task
from test_optimizer import batches, collaborative, loss_of, make_model

CUDA = torch.cuda.is_available()


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    for bad, message in (("tpu", "unknown device 'tpu'"), ("meta", "unsupported device 'meta'"),
                         ("cuda:99", "device 'cuda:99' does not exist")):
        with pytest.raises(UserError, match=message):
            resolve_device(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flat_buffers_are_fp32_views_on_the_parameters_device(dtype):
    params = [torch.nn.Parameter(torch.randn(3, 4, dtype=dtype)), torch.nn.Parameter(torch.randn(5, dtype=dtype))]
    flat, views = flat_buffer_views(params, copies=2)
    assert flat.dtype == torch.float32 and flat.device == params[0].device and flat.numel() == 2 * 17
    assert [v.shape for v in views] == [p.shape for p in params] * 2
    views[3].fill_(7.0)  # a view writes through to the flat buffer the averager averages
    assert flat[-5:].eq(7.0).all() and flat[:-5].eq(0.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_param_spread_compares_in_fp32(dtype):
    params = [torch.full((4,), 2.0, dtype=dtype), torch.full((2,), -1.0, dtype=dtype)]
    averaged = [torch.full((4,), 1.0), torch.full((2,), -1.0)]
    # ||(1,1,1,1,0,0)|| / ||(1,1,1,1,-1,-1)|| = 2 / sqrt(6)
    assert param_spread(params, averaged) == pytest.approx(2 / math.sqrt(6), rel=1e-6)
    assert param_spread([], []) == 0.0


def test_tasks_receive_the_device():
    task = load_task("gpt", device=torch.device("cpu"), dtype="bfloat16", context=8, d_model=16, max_bytes=50_000,
                     eval_windows=4)
    assert task.device == torch.device("cpu") and next(task.model.parameters()).dtype == torch.bfloat16
    loss, count = task.loss(task.model, next(task.open_batches(2)))
    assert count == 2 and loss.dtype == torch.float32 and torch.isfinite(loss)
    # The head is tied to the token embedding (GPT-2): one tensor, counted once.
    assert task.model.head.weight is task.model.token.weight
    with pytest.raises(UserError, match="unknown dtype"):
        load_task("gpt", dtype="int8", max_bytes=50_000)


@pytest.mark.timeout(120)
def test_bf16_state_download_adopts_the_donors_state(dht_node):
    """A newcomer downloads a bf16 donor's state over the real state server: parameters bit for bit, optimizer
    state in bf16."""
    run = "bf16-sync"
    boot = dht_node(run_ids=[run])
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    donor_model, newcomer_model = make_model(seed=0).bfloat16(), make_model(seed=5).bfloat16()
    donor = collaborative(donor_model, dht_node(initial_peers=maddrs, run_ids=[run]), run, batch_size_per_step=32,
                          target_batch_size=64)
    newcomer = collaborative(newcomer_model, dht_node(initial_peers=maddrs, run_ids=[run]), run,
                             batch_size_per_step=32, target_batch_size=64, serve_state=False)
    try:
        for x, y in batches(4, 32):  # a few epochs, alone (the newcomer never steps)
            loss_of(donor_model, (x.bfloat16(), y)).backward()
            donor.step()
            donor.zero_grad()
        assert donor.local_epoch >= 2
        donor.advertise(force=True)
        downloaded = newcomer.catch_up()
        assert downloaded is not None and newcomer.local_epoch == donor.local_epoch
        for p, q in zip(newcomer_model.parameters(), donor_model.parameters()):
            assert p.dtype == torch.bfloat16 and torch.equal(p, q)
        moments = newcomer.inner.state[next(newcomer_model.parameters())]["exp_avg"]
        assert moments.dtype == torch.bfloat16
    finally:
        newcomer.shutdown()
        donor.shutdown()


# Every device test runs on the CPU too (its twin): this one never ran anywhere until it had one (issue 28).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_and_spread_on_device(device):
    params = [torch.nn.Parameter(torch.randn(1000, device=device, dtype=torch.bfloat16))]
    flat, views = flat_buffer_views(params, copies=2)
    assert flat.device.type == device and flat.dtype == torch.float32
    # The strategies fill the buffers with `p.detach()` (parameters.py, gradients.py); copying the Parameter
    # itself, with grad mode on, into a view of torch.split's multi-output views is refused by autograd.
    views[1].copy_(params[0].detach())
    assert param_spread(params, views[1:]) == 0.0
    task = load_task("gpt", device=torch.device(device), context=8, d_model=16, max_bytes=50_000, eval_windows=4)
    assert task.device.type == device and torch.isfinite(task.loss(task.model, next(task.open_batches(2)))[0])
