"""`moshpeer simulate`: Moshpit averaging of N virtual peers, on the group-key decisions the real peers take.

Runs `moshpeer.simulation.run_cell` (restarts of one configuration), prints a table of the mean error per
round and the rounds needed to reach each --eps, and ends with one JSON line. See docs/simulation.md for what
is simulated and what is production code.

Every bad knob value is one line on stderr ("moshpeer simulate: error: ...") and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable, List

MAX_VALUES = 50_000_000

DESCRIPTION = (
    "Simulate Moshpit averaging among many virtual peers: each holds a vector of --dim values drawn from N(0, 1); "
    "each round every peer fails with probability --failure-rate (a failed peer sits the round out and keeps its "
    "value), the others group by group key (at most --group-size per group), average, and rotate their keys with "
    "hivemind's rule. Prints the mean squared distance to the exact mean per round (averaged over --restarts) and "
    "the rounds needed to reach each --eps; the last line is a JSON object."
)


def _int_at_least(low: int, high: int = 1 << 62) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be between {low} and {high}")
        return value
    return parse


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1)")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


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
    parser.add_argument("--peers", type=_int_at_least(1, 10_000_000), default=512, metavar="N",
                        help="number of virtual peers")
    parser.add_argument("--group-size", type=_int_at_least(2, 1 << 20), default=16, metavar="G",
                        help="target group size g: at most G peers per group; also the side of the --grouping grid")
    parser.add_argument("--min-group-size", type=_int_at_least(1, 1 << 20), default=2, metavar="K",
                        help="a group smaller than K does not assemble; its peers keep their value and key "
                        "(must be <= --group-size)")
    parser.add_argument("--grid-bits", type=_int_at_least(0, 62), default=None, metavar="B",
                        help="length of the group bits (keys grouping); default: whole axes of log2(G) bits, as many "
                        "as keep N / 2^B >= 4 G (0 = one key for all below 8 G peers); the paper's 32 x 32 grid for "
                        "512 peers is --group-size 32 --grid-bits 5")
    parser.add_argument("--grid-dims", type=_int_at_least(1, 62), default=None, metavar="M",
                        help="dimensions of the fixed grid (--grouping grid); default: smallest M with G^M >= N")
    parser.add_argument("--grouping", choices=("keys", "grid"), default="keys",
                        help="keys: hivemind group keys and rotation, as moshpeer peers do; grid: the Moshpit "
                        "notebook's fixed grid (distinct random cells of G^M, round t averages along axis t mod M)")
    parser.add_argument("--initial-keys", choices=("random", "balanced"), default="random",
                        help="random: uniform group bits per peer (as a peer draws them); balanced: every key held by "
                        "the same number of peers (a full grid when N = G^M)")
    parser.add_argument("--dim", type=_int_at_least(1, 1 << 24), default=1, metavar="D",
                        help="values per peer (1 = scalars, as in the Moshpit paper)")
    parser.add_argument("--rounds", type=_int_at_least(1, 100_000), default=50, metavar="R",
                        help="round cap; a run that never reaches an eps counts as R rounds (the paper caps at 50)")
    parser.add_argument("--failure-rate", type=_probability, default=0.0, metavar="P",
                        help="probability that a peer fails in a round, independently per peer and round")
    parser.add_argument("--chunk-loss", type=_probability, default=0.0, metavar="Q",
                        help="probability that one chunk on one link is lost (reduce-scatter and all-gather); "
                        "averaged with the production loss-tolerant estimator; 0 = exact group means")
    parser.add_argument("--chunk-numel", type=_int_at_least(1, 1 << 30), default=1024, metavar="C",
                        help="values per chunk when --chunk-loss > 0")
    parser.add_argument("--restarts", type=_int_at_least(1, 10_000), default=10, metavar="K",
                        help="independent runs, seeds SEED .. SEED+K-1; results are their mean (and sd)")
    parser.add_argument("--seed", type=_int_at_least(0, (1 << 32) - 1), default=0, metavar="S",
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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
    print(json.dumps(line), flush=True)
    return 0


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
