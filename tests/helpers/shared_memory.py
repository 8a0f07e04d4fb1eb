"""A process that holds a torch /dev/shm segment, as a peer does: for the tests of whoever stops peers."""

from __future__ import annotations

import glob
import textwrap
from typing import List

from moshpeer.testing import orphans

# Shares a tensor through torch's file_system strategy (a /dev/shm segment that torch_shm_manager removes once its
# clients are gone, as hivemind's futures do in a peer), says so, and ends when its stdin closes.
SHARES_MEMORY = textwrap.dedent("""
    import sys, torch, torch.multiprocessing
    torch.multiprocessing.set_sharing_strategy("file_system")
    shared = torch.zeros(1000).share_memory_()
    print("shared", flush=True)
    sys.stdin.read()
""")


def segments_of(pid: int) -> List[str]:
    """The torch segments in /dev/shm that process `pid` created."""
    return glob.glob(f"{orphans.SHARED_MEMORY_DIR}/torch_{pid}_*")
