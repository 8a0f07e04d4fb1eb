"""`CollaborativeOptimizer`: a torch optimizer whose steps are taken by a whole swarm (docs/training.md).

    opt = CollaborativeOptimizer(torch.optim.AdamW(model.parameters()), run_id="my-run", target_batch_size=4096,
                                 batch_size_per_step=32, initial_peers=[...], averaging=DiLoCoStrategy(inner_steps=50))
    for batch in data:
        loss_fn(model, batch).backward()
        opt.step(); opt.zero_grad()          # local accumulation; a swarm step when the epoch is over

It is a `torch.optim.Optimizer` whose `param_groups` and `state` are the wrapped optimizer's (the same objects,
also after `load_state_dict`), so LR schedulers and `transformers.Trainer(optimizers=(opt, sched))` work. This is
the torch-facing wrapper: the parts it hosts (`EpochLoop` or `AuxPeer`, the strategy, `StateExchange`,
`RoundTiming`, `SwarmLink`, `MoshpitAverager`) are built in wiring.py, and most of its methods are theirs.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Union

import torch

from moshpeer.dht import SwarmDHT
from moshpeer.errors import UserError
from moshpeer.peer.optimizer.dropcompute import BudgetSetting
from moshpeer.peer.optimizer.epoch_loop import EpochLoop
from moshpeer.peer.optimizer.rounds import CollaborativeRound
from moshpeer.peer.optimizer.state_exchange import StateExchange
from moshpeer.peer.optimizer.wiring import Parts, Settings, assemble, delegate, prepare
from moshpeer.peer.strategies.base import AveragingStrategy


class CollaborativeOptimizer(torch.optim.Optimizer):
    """Wraps a local optimizer so that a swarm of peers trains one model; see the module docstring.

    :param optimizer, model: the local optimizer; the model (optional: downloaded states then carry its buffers)
    :param run_id, target_batch_size: the run; samples the swarm gathers per epoch. batch_size_per_step: samples
        behind a `step()` without `batch_size=`
    :param daemon / dht / initial_peers: a started `PeerDaemon`, a running `SwarmDHT`, or multiaddrs for a DHT
        node of this optimizer's own; host: the address this peer's data plane and state server listen on
        ("0.0.0.0": every interface; they then announce the address this machine reaches the DHT's initial peers
        from, asked anew, as the machine's address may change: moshpeer/dht/local_address.py)
    :param averaging: an `AveragingStrategy` instance (with its options), or a name in `strategies.STRATEGIES`
    :param compression, group_size, min_group_size, matchmaking_time, round_timeout, averager_kwargs: the
        rounds' codec, group sizes, deadlines (seconds) and further `MoshpitAverager` arguments
    :param compute_budget: DropCompute threshold per epoch (None, seconds, "auto"); max_epoch_lag: download
        state when the swarm is further ahead; role: "trainer" or "aux" (weight 0, no compute)
    :param error_feedback: error feedback around a sparsifying codec (EF21M; DiLoCo: residual feedback);
        loss_budget, phase_threshold, phase_window: the rounds' DBLP loss budget; swarm_key, allow_peers: a private
        run (docs/security.md)
    :param serve_state, state_download_timeout, state_bytes_per_second, show_progress: donating (never behind a
        NAT: nobody could connect) and downloading state; should_stop: polled while a round is in flight (True
        abandons it); progress_refresh: the shortest interval (seconds) between reads of the swarm's progress, used
        near an epoch's end (further from it, and in large swarms, reads come less often: `progress_cadence.py`)
    :param assigned_data: this peer's micro-batches of `batch_size_per_step` samples are its data assignment
        (`moshpeer.peer.accountability.AssignedBatches`), so its gradient rounds tell their group (epoch, batch size)
        and the group's owners may spot-check them (docs/security.md); gradients mode without error feedback only

    Bad settings raise `UserError` with one line. A round that fails or finds no group is logged and the epoch
    ends with this peer's own step (its record says why).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, run_id: str, target_batch_size: int,
                 batch_size_per_step: Optional[int] = None, daemon: Any = None, dht: Optional[SwarmDHT] = None,
                 initial_peers: Sequence[str] = (), host: str = "127.0.0.1",
                 averaging: Union[str, AveragingStrategy] = "gradients", compression: str = "none",
                 group_size: int = 4, min_group_size: int = 2, compute_budget: BudgetSetting = None,
                 error_feedback: bool = False, role: str = "trainer", matchmaking_time: float = 1.0,
                 round_timeout: float = 10.0, max_epoch_lag: int = 1, serve_state: bool = True,
                 state_download_timeout: float = 60.0, state_bytes_per_second: Optional[float] = None,
                 progress_refresh: float = 0.3, show_progress: bool = False,
                 should_stop: Optional[Callable[[], bool]] = None, model: Optional[torch.nn.Module] = None,
                 averager_kwargs: Optional[Dict[str, Any]] = None, loss_budget: Any = None,
                 phase_threshold: float = 0.5, phase_window: Optional[int] = None,
                 swarm_key: Optional[bytes] = None, allow_peers: Optional[Sequence[str]] = None,
                 assigned_data: bool = False):
        settings = Settings.of(locals())  # first thing: the arguments above, by name
        own = prepare(optimizer, settings)  # UserError for settings that cannot work; nothing started yet
        self.params, self.strategy, self.counters = own.params, own.strategy, own.counters
        self.error_feedback, self.run_id, self.averaging = own.error_feedback, own.run_id, own.strategy.name
        # torch's own setup (hooks, step patching) over the wrapped optimizer's groups; then its very objects,
        # re-shared whenever the wrapped optimizer loads a state dict (which replaces them).
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.inner = optimizer
        self._share_inner_state(optimizer)
        optimizer.register_load_state_dict_post_hook(self._share_inner_state)
        self.batch_size_per_step, self.compression, self.group_size = batch_size_per_step, compression, group_size
        self.role, self.model, self.max_epoch_lag = role, model, max_epoch_lag
        self.should_stop: Callable[[], bool] = should_stop or (lambda: False)
        self.lock = threading.RLock()  # held while the training state changes (the state server reads under it)
        self.parts = parts = assemble(self, own, settings)  # each part is also an attribute of its own:
        self.timing, self.swarm, self.averager = parts.timing, parts.swarm, parts.averager
        self.exchange, self.epochs, self.aux = parts.exchange, parts.epochs, parts.aux
        self.dht, self.progress, self.peer_id = self.swarm.dht, self.swarm.progress, self.swarm.dht.identity.peer_id
        self._stepper = self.aux or self.epochs  # what step() does: a trainer's epochs, or an aux's rounds
        self.ended_round: Optional[CollaborativeRound] = None  # what the last step() ended (None: no epoch)
        parts.begin()

    def __repr__(self) -> str:
        return f"CollaborativeOptimizer({self.inner!r}, run_id={self.run_id!r}, averaging={self.averaging!r})"

    def _share_inner_state(self, inner: torch.optim.Optimizer) -> None:
        self.param_groups, self.state = inner.param_groups, inner.state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, batch_size: Optional[int] = None) -> Any:
        """Account for the gradients in `.grad` (computed from `batch_size` samples); when that ends the epoch,
        the swarm step happens inside and `ended_round` holds the epoch's record (else None). On an aux peer:
        wait for one round (`wait_and_average`). Returns the closure's loss, if any. UserError without a batch
        size (neither `batch_size` nor `batch_size_per_step`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ended_round = self._stepper.step(batch_size)
        return loss

    def wait_and_average(self, timeout: Optional[float] = None) -> Optional[CollaborativeRound]:
        """Aux peers: join the swarm's next round with weight 0 (aux_peer.py); the round's record, or None if no
        group formed by `timeout`. UserError on a trainer (trainers call step())."""
        if self.aux is None:
            raise UserError("wait_and_average is for aux peers; trainers call step()")
        self.ended_round = self.aux.wait_and_average(timeout)
        return self.ended_round

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def inner_step(self) -> None:
        """One step of the wrapped optimizer on the current `.grad`s (strategies call it), counted."""
        self.inner.step()
        self.counters.steps += 1

    # A part's method (Parts' when it spans several) as ours: name, signature, docstring (what it raises) too.
    state_dict = delegate("exchange", StateExchange.state_dict)
    load_state_dict = delegate("exchange", StateExchange.load_state_dict)
    collaborative_state = delegate("exchange", StateExchange.collaborative_state)
    load_collaborative_state = delegate("exchange", StateExchange.load_collaborative_state)
    checkpoint_state = delegate("exchange", StateExchange.checkpoint_state)
    load_checkpoint_state = delegate("parts", Parts.load_checkpoint_state)
    catch_up = delegate("parts", Parts.catch_up)
    settle = delegate("epochs", EpochLoop.settle)
    wait_for_peers = delegate("epochs", EpochLoop.wait_for_peers)
    shutdown = delegate("parts", Parts.shutdown)
    restart_epoch = delegate("epochs", EpochLoop.restart_epoch)  # for StateHost (the parts' contracts)
    advertise = delegate("exchange", StateExchange.advertise)  # for EpochHost
    fetch_updates = delegate("exchange", StateExchange.fetch_updates)  # for EpochHost

    def averaging_paused(self) -> ContextManager:  # StateHost: hold off rounds while error feedback changes
        return self.averager.get_tensors()

    grad_sums = property(lambda self: self.counters.grad_sums)
    local_epoch = property(lambda self: self.counters.epoch, doc="this peer's collaborative epoch")
    local_steps = property(lambda self: self.counters.steps, doc="inner optimizer steps taken")
    samples_accumulated = property(lambda self: self.counters.samples, doc="samples of this epoch")
    total_samples = property(lambda self: self.counters.total_samples, doc="samples this peer ever computed")
    dropped_samples = property(lambda self: self.counters.dropped_samples, doc="left out of the swarm's average")
    rounds = property(lambda self: self.epochs.rounds, doc="the recent epochs' records, oldest first (bounded)")
    downloads = property(lambda self: self.exchange.downloads, doc="the states this peer downloaded")
    samples_per_second = property(lambda self: self.epochs.speed.rate(), doc="this peer's recent throughput")
    loss_budget = property(lambda self: self.averager.loss_budget, doc="the averager's `LossBudget`")
