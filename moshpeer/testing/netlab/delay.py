"""Latency and jitter without netem: a delay line of our own (delay_line.c) on a TUN device in a peer's namespace.

This kernel has no netem, so a peer's upload is routed through a TUN device whose reader, a small C program,
writes each packet back after the peer's one-way delay (FIFO; jitter never reorders). Inside the peer's
namespace:

    locally sent packets --(rule: iif lo -> table 100)--> dl0 (tbf: the upload) --> delay_line
    delay_line --> dl0 --(re-enters, iif dl0 -> main table)--> nl0 --> the router

The shaper sits on dl0, ahead of the delay, so TCP's small-queue backpressure works as on a shaped link, and
ACKs share the uplink and its delay as on a real one. A peer with round-trip time `rtt` delays what it sends
by rtt / 2, so two peers i and j see rtt_i / 2 + rtt_j / 2 between them. The program is compiled once per
source version into ~/.cache/moshpeer/netlab (gcc; NetlabError with gcc's message if it cannot be built).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import select
import subprocess
from pathlib import Path
from typing import List, Sequence

from moshpeer.testing.netlab.commands import COMMAND_TIMEOUT_S, NetlabError, in_netns, run, sysctl

SOURCE = Path(__file__).with_name("delay_line.c")
TUN = "dl0"
TABLE = "100"
READY_TIMEOUT_S = 10.0


def binary() -> Path:
    """The compiled delay line (built on first use, atomically, keyed by the source's hash)."""
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moshpeer" / "netlab"
    target = cache / f"delay_line-{hashlib.sha256(source).hexdigest()[:12]}"
    if target.exists():
        return target
    if shutil.which("gcc") is None:
        raise NetlabError("netlab: delays need gcc to build the delay line (apt-get install gcc)")
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    built = subprocess.run(["gcc", "-O2", "-o", str(partial), str(SOURCE)], capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S * 3)
    if built.returncode != 0:
        raise NetlabError(f"netlab: building the delay line failed: {built.stderr.strip()[-500:]}")
    os.replace(partial, target)
    return target


def route_through_delay(netns: str, destinations: List[str], delay_ms: float, jitter_ms: float,
                        seed: int, route_options: Sequence[str] = ()) -> subprocess.Popen:
    """Start `netns`'s delay line (one-way `delay_ms` +- `jitter_ms`) and route its sent packets to
    `destinations` (CIDRs) through it (routes with `route_options`). Returns the process; NetlabError if it does
    not come up in time."""
    run(["ip", "-n", netns, "tuntap", "add", "dev", TUN, "mode", "tun"])
    proc = subprocess.Popen(in_netns(netns, [str(binary()), f"{TUN}:{int(delay_ms * 1000)}:"
                                              f"{int(jitter_ms * 1000)}:{seed}"]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # "ready" once attached; EOF if it failed; nothing within READY_TIMEOUT_S: stuck.
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        raise NetlabError(f"netlab: the delay line in {netns} did not start: {proc.stderr.read().strip()[-300:]}")
    run(["ip", "-n", netns, "link", "set", TUN, "up"])
    # Packets it writes back carry this namespace's own source address: accept and forward them.
    sysctl(netns, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", f"net.ipv4.conf.{TUN}.rp_filter=0",
           f"net.ipv4.conf.{TUN}.accept_local=1")
    for destination in destinations:
        run(["ip", "-n", netns, "route", "add", destination, "dev", TUN, "table", TABLE, *route_options])
    run(["ip", "-n", netns, "rule", "add", "iif", "lo", "lookup", TABLE, "pref", "100"])
    return proc
