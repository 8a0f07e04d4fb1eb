"""What trust costs and what it buys (issue 14): MACs, CenteredClip, and a hostile peer in digits training.

1. Round cost, in one process over loopback TCP: 4 members (threads) average --numel fp32 values with the
   real `GroupAllReduce`, --rounds times each with `mean`, with `clipped`, and with `mean` without MACs
   (interleaved, so that load on a shared machine hits all three alike); the median round times give
   `clipped_over_mean`. MAC cost is an A/B of whole rounds, not a stopwatch around the MAC calls (with 4
   members as threads of one process, such a stopwatch also counts the time a thread waits for the GIL or
   a core): "without MACs" swaps `FrameAuth.tag` for one that returns a constant 16 bytes, so the frames,
   the handshake and every other step stay the same (both frame paths tag and check through `FrameAuth`, see
   frame_pump.py). `mac_overhead` = 1 - median(round without MACs) /
   median(round with MACs), the share of the round the MACs cost; `mac_cpu_overhead` is the same ratio of
   the process's CPU seconds per round (less sensitive to other load on the machine).
2. Training: 4 (`--peers`) `moshpeer join` peers on digits (bench_training's runner): all honest; one peer hostile
   (`--faults byzantine=-100,weight=1e6`: it sends -100x its gradient and claims weight 1e6) with `mean`;
   the same with `--aggregation clipped` on every peer; the control, all honest with `clipped` (what the
   robust aggregation costs when nobody attacks); and `inside_radius`, a hostile peer inside the rules
   (`--faults byzantine=-1`: its gradient negated at its own scale, under `clipped`), and `sparse_chunks`
   (`--faults byzantine=-100,chunks=0.25`: -100x in one chunk of four, under `clipped`); `sample_liar`, the 4 honest
   peers and a fifth process that, from the swarm's epoch 1 on, claims the whole target batch at the swarm's epoch
   at every refresh and never averages (moshpeer/adversaries/sample_liar.py); `leader_pair`, every peer under
   `clipped` and the hostile one with `--group-size 2`: when it leads, it starts its group as soon as one peer
   joined; `sybil_state`, the 4 honest peers (group size 5), two Sybil donors serving one state forged from the
   first one the swarm offers (moshpeer/adversaries/forged_donors.py), then a fifth peer that joins and downloads
   the swarm's state; `honest_spot`, all honest with `clipped` and `--spot-checks RATE` (what spot checks cost:
   `check_compute_share`, the samples the honest peers recomputed / the samples they trained, and how many honest
   contributions failed a check); `free_rider`, the same with the hostile peer sending zeros at its full weight
   (`--faults byzantine=0`: inside every rule but the spot checks). Final test accuracy of the
   honest peers, the chunks in which an honest peer was clipped, and the rounds in which the hostile peer still
   counted.

    python benchmarks/bench_trust.py [--numel 4000000] [--rounds 15] [--epochs 25] [--spot-check-rate 0.05]
        [--skip-training]

Ends with one JSON line: clipped_over_mean, mac_overhead, mean_round_s, clipped_round_s, honest_acc,
honest_clipped_acc, byzantine_mean_acc, byzantine_clipped_acc, inside_radius_acc, sparse_chunks_acc,
sample_liar_acc, leader_pair_acc, sybil_state_acc (those of the arms run; see --arms); sybil_state_adopted (1 if
the newcomer loaded a Sybil's state in any run) and sybil_state_newcomer_accs; sample_liar_epochs_ratio (collaborative epochs
per second with the liar / in the honest arm, from the mean seconds per epoch over the runs); detection_rate (of the robust attacked arms' runs, the share in which every honest
peer distrusted the hostile one within DETECTION_EPOCHS epochs), honest_distrusted (per arm and run: rounds in
which an honest peer distrusted an honest one), robust_too_few (per arm and run: chunks a robust owner kept its own
value for) and group_sizes (per arm and run: rounds per group size, over all peers); with the spot-check arms,
check_compute_share, spot_checks (per arm: outcomes of the honest peers' checks of honest and of hostile peers) and
spot_check_detection_rate (free_rider runs in which every honest peer distrusted the free rider within
DETECTION_EPOCHS epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from moshpeer.averaging import DataPlane, GroupAllReduce, GroupMember, handshake, wire  # noqa: E402
from moshpeer.averaging.handshake import RoundCredentials  # noqa: E402
from moshpeer.averaging.scratch import ScratchPool  # noqa: E402
from moshpeer.compression import get_compression  # noqa: E402
from moshpeer.dht.identity import Identity  # noqa: E402

MEMBERS = 4
HOSTILE = "byzantine=-100,weight=1e6"
# Inside the rules (issue 26): the hostile peer sends its gradient negated at its own scale, near the honest spread.
INSIDE_RADIUS = "byzantine=-1"
# The audit's sparse attack: -100x in one chunk of four, too few chunks for the suspect rule's "half of them".
SPARSE_CHUNKS = "byzantine=-100,chunks=0.25"
# Inside every rule but a spot check: zeros, at the weight of the samples it claims to have computed.
FREE_RIDER = "byzantine=0"
ARMS = ("honest", "honest_clipped", "byzantine_mean", "byzantine_clipped", "inside_radius", "sparse_chunks",
        "sample_liar", "leader_pair", "sybil_state", "honest_spot", "free_rider")
# One of the 4 peers is hostile (the sample liar is a fifth process, not one of them).
ATTACKED_ARMS = ("byzantine_mean", "byzantine_clipped", "inside_radius", "sparse_chunks", "leader_pair", "free_rider")
SPOT_CHECK_ARMS = ("honest_spot", "free_rider")
ROBUST_ATTACKED_ARMS = ("byzantine_clipped", "inside_radius", "sparse_chunks")  # the arms detection is asked of
DETECTION_EPOCHS = 20  # issue 26: a hostile peer counts as detected when every honest peer distrusts it by then


class ConstantMacs:
    """While entered, every frame's MAC is a constant (both ends agree, nothing is computed): the B side of the
    MAC A/B. Benchmark only: it turns authentication off."""

    def __enter__(self):
        self._original = handshake.FrameAuth.tag
        handshake.FrameAuth.tag = lambda auth, header, payload=b"": bytes(handshake.MAC_BYTES)
        return self

    def __exit__(self, *exc):
        handshake.FrameAuth.tag = self._original


def one_round(identities: List[Identity], inputs: List[torch.Tensor], aggregation: str, chunk_numel: int,
              scratch: List[ScratchPool]) -> float:
    """One all-reduce of `inputs` among MEMBERS threads -> the slowest member's data-plane seconds."""
    planes = [DataPlane() for _ in inputs]
    members = [GroupMember(*p.address, 1.0, ident.peer_id_bytes) for p, ident in zip(planes, identities)]
    tag = wire.allreduce_tag(os.urandom(20), 0)
    tensors = [x.clone() for x in inputs]
    results = [None] * len(inputs)
    creds = [RoundCredentials.create(ident, wire.tag_group(tag), k) for k, ident in enumerate(identities)]

    def run(k: int) -> None:
        results[k] = GroupAllReduce(
            planes[k], tensors[k], members=members, my_index=k, tag=tag, secret=b"s" * 32, credentials=creds[k],
            compression=get_compression("none"), chunk_numel=chunk_numel, deadline=time.monotonic() + 120,
            aggregation=aggregation, scratch=scratch[k]).run()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in planes:
        p.close()
    if any(r is None or r.reduce.chunks_lost or r.gather.chunks_lost for r in results):
        raise RuntimeError("a benchmark round lost chunks: the machine is too loaded to time it")
    return max(r.total_s for r in results)


def round_costs(args) -> dict:
    identities = [Identity.generate() for _ in range(MEMBERS)]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(args.numel, generator=g) for _ in range(MEMBERS)]
    scratch = [ScratchPool(keep=2 + 3 * MEMBERS) for _ in range(MEMBERS)]  # kept as an averager keeps them
    one_round(identities, inputs, "mean", args.chunk_numel, scratch)  # warm-up: threads, allocator, sockets
    times = {"mean": [], "clipped": [], "mean_no_mac": []}
    cpu = {"mean": [], "mean_no_mac": []}
    for _ in range(args.rounds):
        for mode in ("mean", "clipped", "mean_no_mac"):  # interleaved: load on a shared machine hits all alike
            cpu_before = time.process_time()
            if mode == "mean_no_mac":
                with ConstantMacs():
                    seconds = one_round(identities, inputs, "mean", args.chunk_numel, scratch)
            else:
                seconds = one_round(identities, inputs, mode, args.chunk_numel, scratch)
            times[mode].append(seconds)
            if mode in cpu:
                cpu[mode].append(time.process_time() - cpu_before)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    return {"mean_round_s": median["mean"], "clipped_round_s": median["clipped"],
            "no_mac_round_s": median["mean_no_mac"], "clipped_over_mean": median["clipped"] / median["mean"],
            "mac_overhead": 1.0 - median["mean_no_mac"] / median["mean"],
            "mac_cpu_overhead": 1.0 - statistics.median(cpu["mean_no_mac"]) / statistics.median(cpu["mean"]),
            "round_times": times}


def flag_counts(events: List[List[dict]], hostile) -> dict:
    """From one run's event lines: chunks in which an honest peer's contribution was clipped (by any owner); the
    rounds (over all owners) in which the hostile peer's contribution still counted (it was not yet weighed at
    zero: the rounds its pull reached the model); whether every honest peer distrusted it in a round of an epoch
    <= DETECTION_EPOCHS (`detected`); the rounds in which an honest peer distrusted an honest one; and the rounds in
    which an honest peer averaged in a group of two (`honest_pairs`)."""
    hostile_id = None if hostile is None else next(e["peer_id"] for e in events[hostile] if e.get("peer_id"))
    honest_flagged = hostile_free = honest_distrusted = robust_too_few = honest_pairs = 0
    group_sizes: dict = {}
    detectors = set()
    for k, peer in enumerate(events):
        for e in peer:
            if e.get("event") != "epoch" or not e.get("ok"):
                continue
            result = e["round"]  # the RoundResult
            robust_too_few += result.get("robust_too_few", 0)
            group_sizes[result["group_size"]] = group_sizes.get(result["group_size"], 0) + 1
            honest_pairs += result["group_size"] == 2 and k != hostile
            honest_flagged += sum(n for peer_id, n in result["flagged"].items() if peer_id != hostile_id)
            honest_distrusted += sum(1 for peer_id in result["distrusted"] if peer_id != hostile_id)
            if hostile_id is not None and k != hostile:
                if hostile_id not in result["distrusted"]:
                    hostile_free += 1
                elif e.get("epoch", DETECTION_EPOCHS + 1) <= DETECTION_EPOCHS:
                    detectors.add(k)
    detected = hostile is not None and len(detectors) == len(events) - 1
    return {"honest_flagged": honest_flagged, "hostile_free_rounds": hostile_free, "detected": detected,
            "honest_distrusted": honest_distrusted, "robust_too_few": robust_too_few, "group_sizes": group_sizes,
            "honest_pairs": honest_pairs}


# The sybil_state arm's swarm trains at least this many epochs: on 2 cores the newcomer (a fifth interpreter, started
# once the Sybil donors are up) took longer to start than 25 epochs of digits, and found only the Sybils (session 24).
SYBIL_STATE_EPOCHS = 75


def training(args) -> dict:
    import bench_training

    run_args = SimpleNamespace(peers=args.peers, group_size=args.peers, aux=0, epochs=args.epochs, target=args.target,
                               matchmaking_time=args.matchmaking_time, timeout=args.timeout)
    hostile = args.peers - 1

    arms = [arm for arm in (
        ("honest", None),
        # The control: what CenteredClip costs honest peers when nobody attacks.
        ("honest_clipped", lambda i: ["--aggregation", "clipped"]),
        ("byzantine_mean", lambda i: ["--faults", HOSTILE] if i == hostile else []),
        ("byzantine_clipped", lambda i: ["--aggregation", "clipped"] + (["--faults", HOSTILE] if i == hostile else [])),
        ("inside_radius",
         lambda i: ["--aggregation", "clipped"] + (["--faults", INSIDE_RADIUS] if i == hostile else [])),
        ("sparse_chunks",
         lambda i: ["--aggregation", "clipped"] + (["--faults", SPARSE_CHUNKS] if i == hostile else [])),
        ("sample_liar", None),
        ("sybil_state", lambda i: ["--group-size", str(args.peers + 1)]),  # the newcomer averages with all of them
        ("leader_pair", lambda i: ["--aggregation", "clipped"] + (["--group-size", "2"] if i == hostile else [])),
        ("honest_spot", lambda i: ["--aggregation", "clipped", "--spot-checks", str(args.spot_check_rate)]),
        ("free_rider", lambda i: ["--aggregation", "clipped", "--spot-checks", str(args.spot_check_rate)]
         + (["--faults", FREE_RIDER] if i == hostile else [])),
    ) if arm[0] in args.arms]
    out = {name: {"accs": [], "peers_finished": [], "train_s": [], "step_s": [], "honest_flagged": [],
                  "hostile_free_rounds": [], "detected": [], "honest_distrusted": [], "robust_too_few": [],
                  "group_sizes": [], "honest_pairs": [], "adopted": [], "newcomer_accs": [], "spot": []}
           for name, _ in arms}
    # Repeats interleave the arms: a run's accuracy varies by ~1 point between identical runs (thread timing
    # decides which micro-batches make each round), about the size of the floor being checked.
    for repeat in range(args.repeats):
        for name, extra in arms:
            tag = f"{name.replace('_', '-')}-{repeat}"
            arm_args = run_args
            if name == "sybil_state":  # the newcomer must still find the honest donors when it has started
                arm_args = SimpleNamespace(**{**vars(run_args), "epochs": max(run_args.epochs, SYBIL_STATE_EPOCHS)})
            companions = {"sample_liar": sample_liar,
                          "sybil_state": lambda run_id, maddrs: sybil_state(arm_args, run_id, maddrs)}.get(name)
            summary = bench_training.run_moshpeer(arm_args, straggler=None, budget=None, tag=tag, extra_args=extra,
                                                  companions=companions)
            if name == "sybil_state":
                adopted, newcomer_acc = sybil_adoptions(bench_training.ALL_EVENTS[f"moshpeer-{tag}-companions"])
                out[name]["adopted"].append(adopted)
                out[name]["newcomer_accs"].append(newcomer_acc)
            events = bench_training.ALL_EVENTS[f"moshpeer-{tag}"]
            finals = [e["metrics"]["accuracy"] for k, peer in enumerate(events) if name not in ATTACKED_ARMS or k != hostile
                      for e in peer if e.get("event") == "done"]
            out[name]["accs"].append(sum(finals) / len(finals) if finals else None)
            out[name]["peers_finished"].append(len(finals))
            flags = flag_counts(events, hostile if name in ATTACKED_ARMS else None)
            out[name]["honest_flagged"].append(flags["honest_flagged"])
            for key in ("hostile_free_rounds", "detected", "honest_distrusted", "robust_too_few", "group_sizes",
                        "honest_pairs"):
                out[name][key].append(flags[key])
            if name in SPOT_CHECK_ARMS:
                out[name]["spot"].append(spot_checks(events, hostile if name in ATTACKED_ARMS else None))
            out[name]["train_s"].append(summary["train_s"] or 0.0)
            out[name]["step_s"].append(summary["mean_step_s"])
    for r in out.values():
        done = [a for a in r["accs"] if a is not None]
        r["acc"] = sum(done) / len(done) if done else None
        steps = [s for s in r["step_s"] if s]
        r["mean_step_s"] = sum(steps) / len(steps) if steps else None
    return out


def spot_checks(events: List[List[dict]], hostile: Optional[int]) -> dict:
    """From one run's event lines: the honest peers' spot checks of honest peers and of the hostile one, by outcome,
    the samples they recomputed and trained (their `check_compute_share`), the largest relative error of a check of
an honest peer, and why checks were skipped."""
    hostile_id = None if hostile is None else next(e["peer_id"] for e in events[hostile] if e.get("peer_id"))
    outcomes = {"of_honest": {}, "of_hostile": {}}
    checked = trained = 0
    honest_errors, skipped = [], {}
    for k, peer in enumerate(events):
        if k == hostile:
            continue
        for e in peer:
            if e.get("event") == "spot_check":
                whom = outcomes["of_hostile" if e["peer"] == hostile_id else "of_honest"]
                whom[e["outcome"]] = whom.get(e["outcome"], 0) + 1
                checked += e["samples"]
                if e["peer"] != hostile_id and e["relative_error"] is not None:
                    honest_errors.append(e["relative_error"])
                if e["outcome"] == "skipped":
                    skipped[e["reason"]] = skipped.get(e["reason"], 0) + 1
            elif e.get("event") == "done":
                trained += e["samples"]
    return {**outcomes, "samples_checked": checked, "samples_trained": trained,
            "max_honest_error": max(honest_errors, default=None), "skipped": skipped}


def sample_liar(run_id: str, maddrs: List[str]) -> List[Tuple[List[str], str]]:
    """The sample_liar arm's fifth process: it claims the target batch at the swarm's epoch at every refresh."""
    import bench_training

    return [([sys.executable, "-m", "moshpeer.adversaries.sample_liar", "--run-id", run_id, "--initial-peers", *maddrs,
              "--target-batch-size", str(bench_training.GLOBAL_BATCH), "--from-epoch", "1"], "ready")]


def sybil_state(run_args, run_id: str, maddrs: List[str]) -> List[Tuple[List[str], str]]:
    """The sybil_state arm's companions: two Sybil donors serving one forged state (moshpeer/adversaries/forged_donors.py),
    then a newcomer (a fifth `moshpeer join`) that downloads the swarm's state when it starts."""
    import bench_training

    newcomer = bench_training.moshpeer_argv(
        "join", run_id, bench_training.LOOPBACK, "--initial-peers", *maddrs, "--group-size", str(run_args.peers + 1),
        "--max-epochs", str(run_args.epochs), "--eval-every", "1", "--target-batch-size", str(bench_training.GLOBAL_BATCH),
        "--batch-size", str(bench_training.MICRO_BATCH), "--matchmaking-time", str(run_args.matchmaking_time),
        "--seed", str(run_args.peers))
    return [([sys.executable, "-m", "moshpeer.adversaries.forged_donors", "--run-id", run_id, "--initial-peers", *maddrs,
              "--count", "2"], "ready"), (newcomer, "started")]


def sybil_adoptions(companions: List[List[dict]]) -> Tuple[int, Optional[float]]:
    """From the sybil_state arm's companion events: 1 if the newcomer loaded a state from a Sybil donor (at its start
    or in a later catch-up), else 0; and the newcomer's final accuracy (None if it did not finish)."""
    sybils = set(next((e["peer_ids"] for e in companions[0] if e.get("event") == "ready"), []))
    newcomer = companions[1] if len(companions) > 1 else []
    donors = {e.get("donor") for e in newcomer if e.get("event") == "state_loaded"}
    done = next((e for e in newcomer if e.get("event") == "done"), None)
    return int(bool(donors & sybils)), (done["metrics"]["accuracy"] if done else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4_000_000, help="values averaged per round timing (fp32)")
    parser.add_argument("--chunk-numel", type=int, default=1 << 18)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per mode (the A/B medians)")
    parser.add_argument("--epochs", type=int, default=25, help="collaborative epochs of each training run")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=400.0, help="per training run")
    parser.add_argument("--repeats", type=int, default=1, help="training runs per arm (mean accuracy reported)")
    parser.add_argument("--peers", type=int, default=MEMBERS,
                        help="training peers per run (the hostile one, in the arms that have one, is the last)")
    parser.add_argument("--spot-check-rate", type=float, default=0.05,
                        help="--spot-checks of the honest_spot and free_rider arms' peers")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--arms", type=lambda text: text.split(","), default=list(ARMS),
                        help=f"comma-separated training arms (default: all of {','.join(ARMS)})")
    args = parser.parse_args()
    # The 4 members already share the machine's cores; intra-op threads on top of them only add barrier waits
    # (bench_training runs its peers with OMP_NUM_THREADS=1 for the same reason).
    torch.set_num_threads(1)

    costs = round_costs(args)
    print(f"round of {args.numel} fp32 values, {MEMBERS} members in one process over loopback, median of "
          f"{args.rounds}")
    print(f"{'aggregation':<14}{'round (s)':>12}")
    for mode in ("mean", "clipped", "mean_no_mac"):
        print(f"{mode:<14}{statistics.median(costs['round_times'][mode]):>12.3f}")
    print(f"clipped / mean: {costs['clipped_over_mean']:.3f}   MAC share of a mean round: {costs['mac_overhead']:.1%} "
          f"of its time, {costs['mac_cpu_overhead']:.1%} of its CPU")
    figures = {k: v for k, v in costs.items() if k != "round_times"}
    if not args.skip_training:
        runs = training(args)
        print(f"\n{f'digits, {args.peers} peers':<22}{'mean acc':>10}  {'per run':<30}{'peers':>8}{'train (s)':>20}")
        for name, r in runs.items():
            acc = f"{r['acc']:.4f}" if r["acc"] is not None else "-"
            each = " ".join(f"{a:.4f}" if a is not None else "-" for a in r["accs"])
            print(f"{name:<22}{acc:>10}  {each:<30}{str(r['peers_finished']):>8}"
                  f"{' '.join(f'{t:.1f}' for t in r['train_s']):>20}")
        print("flagged chunks of honest peers per run: " + "; ".join(
            f"{name} {r['honest_flagged']}" for name, r in runs.items() if name not in ("honest", "byzantine_mean")))
        print("honest owners' rounds in which the hostile peer still counted, per run: " + "; ".join(
            f"{name} {r['hostile_free_rounds']}" for name, r in runs.items() if name in ATTACKED_ARMS))
        print("rounds in which an honest peer distrusted an honest one, per run: " + "; ".join(
            f"{name} {r['honest_distrusted']}" for name, r in runs.items() if name != "honest"))
        print("chunks a robust owner kept its own value for (too few contributions), per run: " + "; ".join(
            f"{name} {r['robust_too_few']}" for name, r in runs.items()))
        print("rounds per group size, per run: " + "; ".join(f"{name} {r['group_sizes']}" for name, r in runs.items()))
        print("rounds an honest peer averaged in a group of two, per run: " + "; ".join(
            f"{name} {r['honest_pairs']}" for name, r in runs.items()))
        print("seconds per collaborative epoch, per run: " + "; ".join(
            f"{name} {' '.join(f'{s:.2f}' if s else '-' for s in r['step_s'])}" for name, r in runs.items()))
        spot = {name: r["spot"] for name, r in runs.items() if name in SPOT_CHECK_ARMS}
        if spot:
            print("spot checks per run (honest peers' checks of honest / of the hostile peer, by outcome): " + "; ".join(
                f"{name} {[(s['of_honest'], s['of_hostile']) for s in runs_]}" for name, runs_ in spot.items()))
            trained = sum(s["samples_trained"] for runs_ in spot.values() for s in runs_)
            figures["check_compute_share"] = sum(s["samples_checked"] for runs_ in spot.values()
                                                 for s in runs_) / trained if trained else None
            figures.update(spot_checks=spot, spot_check_rate=args.spot_check_rate)
        if "free_rider" in runs:
            figures["spot_check_detection_rate"] = sum(runs["free_rider"]["detected"]) / len(runs["free_rider"]["detected"])
        detections = [d for name, r in runs.items() if name in ROBUST_ATTACKED_ARMS for d in r["detected"]]
        if detections:
            figures["detection_rate"] = sum(detections) / len(detections)
        if "sybil_state" in runs:
            print(f"sybil_state: newcomer adopted a Sybil state in {runs['sybil_state']['adopted']}, its final "
                  f"accuracy {runs['sybil_state']['newcomer_accs']}")
            figures.update(sybil_state_epochs=max(args.epochs, SYBIL_STATE_EPOCHS),
                           sybil_state_adopted=max(runs["sybil_state"]["adopted"], default=None),
                           sybil_state_newcomer_accs=runs["sybil_state"]["newcomer_accs"])
        if "sample_liar" in runs and "honest" in runs and runs["sample_liar"]["mean_step_s"]:
            figures["sample_liar_epochs_ratio"] = runs["honest"]["mean_step_s"] / runs["sample_liar"]["mean_step_s"]
        figures.update({f"{name}_acc": r["acc"] for name, r in runs.items()}, epochs=args.epochs,
                       repeats=args.repeats, accs={name: r["accs"] for name, r in runs.items()},
                       honest_flagged={name: r["honest_flagged"] for name, r in runs.items()},
                       hostile_free_rounds={name: r["hostile_free_rounds"] for name, r in runs.items()},
                       detected={name: r["detected"] for name, r in runs.items() if name in ROBUST_ATTACKED_ARMS},
                       honest_distrusted={name: r["honest_distrusted"] for name, r in runs.items()},
                       robust_too_few={name: r["robust_too_few"] for name, r in runs.items()},
                       group_sizes={name: r["group_sizes"] for name, r in runs.items()},
                       step_s={name: r["step_s"] for name, r in runs.items()},
                       honest_pairs={name: r["honest_pairs"] for name, r in runs.items()})
    figures.update(numel=args.numel, members=MEMBERS, peers=args.peers)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
