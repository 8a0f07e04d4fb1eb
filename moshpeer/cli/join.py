"""`moshpeer join`: run a training peer of a run until it finishes, or until SIGINT or SIGTERM.

With `--initial-peers` it joins their swarm; without, it starts a new swarm and prints how others
join. Either way it prints one JSON readiness line on stdout once it is in the swarm, then trains
the task (`--task`, default: the built-in digits classifier) and prints one JSON line per
collaborative epoch (see `moshpeer.peer.runtime.trainer`). `--no-train` only keeps the peer in the swarm.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import threading
from typing import Callable, Optional

from moshpeer.cli.common import (
    add_initial_peers_argument,
    add_membership_arguments,
    add_metrics_argument,
    add_network_arguments,
    add_private_run_arguments,
    add_run_id_argument,
    announce_ready,
    check_flags,
    configure_logging,
    exit_now,
    int_at_least,
    make_daemon,
    metrics_from_args,
    positive_float,
    share,
)
from moshpeer.errors import UserError
from moshpeer.peer.strategies import STRATEGIES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "join",
        help="join (or start) a training run as a peer",
        description="Join the swarm of a training run (or start a new one without --initial-peers) and train "
        "its task. Runs until training ends or SIGINT / SIGTERM, then withdraws from the swarm and exits.",
    )
    add_initial_peers_argument(parser)
    add_run_id_argument(parser)
    parser.add_argument(
        "--role",
        choices=("trainer", "aux"),
        default="trainer",
        help="trainer: computes and averages; aux: only helps average (default: trainer)",
    )
    parser.add_argument(
        "--client-mode",
        action="store_true",
        help="do not accept incoming connections (for peers behind NAT or firewalls; needs --initial-peers)",
    )
    parser.add_argument(
        "--behind-nat",
        action="store_true",
        help="nobody can connect to this machine (NAT, firewall): within seconds, take a slot on the relay a public "
        "peer serves on its data-plane port, so that groups reach this peer through it (docs/operations.md; needs "
        "--initial-peers)",
    )
    add_network_arguments(parser)
    add_membership_arguments(parser)
    add_training_arguments(parser)
    add_loss_budget_arguments(parser)
    add_checkpoint_arguments(parser)
    add_metrics_argument(parser)
    add_private_run_arguments(parser)
    parser.add_argument("--events", metavar="FILE",
                        help="also append the JSON event lines to FILE (input for 'moshpeer plot')")
    parser.set_defaults(run=run)


_positive_int = int_at_least(1)
_nonnegative_int = int_at_least(0)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags of `moshpeer join` (also passed through by `moshpeer demo`)."""
    group = parser.add_argument_group("training")
    group.add_argument("--task", default="digits", metavar="SPEC",
                       help="built-in task name, package.module:make_task or path/to/file.py:make_task (default: digits)")
    group.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="keyword argument for the task factory (repeatable)")
    group.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                       help="where the task trains and rounds average (auto: CUDA when available; default: auto)")
    group.add_argument("--no-train", action="store_true", help="only stay in the swarm, do not train")
    group.add_argument("--target-batch-size", type=_positive_int, metavar="N",
                       help="samples the swarm gathers per collaborative epoch (default: the task's)")
    group.add_argument("--batch-size", type=_positive_int, metavar="N",
                       help="micro-batch size of this peer (default: the task's)")
    group.add_argument("--averaging", choices=tuple(STRATEGIES), default="gradients",
                       help="gradients: large-batch training; parameters: Moshpit SGD; diloco: H inner steps, then an "
                       "outer step on the group's average pseudo-gradient (default: gradients)")
    group.add_argument("--params-every", type=_positive_int, metavar="K",
                       help="gradients mode: rounds send gradients only, and every K epochs the parameters too, "
                       "to pull peers back together (default: 16; 1: every round)")
    group.add_argument("--inner-steps", type=_positive_int, metavar="H",
                       help="diloco: inner optimizer steps per outer step (default: 50)")
    group.add_argument("--outer-optimizer", metavar="KIND[:lr=X,momentum=Y]",
                       help="diloco: nesterov, sgd or adam (default: nesterov:lr=0.7,momentum=0.9)")
    group.add_argument("--diloco-overlap", action="store_true",
                       help="diloco: average the pseudo-gradient while computing the next inner steps "
                       "(one-outer-step delay)")
    group.add_argument("--diloco-pace", action="store_true",
                       help="diloco with --diloco-overlap: spread each round's upload over most of the next "
                       "epoch's compute instead of sending it at the link's full rate (a lower peak on the link)")
    group.add_argument("--diloco-quorum", type=share, metavar="Q",
                       help="diloco: end an epoch early, with the inner steps taken so far, once trainers holding Q "
                       "of the swarm's compute rate have ended theirs (a slow peer keeps up instead of missing "
                       "rounds; its Δ counts by its samples). 0 < Q <= 1; default: off")
    group.add_argument("--diloco-fragments", type=_positive_int, metavar="F",
                       help="diloco: Streaming DiLoCo, F fragments of the parameters; an epoch of H/F inner steps "
                       "averages one of them, so a round sends 1/F of the bytes (F divides H; default: 1)")
    group.add_argument("--diloco-outer-every", type=_nonnegative_int, metavar="K",
                       help="diloco: every K-th round of a fragment also averages θ_outer, so that peers of different "
                       "groups do not drift apart (1/K more bytes; 0: never; default: 4)")
    group.add_argument("--compression", default="none", metavar="CODEC",
                       help="codec for averaging: none, fp16, bf16, ... (default: none)")
    group.add_argument("--error-feedback", action="store_true",
                       help="with a sparsifying codec (arc-topk:FRACTION, topk-int2:FRACTION): error feedback, "
                       "EF21M in gradients mode (checkpointed, downloaded by newcomers), SparseLoCo's residual in "
                       "diloco mode (checkpointed; outer optimizer sgd:lr=1,momentum=0 unless --outer-optimizer "
                       "is given)")
    group.add_argument("--bandwidth", type=positive_float, metavar="MBIT",
                       help="this peer's upload in Mbit/s, announced to its averaging groups (default: measured "
                       "on the averaging traffic of every round)")
    group.add_argument("--partition", choices=("bandwidth", "equal"), default="bandwidth",
                       help="bandwidth: a group sizes each member's part by its upload, so a slow uplink owns less; "
                       "equal: equal parts (default: bandwidth)")
    group.add_argument("--group-size", type=_positive_int, default=4, metavar="N",
                       help="target Moshpit group size (default: 4)")
    group.add_argument("--compute-budget", default="none", metavar="SECONDS|auto|none",
                       help="DropCompute: stop computing an epoch's micro-batches after this long (default: none)")
    group.add_argument("--max-epochs", type=_positive_int, metavar="N", help="stop after N collaborative epochs")
    group.add_argument("--max-seconds", type=positive_float, metavar="S", help="stop training after S seconds")
    group.add_argument("--target-metric", type=float, metavar="X",
                       help="stop once the task's metric reaches X (e.g. 0.95 accuracy)")
    group.add_argument("--eval-every", type=_positive_int, default=1, metavar="N",
                       help="evaluate every N epochs (default: 1)")
    group.add_argument("--min-peers", type=_positive_int, default=1, metavar="N",
                       help="wait up to --wait-peers seconds for N trainers before training (default: 1)")
    group.add_argument("--wait-peers", type=positive_float, default=60.0, metavar="S",
                       help="how long to wait for --min-peers (default: 60)")
    group.add_argument("--matchmaking-time", type=positive_float, default=1.0, metavar="S",
                       help="longest wait for an averaging group to fill; the window in force adapts to the "
                       "assembly times this peer measured (default: 1)")
    group.add_argument("--round-timeout", type=positive_float, default=10.0, metavar="S",
                       help="longest deadline of a round's data plane after matchmaking; the deadline in force "
                       "adapts to the round times this peer measured (default: 10)")
    group.add_argument("--min-matchmaking-time", type=positive_float, metavar="S",
                       help="shortest adaptive matchmaking window (default: --matchmaking-time, a fixed window: "
                       "on a loaded machine a tighter window formed fewer full groups)")
    group.add_argument("--min-round-timeout", type=positive_float, metavar="S",
                       help="shortest adaptive round deadline (default: 1, or --round-timeout if shorter; equal to "
                       "--round-timeout: a fixed deadline)")
    group.add_argument("--seed", type=int, metavar="N", help="data shuffle seed (default: from the peer id)")
    group.add_argument("--straggler", metavar="SPEC",
                       help="inject compute delays per micro-batch, e.g. lognormal:mean_s=0.05,sigma=1.5 (testing)")
    group.add_argument("--state-rate", type=positive_float, metavar="BYTES_PER_S",
                       help="throttle this peer's state donations (testing)")
    group.add_argument("--progress-bar", action="store_true", help="show a progress bar for state downloads")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """Checkpoints and preemption flags of `moshpeer join` (see docs/checkpoints.md)."""
    group = parser.add_argument_group("checkpoints and preemption")
    group.add_argument("--checkpoint-dir", metavar="DIR",
                       help="resume from the newest valid checkpoint in DIR, save periodic checkpoints there, "
                       "and a final one on SIGTERM / SIGINT / the notice file (one directory per peer)")
    group.add_argument("--checkpoint-every-steps", type=_positive_int, metavar="N",
                       help="periodic checkpoint every N micro-batches (written in the background)")
    group.add_argument("--checkpoint-every-seconds", type=positive_float, metavar="T",
                       help="periodic checkpoint every T seconds (default without either flag: 600)")
    group.add_argument("--keep", type=_positive_int, default=3, metavar="K",
                       help="keep the newest K checkpoints (default: 3)")
    group.add_argument("--grace-period", type=positive_float, default=20.0, metavar="S",
                       help="with --checkpoint-dir: seconds from SIGTERM / notice to exit; the round in flight "
                       "is finished if it fits, then the final checkpoint is written (default: 20)")
    group.add_argument("--preemption-notice", metavar="PATH",
                       help="a file whose appearance means this machine is being taken away (same as SIGTERM)")
    group.add_argument("--max-staleness", type=int, default=1, metavar="EPOCHS",
                       help="resume from the checkpoint only if the swarm is at most this many epochs ahead; "
                       "otherwise download fresher state from peers (default: 1)")


def checkpoint_policy_from_args(args: argparse.Namespace):
    """A `CheckpointPolicy` from the checkpoint flags, or None without --checkpoint-dir."""
    if args.checkpoint_dir is None:
        for flag in ("checkpoint_every_steps", "checkpoint_every_seconds"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag.replace('_', '-')} needs --checkpoint-dir")
        return None
    from moshpeer.peer.checkpoint.training import CheckpointPolicy

    every_seconds = args.checkpoint_every_seconds
    if every_seconds is None and args.checkpoint_every_steps is None:
        every_seconds = 600.0
    return CheckpointPolicy(args.checkpoint_dir, every_steps=args.checkpoint_every_steps, every_seconds=every_seconds,
                            keep_last=args.keep, max_staleness=args.max_staleness)


def add_loss_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """Loss-budget (DBLP) and fault-injection flags of `moshpeer join` (see docs/loss_budget.md)."""
    group = parser.add_argument_group("loss budget and fault injection")
    group.add_argument("--loss-budget", default="fixed", metavar="fixed|P|P_LOW,P_HIGH|phase",
                       help="how much of a round may be missing when a peer stops waiting: fixed (wait for "
                       "everything until the round deadline), a fraction P, or phase-aware P_LOW,P_HIGH "
                       "(phase = 0.02,0.42): P_LOW in critical phases, P_HIGH otherwise (default: fixed)")
    group.add_argument("--phase-threshold", type=positive_float, default=0.5, metavar="ETA",
                       help="relative change of the gradient norm between epochs that marks a critical phase "
                       "(default: 0.5)")
    group.add_argument("--phase-window", type=_positive_int, default=None, metavar="EPOCHS",
                       help="collaborative epochs per phase-signal window: the gradient summed over a window "
                       "is compared with the previous window's (Accordion; default: 5)")
    group.add_argument("--chunk-bytes", type=_positive_int, metavar="N",
                       help="bytes of fp32 values per averaging chunk, the unit of loss (default: 1 MiB; a round halves "
                       "it, down to 64 KB, until each member's part has 4 chunks)")
    group.add_argument("--faults", metavar="SPEC",
                       help="inject faults into this peer's outgoing chunks, e.g. drop_prob=0.1 or "
                       "burst_prob=0.02,burst_len=8,burst_loss=0.75,retransmit_s=0.2, or play a hostile peer: "
                       "byzantine=-100,weight=1e6 (testing; default: none)")
    group.add_argument("--aggregation", default="mean", choices=("mean", "clipped", "trimmed"),
                       help="how this peer combines the contributions to the part it owns in a round: mean, "
                       "clipped (CenteredClip) or trimmed (coordinate-wise trimmed mean); the robust modes "
                       "resist hostile peers, see docs/security.md (default: mean)")
    group.add_argument("--spot-checks", type=share, metavar="RATE",
                       help="train on this peer's data assignment, and after each round recompute one group member's "
                       "contribution with probability RATE, distrusting it on a mismatch (needs --averaging "
                       "gradients and --aggregation clipped; every peer of the run must use it; see "
                       "docs/security.md; default: off)")


def loss_budget_settings_from_args(args: argparse.Namespace) -> dict:
    """TrainerConfig fields from the loss-budget flags (checked here, so bad values fail before start)."""
    from moshpeer.averaging.faults import FaultConfig, FaultyLinks
    from moshpeer.averaging.loss_budget import DEFAULT_WINDOW, parse_loss_budget

    spec, eta = getattr(args, "loss_budget", "fixed"), getattr(args, "phase_threshold", 0.5)
    window = getattr(args, "phase_window", None)
    parse_loss_budget(spec, eta=eta, window=window or DEFAULT_WINDOW)
    averager_kwargs = {}
    if getattr(args, "chunk_bytes", None) is not None:
        averager_kwargs["chunk_bytes"] = args.chunk_bytes
    if getattr(args, "faults", None):
        averager_kwargs["links"] = FaultyLinks(FaultConfig.parse(args.faults))
    if getattr(args, "aggregation", "mean") != "mean":
        averager_kwargs["aggregation"] = args.aggregation
    return {"loss_budget": spec, "phase_threshold": eta, "phase_window": window, "averager_kwargs": averager_kwargs}


def deadline_settings_from_args(args: argparse.Namespace) -> dict:
    """Averager arguments of the adaptive deadlines: the floors (flags or defaults), checked against the caps."""
    from moshpeer.averaging.adaptive_deadlines import DEFAULT_MIN_ROUND_S

    floors = {}
    for floor, cap, default in (("min_matchmaking_time", "matchmaking_time", args.matchmaking_time),
                                ("min_round_timeout", "round_timeout", DEFAULT_MIN_ROUND_S)):
        given, limit = getattr(args, floor), getattr(args, cap)
        if given is not None and given > limit:
            raise UserError(f"--{floor.replace('_', '-')} ({given:g}) must not exceed --{cap.replace('_', '-')} "
                            f"({limit:g})")
        floors[floor] = given if given is not None else min(default, limit)
    return floors


def strategy_from_args(args: argparse.Namespace):
    """The `AveragingStrategy` of `--averaging` with the options of that mode's flags (unset flags: the
    strategy's defaults); UserError for a bad value."""
    from moshpeer.peer.strategies import make_strategy

    if args.averaging == "gradients":
        return make_strategy("gradients", params_every=args.params_every)
    if args.averaging == "diloco":
        from moshpeer.peer.strategies.diloco_outer import parse_outer_optimizer

        return make_strategy("diloco", inner_steps=args.inner_steps, overlap=args.diloco_overlap or None,
                             fragments=args.diloco_fragments, pace=args.diloco_pace or None,
                             quorum=args.diloco_quorum, outer_params_every=args.diloco_outer_every,
                             outer_optimizer=parse_outer_optimizer(args.outer_optimizer) if args.outer_optimizer else None)
    return make_strategy(args.averaging)


def trainer_config_from_args(args: argparse.Namespace):
    """A `TrainerConfig` from the training flags."""
    from moshpeer.peer.optimizer.dropcompute import parse_compute_budget
    from moshpeer.peer.runtime.straggler import parse_straggler
    from moshpeer.peer.runtime.trainer import TrainerConfig

    if args.role == "aux" and args.compute_budget not in ("none", None):
        raise UserError("an aux peer computes nothing: --compute-budget does not apply")
    diloco_flags = [flag for flag, value in (("--inner-steps", args.inner_steps), ("--outer-optimizer", args.outer_optimizer),
                                              ("--diloco-overlap", args.diloco_overlap),
                                              ("--diloco-fragments", args.diloco_fragments),
                                              ("--diloco-pace", args.diloco_pace),
                                              ("--diloco-quorum", args.diloco_quorum),
                                              ("--diloco-outer-every", args.diloco_outer_every is not None))
                    if value]
    if diloco_flags and args.averaging != "diloco":
        raise UserError(f"{', '.join(diloco_flags)} need --averaging diloco")
    if getattr(args, "spot_checks", None) is not None and (
            args.averaging != "gradients" or getattr(args, "aggregation", "mean") != "clipped" or args.error_feedback):
        raise UserError("--spot-checks needs --averaging gradients and --aggregation clipped, without --error-feedback")
    settings = loss_budget_settings_from_args(args)
    settings["averager_kwargs"].update(deadline_settings_from_args(args))
    settings["averager_kwargs"]["partition"] = getattr(args, "partition", "bandwidth")
    if getattr(args, "bandwidth", None) is not None:
        settings["averager_kwargs"]["upload_bandwidth"] = args.bandwidth * 1e6 / 8
    return TrainerConfig(
        target_batch_size=args.target_batch_size, batch_size=args.batch_size, averaging=strategy_from_args(args),
        compression=args.compression, error_feedback=args.error_feedback, group_size=max(args.group_size, 2),
        compute_budget=parse_compute_budget(args.compute_budget), role=args.role, max_epochs=args.max_epochs,
        max_seconds=args.max_seconds, target_metric=args.target_metric, eval_every=args.eval_every,
        min_peers=args.min_peers, wait_peers_timeout=args.wait_peers, matchmaking_time=args.matchmaking_time,
        round_timeout=args.round_timeout, seed=args.seed, spot_checks=getattr(args, "spot_checks", None),
        straggler=parse_straggler(args.straggler) if args.straggler else None,
        state_bytes_per_second=args.state_rate, show_progress=args.progress_bar,
        **settings,
        checkpoint=checkpoint_policy_from_args(args) if hasattr(args, "checkpoint_dir") else None,
    )


def events_emitter(path: Optional[str]) -> Callable[[dict], None]:
    """The trainer's event output: JSON lines on stdout and, with `path`, appended to that file as well
    (flushed line by line, so a crash loses nothing printed).

    :raises UserError: the file cannot be opened
    """
    from moshpeer.peer.runtime.trainer import emit_json

    if path is None:
        return emit_json
    try:
        copy = open(path, "a", encoding="utf-8")
    except OSError as e:
        raise UserError(f"--events {path}: {e.strerror or e}") from None

    def emit(event: dict) -> None:
        emit_json(event)
        copy.write(json.dumps(event, separators=(",", ":")) + "\n")
        copy.flush()

    return emit


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    from moshpeer.peer.device import resolve_device

    device = resolve_device(args.device)  # a device this machine lacks fails before anything starts
    check_flags(args)  # every flag, before the DHT starts
    metrics = metrics_from_args(args, "join")
    ready = functools.partial(announce_ready, command="join", metrics=metrics, metrics_port=args.metrics_port)
    if args.no_train:
        daemon = make_daemon(args, role=args.role, client_mode=args.client_mode, behind_nat=args.behind_nat)
        daemon.configure_preemption(notice_file=args.preemption_notice)
        exit_now(daemon.run(on_ready=ready))
    config = trainer_config_from_args(args)  # bad flags fail before anything starts
    from moshpeer.peer.tasks import load_task, parse_task_kwargs

    task_kwargs = parse_task_kwargs(args.task_arg)
    emit = events_emitter(args.events)
    daemon = make_daemon(args, role=args.role, client_mode=args.client_mode, behind_nat=args.behind_nat)
    # With checkpoints a stop has a deadline: the round in flight and the final checkpoint get the grace period.
    daemon.configure_preemption(grace_period=args.grace_period if config.checkpoint else None,
                                notice_file=args.preemption_notice)

    def train(daemon) -> None:
        # Training runs in a worker thread so that a stop (SIGTERM) is honoured at once, even while
        # the task loads or the averager starts: the main thread then goes on with the bounded
        # shutdown and the worker (a daemon thread) ends with the process.
        failure: list = []

        def work() -> None:
            from moshpeer.peer.runtime.trainer import run_training

            try:
                task = load_task(args.task, device=device, **task_kwargs)
                if not daemon.stop_requested:
                    run_training(daemon, task, config, emit=emit, peer_metrics=metrics)
            except UserError as e:
                failure.append(e)
            except Exception as e:
                if daemon.stop_requested:  # the swarm was torn down under a stopping worker
                    logging.getLogger(__name__).debug("training stopped with an error", exc_info=True)
                else:
                    failure.append(e)

        worker = threading.Thread(target=work, name="moshpeer-training", daemon=True)
        worker.start()
        while worker.is_alive() and not daemon.stop_requested:
            worker.join(timeout=0.1)
        if worker.is_alive():
            # A moment to finish the current micro-batch and print its lines; with a grace period, the
            # time to finish the round in flight and write the final checkpoint.
            wind_down = daemon.seconds_left_for_work()
            worker.join(timeout=0.5 if wind_down == float("inf") else max(wind_down, 0.5))
        if failure:
            raise failure[0]

    exit_now(daemon.run(work=train, on_ready=ready))
