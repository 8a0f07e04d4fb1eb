"""`moshpeer simulate`: Moshpit averaging or training of N virtual peers, on the decisions the real peers take.

--level averaging (default) runs `moshpeer.simulation.run_cell` (restarts of one configuration), prints a table
of the mean error per round and the rounds needed to reach each --eps, and ends with one JSON line.
--level training runs `moshpeer.simulation.training` (a swarm training a problem on a simulated clock,
optionally with the synchronous baseline and a failure-rate sweep), prints loss against simulated time and
ends with one JSON line. See docs/simulation.md for what is simulated and what is production code.

Every bad knob value is one line on stderr ("moshpeer simulate: error: ...") and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import TYPE_CHECKING, Callable, List, Sequence

from moshpeer.cli.common import int_at_least, share

if TYPE_CHECKING:
    from moshpeer.simulation.training_result import TrainingResult

MAX_VALUES = 50_000_000

DESCRIPTION = (
    "Simulate Moshpit averaging among many virtual peers: each holds a vector of --dim values drawn from N(0, 1); "
    "each round every peer fails with probability --failure-rate (a failed peer sits the round out and keeps its "
    "value), the others group by group key (at most --group-size per group), average, and rotate their keys with "
    "hivemind's rule. Prints the mean squared distance to the exact mean per round (averaged over --restarts) and "
    "the rounds needed to reach each --eps; the last line is a JSON object."
)


def _float_in(accepts: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """argparse type: a float that `accepts`; anything else is one line naming `what` it must be."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return value
    return parse


_probability = _float_in(lambda v: 0.0 <= v < 1.0, "in [0, 1)")
_fraction = _float_in(lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
_positive_float = _float_in(lambda v: 0.0 < v < math.inf, "a positive number")
_nonnegative_float = _float_in(lambda v: 0.0 <= v < math.inf, "a non-negative number")
_finite_float = _float_in(math.isfinite, "finite")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate Moshpit averaging of many virtual peers (rounds to reach a given error)",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def one_line_error(message: str) -> None:
        # argparse prints the usage block before the error; a bad knob is one line here (see DESIGN.md).
        print(f"moshpeer simulate: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error  # type: ignore[method-assign]
    parser.add_argument("--peers", type=int_at_least(1, 10_000_000), default=argparse.SUPPRESS, metavar="N",
                        help="number of virtual peers (default: 512; 1000 with --level training)")
    parser.add_argument("--group-size", type=int_at_least(2, 1 << 20), default=16, metavar="G",
                        help="target group size g: at most G peers per group; also the side of the --grouping grid")
    parser.add_argument("--min-group-size", type=int_at_least(1, 1 << 20), default=2, metavar="K",
                        help="a group smaller than K does not assemble; its peers keep their value and key "
                        "(must be <= --group-size)")
    parser.add_argument("--grid-bits", type=int_at_least(0, 62), default=None, metavar="B",
                        help="length of the group bits (keys grouping); default: whole axes of log2(G) bits, as many "
                        "as keep N / 2^B >= 4 G (0 = one key for all below 8 G peers); the paper's 32 x 32 grid for "
                        "512 peers is --group-size 32 --grid-bits 5")
    parser.add_argument("--grid-dims", type=int_at_least(1, 62), default=None, metavar="M",
                        help="dimensions of the fixed grid (--grouping grid); default: smallest M with G^M >= N")
    parser.add_argument("--grouping", choices=("keys", "grid"), default="keys",
                        help="keys: hivemind group keys and rotation, as moshpeer peers do; grid: the Moshpit "
                        "notebook's fixed grid (distinct random cells of G^M, round t averages along axis t mod M)")
    parser.add_argument("--initial-keys", choices=("random", "balanced"), default="random",
                        help="random: uniform group bits per peer (as a peer draws them); balanced: every key held by "
                        "the same number of peers (a full grid when N = G^M)")
    parser.add_argument("--dim", type=int_at_least(1, 1 << 24), default=argparse.SUPPRESS, metavar="D",
                        help="values per peer (default: 1 = scalars, as in the Moshpit paper; with --level training: "
                        "the quadratic's dimension or the mlp's inputs, default 64)")
    parser.add_argument("--rounds", type=int_at_least(1, 100_000), default=argparse.SUPPRESS, metavar="R",
                        help="round cap; a run that never reaches an eps counts as R rounds (default: 50, as the "
                        "paper caps; with --level training: the rounds to train, default 200)")
    parser.add_argument("--failure-rate", type=_probability, default=0.0, metavar="P",
                        help="probability that a peer fails in a round, independently per peer and round")
    parser.add_argument("--chunk-loss", type=_probability, default=0.0, metavar="Q",
                        help="probability that one chunk on one link is lost (reduce-scatter and all-gather); "
                        "averaged with the production loss-tolerant estimator; 0 = exact group means")
    parser.add_argument("--chunk-numel", type=int_at_least(1, 1 << 30), default=1024, metavar="C",
                        help="values per chunk when --chunk-loss > 0")
    parser.add_argument("--restarts", type=int_at_least(1, 10_000), default=10, metavar="K",
                        help="independent runs, seeds SEED .. SEED+K-1; results are their mean (and sd)")
    parser.add_argument("--seed", type=int_at_least(0, (1 << 32) - 1), default=0, metavar="S",
                        help="seed of the first run")
    parser.add_argument("--eps", type=_positive_float, action="append", default=None, metavar="E",
                        help="report rounds until the error is below E; repeatable (default: 1e-9 and 1e-4)")
    parser.add_argument("--baseline", choices=("moshpit", "allreduce"), default="moshpit",
                        help="moshpit: groups by key; allreduce: one group of all peers, and a round with any failed "
                        "peer fails as a whole (nobody's value changes), as in the Moshpit notebook")
    parser.add_argument("--rng-streams", choices=("independent", "notebook"), default="independent",
                        help="independent: numpy Generators per purpose; notebook: values and failures drawn as the "
                        "Moshpit notebook draws them (np.random.seed(seed), normal then uniform per round), which "
                        "replays its all-reduce runs exactly")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line (no table)")
    parser.add_argument("--level", choices=("averaging", "training"), default="averaging",
                        help="averaging: vectors and rounds to eps (the knobs above); training: a swarm training a "
                        "problem (--workload) on a simulated clock (the knobs below; --peers, --group-size, "
                        "--min-group-size, --grid-bits, --dim, --rounds, --chunk-loss, --chunk-numel and --seed apply "
                        "too; --rounds defaults to 200 there, --dim to 64, --peers to 1000)")
    add_training_arguments(parser.add_argument_group("training level (--level training)"))
    parser.set_defaults(run=run)


# Training-level knobs: (flag, dest, type, default, metavar, help). Defaults are those of the 1,000-peer
# scenario (docs/simulation.md); None here means "not given", so that the averaging level can refuse them.
TRAINING_KNOBS = (
    ("--mode", "mode", str, "diloco", "M", "gradients | parameters | diloco (the production strategies)"),
    ("--inner-steps", "inner_steps", int_at_least(1, 1 << 20), 50, "H", "diloco: inner steps per round"),
    ("--outer-optimizer", "outer_optimizer", str, "nesterov:lr=0.7,momentum=0.9", "SPEC",
     "diloco: KIND[:lr=X,momentum=Y], KIND nesterov | sgd | adam (parsed by moshpeer.peer.strategies.diloco_outer)"),
    ("--outer-params-every", "outer_params_every", int_at_least(0, 1 << 20), 4, "K",
     "diloco: every K-th round the group also averages θ_outer (production's --diloco-outer-every; 0 = never)"),
    ("--aggregation", "aggregation", str, "mean", "A", "mean | clipped | trimmed (moshpeer.averaging.aggregation)"),
    ("--partition", "partition", str, "bandwidth", "P", "bandwidth: part sizes by uplink (production "
     "bandwidth_part_sizes); equal: equal parts"),
    ("--model-params", "model_params", int_at_least(1, 1 << 40), 10_000_000, "V",
     "values of the model the time model moves (the math trains a --dim stand-in)"),
    ("--bytes-per-value", "bytes_per_value", int_at_least(1, 8), 4, "B", "wire bytes per value (4 fp32, 1 int8)"),
    ("--uplink-mbps", "uplink_mbps", _positive_float, 10_000.0, "U", "uplink per peer, Mbit/s"),
    ("--downlink-mbps", "downlink_mbps", _positive_float, 10_000.0, "D", "downlink per peer, Mbit/s"),
    ("--rtt-ms", "rtt_ms", _nonnegative_float, 1.0, "R", "round-trip time per peer, ms"),
    # time_model's INITIAL_WINDOW_SEGMENTS and MAX_INITIAL_WINDOW_SEGMENTS, as literals like the other defaults here:
    # the simulator (and torch) is imported only once a simulation runs
    ("--initial-window", "initial_window", int_at_least(1, 1024), 10, "N",
     "TCP's initial window, segments: where each round's fresh connections start (Linux's 10; `ip route ... "
     "initcwnd N`)"),
    ("--link-spread", "link_spread", _nonnegative_float, 0.0, "S",
     "sd of a lognormal factor on each peer's links and RTT (0 = all equal)"),
    ("--speed", "speed", _positive_float, 16.0, "X", "compute speed per peer, samples/s"),
    ("--speed-spread", "speed_spread", _nonnegative_float, 0.0, "S", "sd of a lognormal factor on each peer's speed"),
    ("--batch", "batch", int_at_least(1, 1 << 20), 32, "B", "samples per step (per peer)"),
    ("--workload", "workload", str, "quadratic", "W", "quadratic: the convex problem (--dim values; its loss floor "
     "has a closed form) | mlp: a tanh network of --hidden units learning a teacher network from noisy labels "
     "(--dim inputs; non-convex; docs/simulation.md)"),
    ("--hidden", "hidden", int_at_least(1, 4096), 32, "U", "mlp: hidden units"),
    ("--lr", "lr", _positive_float, None, "LR", "(inner) SGD learning rate, at most 1 (default: 0.003 quadratic, "
     "0.1 mlp)"),
    ("--heterogeneity", "heterogeneity", _nonnegative_float, 0.3, "H",
     "sd of each peer's optimum around the common one (non-IID shards)"),
    ("--failures-per-hour", "failures_per_hour", _nonnegative_float, 0.0, "F",
     "failure rate per peer per hour of simulated time (exponential)"),
    ("--rejoin-s", "rejoin_s", _positive_float, 600.0, "T", "mean time a failed peer stays away, s"),
    ("--never-return", "never_return", _probability, 0.0, "P", "probability that a failed peer never returns"),
    ("--resume-fraction", "resume_fraction", _fraction, 0.0, "P", "probability that a failed peer keeps a checkpoint "
     "of the epoch it failed in (a preemption it checkpointed on); the others lose their state"),
    ("--max-staleness", "max_staleness", int_at_least(0, 1 << 20), 1, "E", "a rejoining peer resumes from its "
     "checkpoint while the swarm is at most E epochs ahead, else downloads a live peer's state (production's "
     "--max-staleness)"),
    ("--hostile-fraction", "hostile_fraction", _probability, 0.0, "P", "fraction of hostile peers"),
    ("--hostile-scale", "hostile_scale", _finite_float, -100.0, "K",
     "a hostile peer sends K x its contribution (-100 scaled, -1 sign flip)"),
    ("--hostile-weight", "hostile_weight", _positive_float, 1.0, "W", "a hostile peer declares W x its weight"),
    ("--hostile-replay", "hostile_replay", int_at_least(0, 1 << 20), 0, "R",
     "a hostile peer sends the contribution it computed R of its rounds earlier (stale work; with --hostile-scale 1 "
     "that alone); 0 = its current one"),
    ("--loss-budget", "loss_budget", _probability, 0.0, "P", "production's fixed loss budget P: a receiver that "
     "lost chunks (--chunk-loss) stops once 1 - P of them arrived and arrivals stalled; 0 = it waits for the "
     "round's deadline"),
    ("--quorum", "quorum", share, None, "Q", "diloco: a peer ends its epoch early, after the inner step that "
     "passes the moment trainers holding Q of the swarm's compute rate are done (production's --diloco-quorum); "
     "rounds weigh each Δ by its samples (default: no quorum, every peer takes H steps)"),
    ("--matchmaking-window", "matchmaking_window_s", _positive_float, 30.0, "S",
     "how long the first ready member of a group waits for the others, s"),
    ("--no-straggler-hold", "no_straggler_hold", None, False, None, "leave out production's straggler hold (a "
     "group stays open longer for trainers still computing its epoch, by their records): the plain window"),
    ("--round-timeout", "round_timeout_s", _positive_float, 120.0, "S",
     "cap of the adaptive round deadline (production DeadlineLearner), s"),
    ("--progress-budget-kbps", "progress_budget_kbps", _nonnegative_float, 128.0, "K",
     "the byte budget of production's progress cadence, KB/s: the control plane models its DHT reads and "
     "publications on every peer's links (0 = leave the control plane out)"),
    ("--sync", "sync", None, False, None, "also run the synchronous data-parallel baseline for the same "
     "simulated time (checkpoint interval: Young's optimum; 60 s timeout, 60 s restart)"),
    ("--sweep-failures", "sweep_failures", _nonnegative_float, None, "F",
     "repeatable: also run both systems at these failure rates (per peer per hour) for the goodput plot"),
    ("--plot", "plot", str, None, "DIR", "write loss-vs-time.png (and goodput-vs-failure-rate.png with "
     "--sweep-failures) into DIR (averaging level: distance-vs-round.png)"),
)


def add_training_arguments(group: argparse._ArgumentGroup) -> None:
    for flag, dest, kind, default, metavar, text in TRAINING_KNOBS:
        shown = f"{text} (default: {default})" if default not in (None, False) else text
        # SUPPRESS: "not given" leaves no attribute (read with getattr(args, dest, None)), and the help formatter
        # does not append "(default: None)" to the per-level defaults written in the text.
        if kind is None:
            group.add_argument(flag, dest=dest, action="store_true", default=argparse.SUPPRESS, help=text)
        elif dest == "sweep_failures":
            group.add_argument(flag, dest=dest, type=kind, action="append", default=argparse.SUPPRESS,
                               metavar=metavar, help=text)
        else:
            group.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, metavar=metavar, help=shown)


def run(args: argparse.Namespace) -> int:
    from moshpeer.errors import UserError

    training = args.level == "training"
    # Per-level defaults (None = not given).
    args.peers = getattr(args, "peers", None) or (1000 if training else 512)
    args.dim = getattr(args, "dim", None) or (64 if training else 1)
    args.rounds = getattr(args, "rounds", None) or (200 if training else 50)
    if training:
        return run_training_level(args)
    given = [flag for flag, dest, *_ in TRAINING_KNOBS if getattr(args, dest, None) is not None and dest != "plot"]
    if given:
        raise UserError(f"{given[0]} is a training-level knob: add --level training")
    return run_averaging(args)


def run_averaging(args: argparse.Namespace) -> int:
    from moshpeer.errors import UserError
    from moshpeer.simulation import AveragingConfig, run_cell

    if args.min_group_size > args.group_size:
        raise UserError(f"--min-group-size ({args.min_group_size}) must be <= --group-size ({args.group_size})")
    topology = "allreduce" if args.baseline == "allreduce" else args.grouping
    eps: List[float] = sorted(set(args.eps or [1e-9, 1e-4]))
    config = AveragingConfig(
        peers=args.peers, dim=args.dim, group_size=args.group_size, min_group_size=args.min_group_size,
        key_bits=args.grid_bits, grid_dims=args.grid_dims, topology=topology, initial_keys=args.initial_keys,
        failure_rate=args.failure_rate, chunk_loss=args.chunk_loss, chunk_numel=args.chunk_numel,
        rounds=args.rounds, rng_streams=args.rng_streams,
    )
    try:
        config.check()
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.peers * args.dim > MAX_VALUES:
        # float64, and a round holds about three copies: 5e7 values is ~1.2 GB.
        raise UserError(f"--peers x --dim = {args.peers * args.dim} values is more than this command holds "
                        f"({MAX_VALUES:.0e})")
    if getattr(args, "plot", None):
        from moshpeer.simulation.plots import prepare_directory
        prepare_directory(args.plot)
    started = time.perf_counter()
    cell = run_cell(config, restarts=args.restarts, seed=args.seed, eps=eps)
    wall = time.perf_counter() - started
    if not args.json:
        print_table(cell, eps)
    summary = cell.summary()
    line = {
        "event": "simulate", "topology": topology, "peers": config.peers, "dim": config.dim,
        "group_size": config.group_size, "min_group_size": config.min_group_size,
        "key_bits": config.resolved_key_bits() if topology == "keys" else None,
        "grid_dims": config.resolved_grid_dims() if topology == "grid" else None,
        "failure_rate": config.failure_rate, "chunk_loss": config.chunk_loss, "rounds_cap": config.rounds,
        "restarts": args.restarts, "seed": args.seed, "rng_streams": config.rng_streams,
        "rounds_to": {k: v["mean"] for k, v in summary["rounds_to"].items()},
        "rounds_to_sd": {k: v["sd"] for k, v in summary["rounds_to"].items()},
        "mean_error": summary["mean_error"],
        "final_spread": float(f"{sum(t.rounds[-1].spread for t in cell.trajectories) / len(cell.trajectories):.4g}"),
        "wall_s": round(wall, 3),
    }
    if getattr(args, "plot", None):
        from moshpeer.simulation.plots import plot_distance
        plot_distance(args.plot, cell)
    print(json.dumps(line), flush=True)
    return 0


def run_training_level(args: argparse.Namespace) -> int:
    """--level training: one Moshpit run, optionally the sync baseline and a failure sweep."""
    import torch

    from moshpeer.errors import UserError
    from moshpeer.simulation.training import run_sync, run_training
    from moshpeer.simulation.training_config import TrainingConfig, Workload

    knobs = {dest: (default if getattr(args, dest, None) is None else getattr(args, dest))
             for _, dest, _, default, _, _ in TRAINING_KNOBS}
    if args.grouping != "keys" or args.baseline != "moshpit" or args.initial_keys != "random":
        raise UserError("--grouping, --baseline and --initial-keys are averaging-level knobs")
    if args.min_group_size > args.group_size:
        raise UserError(f"--min-group-size ({args.min_group_size}) must be <= --group-size ({args.group_size})")
    if knobs["plot"]:
        from moshpeer.simulation.plots import prepare_directory
        prepare_directory(knobs["plot"])  # a bad --plot fails before minutes of simulation, not after
    torch.set_num_threads(1)  # a vectorized step is small: threads only add contention on a shared machine
    peers = args.peers
    try:
        workload = Workload(kind=knobs["workload"], dim=args.dim, hidden=knobs["hidden"],
                            heterogeneity=knobs["heterogeneity"], batch=knobs["batch"], lr=knobs["lr"])
        config = TrainingConfig(
            peers=peers, mode=knobs["mode"], rounds=args.rounds,
            inner_steps=knobs["inner_steps"], outer_optimizer=knobs["outer_optimizer"],
            outer_params_every=knobs["outer_params_every"], group_size=args.group_size,
            min_group_size=args.min_group_size, key_bits=args.grid_bits, aggregation=knobs["aggregation"],
            partition=knobs["partition"], model_params=knobs["model_params"], bytes_per_value=knobs["bytes_per_value"],
            uplink=knobs["uplink_mbps"] * 125_000, downlink=knobs["downlink_mbps"] * 125_000,
            rtt_s=knobs["rtt_ms"] / 1000, initial_window=knobs["initial_window"], link_spread=knobs["link_spread"],
            speed=knobs["speed"], speed_spread=knobs["speed_spread"], failure_rate_per_hour=knobs["failures_per_hour"],
            rejoin_s=knobs["rejoin_s"], never_return=knobs["never_return"],
            resume_fraction=knobs["resume_fraction"], max_staleness=knobs["max_staleness"], chunk_loss=args.chunk_loss,
            chunk_numel=args.chunk_numel, loss_budget=knobs["loss_budget"],
            hostile_fraction=knobs["hostile_fraction"],
            hostile_scale=knobs["hostile_scale"], hostile_weight=knobs["hostile_weight"],
            hostile_replay=knobs["hostile_replay"], quorum=knobs["quorum"] or 0.0,
            straggler_hold=not knobs["no_straggler_hold"], matchmaking_window_s=knobs["matchmaking_window_s"],
            round_timeout_s=knobs["round_timeout_s"],
            min_round_timeout_s=min(5.0, knobs["round_timeout_s"]),
            progress_budget_bps=knobs["progress_budget_kbps"] * 1000, workload=workload,
        ).check()
    except ValueError as e:
        raise UserError(str(e)) from None
    if config.peers * workload.parameters() > MAX_VALUES:
        raise UserError(f"--peers x the model's {workload.parameters()} values is more than this command holds")
    started = time.perf_counter()
    result = run_training(config, seed=args.seed)
    results = [result]
    if knobs["sync"]:
        results.append(run_sync(config, seed=args.seed, seconds=result.sim_seconds))
    sweep = []
    for rate in knobs["sweep_failures"] or []:
        swept = TrainingConfig(**{**config.__dict__, "failure_rate_per_hour": rate})
        sweep.append({"failures_per_hour": rate, "moshpit": run_training(swept, seed=args.seed).goodput,
                      "sync": run_sync(swept, seed=args.seed, seconds=result.sim_seconds).goodput})
    wall = time.perf_counter() - started
    if not args.json:
        print_training_table(results, sweep)
    if knobs["plot"]:
        from moshpeer.simulation.plots import plot_training
        plot_training(knobs["plot"], results, sweep)
    line = {"event": "simulate", "level": "training", "peers": config.peers, "mode": config.mode,
            "aggregation": config.aggregation, "failures_per_hour": config.failure_rate_per_hour,
            "hostile_fraction": config.hostile_fraction, "seed": args.seed,
            "results": [r.summary() for r in results], "sweep": sweep, "wall_s": round(wall, 3)}
    print(json.dumps(line), flush=True)
    return 0


def print_training_table(results: Sequence["TrainingResult"], sweep: Sequence[dict]) -> None:
    """Loss against simulated time per system (about 10 rows), then goodput, bytes and stalls."""
    for r in results:
        print(f"{r.system}: loss against simulated time (loss floor {r.loss_floor:.4g})")
        step = max(1, len(r.curve) // 10)
        for t, loss in r.curve[::step] + ([r.curve[-1]] if (len(r.curve) - 1) % step else []):
            print(f"  {t / 3600:>8.2f} h  {loss:.5g}")
    print(f"{'system':>16} {'goodput':>8} {'final loss':>11} {'spread':>9} {'rounds':>7} {'sim h':>7} "
          f"{'GB/peer':>8} {'DHT GB':>7} {'stalls':>7} {'failures':>8}")
    for r in results:
        print(f"{r.system:>16} {r.goodput:>8.3f} {r.final_loss:>11.5g} {r.final_spread:>9.3g} {r.rounds:>7} "
              f"{r.sim_seconds / 3600:>7.2f} {r.bytes_per_peer / 1e9:>8.2f} {r.dht_bytes_per_peer / 1e9:>7.2f} "
              f"{r.stalls:>7} {r.failures:>8}")
    for row in sweep:
        print(f"failures/peer/h {row['failures_per_hour']:g}: goodput moshpit {row['moshpit']:.3f}, "
              f"sync {row['sync']:.3f}")


def print_table(cell, eps: List[float]) -> None:
    """Per round: the error averaged over restarts, the spread (disagreement between peers: differs from the error
    only when chunk loss moved the mean), and the mean group count / size / peers alone / failed."""
    print(f"{'round':>5} {'error':>10} {'spread':>10} {'groups':>8} {'size':>6} {'alone':>7} {'failed':>7} "
          f"{'running':>7}")
    length = len(cell.mean_error)
    for t in range(length):
        stats = [tr.rounds[t - 1] for tr in cell.trajectories if t >= 1 and len(tr.rounds) >= t]
        if t == 0 or not stats:
            row = ("", "", "", "", "", str(len(cell.trajectories)) if t == 0 else "0")
        else:
            k = len(stats)
            row = (f"{sum(s.spread for s in stats) / k:.3e}", f"{sum(s.groups for s in stats) / k:.1f}",
                   f"{sum(s.mean_group_size for s in stats) / k:.2f}", f"{sum(s.alone for s in stats) / k:.1f}",
                   f"{sum(s.failed for s in stats) / k:.1f}", str(k))
        print(f"{t:>5} {cell.mean_error[t]:>10.3e} {row[0]:>10} {row[1]:>8} {row[2]:>6} {row[3]:>7} {row[4]:>7} "
              f"{row[5]:>7}")
    for e in eps:
        runs = cell.rounds_to[e]
        print(f"rounds to {e:g}: {cell.mean(e):.1f} +- {cell.sd(e):.1f} (runs: {' '.join(map(str, runs))}; "
              f"cap {cell.config.rounds})")
