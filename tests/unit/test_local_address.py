"""Which address a peer listening on every interface announces (moshpeer/dht/local_address.py): asked anew, so a
machine whose address changes mid-run is reached at the new one."""

from __future__ import annotations

from types import SimpleNamespace

from moshpeer.averaging.dataplane import DataPlane
from moshpeer.dht.local_address import AnnouncedHost, announced_host, ipv4_hosts, route_source
from moshpeer.peer.runtime.trainer import _listen_host
from peer_fakes import FakeClock


def test_the_announced_host_follows_the_route_to_the_swarm_and_is_asked_again_after_its_ttl():
    clock, routes, asked = FakeClock(), {"10.0.0.1": "10.0.0.5"}, []

    def probe(destination):
        asked.append(destination)
        return routes.get(destination)

    announced = AnnouncedHost(["10.9.9.9", "10.0.0.1"], fallback="192.168.1.2", ttl_s=1.0, probe=probe, clock=clock)
    assert announced() == "10.0.0.5"  # no route to the first contact: the next one's
    routes["10.0.0.1"] = "10.0.0.55"  # the machine roamed
    assert announced() == "10.0.0.5" and len(asked) == 2  # cached within the ttl
    clock.advance(1.0)
    assert announced() == "10.0.0.55"
    routes.clear()  # the network is gone: the address chosen at start
    clock.advance(1.0)
    assert announced() == "192.168.1.2"


def test_only_listeners_on_every_interface_announce_a_route_and_loopback_is_never_announced():
    dht = SimpleNamespace(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/127.0.0.1/tcp/2/p2p/Qm"],
                          get_visible_maddrs=lambda: ["/ip4/127.0.0.1/tcp/5", "/ip4/10.1.2.3/tcp/5"])
    assert announced_host("10.1.2.3", dht) is None  # one address: announced as it is
    local = announced_host("0.0.0.0", dht)
    assert local.towards == [] and local() == "10.1.2.3"  # no contact beyond loopback: the visible address
    assert ipv4_hosts(["/ip4/1.2.3.4/tcp/1", "/ip6/::1/tcp/1", "/ip4/1.2.3.4/tcp/2"]) == ["1.2.3.4"]
    assert route_source("127.0.0.1") == "127.0.0.1" and route_source("not an address") is None


def test_the_data_plane_announces_what_it_is_told_with_its_own_port():
    hosts = iter(["10.0.0.5", "10.0.0.55"])
    plane = DataPlane("0.0.0.0", announce_host=lambda: next(hosts))
    try:
        port = plane.address[1]
        assert plane.reachable_address() == ("10.0.0.5", port)
        assert plane.reachable_address() == ("10.0.0.55", port)
    finally:
        plane.close()
    fixed = DataPlane("127.0.0.1")
    try:
        assert fixed.reachable_address() == fixed.address
    finally:
        fixed.close()


def test_a_trainer_listens_on_every_interface_only_when_its_dht_does_and_its_swarm_is_beyond_loopback():
    def daemon(listen, initial):
        return SimpleNamespace(dht=SimpleNamespace(kwargs={"host_maddrs": listen}, initial_peers=initial),
                               visible_maddrs=["/ip4/127.0.0.1/tcp/5", "/ip4/10.1.2.3/tcp/5"])

    boot = ["/ip4/10.0.0.1/tcp/1/p2p/Qm"]
    assert _listen_host(daemon(["/ip4/0.0.0.0/tcp/0"], boot)) == "0.0.0.0"
    assert _listen_host(daemon(["/ip4/10.1.2.3/tcp/0"], boot)) == "10.1.2.3"  # the address it was given
    assert _listen_host(daemon(["/ip4/0.0.0.0/tcp/0"], ["/ip4/127.0.0.1/tcp/1/p2p/Qm"])) == "10.1.2.3"  # local
