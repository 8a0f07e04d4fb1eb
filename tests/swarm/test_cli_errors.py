"""Every bad input gets one clear line on stderr and a non-zero exit code, never a traceback.

The failing commands run, AT_ONCE at a time, against one live bootstrap node (a module fixture), then each
case checks its own outcome.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, Optional, Sequence

import faketime
import pytest

from moshpeer.dht import Identity
from swarm import LOOPBACK, RunResult, Swarm

pytestmark = pytest.mark.timeout(180)

CONNECT_TIMEOUT = 2  # seconds, for the unreachable-peer cases
NOBODY = Identity.generate().peer_id  # a well-formed peer id that no process has


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Case:
    command: str  # the subcommand, which names itself in the error line
    args: Callable[[SimpleNamespace], Sequence[str]]  # the rest of the command line
    expected: Callable[[SimpleNamespace], str]  # text the error line must contain
    env: Optional[Dict[str, str]] = None  # added to the command's environment
    missing: str = ""  # what this machine lacks to run the case (it is skipped, saying so)


JOIN = ("--no-train", "--host-maddrs", LOOPBACK, "--run-id", "r")
OWNER = "QmQcurcx1N9FP1ArMGC92egg4NvProCFdKWVdvK7G3eyNk"  # any peer id: the run owner of the credential cases
CASES = {
    "malformed multiaddr": Case(
        "join",
        lambda c: (*JOIN, "--initial-peers", f"/ip4/999.0.0.1/tcp/1/p2p/{NOBODY}"),
        lambda c: "malformed initial peer multiaddr '/ip4/999.0.0.1/tcp/1/p2p/",
    ),
    "multiaddr without peer id": Case(
        "join", lambda c: (*JOIN, "--initial-peers", "/ip4/127.0.0.1/tcp/31337"), lambda c: "has no /p2p/<peer id> part"
    ),
    "malformed host multiaddr": Case("dht", lambda c: ("--host-maddrs", "localhost:31337"), lambda c: "malformed host"),
    "unreachable initial peers": Case(
        "join",
        lambda c: (*JOIN, "--initial-peers", c.unreachable, "--connect-timeout", str(CONNECT_TIMEOUT)),
        lambda c: f"cannot reach initial peers {c.unreachable} after {CONNECT_TIMEOUT} s",
    ),
    "unreachable initial peers (status)": Case(
        "status",
        lambda c: ("--run-id", "r", "--initial-peers", c.unreachable, "--timeout", str(CONNECT_TIMEOUT)),
        lambda c: f"cannot reach initial peers {c.unreachable} after {CONNECT_TIMEOUT} s",
    ),
    "port in use (--port)": Case(
        "join",
        lambda c: ("--no-train", "--run-id", "r", "--port", str(c.taken_port)),
        lambda c: f"port {c.taken_port} on 0.0.0.0 is already in use",
    ),
    "port in use (--host-maddrs)": Case(
        "dht",
        lambda c: ("--host-maddrs", f"/ip4/127.0.0.1/tcp/{c.taken_port}"),
        lambda c: f"port {c.taken_port} on 127.0.0.1 is already in use",
    ),
    "unreadable identity file": Case(
        "join",
        lambda c: (*JOIN, "--identity", str(c.garbage_key)),
        lambda c: f"identity file {c.garbage_key} is not a valid private key",
    ),
    "identity path is a directory": Case(
        "join", lambda c: (*JOIN, "--identity", str(c.tmp)), lambda c: "is a directory"
    ),
    "identity in a missing directory": Case(
        "join", lambda c: (*JOIN, "--identity", str(c.tmp / "nope" / "peer.key")), lambda c: "does not exist"
    ),
    "unknown run": Case(
        "status",
        lambda c: ("--run-id", "no-such-run", "--initial-peers", *c.boot_maddrs),
        lambda c: "no live peers in run 'no-such-run'",
    ),
    "bad run id": Case(
        "join", lambda c: ("--no-train", "--run-id", "bad run id"), lambda c: "invalid run id 'bad run id'"
    ),
    "--port with --host-maddrs": Case(
        "join", lambda c: (*JOIN, "--port", "1"), lambda c: "either --port or --host-maddrs"
    ),
    "client mode without initial peers": Case(
        "join", lambda c: (*JOIN, "--client-mode"), lambda c: "client-mode peer cannot start a new swarm"
    ),
    "behind NAT without initial peers": Case(
        "join", lambda c: (*JOIN, "--behind-nat"), lambda c: "a peer behind NAT cannot start a new swarm"
    ),
    "nonexistent device (join)": Case(
        "join", lambda c: ("--run-id", "r", "--device", "cuda:7"), lambda c: "device 'cuda:7' does not exist"
    ),
    "nonexistent device (demo)": Case(
        "demo", lambda c: ("--peers", "2", "--device", "cuda:7"), lambda c: "device 'cuda:7' does not exist"
    ),
    "unknown device": Case(
        "join", lambda c: (*JOIN, "--device", "tpu"), lambda c: "unknown device 'tpu'; expected auto|cpu|cuda|cuda:N"
    ),
    "expiration not longer than heartbeat": Case(
        "join",
        lambda c: (*JOIN, "--heartbeat", "2", "--expiration", "2"),
        lambda c: "--expiration (2 s) must be longer than --heartbeat (2 s)",
    ),
    # Training flags are checked before the DHT starts (one line means: no "peer ... is in run" line).
    "unknown codec": Case(
        "join", lambda c: ("--run-id", "r", "--compression", "bogus"), lambda c: "unknown compression 'bogus'"
    ),
    "error feedback without a sparsifying codec": Case(
        "join", lambda c: ("--run-id", "r", "--error-feedback", "--compression", "int8"),
        lambda c: "error_feedback needs averaging in ('gradients', 'diloco') and a sparsifying codec",
    ),
    "spot checks without clipped aggregation": Case(
        "join", lambda c: ("--run-id", "r", "--spot-checks", "0.05"),
        lambda c: "--spot-checks needs --averaging gradients and --aggregation clipped, without --error-feedback",
    ),
    "unknown task argument": Case(
        "join", lambda c: ("--run-id", "r", "--task-arg", "nosuch=1"),
        lambda c: "task factory 'digits' got an unexpected keyword argument 'nosuch'",
    ),
    "checkpoint dir is a file": Case(
        "join", lambda c: ("--run-id", "r", "--checkpoint-dir", str(c.garbage_key)), lambda c: "is not a directory"
    ),
    "checkpoint dir that cannot be written": Case(  # root may write anywhere by its permission bits, not in /proc
        "join", lambda c: ("--run-id", "r", "--checkpoint-dir", str(c.garbage_key) + "/ckpt"),
        lambda c: "cannot write there (Not a directory)"
    ),
    "checkpoint dir on a file system that refuses it": Case(
        "join", lambda c: ("--run-id", "r", "--checkpoint-dir", "/proc/moshpeer-checkpoints"),
        lambda c: "cannot write there"
    ),
    "preemption notice in a missing directory": Case(
        "join", lambda c: ("--run-id", "r", "--preemption-notice", str(c.tmp / "nope" / "notice")),
        lambda c: "does not exist",
    ),
    "run owner without a credential": Case(
        "join", lambda c: ("--run-id", "r", "--run-owner", OWNER), lambda c: "--run-owner needs this peer's --credential"
    ),
    "a credential that is not one": Case(
        "join", lambda c: ("--run-id", "r", "--host-maddrs", LOOPBACK, "--run-owner", OWNER, "--credential",
                           str(c.garbage_key)),
        lambda c: "--credential is not a valid credential for this peer",
    ),
    "demo with an unknown codec": Case(
        "demo", lambda c: ("--compression", "bogus", "--out", str(c.tmp / "demo")),
        lambda c: "unknown compression 'bogus'",
    ),
    "clock 10 s ahead of the swarm's": Case(
        "join", lambda c: (*JOIN, "--initial-peers", *c.boot_maddrs),
        lambda c: "this machine's clock is 10.0 s ahead of the initial peers' (they must agree within 3 s)",
        env=faketime.offset_env("+10"), missing=faketime.MISSING,
    ),
    "adaptive deadline floor above its cap": Case(
        "join",
        lambda c: ("--run-id", "r", "--host-maddrs", LOOPBACK, "--round-timeout", "2", "--min-round-timeout", "5"),
        lambda c: "--min-round-timeout (5) must not exceed --round-timeout (2)",
    ),
}


# Cases running at once: all 28 at once, beside another test worker on 2 cores, once kept one past its 120 s.
AT_ONCE = 6


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every case at once; name -> (RunResult, expected text).

    (How long the bounded wait for unreachable peers takes is checked in test_dht_membership, in
    one process: here 15 interpreters start at once and their timings mean little.)
    """
    with Swarm() as swarm, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        boot = swarm.bootstrap("errors-run")
        context = SimpleNamespace(
            tmp=tmp_path_factory.mktemp("bad-input"),
            boot_maddrs=boot.maddrs,
            taken_port=taken.getsockname()[1],
            unreachable=f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{NOBODY}",
        )
        context.garbage_key = context.tmp / "garbage.key"
        context.garbage_key.write_bytes(b"this is not a private key")
        waiting = [(i, (name, case)) for i, (name, case) in enumerate(CASES.items()) if not case.missing]
        running, results = {}, {}
        while waiting or running:
            while waiting and len(running) < AT_ONCE:
                i, (name, case) = waiting.pop(0)
                running[name] = swarm.spawn(case.command, *case.args(context), name=f"case{i}", env=case.env)
            name = next(iter(running))  # the oldest
            proc = running.pop(name)
            code = proc.wait_exit(120)
            results[name] = (RunResult(code, proc.stdout, proc.stderr), CASES[name].expected(context))
        yield results


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(outcomes, name):
    if CASES[name].missing:
        pytest.skip(f"this machine has no {CASES[name].missing}")
    result, expected = outcomes[name]
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr_lines) == 1, result.stderr
    (line,) = result.stderr_lines
    assert line.startswith(f"moshpeer {CASES[name].command}: error: "), line
    assert expected in line, line
    assert '"event"' not in result.stdout, "a failed peer must not announce readiness"

