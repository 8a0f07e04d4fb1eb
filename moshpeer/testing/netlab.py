"""netlab: real, bandwidth-shaped links between processes on one machine (Linux network namespaces).

    with Netlab([100, 100, 100, 10]) as lab:         # upload Mbit/s per peer (None: unshaped)
        proc = lab.popen(0, ["python", "-m", "moshpeer", "dht", "--host-maddrs",
                             f"/ip4/{lab.nodes[0].address}/tcp/0", ...])
        lab.tx_bytes(0)                                # bytes this peer has put on its link
    # leaving the block: every process in the lab is killed, every namespace and link is deleted

Topology: one namespace per peer, each with one veth interface (`IFNAME`) on a private Linux bridge
and one address of a private /24 that no interface or route of this machine uses. The bridge has no
address and there is no route or NAT out: the peers reach each other and nothing else, and nothing
outside the lab reaches them. Each peer's egress (its upload) is shaped with a `tbf` qdisc on its own
veth end, so what a peer receives is limited by its senders' uploads; an optional download rate
shapes the bridge side of the veth. netem is not used (delay and loss come from moshpeer's fault
injector, `moshpeer.averaging.faults`).

Teardown is guaranteed as far as a process can guarantee it: `down()` on leaving the `with` block,
an atexit hook and SIGTERM / SIGHUP handlers for labs still up, and names that carry the owning
process id, so `cleanup()` (also run before every new lab) deletes what a SIGKILLed owner left.
Labs made by `python -m moshpeer.testing.netlab up` belong to no process (owner 0) and stay until
`down` (or `cleanup --all`).

Where namespaces cannot be made (not root, no `ip` / `tc`, no CAP_SYS_ADMIN), `unavailable()` says
why in one line; tests skip with it and `Netlab.up()` raises `NetlabError` with it.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

from moshpeer.errors import UserError

PREFIX = "mpnl"
IFNAME = "nl0"  # the peer's interface inside its namespace (GLOO_SOCKET_IFNAME etc. can name it)
MAX_PEERS = 250
# Private /24s for the lab, tried in order; one that overlaps an address or route of this machine is skipped.
SUBNET_CANDIDATES = ("10.213.0.0/24", "10.214.0.0/24", "10.215.0.0/24", "198.18.213.0/24", "198.19.213.0/24")
PERSISTENT_OWNER = 0  # labs of `netlab up`: no owning process, removed by `netlab down`
# tbf: the bucket holds at least MIN_BURST_BYTES and 1 ms of the rate (a smaller one costs throughput
# at high rates); the queue holds QUEUE_SECONDS of the rate, at least MIN_QUEUE_BYTES, like a router's
# buffer. The shaping qdisc sits on the sending host itself, so TCP small queues decide how much each
# socket may park in it: the kernel default (4 MB here) would overflow any sane buffer with two streams
# and turn the shaper into a packet dropper. In the lab namespaces we set 128 KB (the limit of older
# kernels), so that a few streams per peer fit in the queue (a real uplink's bottleneck is a router whose
# buffer absorbs them the same way) and the queueing delay stays short (at 20 Mbit/s 3 streams wait
# 0.15 s), also for the acknowledgements and control messages queued behind a peer's bulk data.
MIN_BURST_BYTES = 32 * 1024
MIN_QUEUE_BYTES = 2 * 1024 * 1024
QUEUE_SECONDS = 0.1
TSQ_BYTES = 128 * 1024
KILL_GRACE_S = 3.0
COMMAND_TIMEOUT_S = 20.0

_NETNS_RE = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})([0-9a-z])-(\d+|probe)$")
_LINK_RE = re.compile(rf"^{PREFIX}([0-9a-f]{{6}})([0-9a-z])[bhn]\d*$")
_SEQ_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"


class NetlabError(UserError):
    """The lab cannot be built (see `unavailable()`) or a command building it failed."""


RateSpec = Union[None, float, str]


def parse_rate(spec: RateSpec) -> Optional[float]:
    """A rate in Mbit/s from 100, "100", "100mbit", "1gbit", "500kbit"; None / "none" / 0 = unshaped.

    Raises NetlabError on anything else."""
    if spec is None:
        return None
    if isinstance(spec, (int, float)):
        value = float(spec)
    else:
        text = spec.strip().lower()
        if text in ("", "none", "0"):
            return None
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(kbit|mbit|gbit)?(?:/s|ps)?", text)
        if not match:
            raise NetlabError(f"bad rate {spec!r}: use e.g. 100, 100mbit, 1gbit or 500kbit")
        value = float(match.group(1)) * {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, None: 1.0}[match.group(2)]
    if value == 0:
        return None
    if not 0 < value < 1e6:
        raise NetlabError(f"bad rate {spec!r}: must be positive and below 1 Tbit/s")
    return value


def parse_rates(text: str, peers: int) -> List[Optional[float]]:
    """"100" (every peer) or "100,100,10" (one per peer) -> Mbit/s per peer."""
    parts = [p for p in text.split(",")]
    if len(parts) == 1:
        parts = parts * peers
    if len(parts) != peers:
        raise NetlabError(f"{len(parts)} rates for {peers} peers: give one rate, or one per peer")
    return [parse_rate(p) for p in parts]


@dataclass(frozen=True)
class Node:
    """One peer of the lab: its namespace, its address on the bridge, its shaped rates (Mbit/s, None = unshaped)."""

    index: int
    netns: str
    address: str
    upload_mbit: Optional[float]
    download_mbit: Optional[float]
    host_link: str  # the bridge end of its veth

    @property
    def upload_bytes_per_s(self) -> Optional[float]:
        return None if self.upload_mbit is None else self.upload_mbit * 1e6 / 8


# ---- running ip / tc --------------------------------------------------------------------------------


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetlabError(f"netlab: {' '.join(argv)} failed: {e}") from None
    if check and result.returncode != 0:
        raise NetlabError(f"netlab: {' '.join(argv)} failed: {result.stderr.strip() or result.returncode}")
    return result


def _json(argv: Sequence[str]) -> list:
    out = _run(argv).stdout.strip()
    return json.loads(out) if out else []


def _tbf(dev: str, mbit: float, netns: Optional[str] = None) -> List[str]:
    rate_bytes = mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes * 1e-3))
    limit = max(MIN_QUEUE_BYTES, int(rate_bytes * QUEUE_SECONDS))
    where = ["ip", "netns", "exec", netns] if netns else []
    return [*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(mbit * 1e6)}bit",
            "burst", str(burst), "limit", str(limit)]


_unavailable_reason: Optional[str] = None
_probed = False


def unavailable() -> Optional[str]:
    """None if labs can be built here, else one line saying why not (cached; probes once by building a namespace)."""
    global _unavailable_reason, _probed
    if _probed:
        return _unavailable_reason
    _probed = True
    if not sys.platform.startswith("linux"):
        _unavailable_reason = "netlab needs Linux network namespaces"
    elif os.geteuid() != 0:
        _unavailable_reason = "netlab needs root (network namespaces, veth, tc)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        _unavailable_reason = "netlab needs the ip and tc commands (iproute2)"
    else:
        probe = f"{PREFIX}-{_owner_tag(os.getpid())}z-probe"
        try:
            _run(["ip", "netns", "add", probe])
            try:
                _run(["ip", "-n", probe, "link", "set", "lo", "up"])
                _run(_tbf("lo", 100.0, probe))
            finally:
                _run(["ip", "netns", "del", probe], check=False)
        except NetlabError as e:
            _unavailable_reason = f"netlab cannot build namespaces with tbf shaping here ({e})"
    return _unavailable_reason


# ---- names and leftovers ----------------------------------------------------------------------------


def _owner_tag(pid: int) -> str:
    return f"{pid:06x}"[-6:]


def _owner_alive(owner: int) -> bool:
    if owner == PERSISTENT_OWNER:
        return True  # a lab of `netlab up`: removed by `netlab down` only
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_netns() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links() -> List[str]:
    return [link["ifname"] for link in _json(["ip", "-j", "link", "show"])]


def _netns_pids(namespaces: Sequence[str]) -> List[int]:
    pids = []
    for netns in namespaces:
        out = _run(["ip", "netns", "pids", netns], check=False).stdout
        pids += [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
    return pids


def _delete_namespaces(namespaces: Sequence[str]) -> None:
    """SIGTERM every process in `namespaces` (this lab's), SIGKILL what is left after KILL_GRACE_S, delete them."""
    deadline, sig = time.monotonic() + KILL_GRACE_S, signal.SIGTERM
    while True:
        pids = _netns_pids(namespaces)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            if sig == signal.SIGKILL:
                break
            sig, deadline = signal.SIGKILL, time.monotonic() + 1.0
        time.sleep(0.05)
    for netns in namespaces:
        _run(["ip", "netns", "del", netns], check=False)


def cleanup(*, everything: bool = False, persistent: bool = False) -> List[str]:
    """Delete lab namespaces and links whose owning process is gone (`persistent`: also `netlab up` labs;
    `everything`: all of them, running owners included). Returns the names deleted."""
    if unavailable() is not None:
        return []
    removed = []

    def doomed(owner_hex: str) -> bool:
        owner = int(owner_hex, 16)
        if everything or (persistent and owner == PERSISTENT_OWNER):
            return True
        return not _owner_alive(owner)

    # Links first (deleting a veth end deletes both; namespace deletion itself is asynchronous).
    for link in _list_links():
        match = _LINK_RE.match(link)
        if match and doomed(match.group(1)):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    namespaces = [netns for netns in _list_netns() if (m := _NETNS_RE.match(netns)) and doomed(m.group(1))]
    _delete_namespaces(namespaces)
    return removed + namespaces


def pick_subnet(candidates: Sequence[str] = SUBNET_CANDIDATES) -> ipaddress.IPv4Network:
    """The first candidate /24 that overlaps no address or route of this machine's own namespace."""
    used = []
    for entry in _json(["ip", "-j", "-4", "addr", "show"]):
        for info in entry.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{info['local']}/{info.get('prefixlen', 32)}", strict=False))
    for route in _json(["ip", "-j", "-4", "route", "show"]):
        dst = route.get("dst", "")
        if dst and dst != "default":
            used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    for text in candidates:
        subnet = ipaddress.ip_network(text)
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetlabError(f"netlab: every candidate subnet ({', '.join(candidates)}) is in use on this machine")


# ---- the lab ----------------------------------------------------------------------------------------

_live_labs: Dict[int, "Netlab"] = {}
_live_lock = threading.Lock()
_sequence = [0]
_hooks_installed = False


def _down_all() -> None:
    with _live_lock:
        labs = list(_live_labs.values())
    for lab in labs:
        lab.down()


def _on_signal(signum, frame) -> None:
    _down_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    """atexit always; SIGTERM / SIGHUP handlers only where nobody else handles them (main thread)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_down_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_signal)


class Netlab:
    """N peers, one network namespace each, on a private bridge; each peer's upload shaped with tbf.

    :param uploads: one entry per peer: upload rate (Mbit/s, or "100mbit" / "1gbit"), None = unshaped
    :param downloads: optional download rates, same form (one for all, or one per peer)
    :param persistent: owned by no process (the `up` command): no atexit teardown, removed by `netlab down`
    """

    def __init__(self, uploads: Sequence[RateSpec], *, downloads: Union[RateSpec, Sequence[RateSpec]] = None,
                 subnet: Optional[str] = None, persistent: bool = False):
        if not 1 <= len(uploads) <= MAX_PEERS:
            raise NetlabError(f"netlab: 1 to {MAX_PEERS} peers, got {len(uploads)}")
        self.uploads = [parse_rate(u) for u in uploads]
        if downloads is None or isinstance(downloads, (str, int, float)):
            downloads = [downloads] * len(uploads)
        if len(downloads) != len(uploads):
            raise NetlabError("netlab: one download rate, or one per peer")
        self.downloads = [parse_rate(d) for d in downloads]
        self.subnet_spec = subnet
        self.persistent = persistent
        owner = PERSISTENT_OWNER if persistent else os.getpid()
        with _live_lock:
            seq = _SEQ_CHARS[_sequence[0] % len(_SEQ_CHARS)]
            _sequence[0] += 1
        self.lab_id = _owner_tag(owner) + seq
        self.bridge = f"{PREFIX}{self.lab_id}b"
        self.nodes: List[Node] = []
        self._procs: List[subprocess.Popen] = []
        self._created: List[str] = []  # links and namespaces, for teardown
        self._up = False

    # -- lifecycle --

    def up(self) -> "Netlab":
        """Build the lab; on any failure, deletes what it built and raises NetlabError."""
        reason = unavailable()
        if reason is not None:
            raise NetlabError(reason)
        cleanup()  # what earlier, killed owners left behind
        subnet = ipaddress.ip_network(self.subnet_spec) if self.subnet_spec else pick_subnet()
        hosts = list(subnet.hosts())
        if len(hosts) < len(self.uploads):
            raise NetlabError(f"netlab: subnet {subnet} is too small for {len(self.uploads)} peers")
        if not self.persistent:
            _install_hooks()
            with _live_lock:
                _live_labs[id(self)] = self
        self._up = True
        try:
            self._build(subnet, hosts)
        except BaseException:
            self.down()
            raise
        return self

    def _build(self, subnet, hosts) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._created.append(self.bridge)
        _run(["ip", "link", "set", self.bridge, "up"])
        for k, (upload, download) in enumerate(zip(self.uploads, self.downloads)):
            netns, host_link, ns_link = f"{PREFIX}-{self.lab_id}-{k}", f"{PREFIX}{self.lab_id}h{k}", \
                f"{PREFIX}{self.lab_id}n{k}"
            _run(["ip", "netns", "add", netns])
            self._created.append(netns)
            _run(["ip", "link", "add", host_link, "type", "veth", "peer", "name", ns_link])
            self._created.append(host_link)
            _run(["ip", "link", "set", ns_link, "netns", netns])
            _run(["ip", "-n", netns, "link", "set", ns_link, "name", IFNAME])
            address = str(hosts[k])
            _run(["ip", "-n", netns, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", IFNAME])
            _run(["ip", "-n", netns, "link", "set", IFNAME, "up"])
            _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            _run(["ip", "netns", "exec", netns, "sysctl", "-q", f"net.ipv4.tcp_limit_output_bytes={TSQ_BYTES}"])
            _run(["ip", "link", "set", host_link, "master", self.bridge])
            _run(["ip", "link", "set", host_link, "up"])
            if upload is not None:
                _run(_tbf(IFNAME, upload, netns))
            if download is not None:
                _run(_tbf(host_link, download))
            self.nodes.append(Node(k, netns, address, upload, download, host_link))

    def down(self) -> None:
        """Kill every process in the lab, delete its namespaces and links; safe to call again."""
        if not self._up:
            return
        self._up = False
        with _live_lock:
            _live_labs.pop(id(self), None)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for name in reversed(self._created):  # links first: deleting a namespace is asynchronous
            if not name.startswith(f"{PREFIX}-"):
                _run(["ip", "link", "del", name], check=False)
        _delete_namespaces([name for name in self._created if name.startswith(f"{PREFIX}-")])
        for proc in self._procs:
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._created.clear()

    def __enter__(self) -> "Netlab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- using it --

    @property
    def addresses(self) -> List[str]:
        return [node.address for node in self.nodes]

    def command(self, index: int, argv: Sequence[str]) -> List[str]:
        """`argv` wrapped to run in peer `index`'s namespace."""
        return ["ip", "netns", "exec", self.nodes[index].netns, *argv]

    def popen(self, index: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in peer `index`'s namespace (Popen keyword arguments pass through); killed by `down()`."""
        if not self._up:
            raise NetlabError("netlab: the lab is not up")
        proc = subprocess.Popen(self.command(index, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, index: int, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S,
            **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` to completion in peer `index`'s namespace (subprocess.run's keyword arguments)."""
        return subprocess.run(self.command(index, argv), timeout=timeout, **kwargs)

    def tx_bytes(self, index: int) -> int:
        """Bytes peer `index` has sent on its link so far (interface counter: headers and all traffic included)."""
        stats = _json(["ip", "-n", self.nodes[index].netns, "-j", "-s", "link", "show", "dev", IFNAME])
        return int(stats[0]["stats64"]["tx"]["bytes"])


# ---- command line -----------------------------------------------------------------------------------


def _describe(lab: Netlab) -> dict:
    return {"lab": lab.lab_id, "bridge": lab.bridge, "ifname": IFNAME,
            "nodes": [{"index": n.index, "netns": n.netns, "address": n.address, "upload_mbit": n.upload_mbit,
                       "download_mbit": n.download_mbit} for n in lab.nodes]}


def _run_everywhere(lab: Netlab, argv: List[str], timeout: Optional[float]) -> int:
    """Start argv in every namespace ({index}, {address}, {addresses}, {netns}, {peers} substituted); wait."""
    fields = {"addresses": ",".join(lab.addresses), "peers": str(len(lab.nodes))}
    procs = []
    for node in lab.nodes:
        values = {**fields, "index": str(node.index), "address": node.address, "netns": node.netns}
        procs.append(lab.popen(node.index, [arg.format(**values) for arg in argv]))
    deadline = None if timeout is None else time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            print(f"netlab: command still running after {timeout:g} s; stopping the lab", file=sys.stderr)
            return 124
    return max(codes, default=0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moshpeer.testing.netlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def lab_args(p):
        p.add_argument("--peers", type=int, default=2, help="number of namespaces (default: 2)")
        p.add_argument("--rate", default="100mbit", help="upload per peer: one rate or a comma-separated list "
                       "(100, 100mbit, 1gbit, none; default: 100mbit)")
        p.add_argument("--download", default=None, help="download rate(s), same form (default: unshaped)")
        p.add_argument("--subnet", default=None, help="private /24 to use (default: a free one of "
                       f"{', '.join(SUBNET_CANDIDATES)})")

    lab_args(sub.add_parser("up", help="build a lab that stays until `down`; prints it as JSON"))
    sub.add_parser("down", help="delete the labs made by `up`")
    clean = sub.add_parser("cleanup", help="delete labs whose owning process is gone")
    clean.add_argument("--all", action="store_true", help="delete every lab, running owners included")
    sub.add_parser("status", help="list lab namespaces and links on this machine")
    run = sub.add_parser("run", help="build a lab, run a command in every namespace, tear the lab down",
                         description="{index} {address} {addresses} {netns} {peers} in the command are "
                         "substituted per namespace.")
    lab_args(run)
    run.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    try:
        if args.cmd in ("up", "run"):
            reason = unavailable()
            if reason is not None:
                raise NetlabError(reason)
            if not 1 <= args.peers <= MAX_PEERS:
                raise NetlabError(f"--peers must be within 1..{MAX_PEERS}")
            uploads = parse_rates(args.rate, args.peers)
            downloads = parse_rates(args.download, args.peers) if args.download else None
            if args.cmd == "up":
                lab = Netlab(uploads, downloads=downloads, subnet=args.subnet, persistent=True).up()
                print(json.dumps(_describe(lab)))
                return 0
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise NetlabError("netlab run: give a command after --")
            with Netlab(uploads, downloads=downloads, subnet=args.subnet) as lab:
                print(json.dumps(_describe(lab)), file=sys.stderr)
                return _run_everywhere(lab, command, args.timeout)
        if args.cmd == "status":
            for name in _list_netns():
                if _NETNS_RE.match(name):
                    print(f"netns {name}")
            for name in _list_links():
                if _LINK_RE.match(name):
                    print(f"link  {name}")
            return 0
        reason = unavailable()
        if reason is not None:
            raise NetlabError(reason)
        removed = cleanup(persistent=True) if args.cmd == "down" else cleanup(everything=args.all)
        print(f"netlab: removed {len(removed)} namespaces and links", file=sys.stderr)
        return 0
    except NetlabError as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
