"""Argument helpers and output conventions shared by the swarm subcommands (dht, join, status).

Output conventions: human-readable messages go to stderr (through logging), the machine-readable
readiness line is the only thing a peer prints on stdout: one JSON object, flushed at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing.util
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NoReturn, Optional

from moshpeer.dht.maddrs import DEFAULT_HOST_MADDRS, maddrs_for_port
from moshpeer.errors import UserError

if TYPE_CHECKING:
    from moshpeer.dht.records import Role
    from moshpeer.peer.runtime.daemon import PeerDaemon

# The parsers are built from this module before any flag is checked: nothing here imports hivemind or torch at
# module level (they take seconds to load), so a mistyped flag is reported at once. Functions that start
# something import what they need.

DEFAULT_CONNECT_TIMEOUT = 30.0
DEFAULT_HEARTBEAT = 5.0


def share(text: str) -> float:
    """argparse type: a share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def int_at_least(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """argparse type: an integer >= `low` (and <= `high`, when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if high is None and value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be {low} or more")
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be between {low} and {high}")
        return value
    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def add_run_id_argument(parser: argparse.ArgumentParser, *, required: bool = True, default: str = None) -> None:
    parser.add_argument(
        "--run-id",
        required=required,
        default=default,
        metavar="NAME",
        help="name of the training run; peers of one run share it" + (f" (default: {default})" if default else ""),
    )


def add_initial_peers_argument(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        required=required,
        metavar="MADDR",
        help="multiaddrs of running peers, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm... (as printed by 'moshpeer dht')",
    )


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """Listening, announcing, identity and connection-timeout options of a long-running peer."""
    group = parser.add_argument_group("network")
    group.add_argument(
        "--host-maddrs",
        nargs="+",
        metavar="MADDR",
        help=f"multiaddrs to listen on (default: {' '.join(DEFAULT_HOST_MADDRS)})",
    )
    group.add_argument("--port", type=int, metavar="N", help="listen on TCP port N of all interfaces")
    group.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs other peers should use to reach this one (public address behind NAT or a proxy)",
    )
    group.add_argument(
        "--identity",
        metavar="PATH",
        help="private key file that keeps this peer's id across restarts (created if missing; one per machine, "
             "never copied to another)",
    )
    group.add_argument(
        "--connect-timeout",
        type=positive_float,
        default=DEFAULT_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up if no initial peer answers within this time (default: {DEFAULT_CONNECT_TIMEOUT:g})",
    )


def add_membership_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("membership")
    group.add_argument(
        "--heartbeat",
        type=positive_float,
        default=DEFAULT_HEARTBEAT,
        metavar="SECONDS",
        help=f"re-publish this peer's record this often (default: {DEFAULT_HEARTBEAT:g})",
    )
    group.add_argument(
        "--expiration",
        type=positive_float,
        metavar="SECONDS",
        help="a record vanishes this long after its last heartbeat (default: 3 heartbeats)",
    )


def add_private_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("private run (docs/security.md)")
    group.add_argument("--swarm-key", metavar="FILE",
                       help="admit only peers holding this pre-shared secret (the file's bytes, at least 16; "
                       "e.g. made with `openssl rand -hex 32 > FILE`)")
    group.add_argument("--allow-peers", metavar="FILE",
                       help="admit only the peer ids listed in FILE (one per line, # comments)")
    group.add_argument("--run-owner", metavar="PEER_ID",
                       help="admit only peers with a credential this peer id signed (`moshpeer member issue`)")
    group.add_argument("--credential", metavar="FILE", help="this peer's credential from the run owner")
    group.add_argument("--revoked", metavar="FILE",
                       help="the run owner's revocation list (`moshpeer member revoke`), re-read when it changes")


def admission_from_args(args: argparse.Namespace, *, member: bool = True):
    """The `Admission` of the private-run flags (UserError for a bad file or a missing credential), None for an open
    run. `member`: this node takes part (a member of a run with an owner needs --credential, unless it is the
    owner: its --identity is the owner's key); `moshpeer status` only reads."""
    key, allowed = getattr(args, "swarm_key", None), getattr(args, "allow_peers", None)
    owner, credential = getattr(args, "run_owner", None), getattr(args, "credential", None)
    revoked = getattr(args, "revoked", None)
    if key is None and allowed is None and owner is None and credential is None and revoked is None:
        return None
    from moshpeer.dht import Admission

    admission = Admission.from_files(key, allowed, owner=owner, credential_path=credential, revoked_path=revoked)
    if member and owner is not None and credential is None and _identity_peer_id(args) != owner:
        raise UserError("--run-owner needs this peer's --credential FILE (`moshpeer member issue` by the owner), "
                        "or the owner's --identity")
    return admission


def _identity_peer_id(args: argparse.Namespace) -> Optional[str]:
    """The peer id of an existing --identity file, None without one (a bad file is the DHT start's to report)."""
    path = getattr(args, "identity", None)
    if path is None or not os.path.exists(path):
        return None
    from moshpeer.dht import Identity

    try:
        return Identity.load(path).peer_id
    except (UserError, ValueError, OSError):
        return None


def add_metrics_argument(parser: argparse.ArgumentParser, *, demo: bool = False) -> None:
    extra = " (the bootstrap node; training peer k gets N+k)" if demo else ""
    parser.add_argument("--metrics-port", type=int, metavar="N",
                        help=f"serve Prometheus metrics at http://0.0.0.0:N/metrics{extra}; 0: any free port, "
                        "announced in the ready line (see docs/operations.md, 'Prometheus metrics')")


def metrics_from_args(args: argparse.Namespace, command: str):
    """A `PeerMetrics` for --metrics-port (served by `announce_ready`, once the DHT process has forked, so
    it does not inherit the listening socket), or None without the flag."""
    if getattr(args, "metrics_port", None) is None:
        return None
    from moshpeer.peer.runtime.metrics import PeerMetrics

    return PeerMetrics(run_id=args.run_id, role=getattr(args, "role", "bootstrap"), command=command)


def host_maddrs_from_args(args: argparse.Namespace) -> List[str]:
    """--host-maddrs, or --port on all interfaces, or the default (any free port on all interfaces)."""
    if args.host_maddrs and args.port is not None:
        raise UserError("give either --port or --host-maddrs, not both")
    if args.port is not None:
        return maddrs_for_port(args.port)
    return list(args.host_maddrs or DEFAULT_HOST_MADDRS)


def membership_timing_from_args(args: argparse.Namespace) -> Dict[str, float]:
    expiration = args.expiration if args.expiration is not None else 3 * args.heartbeat
    if expiration <= args.heartbeat:
        raise UserError(f"--expiration ({expiration:g} s) must be longer than --heartbeat ({args.heartbeat:g} s)")
    return {"heartbeat": args.heartbeat, "expiration": expiration}


def check_flags(args: argparse.Namespace) -> None:
    """Check every flag a command has before anything starts (no DHT, no peer record, no file written).

    Codec, task and its arguments, compute budget, error feedback with its codec, and the paths
    (--checkpoint-dir, --out, --preemption-notice, --events), that --metrics-port is free, and the private-run
    files (--swarm-key, --allow-peers). The library's own parsers do the checking, so the
    command accepts exactly what the library does. Flags a command lacks are skipped; with `--no-train`
    the training flags are. (Multiaddrs, ports and the identity file are checked by the DHT's start,
    before anything listens.)

    :raises UserError: the first bad flag, as one line
    """
    if not getattr(args, "no_train", False):
        if getattr(args, "compression", None) is not None:
            from moshpeer.compression import get_compression

            get_compression(args.compression)
        if getattr(args, "error_feedback", False):
            from moshpeer.peer.optimizer.error_feedback import error_feedback_sparsifier

            error_feedback_sparsifier(args.averaging, args.compression)
        if getattr(args, "compute_budget", None) is not None:
            from moshpeer.peer.optimizer.dropcompute import parse_compute_budget

            parse_compute_budget(args.compute_budget)
        if getattr(args, "task", None) is not None:
            from moshpeer.peer.tasks import check_task, parse_task_kwargs

            check_task(args.task, **parse_task_kwargs(getattr(args, "task_arg", [])))
    for flag in ("checkpoint_dir", "out"):
        path = getattr(args, flag, None)
        if path is not None:
            check_directory_flag(f"--{flag.replace('_', '-')}", path)
    for flag in ("preemption_notice", "events"):
        path = getattr(args, flag, None)
        if path is not None:
            check_file_flag(f"--{flag.replace('_', '-')}", path)
    if getattr(args, "metrics_port", None) is not None:
        from moshpeer.peer.runtime.metrics import check_metrics_port

        check_metrics_port(args.metrics_port)
    admission_from_args(args)


def check_directory_flag(flag: str, path: str) -> None:
    """UserError unless `path` is a directory this process can write a file in (created if missing). Writes and
    removes a probe file: permission bits say nothing of a read-only mount or of /proc, which root may "write"."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".moshpeer-write-check-"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_file_flag(flag: str, path: str) -> None:
    """UserError unless `path` names a file (existing or not) in an existing directory."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory, expected a file")
    if not os.path.isdir(os.path.dirname(path)):
        raise UserError(f"{flag} {path}: directory {os.path.dirname(path)} does not exist")


def configure_logging(verbose: bool) -> None:
    """Keep the default output readable: hivemind's loggers at WARNING unless -v (then DEBUG)."""
    from hivemind.utils.logging import use_hivemind_log_handler

    from moshpeer.logs import quiet_expected_peer_failures

    use_hivemind_log_handler("nowhere")  # hivemind's records go through the root handler, in our format
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbose else logging.WARNING)
    quiet_expected_peer_failures()  # a peer leaving is one line (with -v), not hivemind's traceback
    # Forked DHT processes inherit these settings; p2pd's output is logged (and filtered) through them.


def join_command(maddrs: List[str], run_id: str) -> str:
    """The ready-to-paste command that joins this swarm."""
    return f"moshpeer join --initial-peers {' '.join(maddrs)} --run-id {run_id}"


def print_ready_line(**fields: Any) -> None:
    """Print the one machine-readable readiness line: {"event": "ready", ...} on stdout, flushed."""
    sys.stdout.write(json.dumps({"event": "ready", **fields}, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def make_daemon(args: argparse.Namespace, *, role: Role, client_mode: bool = False,
                behind_nat: bool = False) -> PeerDaemon:
    """A `PeerDaemon` configured from the network and membership options."""
    from moshpeer.peer.runtime.daemon import PeerDaemon

    return PeerDaemon(
        args.run_id,
        role=role,
        initial_peers=args.initial_peers,
        host_maddrs=host_maddrs_from_args(args),
        announce_maddrs=args.announce_maddrs,
        identity_path=args.identity,
        client_mode=client_mode,
        behind_nat=behind_nat,
        connect_timeout=args.connect_timeout,
        admission=admission_from_args(args),
        **membership_timing_from_args(args),
    )


def announce_ready(daemon: PeerDaemon, command: str, metrics=None, metrics_port: int = 0) -> None:
    """Tell humans (stderr) how to join, and scripts (stdout, one JSON line) that the peer is ready.
    With `metrics` (a `PeerMetrics`): label them with the peer id, serve them on `metrics_port` and
    announce the port (UserError if it was taken since check_flags)."""
    joining = join_command(daemon.visible_maddrs, daemon.run_id)
    log = logging.getLogger(f"moshpeer.cli.{command}")
    log.info(f"peer {daemon.peer_id} listening on {' '.join(daemon.visible_maddrs)}")
    log.info(f"to join this swarm, run:\n\n    {joining}\n")
    extra = {}
    if metrics is not None:
        metrics.set_identity(run_id=daemon.run_id, peer_id=daemon.peer_id, role=daemon.role, command=command)
        metrics.serve(metrics_port)
        log.info(f"Prometheus metrics at http://0.0.0.0:{metrics.port}/metrics")
        extra["metrics_port"] = metrics.port
    print_ready_line(
        command=command,
        peer_id=daemon.peer_id,
        maddrs=daemon.visible_maddrs,
        run_id=daemon.run_id,
        role=daemon.role,
        pid=os.getpid(),
        join_command=joining,
        **extra,
    )


def exit_now(code: int) -> NoReturn:
    """Leave at once after a completed shutdown: flush output, skip interpreter teardown.

    Tearing down an interpreter that has loaded torch and hivemind takes 0.5 s on an idle machine
    and several seconds on a busy one, which would break the promise to exit within 5 s of SIGTERM.
    Whatever must happen on exit runs before this, as a PeerDaemon shutdown hook, not in atexit; except
    multiprocessing's own finalizers, which remove the folder it made in the temp dir (hivemind's DHT calls
    pass pipes to the DHT process, which starts multiprocessing's fd-sharing listener there): without them
    every peer that ran left a `pymp-*` folder behind.
    """
    multiprocessing.util._run_finalizers()  # what its atexit hook runs, without the joins of child processes
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
