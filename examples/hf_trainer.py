"""Train a tiny, randomly initialised GPT-2 with Hugging Face's `Trainer` across a moshpeer swarm.

Nothing is downloaded: the model is built from a small config, the text is the standard library's
own `collections/__init__.py`, tokenized per byte. The only moshpeer-specific line is the optimizer:

    optimizer = CollaborativeOptimizer(torch.optim.AdamW(model.parameters(), lr=...), run_id=...,
                                       target_batch_size=..., batch_size_per_step=..., initial_peers=[...])
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))

Run a bootstrap node, then this script on every machine:

    moshpeer dht --run-id hf-demo                   # prints the multiaddrs to use below
    python examples/hf_trainer.py --initial-peers /ip4/.../p2p/Qm... --run-id hf-demo

Each process prints a JSON line at the end: {"event": "done", "initial_eval_loss": ..., "eval_loss": ..., ...}.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import tempfile
import time

import torch

BLOCK = 64


def byte_blocks(block: int = BLOCK) -> torch.Tensor:
    """The bytes of a standard-library source file, cut into blocks of `block` tokens (vocab = 256)."""
    with open(collections.__file__, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    usable = len(data) // block * block
    return data[:usable].view(-1, block)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", default="hf-demo")
    parser.add_argument("--max-steps", type=int, default=60, help="Trainer steps (micro-batches) of this peer")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target-batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--min-peers", type=int, default=1, help="wait up to 60 s for this many trainers")
    parser.add_argument("--seed", type=int, default=0, help="data order of this peer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from moshpeer.logs import quiet_expected_peer_failures

    quiet_expected_peer_failures()  # a peer leaving: one line, not hivemind's traceback

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_linear_schedule_with_warmup

    from moshpeer.peer.optimizer import CollaborativeOptimizer

    torch.manual_seed(0)  # every peer starts from the same random model
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2))
    blocks = byte_blocks()
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(len(blocks), generator=generator)
    eval_blocks, train_blocks = blocks[order[:64]], blocks[order[64:]]

    optimizer = CollaborativeOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3), run_id=args.run_id,
        target_batch_size=args.target_batch_size, batch_size_per_step=args.batch_size,
        initial_peers=args.initial_peers, group_size=args.group_size, model=model,
        matchmaking_time=1.0, round_timeout=10.0)
    optimizer.wait_for_peers(args.min_peers, timeout=60.0)  # start together, nobody races ahead alone
    # Trainer steps the schedule once per optimizer.step() call (one micro-batch); the collaborative
    # optimizer applies whatever learning rate the schedule has set when its epoch ends.
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=5, num_training_steps=args.max_steps)

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=32, logging_steps=10, report_to=[], save_strategy="no",
            use_cpu=True, seed=args.seed, data_seed=args.seed, disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(train_blocks),
                          eval_dataset=Blocks(eval_blocks), optimizers=(optimizer, scheduler))
        initial = trainer.evaluate()["eval_loss"]
        started = time.monotonic()
        trainer.train()
        final = trainer.evaluate()["eval_loss"]
    rounds = optimizer.rounds
    print(json.dumps({
        "event": "done", "initial_eval_loss": initial, "eval_loss": final, "epochs": optimizer.local_epoch,
        "rounds_ok": optimizer.epochs.rounds_ok, "rounds": optimizer.epochs.rounds_total, "seconds": round(time.monotonic() - started, 2),
        "max_group_size": max((r.group_size for r in rounds), default=1),
    }), flush=True)
    optimizer.shutdown(close_averager=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
