"""GPU peers: rounds that stay on the device, codec kernels on the data path, a GPT trained with `--device`.

    python benchmarks/bench_gpu.py [--device cuda] [--mbytes 256] [--rounds 5] [--codecs none,int8,int4]
                                   [--gpt-epochs 20] [--gpt-arg d_model=512 --gpt-arg layers=8 ...]

Needs CUDA: without it (and without `--device cpu`) it prints one line and exits 0. `--device cpu` runs the
same harness on the CPU (the default test suite does, with tiny sizes).

1. Averaging: 2 peers (processes) average `--mbytes` MB of fp32 living on the device, one group all-reduce
   (`GroupAllReduce` over the TCP data plane on loopback; no matchmaking) per round and codec: median round
   time over `--rounds` after a warm-up, reduce-scatter and all-gather time, bytes staged across PCIe per peer
   (device <-> pinned host; 0 on the CPU), relative error to the exact mean. int8_round_vs_none = int8 round /
   uncompressed round. The anchor, in the same run: two processes' `torch.distributed` gloo all_reduce of the
   same tensors on the same device (NCCL cannot put two ranks on one GPU); none_round_vs_gloo and
   int8_round_vs_gloo = moshpeer's round / gloo's.
2. Encoding on the data path: a part encoded the way the averager encodes it (`encode_chunks` over
   part_sender.encode_runs: the whole part in one call on a device, a pipeline slice at a time on the CPU),
   against a device-to-device copy of the same vector (the anchor); encode_vs_copy = encode bandwidth / copy
   bandwidth for int8 (input bytes per second).
   Also: the old chunk-by-chunk `codec.encode` loop (`*_chunkwise_encode_gbps`), backend calls per part (a
   counter) and, on CUDA, syncs_per_part (host syncs `torch.cuda.set_sync_debug_mode("warn")` reports while one
   part is encoded; None on the CPU, where nothing syncs).
3. GPT: one process alone (`train_locally`, the anchor) on `--gpt-epochs` global batches, then for each of
   `--gpt-averaging` (gradients, diloco) two `moshpeer join --device D --task gpt` peers in a group of 2 for
   `--gpt-epochs` epochs: gpt_MODE_tokens_per_s_vs_single (tokens/s per peer / the single process's on the same
   device; both peers share it, so gpt_MODE_total_tokens_per_s_vs_single, their sum, is the swarm's efficiency), gpt_MODE_averaging_share (seconds in averaging rounds / training seconds) and
   gpt_MODE_loss_over_single (the peers' final validation loss / the single process's).

Ends with one JSON line: none_round_vs_gloo, int8_round_vs_gloo, int8_round_vs_none, encode_vs_copy, syncs_per_part,
gpt_{gradients,diloco}_{tokens_per_s_vs_single,loss_over_single,averaging_share}, ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from bench_training import LOOPBACK, Child, env  # noqa: E402  (the same child-process plumbing)

CHUNK_BYTES = 1 << 20  # the averager's default chunk (fp32 bytes)
DEFAULT_GPT = ("context=128", "d_model=256", "layers=4", "batch_size=32", "target_batch_size=256")


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- part 1: averaging (worker processes) ---------------------------------------------------------


def peer_vector(rank: int, numel: int, device):
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(numel, generator=gen) + rank).to(device)


def averaging_worker(args) -> int:
    """One peer: listen, learn the group from stdin, then one all-reduce per 'go' line; a JSON line per round."""
    import torch

    from moshpeer.averaging import wire
    from moshpeer.averaging.allreduce import GroupAllReduce, GroupMember
    from moshpeer.averaging.dataplane import DataPlane
    from moshpeer.averaging.handshake import RoundCredentials
    from moshpeer.averaging.kept_links import KeptLinks
    from moshpeer.compression import get_compression
    from moshpeer.dht.identity import Identity
    from moshpeer.peer.device import resolve_device

    device = resolve_device(args.device)
    numel = args.mbytes * (1 << 20) // 4
    # Connections kept between rounds, as a MoshpitAverager keeps them.
    plane, kept, identity = DataPlane(), KeptLinks(), Identity.generate()
    print(json.dumps({"event": "address", "host": plane.address[0], "port": plane.address[1],
                      "peer_id": identity.peer_id_bytes.hex()}), flush=True)
    members = [GroupMember(host, port, 1.0, bytes.fromhex(peer_id))
               for host, port, peer_id in json.loads(sys.stdin.readline())["members"]]
    initial = peer_vector(args.rank, numel, device)
    exact = sum(peer_vector(rank, numel, "cpu").double() for rank in range(len(members))) / len(members)
    flat = torch.empty_like(initial)
    try:
        for line in sys.stdin:
            order = json.loads(line)
            if order.get("stop"):
                break
            flat.copy_(initial)
            synchronize(device)
            tag = wire.allreduce_tag(bytes(20), order["round"])
            allreduce = GroupAllReduce(
                plane, flat, members=members, my_index=args.rank, tag=tag, secret=b"bench-gpu-secret".ljust(32, b"."),
                credentials=RoundCredentials.create(identity, wire.tag_group(tag), args.rank),
                compression=get_compression(order["codec"]),
                chunk_numel=CHUNK_BYTES // 4, deadline=time.monotonic() + 120.0, kept=kept)
            result = allreduce.run()
            synchronize(device)
            error = float((flat.double().cpu() - exact).norm() / exact.norm())
            print(json.dumps({"event": "round", "codec": order["codec"], "round": order["round"],
                              "total_s": result.total_s, "reduce_scatter_s": result.reduce_scatter_s,
                              "all_gather_s": result.all_gather_s, "staged_bytes": result.staged_bytes,
                              "bytes_sent": result.reduce.bytes_sent + result.gather.bytes_sent,
                              "chunks_lost": result.reduce.chunks_lost + result.gather.chunks_lost,
                              "rel_err": error}), flush=True)
    finally:
        kept.close()
        plane.close()
    return 0


def gloo_worker(args) -> int:
    """One rank of the anchor: gloo all_reduce of this peer's vector on `--device`, warm-up + `--rounds` times."""
    import torch
    import torch.distributed as dist

    from moshpeer.peer.device import resolve_device

    device = resolve_device(args.device)
    numel = args.mbytes * (1 << 20) // 4
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=args.rank, world_size=2)
    try:
        initial = peer_vector(args.rank, numel, device)
        flat = torch.empty_like(initial)
        times = []
        for r in range(args.rounds + 1):
            flat.copy_(initial)
            synchronize(device)
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(flat)
            synchronize(device)
            if r:
                times.append(time.perf_counter() - started)
        print(json.dumps({"event": "gloo", "round_s": statistics.median(times)}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def run_gloo(args) -> dict:
    """The anchor: median gloo all_reduce time of the same 2 x `--mbytes` MB on the same device (slower rank)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "gloo-worker", "--device", args.device,
            "--mbytes", str(args.mbytes), "--rounds", str(args.rounds), "--gloo-port", str(port)]
    workers = [subprocess.Popen(argv + ["--rank", str(rank)], stdout=subprocess.PIPE, env=env(), cwd=str(REPO),
                                text=True) for rank in range(2)]
    try:
        results = [json.loads(_next_json(w, "gloo", 300)) for w in workers]
    finally:
        _reap(workers)
    return {"round_s": max(r["round_s"] for r in results)}


def run_averaging(args) -> Dict[str, dict]:
    """Both peers, every codec, warm-up + `--rounds` rounds each; per codec the median of the slower peer."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "avg-worker", "--device", args.device,
            "--mbytes", str(args.mbytes)]
    workers = [subprocess.Popen(argv + ["--rank", str(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env(), cwd=str(REPO), text=True) for rank in range(2)]
    try:
        addresses = [json.loads(_next_json(w, "address", 120)) for w in workers]
        group = json.dumps({"members": [[a["host"], a["port"], a["peer_id"]] for a in addresses]})
        for w in workers:
            w.stdin.write(group + "\n")
            w.stdin.flush()
        figures: Dict[str, dict] = {}
        round_id = 0
        for codec in args.codecs.split(","):
            rounds = []
            for r in range(args.rounds + 1):  # round 0 warms up (kernel builds, pinned pools, connections)
                round_id += 1
                for w in workers:
                    w.stdin.write(json.dumps({"codec": codec, "round": round_id}) + "\n")
                    w.stdin.flush()
                results = [json.loads(_next_json(w, "round", 300)) for w in workers]
                if r:
                    rounds.append(results)
            figures[codec] = summarize_rounds(rounds)
        for w in workers:
            w.stdin.write(json.dumps({"stop": True}) + "\n")
            w.stdin.flush()
        return figures
    finally:
        _reap(workers)


def _reap(workers: List[subprocess.Popen]) -> None:
    """Wait up to 30 s for each worker to exit (they stop after their last line), then kill what is left."""
    for w in workers:
        try:
            w.wait(30)
        except subprocess.TimeoutExpired:
            w.kill()


def summarize_rounds(rounds: List[List[dict]]) -> dict:
    """Median over rounds of the slower peer's figures (a round is over when both peers are done)."""
    def median(key: str, reduce=max) -> float:
        return statistics.median(reduce(peer[key] for peer in peers) for peers in rounds)

    return {"round_s": median("total_s"), "reduce_scatter_s": median("reduce_scatter_s"),
            "all_gather_s": median("all_gather_s"), "pcie_mb": median("staged_bytes") / 1e6,
            "sent_mb": median("bytes_sent") / 1e6, "rel_err": median("rel_err"),
            "chunks_lost": sum(peer["chunks_lost"] for peers in rounds for peer in peers)}


def _next_json(proc: subprocess.Popen, event: str, timeout: float) -> str:
    """The next stdout line of `proc` that is the JSON event `event` (other lines are skipped)."""
    found: List[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("{") and json.loads(line).get("event") == event:
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        raise RuntimeError(f"averaging worker: no {event!r} line within {timeout} s (exit code {proc.poll()})")
    return found[0]


# ---- part 2: encoding bandwidth on the data path ----------------------------------------------------


def encode_bandwidth(device, mbytes: int, codecs: List[str], repeats: int = 20) -> dict:
    """GB/s of fp32 input: a device-to-device copy of the vector, and each codec encoding it chunk by chunk."""
    import torch

    from moshpeer.compression import get_compression

    numel = mbytes * (1 << 20) // 4
    source = peer_vector(0, numel, device)
    target = torch.empty_like(source)
    chunk = CHUNK_BYTES // 4

    def best_of(work) -> float:
        work()  # warm-up (kernel build / caches)
        times = []
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            work()
            synchronize(device)
            times.append(time.perf_counter() - started)
        return numel * 4 / min(times) / 1e9

    figures = {"copy_gbps": best_of(lambda: target.copy_(source))}
    from moshpeer.averaging.part_sender import encode_runs
    import moshpeer.compression.quantization as quantization

    num_chunks = -(-numel // chunk)
    runs = encode_runs(num_chunks, chunk, device)

    def encode_part(codec) -> None:  # what a reduce sender does with the part it sends (part_sender.py):
        encoded = [codec.encode_chunks(source[run[0] * chunk:min(numel, (run[-1] + 1) * chunk)], chunk, list(run))
                   for run in runs]  # its runs (the whole part on a device), each in one call, ...
        for batch in encoded:  # ... and each run's verdicts, read back once
            assert not any(batch.errors)

    for spec in codecs:
        codec = get_compression(spec).reduce_codec
        figures[f"{spec}_encode_gbps"] = best_of(lambda: encode_part(codec))
        # the same part in one call (on a device, what encode_part does): the least host work
        figures[f"{spec}_one_call_encode_gbps"] = best_of(
            lambda: codec.encode_chunks(source, chunk, list(range(num_chunks))).errors)
        figures[f"{spec}_chunkwise_encode_gbps"] = best_of(
            lambda: [codec.encode(source[start:start + chunk], seed=start) for start in range(0, numel, chunk)])
        # Backend calls per part (a counter around the backend quantization.py calls) ...
        calls = [0]
        real = quantization.backend_for

        class Counting:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                attr = getattr(self.inner, name)

                def counted(*a, **k):
                    calls[0] += 1
                    return attr(*a, **k)

                return counted if callable(attr) else attr

        quantization.backend_for = lambda dev: Counting(real(dev))
        try:
            encode_part(codec)
        finally:
            quantization.backend_for = real
        figures[f"{spec}_backend_calls_per_part"] = calls[0]
        figures[f"{spec}_chunks_per_part"] = num_chunks
        # ... and host syncs per part on CUDA (the sync debug mode warns once per synchronizing call).
        if device.type == "cuda":
            import warnings

            synchronize(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    encode_part(codec)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            figures[f"{spec}_syncs_per_part"] = sum("synchroniz" in str(w.message).lower() for w in caught)
        else:
            figures[f"{spec}_syncs_per_part"] = None
    return figures


# ---- part 3: GPT through `moshpeer join --device` ---------------------------------------------------


def run_gpt_peers(args, task_args: List[str], averaging: str) -> List[dict]:
    """Two `moshpeer join --task gpt` peers in one group for `--gpt-epochs` epochs: per-peer figures."""
    run_id = f"bench-gpu-{averaging}-{os.getpid()}"
    e = env()
    boot = Child([sys.executable, "-m", "moshpeer", "dht", "--run-id", run_id, "--host-maddrs", LOOPBACK,
                  "--heartbeat", "1"], e)
    children = [boot]
    try:
        ready = boot.wait_event("ready", 60)
        if ready is None:
            raise RuntimeError("bootstrap did not start")
        for rank in range(2):
            argv = [sys.executable, "-m", "moshpeer", "join", "--initial-peers", *ready["maddrs"], "--run-id", run_id,
                    "--host-maddrs", LOOPBACK, "--heartbeat", "1", "--device", args.device, "--task", "gpt",
                    "--group-size", "2", "--min-peers", "2", "--max-epochs", str(args.gpt_epochs),
                    "--eval-every", str(args.gpt_epochs), "--seed", str(rank), "--compression", args.gpt_compression,
                    "--averaging", averaging]
            if averaging == "diloco":
                argv += ["--inner-steps", str(args.gpt_inner_steps)]
            for item in task_args:
                argv += ["--task-arg", item]
            children.append(Child(argv, e))
        peers = children[1:]
        done = [peer.wait_event("done", args.timeout) for peer in peers]
    finally:
        for child in children:
            child.stop()
    if not all(done):
        raise RuntimeError(f"a GPT peer ({averaging}) did not finish; rerun with fewer --gpt-epochs or a longer "
                           "--timeout")
    per_peer = []
    for peer, summary in zip(peers, done):
        epochs = [e for e in peer.events if e.get("event") == "epoch"]
        train_s = max(e["train_time"] for e in epochs)
        samples = sum(e["samples"] for e in epochs)
        per_peer.append({"samples": samples, "train_s": train_s,
                         "averaging_s": sum(e["averaging_s"] + e["matchmaking_s"] for e in epochs),
                         "eval_loss": summary["metrics"]["loss"],
                         "rounds_ok": summary["rounds_ok"], "rounds": summary["rounds"]})
    return per_peer


def run_gpt(args) -> dict:
    """Part 3: the GPT peers in each `--gpt-averaging` mode, and one process alone on the same GPU."""
    from moshpeer.peer.tasks import load_task, parse_task_kwargs, train_locally
    from moshpeer.peer.device import resolve_device

    task_args = list(DEFAULT_GPT) + list(args.gpt_arg)
    task = load_task("gpt", device=resolve_device(args.device), **parse_task_kwargs(task_args))
    context = task.model.context
    target = task.target_batch_size
    single = train_locally(task, num_samples=args.gpt_epochs * target, global_batch_size=target)
    single_tokens_per_s = single.samples * context / single.seconds
    modes = {}
    for averaging in [m for m in args.gpt_averaging.split(",") if m]:
        per_peer = run_gpt_peers(args, task_args, averaging)
        for peer in per_peer:
            peer["tokens_per_s"] = peer["samples"] * context / peer["train_s"]
        peer_loss = statistics.mean(p["eval_loss"] for p in per_peer)
        tokens_per_s = statistics.mean(p["tokens_per_s"] for p in per_peer)
        modes[averaging] = {
            "peers": per_peer, "peer_eval_loss": peer_loss, "tokens_per_s_per_peer": tokens_per_s,
            "tokens_per_s_vs_single": tokens_per_s / single_tokens_per_s,
            # both peers share the one GPU: their sum against the process alone is the swarm's efficiency
            "total_tokens_per_s_vs_single": 2 * tokens_per_s / single_tokens_per_s,
            "averaging_share": sum(p["averaging_s"] for p in per_peer) / sum(p["train_s"] for p in per_peer),
            "loss_over_single": peer_loss / single.metrics["loss"]}
    return {"modes": modes, "single_eval_loss": single.metrics["loss"], "single_tokens_per_s": single_tokens_per_s,
            "parameters": sum(p.numel() for p in task.model.parameters()), "task_args": task_args}


# ---- main ---------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--mbytes", type=int, default=256, help="MB of fp32 each peer averages (default: 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per codec, after one warm-up")
    parser.add_argument("--codecs", default="none,int8,int4")
    parser.add_argument("--gpt-epochs", type=int, default=20, help="0 skips the GPT part")
    parser.add_argument("--gpt-arg", action="append", default=[], metavar="KEY=VALUE",
                        help=f"gpt task argument (repeatable; defaults: {' '.join(DEFAULT_GPT)})")
    parser.add_argument("--gpt-compression", default="none", help="codec of the GPT peers' rounds")
    parser.add_argument("--gpt-averaging", default="gradients,diloco",
                        help="the GPT peers' --averaging modes, each a run of its own (default: gradients,diloco)")
    parser.add_argument("--gpt-inner-steps", type=int, default=4, help="diloco: inner steps per outer step")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the GPT peers may take")
    parser.add_argument("--role", choices=["avg-worker", "gloo-worker"], help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "avg-worker":
        return averaging_worker(args)
    if args.role == "gloo-worker":
        return gloo_worker(args)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available on this machine: nothing measured (use --device cpu to run the "
              "harness on the CPU)")
        return 0
    from moshpeer.peer.device import resolve_device

    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    averaging = run_averaging(args)
    gloo = run_gloo(args)
    encoding = encode_bandwidth(device, args.mbytes, [c for c in args.codecs.split(",") if c != "none"])
    gpt = run_gpt(args) if args.gpt_epochs > 0 else None

    print(f"\n{name}, 2 peers, {args.mbytes} MB fp32 on {device}, median of {args.rounds} rounds after a warm-up")
    print(f"{'codec':<10}{'round s':>10}{'reduce s':>10}{'gather s':>10}{'PCIe MB':>10}{'sent MB':>10}{'rel. err':>11}")
    for codec, f in averaging.items():
        print(f"{codec:<10}{f['round_s']:>10.3f}{f['reduce_scatter_s']:>10.3f}{f['all_gather_s']:>10.3f}"
              f"{f['pcie_mb']:>10.1f}{f['sent_mb']:>10.1f}{f['rel_err']:>11.2e}")
    print(f"{'gloo':<10}{gloo['round_s']:>10.3f}   (torch.distributed all_reduce of the same tensors, same device)")
    print(f"\nencoding on the data path (GB/s of fp32 input; anchor: device-to-device copy "
          f"{encoding['copy_gbps']:.1f} GB/s)")
    for key, value in encoding.items():
        if key.endswith("_encode_gbps"):
            print(f"  {key[:-len('_encode_gbps')]:<20}{value:>8.1f} GB/s = {value / encoding['copy_gbps']:.2f}x copy")
    for key, value in encoding.items():
        if key.endswith("_per_part"):
            print(f"  {key:<30}{value}")
    if gpt is not None:
        print(f"\nGPT ({gpt['parameters'] / 1e6:.1f}M parameters, {' '.join(gpt['task_args'])}), 2 peers, "
              f"{args.gpt_epochs} epochs; one process alone: {gpt['single_tokens_per_s']:.0f} tokens/s, "
              f"eval loss {gpt['single_eval_loss']:.4f}")
        for mode_name, mode in gpt["modes"].items():
            for i, peer in enumerate(mode["peers"]):
                print(f"  {mode_name} peer {i}: {peer['tokens_per_s']:.0f} tokens/s, averaging "
                      f"{peer['averaging_s']:.1f} s of {peer['train_s']:.1f} s, rounds ok "
                      f"{peer['rounds_ok']}/{peer['rounds']}, eval loss {peer['eval_loss']:.4f}")

    def ratio(a: Optional[dict], b: Optional[dict]) -> Optional[float]:
        return a["round_s"] / b["round_s"] if a and b and b["round_s"] > 0 else None

    figures = {
        "device": str(device), "device_name": name, "mbytes": args.mbytes,
        "none_round_vs_gloo": ratio(averaging.get("none"), gloo),
        "int8_round_vs_gloo": ratio(averaging.get("int8"), gloo),
        "gloo_round_s": gloo["round_s"],
        "syncs_per_part": encoding.get("int8_syncs_per_part"),
        "backend_calls_per_part": encoding.get("int8_backend_calls_per_part"),
        "int8_round_vs_none": ratio(averaging.get("int8"), averaging.get("none")),
        "int4_round_vs_none": ratio(averaging.get("int4"), averaging.get("none")),
        "encode_vs_copy": (encoding["int8_encode_gbps"] / encoding["copy_gbps"]
                           if "int8_encode_gbps" in encoding else None),
        **{f"gpt_{mode}_{key}": figures_of_mode[key] for mode, figures_of_mode in (gpt or {"modes": {}})["modes"].items()
           for key in ("tokens_per_s_vs_single", "total_tokens_per_s_vs_single", "loss_over_single",
                       "averaging_share")},
        "gpt": gpt, "averaging": averaging, "encoding": encoding,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
