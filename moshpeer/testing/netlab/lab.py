"""The lab: one network namespace per peer, behind a router namespace (and optionally a site router), torn down
whatever happens. See the package docstring for the topology."""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from moshpeer.testing.netlab import cpu, delay, nat, tcp
from moshpeer.testing.netlab.commands import COMMAND_TIMEOUT_S, NetlabError, in_netns, run, run_json, sysctl
from moshpeer.testing.netlab.namespaces import KILL_GRACE_S, delete_namespaces, list_netns
from moshpeer.testing.netlab.spec import (RateSpec, parse_ms, parse_rate, parse_share, parse_site, per_peer,
                                          site_kind)

PREFIX = "mpnl"
IFNAME = "nl0"  # the peer's interface inside its namespace (GLOO_SOCKET_IFNAME etc. can name it)
MAX_PEERS = 250
# Private /24s for the lab's public side, tried in order; one that overlaps an address or route of this machine
# is skipped. Sites (NAT, firewall) take theirs from SITE_SUBNETS the same way.
SUBNET_CANDIDATES = ("10.213.0.0/24", "10.214.0.0/24", "10.215.0.0/24", "198.18.213.0/24", "198.19.213.0/24")
SITE_SUBNETS = tuple(f"172.31.{k}.0/24" for k in range(256))
# A lab whose peers behind NAT must be reached through a relay takes its public side from public address space (pass
# it as `subnet`): libp2p counts RFC 1918 and benchmarking ranges as private, and a relay puts only public addresses
# in the slots it reserves, so on the usual candidates no NAT'ed peer could be reached through a public one. The
# range lives on the lab's own bridges only, with no route out of the machine.
PUBLIC_CORE_SUBNET = "11.213.0.0/24"
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
MAX_INITIAL_WINDOW = 1024  # segments; what `ip route ... initcwnd` takes is far above any sane first flight

_NETNS_RE = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})([0-9a-z])-(\d+|probe|r|s\d+)$")
_SEQ_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Node:
    """One peer of the lab: its namespace, its address, and what its link and machine are like."""

    index: int
    netns: str
    address: str  # where the others reach it: behind a NAT, its private address (the others see the site's)
    upload_mbit: Optional[float]  # None = unshaped
    download_mbit: Optional[float]
    rtt_ms: float = 0.0  # its share of round trips: rtt_i / 2 + rtt_j / 2 between peers i and j
    jitter_ms: float = 0.0
    site: Optional[str] = None  # label of the site router it sits behind (None: on the core router)
    site_address: Optional[str] = None  # the site's public address (what others see of it behind a NAT)
    cpu_share: Optional[float] = None  # cores its processes may use (None: unlimited)
    cgroup: Optional[Path] = None

    @property
    def upload_bytes_per_s(self) -> Optional[float]:
        return None if self.upload_mbit is None else self.upload_mbit * 1e6 / 8


def tbf(dev: str, mbit: float, netns: Optional[str] = None) -> List[str]:
    """The `tc` command shaping `dev`'s egress to `mbit` (see MIN_BURST_BYTES for the bucket and queue)."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(MIN_BURST_BYTES, int(rate_bytes * 1e-3))
    limit = max(MIN_QUEUE_BYTES, int(rate_bytes * QUEUE_SECONDS))
    return in_netns(netns, ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(mbit * 1e6)}bit",
                            "burst", str(burst), "limit", str(limit)])


# ---- can it be built here? ----------------------------------------------------------------------------

_unavailable_reason: Optional[str] = None
_probed = False


def unavailable(*, delays: bool = False, sites: bool = False, cpu_budgets: bool = False) -> Optional[str]:
    """None if labs (with the features asked for) can be built here, else one line saying why not. The base
    check is cached and probes once by building a namespace with a shaped link."""
    global _unavailable_reason, _probed
    if not _probed:
        _probed = True
        _unavailable_reason = _probe()
    if _unavailable_reason is not None:
        return _unavailable_reason
    if delays and not os.path.exists("/dev/net/tun"):
        return "netlab delays need /dev/net/tun"
    if delays and shutil.which("gcc") is None:
        return "netlab delays need gcc (to build the delay line)"
    if sites and shutil.which("iptables") is None:
        return "netlab sites (NAT, firewall) need iptables (apt-get install iptables)"
    if cpu_budgets:
        return cpu.unavailable()
    return None


def _probe() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return "netlab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces, veth, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "netlab needs the ip and tc commands (iproute2)"
    probe = f"{PREFIX}-{_owner_tag(os.getpid())}z-probe"
    try:
        run(["ip", "netns", "add", probe])
        try:
            run(["ip", "-n", probe, "link", "set", "lo", "up"])
            run(tbf("lo", 100.0, probe))
        finally:
            run(["ip", "netns", "del", probe], check=False)
    except NetlabError as e:
        return f"netlab cannot build namespaces with tbf shaping here ({e})"
    return None


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


def cleanup(*, everything: bool = False, persistent: bool = False) -> List[str]:
    """Delete lab namespaces and CPU cgroups whose owning process is gone (`persistent`: also `netlab up` labs;
    `everything`: all of them, running owners included). Returns the names deleted."""
    if unavailable() is not None:
        return []

    def doomed(name: str) -> bool:
        match = _NETNS_RE.match(name)
        if match is None:
            return False
        owner = int(match.group(1), 16)
        if everything or (persistent and owner == PERSISTENT_OWNER):
            return True
        return not _owner_alive(owner)

    namespaces = [netns for netns in list_netns() if doomed(netns)]
    delete_namespaces(namespaces)
    groups = [group for group in cpu.leftovers(f"{PREFIX}-") if doomed(group.name)]
    for group in groups:
        cpu.remove(group)
    return namespaces + [f"cgroup {group.name}" for group in groups]


def _used_networks() -> list:
    used = []
    for entry in run_json(["ip", "-j", "-4", "addr", "show"]):
        for info in entry.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{info['local']}/{info.get('prefixlen', 32)}", strict=False))
    for route in run_json(["ip", "-j", "-4", "route", "show"]):
        dst = route.get("dst", "")
        if dst and dst != "default":
            used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return used


def pick_subnet(candidates: Sequence[str] = SUBNET_CANDIDATES, taken: Sequence = ()) -> ipaddress.IPv4Network:
    """The first candidate /24 that overlaps no address or route of this machine's namespace, nor `taken`."""
    used = _used_networks() + list(taken)
    for text in candidates:
        subnet = ipaddress.ip_network(text)
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetlabError(f"netlab: every candidate subnet ({candidates[0]} ...) is in use on this machine")


def cpu_budget(index: int, share: float) -> Path:
    """A CPU budget of `share` cores for a process started outside a lab (e.g. a loopback swarm's peer: pass
    `cpu.joiner(path)` as its preexec_fn), named as this process's, so `cleanup()` removes it once this process
    is gone; remove it with `cpu.remove(path)` when done. NetlabError where budgets are unavailable."""
    return cpu.create(f"{PREFIX}-{_owner_tag(os.getpid())}c-{index}", share)


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


PerPeer = Union[None, float, str, Sequence]


class Netlab:
    """N peers, one network namespace each, behind a router namespace: each peer's upload shaped with tbf,
    optionally delayed (round-trip time and jitter), behind a NAT or firewall site, and held to a CPU budget.

    :param uploads: one entry per peer: upload rate (Mbit/s, or "100mbit" / "1gbit"), None = unshaped
    :param downloads: download rates, same form (one for all, or one per peer)
    :param rtt: round-trip time each peer adds (ms, or "100ms"; one for all, or one per peer): between two peers
        with rtt r the round trip is r; jitter: how much it varies (+- jitter / 2 each way, never reordering)
    :param sites: per peer, None for a public address, or a site label ("cone", "symmetric-b", "firewall-x":
        spec.SITE_KINDS; peers with the same label share one site router)
    :param cpu_shares: cores each peer's processes may use (e.g. 0.3; None = unlimited)
    :param tcp_congestion: the TCP congestion control every peer runs (e.g. "cubic", stock Linux's; None = this
        kernel's default; see tcp.py)
    :param initial_window: TCP's initial congestion and receive windows on every peer's routes, in segments (what
        `ip route change ... initcwnd N initrwnd N` sets on a host; None = the kernel's, 10)
    :param persistent: owned by no process (the `up` command): no atexit teardown, removed by `netlab down`
    :raises NetlabError: a bad value (one line), here or from `up()`
    """

    def __init__(self, uploads: Sequence[RateSpec], *, downloads: PerPeer = None, rtt: PerPeer = None,
                 jitter: PerPeer = None, sites: PerPeer = None, cpu_shares: PerPeer = None,
                 subnet: Optional[str] = None, persistent: bool = False, tcp_congestion: Optional[str] = None,
                 initial_window: Optional[int] = None):
        if not 1 <= len(uploads) <= MAX_PEERS:
            raise NetlabError(f"netlab: 1 to {MAX_PEERS} peers, got {len(uploads)}")
        n = len(uploads)
        self.uploads = [parse_rate(u) for u in uploads]
        self.downloads = per_peer(downloads, n, parse_rate, "download")
        self.rtts = per_peer(rtt, n, parse_ms, "rtt")
        self.jitters = per_peer(jitter, n, parse_ms, "jitter")
        self.sites = per_peer(sites, n, parse_site, "site")
        self.cpu_shares = per_peer(cpu_shares, n, parse_share, "cpu")
        self.subnet_spec = subnet
        self.persistent = persistent
        self.tcp_congestion = tcp_congestion
        if initial_window is not None and not 1 <= initial_window <= MAX_INITIAL_WINDOW:
            raise NetlabError(f"netlab: initial_window must be 1 to {MAX_INITIAL_WINDOW} segments, "
                              f"got {initial_window}")
        # A peer's routes to the others: TCP's initial congestion and receive windows, as an operator sets them
        self._route_options = [] if initial_window is None else ["initcwnd", str(initial_window),
                                                                 "initrwnd", str(initial_window)]
        self._congestion_allowed = False
        owner = PERSISTENT_OWNER if persistent else os.getpid()
        with _live_lock:
            seq = _SEQ_CHARS[_sequence[0] % len(_SEQ_CHARS)]
            _sequence[0] += 1
        self.lab_id = _owner_tag(owner) + seq
        self.router = f"{PREFIX}-{self.lab_id}-r"
        self.nodes: List[Node] = []
        self._procs: List[subprocess.Popen] = []
        self._namespaces: List[str] = []
        self._cgroups: List[Path] = []
        self._routed: List[str] = []  # destinations every namespace routes: the public /24, firewall sites
        self._up = False

    # -- lifecycle --

    def up(self) -> "Netlab":
        """Build the lab; on any failure, deletes what it built and raises NetlabError."""
        reason = unavailable(delays=any(self.rtts) or any(self.jitters), sites=any(self.sites),
                             cpu_budgets=any(s is not None for s in self.cpu_shares))
        if reason is not None:
            raise NetlabError(reason)
        cleanup()  # what earlier, killed owners left behind
        public = ipaddress.ip_network(self.subnet_spec) if self.subnet_spec else pick_subnet()
        labels = list(dict.fromkeys(s for s in self.sites if s is not None))
        if len(list(public.hosts())) < len(self.uploads) + len(labels) + 1:
            raise NetlabError(f"netlab: subnet {public} is too small for {len(self.uploads)} peers")
        if not self.persistent:
            _install_hooks()
            with _live_lock:
                _live_labs[id(self)] = self
        self._up = True
        try:
            if self.tcp_congestion is not None:
                tcp.allow(self.tcp_congestion)
                self._congestion_allowed = True
            self._build(public, labels)
        except BaseException:
            self.down()
            raise
        return self

    def _namespace(self, name: str) -> str:
        run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _router(self, name: str) -> str:
        self._namespace(name)
        sysctl(name, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
        return name

    def _wire(self, upper: str, upper_link: str, gateway: str, lower: str, lower_link: str, address: str,
              reachable: Sequence[str], route_options: Sequence[str] = ()) -> None:
        """A veth between a router (`upper`) and a namespace below it that has `address`: /32 addresses and
        on-link routes (with `route_options`), so one router address serves every link and no subnet needs
        splitting."""
        run(["ip", "link", "add", "name", upper_link, "netns", upper, "type", "veth",
             "peer", "name", lower_link, "netns", lower])
        run(["ip", "-n", upper, "addr", "add", f"{gateway}/32", "dev", upper_link])
        run(["ip", "-n", upper, "link", "set", upper_link, "up"])
        run(["ip", "-n", upper, "route", "add", f"{address}/32", "dev", upper_link])
        run(["ip", "-n", lower, "addr", "add", f"{address}/32", "dev", lower_link])
        run(["ip", "-n", lower, "link", "set", lower_link, "up"])
        for destination in reachable:
            run(["ip", "-n", lower, "route", "add", destination, "via", gateway, "dev", lower_link, "onlink",
                 *route_options])

    def _build(self, public, labels: List[str]) -> None:
        hosts = [str(h) for h in public.hosts()]
        gateway, free = hosts[0], iter(hosts[1:])
        self._router(self.router)
        site_of: Dict[str, dict] = {}
        taken = [public]
        for label in labels:
            taken.append(pick_subnet(SITE_SUBNETS, taken))
        privates = dict(zip(labels, taken[1:]))
        # A firewall's addresses are routed, not translated: everyone needs a route to them.
        self._routed = [str(public)] + [str(privates[label]) for label in labels if site_kind(label) == "firewall"]
        for j, label in enumerate(labels):
            private = privates[label]
            netns, outside = self._router(f"{PREFIX}-{self.lab_id}-s{j}"), next(free)
            self._wire(self.router, f"s{j}", gateway, netns, nat.UPLINK, outside,
                       [d for d in self._routed if d != str(private)])
            if site_kind(label) == "firewall":  # routed, not translated: the core router must know the way in
                run(["ip", "-n", self.router, "route", "add", str(private), "via", outside, "dev", f"s{j}", "onlink"])
            nat.apply(netns, site_kind(label))
            site_of[label] = {"netns": netns, "outside": outside, "private": private,
                              "hosts": iter(str(h) for h in list(private.hosts())[1:]),
                              "gateway": str(next(private.hosts()))}
        for k in range(len(self.uploads)):
            self._add_node(k, public, gateway, free, site_of)

    def _add_node(self, k: int, public, gateway: str, free, site_of: Dict[str, dict]) -> None:
        netns = self._namespace(f"{PREFIX}-{self.lab_id}-{k}")
        label = self.sites[k]
        reachable = list(self._routed)
        if label is None:
            upper, upper_gateway, address, outside = self.router, gateway, next(free), None
        else:
            site = site_of[label]
            upper, upper_gateway, address, outside = site["netns"], site["gateway"], next(site["hosts"]), \
                site["outside"]
            if str(site["private"]) not in reachable:
                reachable.append(str(site["private"]))
        self._wire(upper, f"p{k}", upper_gateway, netns, IFNAME, address, reachable, self._route_options)
        sysctl(netns, f"net.ipv4.tcp_limit_output_bytes={TSQ_BYTES}",
               *([f"net.ipv4.tcp_congestion_control={self.tcp_congestion}"] if self.tcp_congestion else []))
        upload, download, rtt, jitter = self.uploads[k], self.downloads[k], self.rtts[k], self.jitters[k]
        shaped = IFNAME
        if rtt or jitter:
            self._procs.append(delay.route_through_delay(netns, reachable, rtt / 2, jitter / 2, seed=k + 1,
                                                         route_options=self._route_options))
            shaped = delay.TUN  # ahead of the delay: TCP's backpressure works as on a shaped link
        if upload is not None:
            run(tbf(shaped, upload, netns))
        if download is not None:
            run(tbf(f"p{k}", download, upper))
        group = None
        if self.cpu_shares[k] is not None:
            group = cpu.create(f"{PREFIX}-{self.lab_id}-{k}", self.cpu_shares[k])
            self._cgroups.append(group)
        self.nodes.append(Node(k, netns, address, upload, download, rtt, jitter, label, outside,
                               self.cpu_shares[k], group))

    def down(self) -> None:
        """Kill every process in the lab, delete its namespaces (and with them every link) and cgroups; safe
        to call again."""
        if not self._up:
            return
        self._up = False
        with _live_lock:
            _live_labs.pop(id(self), None)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        delete_namespaces(list(reversed(self._namespaces)))
        for proc in self._procs:
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for group in self._cgroups:
            cpu.remove(group)
        self._namespaces.clear()
        self._cgroups.clear()
        if self._congestion_allowed:
            self._congestion_allowed = False
            tcp.release(self.tcp_congestion)

    def __enter__(self) -> "Netlab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- using it --

    @property
    def addresses(self) -> List[str]:
        return [node.address for node in self.nodes]

    @property
    def namespaces(self) -> List[str]:
        """Every namespace of the lab: routers, sites and peers."""
        return list(self._namespaces)

    def command(self, index: int, argv: Sequence[str]) -> List[str]:
        """`argv` wrapped to run in peer `index`'s namespace."""
        return in_netns(self.nodes[index].netns, argv)

    def popen(self, index: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in peer `index`'s namespace and CPU budget (Popen keyword arguments pass through); killed
        by `down()`."""
        if not self._up:
            raise NetlabError("netlab: the lab is not up")
        group = self.nodes[index].cgroup
        if group is not None:
            kwargs["preexec_fn"] = cpu.joiner(group)
        proc = subprocess.Popen(self.command(index, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, index: int, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S,
            **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` to completion in peer `index`'s namespace and CPU budget (subprocess.run's arguments)."""
        group = self.nodes[index].cgroup
        if group is not None:
            kwargs["preexec_fn"] = cpu.joiner(group)
        return subprocess.run(self.command(index, argv), timeout=timeout, **kwargs)

    def tx_bytes(self, index: int) -> int:
        """Bytes peer `index` has sent on its link so far (interface counter: headers and all traffic included)."""
        stats = run_json(["ip", "-n", self.nodes[index].netns, "-j", "-s", "link", "show", "dev", IFNAME])
        return int(stats[0]["stats64"]["tx"]["bytes"])
