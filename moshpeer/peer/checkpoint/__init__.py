"""Checkpoints: atomic, checksummed, written off the training thread; see docs/checkpoints.md.

    store = CheckpointStore("ckpt/", keep_last=3)
    resumed = store.load_latest()            # (state, meta) of the newest valid one, or None
    store.save_async({Parts.MODEL: model.state_dict(), Parts.OPTIMIZER: opt.state_dict(),
                      Parts.RNG: capture_rng_state()}, step=step, epoch=epoch)
    store.save(state, step=step, epoch=epoch, abort_in_flight=True)   # on the way out
"""

from moshpeer.peer.checkpoint.filewriter import WriteAborted
from moshpeer.peer.checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpoint,
    UnsupportedCheckpointVersion,
)
from moshpeer.peer.checkpoint.rng import capture_rng_state, restore_rng_state
from moshpeer.peer.checkpoint.directory import (CheckpointInfo, CheckpointMeta, inspect_file, list_checkpoints,
                                               load_checkpoint)
from moshpeer.peer.checkpoint.store import CheckpointStore, Parts, SaveHandle, StoreStats

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMeta",
    "CheckpointStore",
    "CorruptCheckpoint",
    "Parts",
    "SaveHandle",
    "StoreStats",
    "UnsupportedCheckpointVersion",
    "WriteAborted",
    "capture_rng_state",
    "inspect_file",
    "list_checkpoints",
    "load_checkpoint",
    "restore_rng_state",
]
