"""A small training process that uses the checkpoint and preemption API directly.

Used by tests/swarm/test_preemption_training.py and benchmarks/bench_checkpoint.py; the swarm-level
version of this loop lives in the real peer. It trains an MLP on a fixed synthetic dataset with
every source of randomness in play (dropout: torch; input noise: numpy; a scale jitter: Python's
random; batch order: its own torch.Generator per data epoch), so an exact resume needs all of the
checkpoint: parameters, Adam state, RNG states and the data position.

It prints one JSON object per line on stdout (events: resumed, ready, step, preempted,
saving_final, checkpoint, done) and exits 0 after a graceful stop.

    python tests/helpers/preemption_trainer.py --dir CKPT [--notice-file F] [--total-steps N] ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from moshpeer.peer.checkpoint import CheckpointStore, Parts, capture_rng_state, restore_rng_state  # noqa: E402
from moshpeer.peer.runtime.preemption import PreemptionWatcher  # noqa: E402

NUM_SAMPLES = 512


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def make_model(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every parameter and every optimizer state value, in a fixed order."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    opt_state = optimizer.state_dict()
    for index in sorted(opt_state["state"]):
        for key, value in sorted(opt_state["state"][index].items()):
            h.update(f"{index}.{key}".encode())
            h.update(torch.as_tensor(value).cpu().contiguous().numpy().tobytes())
    h.update(json.dumps(opt_state["param_groups"], sort_keys=True, default=str).encode())
    return h.hexdigest()


class Data:
    """A fixed dataset read in a shuffled order per data epoch; its position is checkpointed."""

    def __init__(self, width: int, batch: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(NUM_SAMPLES, width, generator=generator)
        self.targets = self.inputs[:, :4].sum(dim=1, keepdim=True)
        self.batch, self.seed = batch, seed
        self.data_epoch, self.offset = 0, 0

    def next_batch(self):
        order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(self.seed * 1000 + self.data_epoch))
        index = order[self.offset : self.offset + self.batch]
        self.offset += self.batch
        if self.offset + self.batch > NUM_SAMPLES:
            self.data_epoch, self.offset = self.data_epoch + 1, 0
        return self.inputs[index], self.targets[index]

    def state_dict(self):
        return {"data_epoch": self.data_epoch, "offset": self.offset}

    def load_state_dict(self, state):
        self.data_epoch, self.offset = int(state["data_epoch"]), int(state["offset"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--notice-file")
    parser.add_argument("--grace", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--total-steps", type=int, default=10**9)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="async checkpoint every N steps (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--poll-interval", type=float, default=0.1)
    parser.add_argument("--no-digest", action="store_true", help="skip the state digests (for timing)")
    parser.add_argument(
        "--expect-signals",
        type=int,
        default=0,
        help="test hook: before the final report, wait (until the deadline) for this many signals",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = Data(args.width, args.batch, args.seed)
    step = 0

    def state_digest():
        return None if args.no_digest else digest(model, optimizer)

    def training_state():
        return {
            Parts.MODEL: model.state_dict(),
            Parts.OPTIMIZER: optimizer.state_dict(),
            Parts.RNG: capture_rng_state(),
            Parts.DATA: data.state_dict(),
            Parts.COLLABORATIVE: {"epoch": step // 10, "samples": step * args.batch},
        }

    with PreemptionWatcher(args.notice_file, grace_period=args.grace, poll_interval=args.poll_interval) as watcher:
        with CheckpointStore(args.dir, keep_last=3) as store:
            resumed = store.load_latest()
            if resumed is not None:
                state, meta = resumed
                model.load_state_dict(state[Parts.MODEL])
                optimizer.load_state_dict(state[Parts.OPTIMIZER])
                restore_rng_state(state[Parts.RNG])
                data.load_state_dict(state[Parts.DATA])
                step = meta.step
                emit("resumed", step=step, digest=state_digest(), file=meta.path.name)
            emit("ready", step=step, pid=__import__("os").getpid())

            model.train()
            while step < args.total_steps and not watcher.triggered:
                inputs, targets = data.next_batch()
                inputs = inputs * (1 + 0.01 * random.random()) + torch.from_numpy(
                    0.01 * np.random.randn(*inputs.shape).astype(np.float32)
                )
                loss = nn.functional.mse_loss(model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                emit("step", step=step, loss=round(loss.item(), 6))
                if args.checkpoint_every and step % args.checkpoint_every == 0:
                    store.save_async(training_state(), step=step, epoch=step // 10)

            if watcher.triggered:
                notice = watcher.notice
                emit("preempted", step=step, reason=notice.reason, remaining=watcher.remaining())
                emit("saving_final", step=step)
                path = store.save(
                    training_state(), step=step, epoch=step // 10, abort_in_flight=True, extra={"reason": notice.reason}
                )
                while watcher.signal_count < args.expect_signals and watcher.remaining() > 0:
                    time.sleep(0.01)  # test hook only (see --expect-signals)
                emit(
                    "checkpoint",
                    step=step,
                    digest=state_digest(),
                    file=path.name,
                    remaining=watcher.remaining(),
                    signals=watcher.signal_count,
                )
                return 0
            store.wait()
            emit("done", step=step, digest=state_digest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
