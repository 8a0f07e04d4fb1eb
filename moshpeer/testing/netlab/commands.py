"""Running `ip`, `tc`, `iptables` and `sysctl` for netlab: one line of error, never a hang."""

from __future__ import annotations

import json
import subprocess
from typing import List, Optional, Sequence

from moshpeer.errors import UserError

COMMAND_TIMEOUT_S = 20.0


class NetlabError(UserError):
    """The lab cannot be built (see `unavailable()`) or a command building it failed."""


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command to completion within COMMAND_TIMEOUT_S; NetlabError (one line) if it fails and `check`."""
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetlabError(f"netlab: {' '.join(argv)} failed: {e}") from None
    if check and result.returncode != 0:
        raise NetlabError(f"netlab: {' '.join(argv)} failed: {result.stderr.strip() or result.returncode}")
    return result


def run_json(argv: Sequence[str]) -> list:
    out = run(argv).stdout.strip()
    return json.loads(out) if out else []


def in_netns(netns: Optional[str], argv: Sequence[str]) -> List[str]:
    """`argv` run inside `netns` (None: this namespace)."""
    return ["ip", "netns", "exec", netns, *argv] if netns else list(argv)


def sysctl(netns: str, *settings: str) -> None:
    run(in_netns(netns, ["sysctl", "-q", *[f"{s}" for s in settings]]))
