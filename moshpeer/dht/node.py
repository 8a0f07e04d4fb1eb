"""Starting (or joining) the swarm's hivemind DHT, with every failure the user can fix as a `UserError`.

`start_dht` checks its inputs before starting anything (multiaddrs, listen ports, identity file),
then starts a `SwarmDHT` (a `hivemind.DHT` in its own process, which runs a p2pd child) and, if
initial peers are given, retries until one of them answers or `connect_timeout` runs out.

Process hygiene: the DHT process leads its own process group, which its p2pd child joins. Signals
sent to the terminal's or the launcher's process group (Ctrl-C, `kill -- -PGID`) therefore reach
only the main process, which stays in charge of an orderly shutdown (it needs the DHT alive to
withdraw its record). If the main process dies without shutting down (SIGKILL, crash), a watchdog
thread in the DHT process notices that it was orphaned and takes its whole group, p2pd included,
down with it; `SwarmDHT.kill` and an atexit hook do the same from the main process. The same watchdog
ends the group when p2pd exits on its own or its sockets are deleted, and keeps the sockets from aging
into a /tmp cleaner's reach (process_watch.py); with the DHT process gone, the peer stops with an error
(heartbeat.py), and a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import fcntl
import functools
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import weakref
from typing import Awaitable, Callable, List, Optional, Sequence, Set

import hivemind
from hivemind.dht import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.proto import dht_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.multiaddr import Multiaddr

from moshpeer.dht.admission import Admission
from moshpeer.dht.clock import describe_offset
from moshpeer.dht.fork_locks import repair_fork_locks
from moshpeer.dht.identity import Identity
from moshpeer.dht.keys import validate_run_id
from moshpeer.dht.maddrs import DEFAULT_HOST_MADDRS, check_ports_free, parse_initial_peers, parse_listen_maddrs
from moshpeer.dht.process_watch import ORPHANED, DhtProcessWatch
from moshpeer.dht.validation import run_validator
from moshpeer.logs import quiet_abandoned_dht_requests
from moshpeer.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 30.0
# How often the DHT process checks its parent, its p2pd and their sockets (process_watch.py).
_ORPHAN_POLL_SECONDS = 0.5
# How long a pipe error in the DHT process may precede the main process's death being visible to it.
_ORPHAN_CONFIRM_SECONDS = 2.0
# Pause between attempts to reach initial peers that are not up yet.
_RETRY_PAUSE_SECONDS = 1.0
# How long a question to the DHT process may go unanswered (`get_visible_maddrs`): a stalled p2pd delays its answer
# for as long as it stalls, and the caller (the heartbeat) has other work.
DHT_CALL_TIMEOUT = 10.0


class StartCancelled(Exception):
    """`start_dht` gave up because its caller asked to stop (e.g. SIGTERM while connecting)."""


class DhtRequestAbandoned(RuntimeError):
    """The DHT process dropped a request before it finished (its task was cancelled: the process is stopping)."""


class SwarmDHT(hivemind.DHT):
    """A `hivemind.DHT` that knows its `Identity` and cleans up after itself (see module docstring).

    Use `start_dht` to create one; the constructor takes hivemind.DHT's arguments plus `identity`.
    """

    def __init__(self, *args, identity: Identity, admission: Optional[Admission] = None, behind_nat: bool = False,
                 **kwargs):
        if behind_nat:  # p2pd: autorelay on, and private reachability at once rather than after AutoNAT's probes
            kwargs = {"use_auto_relay": True, "force_reachability": "private", **kwargs}
        # No node-local caching of what a read found: hivemind's find RPC answers with the cached copy too, so every
        # node that had read the membership dictionary answered every later read (and every store's lookup of
        # the nodes near the key) with all of it, and a read cost min(N, 20) copies instead of the 5 replicas'.
        kwargs = {"cache_locally": False, "cache_nearest": 0, **kwargs}
        super().__init__(*args, **kwargs)
        self.identity = identity
        # Nobody can dial this node (`start_dht`'s behind_nat): its averager announces no data-plane address, so
        # that members reach it over libp2p streams at once instead of after timed-out TCP attempts.
        self.behind_nat = behind_nat
        # Who this node admits (private runs); read in this (the main) process by every layer above.
        self.admission = admission if admission is not None else Admission()
        self.admission.bind(identity.peer_id)
        self._creator_pid = os.getpid()
        self._identity_lock = None  # the open lock file of a persistent identity (start_dht), closed by kill()

    def relay_maddrs(self) -> List[str]:
        """The addresses through a circuit relay at which others reach this node (`start_dht(behind_nat=True)`),
        as its p2pd announces them now; [] before a relay has reserved it a slot (or without `behind_nat`)."""
        return [str(m) for m in self.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(m)]

    @property
    def owner_subkey(self) -> bytes:
        """Subkey under which this peer's owned (signed) records are stored."""
        return self.identity.owner_subkey

    def run(self) -> None:
        # Runs in the forked DHT process, before p2pd is spawned, so p2pd joins this group.
        os.setpgid(0, 0)
        # The fork copied the main process's Python signal handlers (PeerDaemon's): this process must
        # simply die on SIGTERM / SIGHUP. (hivemind makes it ignore SIGINT: Ctrl-C is the main's job.)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        quiet_abandoned_dht_requests()  # the requests its loop abandons when it stops are no error
        # hivemind's DHTProtocol registers its handlers before it sets `node_info`, and a ping served in between
        # failed with an AttributeError traceback (CI saw one when a twin with this peer id was dialled): until it is
        # set, answer as a client-mode node does (an empty NodeInfo: the asker does not add this node yet).
        DHTProtocol.node_info = dht_pb2.NodeInfo()
        parent = os.getppid()
        self._stopping = threading.Event()  # set by `_shutdown`: from then on p2pd's exit is expected
        self._requests: Set[asyncio.Task] = set()  # `_run_coroutine`'s tasks, held until they end
        watch = DhtProcessWatch(parent, self._node_started, self._stopping, self._p2p_sockets)
        threading.Thread(target=_watch_process_group, args=(watch,), name="moshpeer-dht-watchdog", daemon=True).start()
        try:
            super().run()
        except (EOFError, OSError):
            # A main process killed while it sent a request (SIGKILL mid-pickle) leaves half a message in
            # the pipe: reading it fails here. That is the peer leaving, not an error worth a traceback.
            if not _orphaned_within(parent, _ORPHAN_CONFIRM_SECONDS):
                raise
            _end_process_group()

    def get_visible_maddrs(self, latest: bool = False, timeout: float = DHT_CALL_TIMEOUT) -> List[Multiaddr]:
        """This node's addresses as others reach it (hivemind's, with a deadline); `latest` asks p2pd afresh.
        Raises TimeoutError when the DHT process does not answer within `timeout` (a stalled p2pd), and
        DhtRequestAbandoned, ValueError (no address yet) or OSError (the process is gone) as it fails."""
        future = self.run_coroutine(functools.partial(hivemind.DHT._get_visible_maddrs, latest=latest),
                                    return_future=True)
        return future.result(timeout=timeout)

    async def _run_coroutine(self, coro: Callable[[hivemind.DHT, DHTNode], Awaitable], future: MPFuture) -> None:
        # In the DHT process, for `run_coroutine`. hivemind's pipe loop keeps no reference to a request's task, and
        # asyncio's loop only a weak one: a request waiting on a connection of its own to a stalled p2pd (`identify`,
        # `connect`: uvloop does not keep such a transport alive) was garbage-collected mid-wait ("Task was destroyed
        # but it is pending") and never answered. So the task is held until it ends. (`get` and `store` wait on
        # p2pd's persistent connection, which the p2p client holds.) hivemind's also logged a
        # traceback for every failure and handed the caller whatever ended the coroutine, GeneratorExit included,
        # which no `except Exception` catches: here the caller alone gets the failure, as an Exception.
        task = asyncio.current_task()
        self._requests.add(task)
        try:
            result = await coro(self, self._node)
        except Exception as e:
            if not future.done():  # else the caller cancelled it
                future.set_exception(e)
        except BaseException as e:
            if not future.done():
                future.set_exception(DhtRequestAbandoned(f"the DHT process dropped this request ({type(e).__name__})"))
            raise
        else:
            if not future.done():
                future.set_result(result)
        finally:
            self._requests.discard(task)

    def _node_started(self) -> bool:
        """In the DHT process: has hivemind started the node (and so its p2pd)?"""
        return getattr(self, "_node", None) is not None

    def _p2p_sockets(self) -> List[str]:
        """In the DHT process: the paths of p2pd's control socket and of hivemind's client socket (hivemind's
        private attributes: [] if they are not there)."""
        p2p = getattr(getattr(self, "_node", None), "p2p", None)
        maddrs = [getattr(p2p, name, None) for name in ("_daemon_listen_maddr", "_client_listen_maddr")]
        return [str(m)[len("/unix"):] for m in maddrs if m is not None and str(m).startswith("/unix/")]

    async def _shutdown(self) -> None:
        # In the DHT process, on the main process's `shutdown()`: hivemind now stops p2pd, which the watchdog
        # must not take for a crash.
        self._stopping.set()
        await super()._shutdown()

    def kill(self) -> None:
        """SIGKILL the DHT process and its p2pd, wherever they are; safe to call more than once."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the DHT process leads its group: pgid == its pid
        except (ProcessLookupError, PermissionError):
            pass
        if self._creator_pid == os.getpid():
            self.join(timeout=1.0)  # reap it, so no zombie is left behind
            if self._identity_lock is not None:
                self._identity_lock.close()
                self._identity_lock = None

    def stop(self, timeout: float = 2.0) -> None:
        """Graceful shutdown (p2pd terminated by hivemind), then kill whatever is left of the group; a lock the
        killed process held is replaced (fork_locks.py)."""
        if self.is_alive():
            self.shutdown_timeout = timeout
            try:
                self.shutdown()
            except (OSError, ValueError):  # pipe already closed by an earlier shutdown
                pass
        killed = self.is_alive()
        self.kill()
        if killed:  # it may have died holding one of hivemind's fork-shared locks
            repair_fork_locks()


def _watch_process_group(watch: DhtProcessWatch) -> None:
    """In the DHT process: end this process group (p2pd included) when `watch` says so (process_watch.py)."""
    why = None
    while why is None:
        time.sleep(_ORPHAN_POLL_SECONDS)
        why = watch.check()
    if why != ORPHANED:
        logger.error(f"{why}; ending this peer's DHT process")
    _end_process_group()


def _orphaned_within(parent_pid: int, seconds: float) -> bool:
    """Has the main process gone, or does it go within `seconds`? (A dying process closes its pipes a moment
    before its children are handed to another parent.)"""
    deadline = time.monotonic() + seconds
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _end_process_group() -> None:
    """Terminate this DHT process's group (itself and p2pd); SIGKILL if SIGTERM did not end it."""
    os.killpg(0, signal.SIGTERM)
    time.sleep(3.0)  # only reached if SIGTERM did not end this process
    os.killpg(0, signal.SIGKILL)


def _stop_at_exit(dht_ref: "weakref.ReferenceType[SwarmDHT]") -> None:
    dht = dht_ref()
    if dht is not None and dht._creator_pid == os.getpid():
        dht.stop(timeout=1.0)


def start_dht(
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
    announce_maddrs: Sequence[str] = (),
    identity_path: Optional[str] = None,
    identity: Optional[Identity] = None,
    client_mode: bool = False,
    behind_nat: bool = False,
    run_ids: Sequence[str] = (),
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    should_stop: Optional[Callable[[], bool]] = None,
    admission: Optional[Admission] = None,
    **dht_kwargs,
) -> SwarmDHT:
    """Start a DHT node and, with `initial_peers`, join their swarm; return it once it is ready.

    :param initial_peers: multiaddrs of running peers, each ending in /p2p/<peer id>; empty = new swarm
    :param host_maddrs: where to listen; announce_maddrs: addresses to advertise instead (NAT, proxies)
    :param identity_path: persistent identity file (created if missing), so a restart keeps the peer id;
        `identity` passes an already loaded one; with neither, the peer gets a fresh identity
    :param client_mode: do not accept incoming DHT requests (for peers that cannot be reached)
    :param behind_nat: nobody can dial this node (NAT, firewall): it takes a slot on a circuit relay (p2pd's
        autorelay, among its initial peers, which relay by default) and announces the relay's address, so that
        peers behind other NATs reach it through the relay (its data plane then takes libp2p streams). p2pd
        reserves the slot about 3 minutes after start (autorelay's boot delay, not configurable there); until
        then only peers it dialled itself reach it. `SwarmDHT.relay_maddrs()` says when it is reachable.
    :param run_ids: runs whose peer records this node schema-checks (signatures are always checked)
    :param connect_timeout: how long to keep trying to reach `initial_peers`
    :param should_stop: polled between attempts; returning True raises `StartCancelled`
    :param admission: a private run's policy (swarm key, allow-list; admission.py); default: admit everyone
    :param dht_kwargs: passed on to hivemind.DHT / DHTNode / P2P
    :raises UserError: malformed multiaddr, port in use, bad identity file, unreachable initial peers
    """
    initial_peers = parse_initial_peers(initial_peers)
    host_maddrs = parse_listen_maddrs(host_maddrs)
    announce_maddrs = parse_listen_maddrs(announce_maddrs, announce=True)
    run_ids = [validate_run_id(run_id) for run_id in run_ids]
    if client_mode and not initial_peers:
        raise UserError("a client-mode peer cannot start a new swarm: give --initial-peers")
    if behind_nat and not initial_peers:
        raise UserError("a peer behind NAT cannot start a new swarm (nobody could reach it): give --initial-peers")

    check_ports_free(host_maddrs)

    persistent = identity_path is not None
    if identity is None:
        identity = Identity.load_or_create(identity_path) if persistent else Identity.generate()
    if admission is not None:
        admission.bind(identity.peer_id)  # a refused credential is one line, before anything starts
    identity_lock = _lock_identity(identity.path) if identity.path is not None else None
    try:
        return _start_dht_node(identity, identity_lock, persistent, initial_peers=initial_peers,
                               host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, client_mode=client_mode,
                               behind_nat=behind_nat,
                               run_ids=run_ids, connect_timeout=connect_timeout, should_stop=should_stop,
                               admission=admission, **dht_kwargs)
    except BaseException:
        if identity_lock is not None:
            identity_lock.close()
        raise


def _lock_identity(path: str):
    """An exclusive lock on `path`.lock, held (open) for as long as the returned file is: two peers on one
    machine never run with one identity. hivemind's check asks the swarm whether the peer id answers, which
    a swarm that has not yet learned the first peer's address misses (CI: the second start went through).

    :raises UserError: another process (or another node of this one) holds it"""
    try:
        lock = open(path + ".lock", "a+")
    except OSError as e:  # a read-only directory: hivemind's check in the swarm still applies
        logger.warning(f"cannot lock identity {path} ({e.strerror}): two peers on this machine could share it")
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError("this identity is already used by a running peer: stop it first, or use another --identity") \
            from None
    return lock


def _start_dht_node(identity: Identity, identity_lock, persistent: bool, *, initial_peers, host_maddrs,
                    announce_maddrs, client_mode, behind_nat, run_ids, connect_timeout, should_stop, admission,
                    **dht_kwargs) -> SwarmDHT:
    """start_dht once its arguments are checked and its identity is loaded (and locked, if it is a file);
    `persistent`: the identity came from `identity_path` (hivemind then also asks the swarm whether it is free)."""
    validators = [
        identity.signature_validator(),
        run_validator(run_ids),
    ]

    key_dir = None
    if identity.path is None:
        # p2pd reads its key from a file: give it a private temporary one, removed once p2pd has read it.
        key_dir = tempfile.mkdtemp(prefix="moshpeer-identity-")
        key_path = os.path.join(key_dir, "identity.key")
        with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(identity.to_file_bytes())
    else:
        key_path = identity.path

    deadline = time.monotonic() + connect_timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            repair_fork_locks()  # a lock left held by a killed DHT process would hang this one's start
            dht = SwarmDHT(
                initial_peers=initial_peers or None,
                identity=identity,
                admission=admission,
                behind_nat=behind_nat,
                start=False,
                host_maddrs=host_maddrs,
                announce_maddrs=announce_maddrs or None,
                identity_path=key_path,
                # A fresh key cannot be in use; a persistent one is checked (hivemind asks the swarm).
                check_if_identity_free=persistent,
                client_mode=client_mode,
                record_validators=validators,
                startup_timeout=max(remaining, 5.0),
                shutdown_timeout=2.0,
                **dht_kwargs,
            )
            dht.run_in_background(await_ready=False)
            try:
                dht.wait_until_ready(timeout=max(remaining, 5.0) + 15.0)
            except BaseException as e:
                dht.stop(timeout=1.0)
                if isinstance(e, KeyboardInterrupt):
                    raise
                _raise_user_error_unless_unreachable(e, has_initial_peers=bool(initial_peers), persistent=persistent)
                if should_stop is not None and should_stop():
                    raise StartCancelled() from None
                if time.monotonic() + _RETRY_PAUSE_SECONDS >= deadline:
                    raise UserError(
                        f"cannot reach initial peers {' '.join(initial_peers)} after {connect_timeout:g} s"
                    ) from None
                logger.debug(f"initial peers not reachable yet, retrying ({_first_line(e)})")
                time.sleep(_RETRY_PAUSE_SECONDS)
                continue
            atexit.register(_stop_at_exit, weakref.ref(dht))
            dht._identity_lock = identity_lock
            return dht
    finally:
        if key_dir is not None:
            shutil.rmtree(key_dir, ignore_errors=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _raise_user_error_unless_unreachable(error: BaseException, *, has_initial_peers: bool,
                                        persistent: bool = False) -> None:
    """Turn a DHT startup failure into a `UserError`, unless it means "initial peers not reachable yet".
    `persistent`: the identity came from a file (which another machine may have a copy of)."""
    text = str(error)
    if isinstance(error, concurrent.futures.TimeoutError):  # the DHT process never reported back
        if has_initial_peers:
            return
        raise UserError("the DHT did not start in time (is the machine overloaded?)") from None
    unreachable = (
        "failed to connect to bootstrap peers" in text
        or "none of the initial_peers responded" in text
        or "Daemon failed to start in" in text  # p2pd still dialing an address that does not answer
    )
    if unreachable and has_initial_peers:
        return
    if "address already in use" in text:
        raise UserError(f"a listen port is already in use ({_first_line(error)})") from None
    if "already taken by another peer" in text:
        raise UserError(
            "this identity is already used by a running peer: stop it first, or use another --identity"
        ) from None
    if type(error).__name__ == "P2PDaemonError":
        raise UserError(f"could not start p2pd: {_first_line(error)}") from None
    if "local time must be within" in text:  # hivemind pings the initial peers and compares their clocks with ours
        raise UserError(_clock_error(text)) from None
    if "can't access this node" in text:
        # The initial peer dialed this peer id back and reached another node. Measured: also what two machines
        # starting together with copies of one identity file see (twins.py).
        twin = ", or another machine runs with a copy of this --identity file" if persistent else ""
        raise UserError(f"the initial peers cannot connect back to this machine (a NAT or a firewall in the way"
                        f"{twin}): join with --client-mode, or --behind-nat to be reachable through a relay") from None
    raise error


def _clock_error(text: str) -> str:
    """The user's line for hivemind's "local time must be within N seconds of others(local: T1, peer: T2)"."""
    match = re.search(r"within ([\d.]+) seconds.*local: ([\d.]+), peer: ([\d.]+)", text, re.S)
    if match is None:
        return f"this machine's clock disagrees with the initial peers' ({text.strip().splitlines()[0]}): set it " \
               "right (e.g. `timedatectl set-ntp true`) and start again"
    allowed, local, peer = (float(group) for group in match.groups())
    return describe_offset(local - peer, "the initial peers'", allowed, "set it right and start again")
