"""DiLoCo on Moshpit groups vs gradient and parameter averaging, 4 peers on 50 Mbit/s links.

Task: the built-in `charlm` byte-level transformer, widened to 5.2M parameters (d_model 288, 5 layers,
context 32) so that communication matters, with micro-batches of 4 windows per peer (the 2-core sandbox
computes one in ~0.1 s). Every arm trains on the same number of samples: STEPS micro-batches per peer.

- gradients: `--averaging gradients`, target batch = peers x micro-batch, so one round (41 MB of fp32
  gradients and parameters per peer) per micro-batch;
- parameters: Moshpit SGD, `--averaging parameters`, averaging parameters and Adam's second moment every
  50 local steps (the period of DiLoCo H=50);
- diloco-h50 / diloco-h200: `--averaging diloco --inner-steps H`, Δ uncompressed;
- diloco-h50-int4: Δ as int4; diloco-h50-int4-overlap: the same with the one-outer-step delay;
- diloco-streaming: Streaming DiLoCo, `--diloco-fragments 4`, Δ as int4, H=40 (F must divide H, and H/F
  the steps): an epoch of 10 inner steps averages a quarter of the parameters, so each fragment syncs
  every 40 steps and a round carries a quarter of the bytes; peers evaluate every 4 epochs (every H);
- diloco-streaming-paced: the same, overlapped (`--diloco-overlap`: a fragment's round runs during the next
  epoch's inner steps) and paced (`--diloco-pace`: the round spreads its upload over most of that epoch's
  compute instead of bursting at the link's rate), as Streaming DiLoCo overlaps a fragment's communication;
- single: one process (`train_locally`), global batch peers x micro-batch, the same samples.

Learning rates: --lr (AdamW, default 1.5e-3, the best of a sweep of the single process at this size) is
the rate at the global batch of peers x micro-batch: the single process's and the gradients arm's. The
arms whose peers take local steps on one micro-batch (parameters, DiLoCo's inner steps) use
--lr x sqrt(micro-batch / global batch), Adam's square-root scaling rule (Malladi et al., 2022): a
batch 4x smaller has 2x the gradient noise. Without it, the local arms train at a rate tuned for
4x their batch (charlm's default 3e-3 was too high for either at this width; see docs/training.md).

Links: with --netlab (default when network namespaces can be made) every peer runs in its own namespace
behind a tbf-shaped 50 Mbit/s upload (moshpeer.testing.netlab); --loopback runs on 127.0.0.1 unshaped.

What is measured and what is derived (said again in the table):
- A gradients round at 50 Mbit/s takes ~10 s, so the arm's STEPS rounds would take an hour. It runs
  GRADIENT_STEPS real rounds on the shaped links to measure seconds and bytes per step; its loss curve
  is the single process's (a full group averaging fp32 gradients of peers x micro-batch samples is
  the same Adam step as one process on that batch; the benchmark checks the losses after
  GRADIENT_STEPS steps agree), so its time to the target is (single's steps to the target) x (measured
  seconds per step), and its bytes are (measured bytes of a gradients round) x STEPS, plus the
  parameters every 16th round (gradients mode's --params-every default).
- Time to target: from training start until a peer first evaluates at or below the target loss
  (the single process's eval loss at half its samples). Every DiLoCo/parameters peer evaluates after
  every outer step.
- bytes/peer: payload bytes sent by the averaging rounds (RoundReport.bytes_sent), mean over peers;
  with --netlab also the bytes each peer's link carried (all traffic: DHT, state, headers; the bootstrap DHT
  node runs in a namespace of its own, not counted).
- hidden communication (overlap arm): 1 - (time the training loop waited for rounds) / (time the rounds
  took, matchmaking included).
- peak upload (--netlab): the highest rate any peer's link carried over a 1-second window (its interface
  counter sampled every 0.5 s); streaming_peak_bandwidth_ratio = the streaming arm's / diloco-h50-int4's.

    python benchmarks/bench_diloco.py [--loopback] [--steps 400]

Ends with one JSON line: diloco_loss_over_gradients, gradients_bytes_over_diloco, time_to_target_speedup,
sparse_loss_over_gradients, sparse_bytes_over_gradients (the `diloco-sparse` arm: topk-int2 + residual feedback),
streaming_loss_over_gradients, streaming_peak_bandwidth_ratio (the `diloco-streaming` arm; streaming_paced_* the
paced arm's; *_loss_over_single for both), link_over_payload and
failed_round_fraction (the headline arm), quorum_time_to_target_over_homogeneous and
noquorum_time_to_target_over_homogeneous (`diloco-quorum` / `diloco-hetero`, peer 0 at about half speed, over the
headline arm), hidden_comm_fraction, single_loss, and per-arm figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from moshpeer.peer.optimizer.epoch_loop import MISSED_ROUND_UPDATE  # noqa: E402
from bench_training import Child, bootstrap_maddrs, env, moshpeer_argv  # noqa: E402  (same process handling as the training benchmark)
from moshpeer.peer.strategies.gradients import DEFAULT_PARAMS_EVERY  # noqa: E402

TASK_ARGS = {"d_model": 288, "layers": 5, "heads": 4, "context": 32, "max_bytes": 1_000_000}
LOOPBACK = "127.0.0.1"
# What --events-out keeps of each epoch event (the JSON line has only the figures).
RECORD_FIELDS = ("event", "epoch", "ok", "error", "group_size", "bytes_sent", "wait_s", "matchmaking_s", "train_time",
                 "matchmaking_window_s", "stragglers_eta_s", "group_target", "received_at")
HEADLINE = "diloco-h50-int4"  # the DiLoCo arm of the JSON figures: H and the Δ codec together


def arms(args) -> List[dict]:
    steps, h = args.steps, 50
    return [
        {"name": "gradients", "averaging": "gradients", "epochs": args.gradient_steps, "target_batch": args.peers * args.batch,
         "compression": "none", "round_timeout": 120},
        {"name": "parameters", "averaging": "parameters", "epochs": steps // h,
         "target_batch": args.peers * args.batch * h, "compression": "none", "round_timeout": 120},
        {"name": "diloco-h50", "averaging": "diloco", "epochs": steps // h, "inner_steps": h, "compression": "none",
         "round_timeout": 60},
        {"name": "diloco-h200", "averaging": "diloco", "epochs": steps // 200, "inner_steps": 200,
         "compression": "none", "round_timeout": 60},
        {"name": "diloco-h50-int4", "averaging": "diloco", "epochs": steps // h, "inner_steps": h,
         "compression": "int4", "round_timeout": 30},
        {"name": "diloco-h50-int4-overlap", "averaging": "diloco", "epochs": steps // h, "inner_steps": h,
         "compression": "int4", "overlap": True, "round_timeout": 30},
        {"name": "diloco-streaming", "averaging": "diloco", "epochs": steps // 10, "inner_steps": 40, "fragments": 4,
         "compression": "int4", "round_timeout": 30, "eval_every": 4},
        {"name": "diloco-streaming-paced", "averaging": "diloco", "epochs": steps // 10, "inner_steps": 40,
         "fragments": 4, "overlap": True, "pace": True, "compression": "int4", "round_timeout": 30, "eval_every": 4},
        # Decoupled DiLoCo's quorum (issue 27): peer 0 at about half speed, without and with a quorum of 0.75
        {"name": "diloco-hetero", "averaging": "diloco", "epochs": steps // h, "inner_steps": h,
         "compression": "int4", "round_timeout": 30, "straggler": f"constant:mean_s={args.half_speed_s}"},
        {"name": "diloco-quorum", "averaging": "diloco", "epochs": steps // h, "inner_steps": h,
         "compression": "int4", "round_timeout": 30, "straggler": f"constant:mean_s={args.half_speed_s}",
         "quorum": 0.75},
        # SparseLoCo's recipe (issue 27): top-k rows (1.56%) as ternary codes, the sketch as int8, residual error
        # feedback (--sparse-inner-steps: a round moves 1.56% of the rows, so every row needs 64 rounds:
        # docs/compression.md; --sparse-codec: e.g. a rank-1 sketch, which halves a round's bytes)
        {"name": "diloco-sparse", "averaging": "diloco", "epochs": steps // args.sparse_inner_steps,
         "inner_steps": args.sparse_inner_steps, "compression": args.sparse_codec, "error_feedback": True,
         "round_timeout": 30},
    ]


def local_lr(args) -> float:
    """The AdamW rate of a peer stepping on its own micro-batch: --lr (set for peers x micro-batch) scaled by the
    square root of the batch ratio."""
    return args.lr * (args.batch / (args.peers * args.batch)) ** 0.5


def task_flags(lr: float) -> List[str]:
    flags = ["--task", "charlm"]
    for key, value in {**TASK_ARGS, "lr": lr}.items():
        flags += ["--task-arg", f"{key}={value}"]
    return flags


class UploadPeaks:
    """Samples every peer's link counter (netlab) every `interval` s on a thread of its own and keeps, per peer,
    the highest upload rate over any `window`-second span: the peak bandwidth an arm asks of a link."""

    def __init__(self, lab, peers: int, window: float = 1.0, interval: float = 0.5):
        self.lab, self.peers, self.window, self.interval = lab, peers, window, interval
        self.peak = [0.0] * peers  # bytes/s
        self._history: List[List[tuple]] = [[] for _ in range(peers)]
        self.samples: List[List[tuple]] = [[] for _ in range(peers)]  # (unix time, bytes sent): --events-out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for i in range(self.peers):
                now, sent = time.monotonic(), self.lab.tx_bytes(i)
                history = self._history[i]
                history.append((now, sent))
                self.samples[i].append((time.time(), sent))
                while len(history) > 1 and now - history[1][0] >= self.window:
                    history.pop(0)
                start, before = history[0]
                if now - start >= self.window:
                    self.peak[i] = max(self.peak[i], (sent - before) / (now - start))

    def stop(self) -> float:
        """Stop sampling; -> the highest peak over the peers, bytes/s."""
        self._stop.set()
        self._thread.join(timeout=10)
        return max(self.peak)


def run_arm(args, arm: dict, lab) -> dict:
    """One swarm of args.peers `moshpeer join` peers (plus a `moshpeer dht` bootstrap) for one arm."""
    e = env()
    run_id = f"bench-diloco-{arm['name']}-{os.getpid()}"
    # The bootstrap DHT node has a namespace of its own (the lab's last): on a peer's, its share of the DHT's
    # traffic counted as that peer's link bytes (~8 MB a run, 2 MB on the mean per peer; session 28).
    hosts = lab.addresses if lab is not None else [LOOPBACK] * (args.peers + 1)

    def wrap(index: int, argv: List[str]) -> List[str]:
        return lab.command(index, argv) if lab is not None else argv

    # ... and the peers' heartbeat: at moshpeer_argv's 1 s, every publication of its record cost each peer a read
    # of the whole membership dictionary (hivemind's store asks the nodes near the key, which answer with it).
    boot = Child(wrap(args.peers, moshpeer_argv("dht", run_id, f"/ip4/{hosts[args.peers]}/tcp/0",
                                                "--heartbeat", str(args.heartbeat))), e)
    children = [boot]
    tx_before = [lab.tx_bytes(i) for i in range(args.peers)] if lab is not None else None
    peaks = UploadPeaks(lab, args.peers) if lab is not None else None
    try:
        maddrs = bootstrap_maddrs(boot, 120)
        peers = []
        lr = args.lr if arm["averaging"] == "gradients" else local_lr(args)
        for i in range(args.peers):
            argv = moshpeer_argv("join", run_id, f"/ip4/{hosts[i]}/tcp/0", "--initial-peers", *maddrs, *task_flags(lr),
                                 "--group-size", str(args.peers), "--min-peers", str(args.peers), "--wait-peers", "120",
                                 "--max-epochs", str(arm["epochs"]), "--batch-size", str(args.batch),
                                 "--target-batch-size", str(arm.get("target_batch", args.peers * args.batch)),
                                 "--averaging", arm["averaging"], "--compression", arm["compression"],
                                 "--eval-every",
                                 str(arm.get("eval_every", arm["epochs"] if arm["averaging"] == "gradients" else 1)),
                                 "--matchmaking-time", str(args.matchmaking_time),
                                 "--round-timeout", str(arm["round_timeout"]), "--seed", str(i),
                                 "--heartbeat", str(args.heartbeat))
            if "inner_steps" in arm:
                argv += ["--inner-steps", str(arm["inner_steps"]), "--outer-optimizer", args.outer_optimizer]
            if arm.get("overlap"):
                argv += ["--diloco-overlap"]
            if arm.get("pace"):
                argv += ["--diloco-pace"]
            if arm.get("fragments"):
                argv += ["--diloco-fragments", str(arm["fragments"])]
            if arm.get("straggler") and i == 0:
                argv += ["--straggler", arm["straggler"]]
            if arm.get("quorum"):
                argv += ["--diloco-quorum", str(arm["quorum"])]
            if arm.get("error_feedback"):
                argv += ["--error-feedback"]
            peers.append(Child(wrap(i, argv), e))
        children += peers
        for peer in peers:
            peer.wait_event("done", args.timeout)
        figures = summarize(arm, peers)
        if lab is not None:
            figures["link_bytes_per_peer"] = sum(lab.tx_bytes(i) - b for i, b in enumerate(tx_before)) / args.peers
            figures["peak_upload_bytes_per_s"] = peaks.stop()
            figures["upload_samples"] = peaks.samples
        return figures
    finally:
        if peaks is not None:
            peaks.stop()
        for child in children:
            child.stop()


def summarize(arm: dict, peers: List[Child]) -> dict:
    done = [p.wait_event("done", 0) for p in peers]
    if not all(done):
        tails = "\n".join(f"--- peer {i} (exit {p.proc.poll()}):\n{p.stderr_tail()}"
                          for i, (p, d) in enumerate(zip(peers, done)) if d is None)
        raise RuntimeError(f"arm {arm['name']}: {sum(d is None for d in done)} peers did not finish\n{tails}")
    epochs = [[e for e in p.events if e.get("event") in ("epoch", "settled")] for p in peers]
    starts = [e["received_at"] for p in peers for e in p.events if e.get("event") == "started"]
    evals = sorted((e["received_at"] - min(starts), e["eval_loss"]) for eps in epochs for e in eps
                   if e.get("eval_loss") is not None)
    comm = [sum(e.get("matchmaking_s", 0) + e.get("averaging_s", 0) for e in eps) for eps in epochs]
    waited = [sum(e.get("wait_s") or 0 for e in eps) for eps in epochs]
    rounds = [e for eps in epochs for e in eps if e.get("event") == "epoch"]
    sent = [e["bytes_sent"] for e in rounds if e.get("ok")]
    with_params = [e["bytes_sent"] for e in rounds if e.get("ok") and "parameters" in (e.get("averaged") or [])]
    without = [b for e, b in zip([e for e in rounds if e.get("ok")], sent) if "parameters" not in (e.get("averaged") or [])]
    return {
        "round_bytes": sum(sent) / max(len(sent), 1),
        "round_bytes_without_params": sum(without) / len(without) if without else None,
        "round_bytes_with_params": sum(with_params) / len(with_params) if with_params else None,
        "final_loss": sum(d["metrics"]["loss"] for d in done) / len(done),
        "train_s": max(d["seconds"] for d in done),
        "evals": evals,
        "bytes_per_peer": sum(sum(e.get("bytes_sent") or 0 for e in eps) for eps in epochs) / len(peers),
        "rounds": max(len(eps) for eps in epochs),
        "rounds_ok_fraction": sum(bool(e.get("ok")) for e in rounds) / max(len(rounds), 1),
        # Rounds a peer missed while the others averaged: made up for by their Δ̄, or by downloading their state.
        "missed_rounds_by_update": sum(e.get("error") == MISSED_ROUND_UPDATE for eps in epochs for e in eps),
        "missed_rounds_by_download": sum(e.get("error") == "missed round; caught up" for eps in epochs for e in eps),
        "comm_s": sum(comm) / len(comm),
        "waited_s": sum(waited) / len(waited),
        "hidden_comm_fraction": (1.0 - sum(waited) / sum(comm)) if sum(comm) > 0 else None,
        "seconds_per_epoch": _seconds_per_epoch(epochs),
        "records": [[{k: e.get(k) for k in RECORD_FIELDS} for e in eps] for eps in epochs],  # --events-out only
    }


def _seconds_per_epoch(epochs: List[List[dict]]) -> Optional[float]:
    spans = [(eps[-1]["train_time"] - eps[0]["train_time"], eps[-1]["epoch"] - eps[0]["epoch"])
             for eps in ([e for e in p if e.get("event") == "epoch"] for p in epochs)
             if len(eps) >= 2 and eps[-1]["epoch"] > eps[0]["epoch"]]
    seconds, advanced = sum(s for s, _ in spans), sum(n for _, n in spans)
    return seconds / advanced if advanced else None


def run_single(args) -> dict:
    import torch

    from moshpeer.peer.tasks import load_task, train_locally

    torch.set_num_threads(2)
    batch = args.peers * args.batch
    started = time.monotonic()
    run = train_locally(load_task("charlm", **TASK_ARGS, lr=args.lr), num_samples=args.steps * batch, global_batch_size=batch,
                        micro_batch_size=batch, eval_every=args.gradient_steps)
    return {"final_loss": run.metrics["loss"], "train_s": time.monotonic() - started,
            "curve": [(samples // batch, metrics["loss"]) for samples, metrics in run.history]}


def first_time_at(evals: List[tuple], target: float) -> Optional[float]:
    return next((t for t, loss in evals if loss <= target), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=50.0, help="upload Mbit/s per peer (netlab)")
    parser.add_argument("--steps", type=int, default=400, help="micro-batches per peer in every arm")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch (windows) per peer")
    parser.add_argument("--gradient-steps", type=int, default=5, help="real rounds of the gradients arm")
    parser.add_argument("--lr", type=float, default=1.5e-3,
                        help="AdamW rate at the global batch (single, gradients); local steps use it x sqrt(1/peers)")
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--sparse-inner-steps", type=int, default=50, help="H of the diloco-sparse arm")
    parser.add_argument("--sparse-codec", default="topk-int2:0.0156", help="the diloco-sparse arm's Δ codec")
    parser.add_argument("--half-speed-s", type=float, default=0.4,
                        help="the quorum arms' slow peer sleeps this long per micro-batch (about one micro-batch's "
                        "compute of 4 peers on 2 cores: half speed)")
    parser.add_argument("--heartbeat", type=float, default=5.0,
                        help="seconds between a peer's (and the bootstrap node's) record heartbeats (the product's "
                             "default; until session 13 the peers', until session 28 the bootstrap node's were 1 s)")
    parser.add_argument("--outer-optimizer", default="sgd:lr=1,momentum=0",
                        help="DiLoCo arms' outer optimizer (a run of 2-8 outer steps: momentum overshoots; see docs)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per arm")
    parser.add_argument("--arms", default="", help="comma-separated arm names (default: all)")
    links = parser.add_mutually_exclusive_group()
    links.add_argument("--netlab", action="store_true", help="shaped links in network namespaces (default if possible)")
    links.add_argument("--loopback", action="store_true", help="127.0.0.1, unshaped")
    parser.add_argument("--events-out", help="write every arm's figures (with eval curves) here as JSON")
    args = parser.parse_args()
    if args.steps % 200:
        parser.error("--steps must be a multiple of 200 (H=200 arm)")

    lab = None
    if not args.loopback:
        try:
            from moshpeer.testing.netlab import Netlab, unavailable
        except ImportError:
            unavailable, Netlab = (lambda: "moshpeer.testing.netlab is not installed"), None
        reason = unavailable()
        if reason is not None:
            if args.netlab:
                print(f"netlab unavailable: {reason}", file=sys.stderr)
                return 2
            print(f"# netlab unavailable ({reason}): running on loopback, unshaped", file=sys.stderr)
        else:
            lab = Netlab([args.rate] * (args.peers + 1)).up()  # the last: the bootstrap node
    links_desc = f"netlab, {args.rate:g} Mbit/s upload per peer" if lab is not None else "loopback (unshaped)"
    wanted = set(filter(None, args.arms.split(",")))
    results: Dict[str, dict] = {}
    try:
        results["single"] = run_single(args)
        for arm in arms(args):
            if wanted and arm["name"] not in wanted:
                continue
            print(f"# {arm['name']} ...", file=sys.stderr, flush=True)
            results[arm["name"]] = run_arm(args, arm, lab)
    finally:
        if lab is not None:
            lab.down()

    single = results["single"]
    curve = single["curve"]
    target = next(loss for step, loss in curve if step >= args.steps // 2)
    steps_to_target = next(step for step, loss in curve if loss <= target)
    grad = results.get("gradients")
    if grad is not None:
        # The gradients arm's loss curve is the single process's (see the module docstring).
        per_step = grad["seconds_per_epoch"] or grad["train_s"] / args.gradient_steps
        grad["time_to_target_s"] = steps_to_target * per_step
        grad["measured_loss"], grad["final_loss"] = grad["final_loss"], single["final_loss"]
        grad["single_loss_at_measured"] = next(loss for step, loss in curve if step >= args.gradient_steps)
        # Gradients mode sends the parameters too every --params-every epochs: scale each kind of round.
        plain = grad["round_bytes_without_params"] or grad["round_bytes"]
        heavy = grad["round_bytes_with_params"] or 2 * plain
        heavy_rounds = args.steps // DEFAULT_PARAMS_EVERY
        grad["bytes_per_peer"] = (args.steps - heavy_rounds) * plain + heavy_rounds * heavy
        grad["derived"] = True
    for name, figures in results.items():
        if "evals" in figures and not figures.get("derived"):  # the gradients arm's time is derived above
            figures["time_to_target_s"] = first_time_at(figures["evals"], target)

    print(f"\n{args.peers} peers, {links_desc}; charlm {TASK_ARGS}; {args.steps} micro-batches of {args.batch} per peer; "
          f"lr {args.lr:g} (global batch), {local_lr(args):g} (local steps); "
          f"target loss {target:.4f} (single process at half its samples)")
    print(f"{'arm':26s} {'final loss':>10s} {'to target s':>11s} {'MB/peer':>10s} {'comm s':>8s} {'hidden':>7s} {'train s':>8s}")
    for name, f in results.items():
        tt = f.get("time_to_target_s")
        hidden = f.get("hidden_comm_fraction")
        print(f"{name + (' *' if f.get('derived') else ''):26s} {f['final_loss']:10.4f} "
              f"{(f'{tt:.1f}' if tt is not None else '-'):>11s} {f.get('bytes_per_peer', 0) / 1e6:10.2f} "
              f"{f.get('comm_s', 0):8.1f} {(f'{hidden:.2f}' if hidden is not None else '-'):>7s} {f['train_s']:8.1f}")
    if grad is not None:
        print(f"* gradients: {args.gradient_steps} real rounds measured ({grad['seconds_per_epoch']:.2f} s/step, loss "
              f"{grad['measured_loss']:.4f} vs single {grad['single_loss_at_measured']:.4f} at that step); time to target "
              f"and bytes scaled to {args.steps} steps (a parameter round every {DEFAULT_PARAMS_EVERY}), final loss = single process's")

    figures = {"links": links_desc, "steps_per_peer": args.steps, "target_loss": target, "lr": args.lr,
               "local_lr": local_lr(args),
               "single_loss": single["final_loss"]}
    head = results.get(HEADLINE)
    if grad is not None and head is not None:
        figures["diloco_loss_over_gradients"] = head["final_loss"] / grad["final_loss"]
        figures["gradients_bytes_over_diloco"] = grad["bytes_per_peer"] / max(head["bytes_per_peer"], 1)
        if head.get("time_to_target_s"):
            figures["time_to_target_speedup"] = grad["time_to_target_s"] / head["time_to_target_s"]
    sparse = results.get("diloco-sparse")
    if grad is not None and sparse is not None:
        figures["sparse_loss_over_gradients"] = sparse["final_loss"] / grad["final_loss"]
        figures["sparse_bytes_over_gradients"] = grad["bytes_per_peer"] / max(sparse["bytes_per_peer"], 1)
    if head is not None:
        figures["failed_round_fraction"] = 1.0 - head["rounds_ok_fraction"]
        if head.get("link_bytes_per_peer"):
            figures["link_over_payload"] = head["link_bytes_per_peer"] / max(head["bytes_per_peer"], 1)
    for arm, key in (("diloco-streaming", "streaming"), ("diloco-streaming-paced", "streaming_paced")):
        streaming = results.get(arm)
        if streaming is None:
            continue
        figures[f"{key}_loss_over_single"] = streaming["final_loss"] / single["final_loss"]
        if grad is not None:
            figures[f"{key}_loss_over_gradients"] = streaming["final_loss"] / grad["final_loss"]
        if head is not None and head.get("peak_upload_bytes_per_s") and streaming.get("peak_upload_bytes_per_s"):
            figures[f"{key}_peak_bandwidth_ratio"] = \
                streaming["peak_upload_bytes_per_s"] / head["peak_upload_bytes_per_s"]
    for arm, key in (("diloco-quorum", "quorum"), ("diloco-hetero", "noquorum")):
        if arm in results and head is not None and head.get("time_to_target_s") and results[arm].get("time_to_target_s"):
            figures[f"{key}_time_to_target_over_homogeneous"] = results[arm]["time_to_target_s"] / head["time_to_target_s"]
    overlap = results.get("diloco-h50-int4-overlap")
    if overlap is not None:
        figures["hidden_comm_fraction"] = overlap["hidden_comm_fraction"]
    figures["arms"] = {name: {k: v for k, v in f.items() if k not in ("evals", "curve", "records", "upload_samples")}
                       for name, f in results.items()}
    if args.events_out:
        with open(args.events_out, "w") as out:
            json.dump(results, out)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
