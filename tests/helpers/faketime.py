"""A process whose wall clock is off, for the clock tests: libfaketime (Debian package faketime) preloaded.

libfaketime shifts CLOCK_MONOTONIC with the wall clock (leaving it alone breaks Python's sleeps with EINVAL), so a
jump mid-run also moves the process's own deadlines: tests change the offset between rounds only.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Dict, Optional

LIBRARY: Optional[str] = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))), None)
MISSING = "" if LIBRARY else "libfaketime (Debian package faketime)"  # what a test skips for, if anything


def offset_env(offset: str) -> Dict[str, str]:
    """Environment of a process whose clock is `offset` ("+10", "-2.5": seconds) from this machine's."""
    return {"LD_PRELOAD": LIBRARY or "", "FAKETIME": offset}


def offset_file_env(path: Path) -> Dict[str, str]:
    """... whose offset is read from `path` (a line like "+10") on every clock read: write it to move the clock."""
    return {"LD_PRELOAD": LIBRARY or "", "FAKETIME_TIMESTAMP_FILE": str(path), "FAKETIME_NO_CACHE": "1"}
