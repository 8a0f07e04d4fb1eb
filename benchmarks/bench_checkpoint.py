"""Checkpoint benchmark: write cost against torch.save, training throughput with periodic
background checkpoints on and off, and SIGTERM-to-exit latency of a training process.

    python benchmarks/bench_checkpoint.py [--dir DIR] [--reps 7] [--width 4096 --depth 6]

1. Write time. A ~100M-parameter model (a stack of Linear layers) after one Adam step (so
   exp_avg / exp_avg_sq exist), ~1.2 GB of state. In the same run and directory, median of
   --reps: `torch.save(state, path)` (no fsync: the anchor the target is stated against),
   `torch.save` + fsync (what durability costs plain torch.save), `CheckpointStore.save`
   (atomic, checksummed, fsynced, old checkpoint pruned), `save_async` (time the caller is
   blocked, and time until durable), and `load_latest` (verify + load). Before each timed
   operation the page cache is flushed (os.sync) so one operation's writeback does not land in
   the next one's time.
2. Throughput. A smaller model's training loop (steps/s, ~100 MB of state) with a background
   checkpoint every --checkpoint-every seconds of training (default 2: one per run) against
   none, interleaved runs, median ratio of --throughput-pairs pairs. 100 MB every 2 s is 50 MB/s of
   checkpoints, ~10x denser than a 100M-parameter peer saving its 1.2 GB every 5 minutes, so
   this bounds the overhead from above. The loop saves with `copy_in_background=True` and calls
   `store.fence()` before each optimizer step, as `moshpeer join` does; a second set of pairs
   with the memcpy on the training thread (`throughput_ratio_sync_snapshot`) shows what that buys
   (`--skip-sync-snapshot` skips it).
3. SIGTERM-to-exit. tests/helpers/preemption_trainer.py trains the ~100M model; SIGTERM arrives after a
   few steps; the time until the process has exited, having written its final checkpoint.

Prints a table, then one line holding a JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moshpeer.peer.checkpoint import CheckpointStore, Parts, capture_rng_state  # noqa: E402

TRAINER = REPO / "tests" / "helpers" / "preemption_trainer.py"


def filesystem_of(path: Path) -> str:
    """The filesystem type holding `path` (from /proc/mounts; "unknown" elsewhere)."""
    best, fstype = "", "unknown"
    try:
        resolved = str(path.resolve())
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point = fields[1]
                if resolved.startswith(mount_point.rstrip("/") + "/") or resolved == mount_point:
                    if len(mount_point) >= len(best):
                        best, fstype = mount_point, fields[2]
    except OSError:
        pass
    return fstype


def mlp(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def model_and_adam(width: int, depth: int) -> tuple:
    torch.manual_seed(0)
    model = mlp(width, depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).pow(2).mean().backward()
    optimizer.step()  # creates exp_avg / exp_avg_sq
    return model, optimizer


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {
        Parts.MODEL: model.state_dict(),
        Parts.OPTIMIZER: optimizer.state_dict(),
        Parts.RNG: capture_rng_state(),
        Parts.COLLABORATIVE: {"epoch": step // 10, "samples": step * 64},
    }


def timed(operation: Callable[[], object], prepare: Callable[[], None], cpu: List[float]) -> float:
    """Wall time of `operation`; its CPU time (all threads of this process) is appended to `cpu`."""
    prepare()
    os.sync()
    started, started_cpu = time.perf_counter(), time.process_time()
    operation()
    cpu.append(time.process_time() - started_cpu)
    return time.perf_counter() - started


def spread(values: List[float]) -> List[float]:
    """[lowest, highest] of a figure's repetitions, printed next to its median: how far one run can be off."""
    return [round(min(values), 3), round(max(values), 3)]


def bench_write(directory: Path, width: int, depth: int, reps: int) -> Dict[str, float]:
    model, optimizer = model_and_adam(width, depth)
    params = sum(p.numel() for p in model.parameters())
    state = training_state(model, optimizer, step=1)
    plain = directory / "plain.pt"
    store = CheckpointStore(directory / "store", keep_last=1)
    results: Dict[str, List[float]] = {k: [] for k in ("torch", "torch_fsync", "store", "async_block", "async_total")}
    loads: List[float] = []
    cpu: Dict[str, List[float]] = {"torch": [], "store": [], "unused": []}

    def remove_plain() -> None:
        if plain.exists():
            plain.unlink()

    def torch_save_fsync() -> None:
        torch.save(state, plain)
        fd = os.open(plain, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def settle() -> None:
        remove_plain()
        store.wait()  # the pruning of the previous checkpoint is not this operation's cost

    def plain_save() -> None:
        results["torch"].append(timed(lambda: torch.save(state, plain), remove_plain, cpu["torch"]))

    def plain_save_fsync() -> None:
        results["torch_fsync"].append(timed(torch_save_fsync, remove_plain, cpu["unused"]))

    def store_save() -> None:
        results["store"].append(timed(lambda: store.save(state, step=1, epoch=0), settle, cpu["store"]))

    def store_save_async() -> None:
        settle()
        os.sync()
        started = time.perf_counter()
        handle = store.save_async(state, step=1, epoch=0)
        results["async_block"].append(time.perf_counter() - started)
        handle.result()
        results["async_total"].append(time.perf_counter() - started)

    # The order rotates from one repetition to the next, so that no method always pays for what
    # the previous one left behind (dirty pages, freed memory).
    methods = [plain_save, store_save, plain_save_fsync, store_save_async]
    for rep in range(reps):
        for method in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            method()
    settle()
    # Loads last: freeing a loaded GB-sized state slows whatever runs next.
    for _ in range(reps):
        os.sync()
        started = time.perf_counter()
        loaded = store.load_latest()
        loads.append(time.perf_counter() - started)
        del loaded
    size = store.stats.last_size
    store.close()
    remove_plain()
    median = {name: statistics.median(values) for name, values in results.items()}
    # Paired: each repetition's store.save against the torch.save of the same repetition (same rotation, same
    # state of the page cache and the disk), so that a slow moment of the machine lands on both.
    save_ratios = [store_s / torch_s for store_s, torch_s in zip(results["store"], results["torch"])]
    return {
        "params": params,
        "state_bytes": size,
        "torch_save_s": median["torch"],
        "torch_save_fsync_s": median["torch_fsync"],
        "save_s": median["store"],
        "save_ratio": statistics.median(save_ratios),
        "save_ratio_spread": spread(save_ratios),
        # Fastest of the repetitions: closer to an idle machine when other work shares it.
        "torch_save_min_s": min(results["torch"]),
        "save_min_s": min(results["store"]),
        "save_async_blocking_s": median["async_block"],
        "save_async_total_s": median["async_total"],
        "load_s": statistics.median(loads),
        # CPU time of the process (less sensitive than wall time to other load on the machine).
        "torch_save_cpu_s": statistics.median(cpu["torch"]),
        "save_cpu_s": statistics.median(cpu["store"]),
        "samples": {name: [round(v, 3) for v in values] for name, values in results.items()},
    }


def bench_throughput(
    directory: Path,
    reps: int,
    every_s: float,
    width: int = 1024,
    depth: int = 8,
    batch: int = 64,
    copy_in_background: bool = True,
) -> dict:
    """Training throughput with a background checkpoint per run against none.

    `copy_in_background`: the snapshot's memcpy runs on the writer thread during the forward and
    backward pass, and the loop calls `store.fence()` before the optimizer step (what `moshpeer join`
    does); otherwise the memcpy blocks the training thread inside `save_async`.
    """
    model, optimizer = model_and_adam(width, depth)
    inputs, targets = torch.randn(batch, width), torch.randn(batch, width)
    store = CheckpointStore(directory / "throughput", keep_last=2)
    fence_waits = [0.0]  # time the training thread waited in fence() during the current run

    def step() -> None:
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        fenced = time.perf_counter()
        store.fence()  # a snapshot copying in the background must be done before the update
        fence_waits[0] += time.perf_counter() - fenced
        optimizer.step()

    def seconds_per_step(duration: float) -> float:
        started, count = time.perf_counter(), 0
        while time.perf_counter() - started < duration:
            step()
            count += 1
        return (time.perf_counter() - started) / count

    seconds_per_step(0.5)  # warm-up: allocator, Adam state, caches
    step_s = seconds_per_step(1.0)
    interval = max(8, round(every_s / step_s))  # steps between checkpoints
    # One interval per run, with its checkpoint a quarter of the way in: the write has the rest
    # of the run to finish (whatever it has left at the end is waited for, and counted).
    steps = interval
    offset = interval // 4

    end_waits: List[float] = []
    cpu_per_run: Dict[bool, List[float]] = {False: [], True: []}

    def process_cpu() -> float:
        times = os.times()
        return times.user + times.system

    def run(checkpoints: bool) -> float:
        store.wait()
        os.sync()
        started, started_cpu = time.perf_counter(), process_cpu()
        for i in range(1, steps + 1):
            step()
            if checkpoints and i % interval == offset:
                store.save_async(
                    training_state(model, optimizer, i), step=i, epoch=0, copy_in_background=copy_in_background
                )
        if checkpoints:
            waited = time.perf_counter()
            store.wait()  # a write still running is part of this run's cost
            end_waits.append(time.perf_counter() - waited)
        cpu_per_run[checkpoints].append(process_cpu() - started_cpu)
        return steps / (time.perf_counter() - started)

    on, off, blocked, fenced = [], [], [], []
    for _ in range(reps):
        off.append(run(False))
        fence_waits[0] = 0.0
        on.append(run(True))
        blocked.append(store.stats.last_snapshot_s)
        fenced.append(fence_waits[0])
    skipped = store.stats.skipped_busy
    size = store.stats.last_size
    store.close()
    ratios = [a / b for a, b in zip(on, off)]
    return {
        "throughput_on": statistics.median(on),
        "throughput_off": statistics.median(off),
        "throughput_ratio": statistics.median(ratios),
        "throughput_ratio_spread": spread(ratios),
        "throughput_params": sum(p.numel() for p in model.parameters()),
        "throughput_state_bytes": size,
        "checkpoint_every_steps": interval,
        "checkpoint_every_s": interval * step_s,
        "steps_per_run": steps,
        "checkpoints_skipped_busy": skipped,
        "throughput_end_wait_s": statistics.median(end_waits),  # included in the "on" time
        # CPU time (all threads of this process) a checkpoint adds to a run: a figure that other
        # load on the machine disturbs much less than wall-clock throughput.
        "checkpoint_cpu_s": statistics.median(cpu_per_run[True]) - statistics.median(cpu_per_run[False]),
        "training_cpu_per_run_s": statistics.median(cpu_per_run[False]),
        "ratios": [round(r, 3) for r in ratios],
        "throughput_save_async_blocking_s": statistics.median(blocked),  # inside save_async, per checkpoint
        "throughput_fence_wait_s": statistics.median(fenced),  # waiting for the background copy, per checkpoint
        # The training thread's stall per checkpoint as a fraction of the interval: the part of the
        # overhead that does not depend on how much spare CPU the machine has.
        "training_thread_stall_fraction": (statistics.median(blocked) + statistics.median(fenced)) / (interval * step_s),
    }


def bench_sigterm(directory: Path, width: int, depth: int, reps: int, grace: float) -> dict:
    latencies, remaining, to_checkpoint = [], [], []
    for rep in range(reps):
        run_dir = directory / f"sigterm-{rep}"
        command = [
            sys.executable, str(TRAINER), "--dir", str(run_dir), "--width", str(width), "--depth", str(depth),
            "--batch", "8", "--threads", str(torch.get_num_threads()), "--grace", str(grace), "--no-digest",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        events = []
        sent = checkpointed = None
        for line in proc.stdout:
            event = json.loads(line)
            events.append(event)
            if sent is None and event["event"] == "step" and event["step"] >= 2:
                sent = time.perf_counter()
                proc.send_signal(signal.SIGTERM)
            elif event["event"] == "checkpoint" and sent is not None:
                checkpointed = time.perf_counter()
        code = proc.wait()
        exited = time.perf_counter()
        final = [e for e in events if e["event"] == "checkpoint"]
        if code != 0 or not final or sent is None:
            raise RuntimeError(f"trainer did not exit cleanly (code {code}); last events {events[-3:]}")
        latencies.append(exited - sent)
        to_checkpoint.append(checkpointed - sent)
        remaining.append(final[-1]["remaining"])
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "sigterm_exit_s": statistics.median(latencies),
        "sigterm_grace_s": grace,
        "sigterm_samples": [round(v, 3) for v in latencies],
        "sigterm_to_checkpoint_s": statistics.median(to_checkpoint),  # step finished + final save durable
        "sigterm_remaining_at_checkpoint_s": statistics.median(remaining),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where to write (default: a temporary folder under the current directory)")
    parser.add_argument("--reps", type=int, default=7,
                        help="write-time repetitions; save_ratio is the median of the paired ratios (default: 7)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6, help="6 x 4096^2 layers: ~100M parameters")
    parser.add_argument("--grace", type=float, default=20.0)
    parser.add_argument("--throughput-pairs", type=int, default=7, help="throughput test: off/on run pairs")
    parser.add_argument(
        "--checkpoint-every", type=float, default=2.0, metavar="SECONDS", help="throughput test: checkpoint interval"
    )
    parser.add_argument("--skip-sigterm", action="store_true")
    parser.add_argument("--skip-sync-snapshot", action="store_true",
                        help="throughput test: skip the comparison run with the snapshot memcpy on the training thread")
    parser.add_argument("--skip-write", action="store_true", help="skip the write-time section (quick runs)")
    args = parser.parse_args()

    base = Path(args.dir) if args.dir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=base))
    fstype = filesystem_of(directory)
    load_before = os.getloadavg()
    print(f"writing to {directory} ({fstype}); {os.cpu_count()} CPUs, load average {load_before[0]:.2f}")
    if fstype in ("tmpfs", "ramfs"):
        print("warning: this directory is in memory; fsync costs nothing here, pass --dir on a real disk")
    try:
        results = {"fs": fstype, "cpus": os.cpu_count(), "torch": torch.__version__}
        if not args.skip_write:
            results.update(bench_write(directory, args.width, args.depth, args.reps))
        results.update(bench_throughput(directory, args.throughput_pairs, args.checkpoint_every))
        if not args.skip_sync_snapshot:
            # The same with the memcpy on the training thread, to show what overlapping it buys.
            sync = bench_throughput(directory, args.throughput_pairs, args.checkpoint_every, copy_in_background=False)
            results["throughput_ratio_sync_snapshot"] = sync["throughput_ratio"]
            results["ratios_sync_snapshot"] = sync["ratios"]
            results["checkpoint_cpu_sync_snapshot_s"] = sync["checkpoint_cpu_s"]
            results["throughput_save_async_blocking_sync_snapshot_s"] = sync["throughput_save_async_blocking_s"]
            results["training_thread_stall_fraction_sync_snapshot"] = sync["training_thread_stall_fraction"]
        if not args.skip_sigterm:
            results.update(bench_sigterm(directory, args.width, args.depth, args.reps, args.grace))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    results["load_average"] = [round(x, 2) for x in (load_before[0], os.getloadavg()[0])]

    rows = []
    if "save_s" in results:
        gb = results["state_bytes"] / 1e9
        rows += [
            (f"state: {results['params'] / 1e6:.1f}M params + Adam", f"{gb:.2f} GB", ""),
            ("torch.save (anchor)", f"{results['torch_save_s']:.3f} s", f"{gb / results['torch_save_s']:.2f} GB/s"),
            ("torch.save + fsync", f"{results['torch_save_fsync_s']:.3f} s", ""),
            ("CheckpointStore.save", f"{results['save_s']:.3f} s",
             f"{results['save_ratio']:.2f}x torch.save (paired median; runs {results['save_ratio_spread']})"),
            (
                "fastest run: torch.save / store.save",
                f"{results['torch_save_min_s']:.2f} / {results['save_min_s']:.2f}",
                f"s, {results['save_min_s'] / results['torch_save_min_s']:.2f}x",
            ),
            (
                "CPU time: torch.save / store.save",
                f"{results['torch_save_cpu_s']:.2f} / {results['save_cpu_s']:.2f}",
                "s, all threads of the process",
            ),
            ("save_async: caller blocked", f"{results['save_async_blocking_s']:.3f} s", "snapshot (memcpy)"),
            ("save_async: until durable", f"{results['save_async_total_s']:.3f} s", ""),
            ("load_latest (verify + load)", f"{results['load_s']:.3f} s", ""),
        ]
    rows += [
        (
            f"training, {results['throughput_params'] / 1e6:.1f}M params: steps/s off / on",
            f"{results['throughput_off']:.2f} / {results['throughput_on']:.2f}",
            f"ratio {results['throughput_ratio']:.3f}, runs {results['throughput_ratio_spread']} "
            f"(checkpoint every {results['checkpoint_every_s']:.2f} s)",
        ),
        (
            "  training thread blocked: save_async + fence",
            f"{results['throughput_save_async_blocking_s']:.3f} + {results['throughput_fence_wait_s']:.3f} s",
            f"{100 * results['training_thread_stall_fraction']:.1f}% of the interval (memcpy overlapped with "
            "forward/backward)",
        ),
        (
            "  CPU time one checkpoint adds to a run",
            f"{results['checkpoint_cpu_s']:.3f} s",
            f"of {results['training_cpu_per_run_s']:.2f} s of training CPU per run",
        ),
    ]
    if "throughput_ratio_sync_snapshot" in results:
        rows.append(("  ratio with the memcpy on the training thread", f"{results['throughput_ratio_sync_snapshot']:.3f}",
                     f"blocked {results['throughput_save_async_blocking_sync_snapshot_s']:.3f} s per checkpoint, "
                     f"{100 * results['training_thread_stall_fraction_sync_snapshot']:.1f}% of the interval"))
    if "sigterm_exit_s" in results:
        rows.append(
            ("SIGTERM -> exit, checkpoint written", f"{results['sigterm_exit_s']:.2f} s", f"grace {args.grace:g} s")
        )
        rows.append(("  of which SIGTERM -> checkpoint durable", f"{results['sigterm_to_checkpoint_s']:.2f} s", ""))
    width = max(len(r[0]) for r in rows)
    print()
    for label, value, note in rows:
        print(f"  {label:<{width}}  {value:>12}  {note}")
    print(f"  ({platform.node()}, {results['fs']}, load average {results['load_average']})")
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
