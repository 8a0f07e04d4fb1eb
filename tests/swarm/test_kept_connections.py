"""Kept data-plane connections on a real network (netlab): a kept connection that a middlebox silently dropped (no
reset, no answer) is given up within seconds of its rebind, and the round goes on over a new one.

The two members run in this process, each all-reduce in a thread that entered its peer's network namespace
(setns), so that its sockets live there; the router between them drops the kept connections' packets.
Needs root, iproute2 and iptables; skips with netlab's reason otherwise.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch
from local_group import identities

from moshpeer.averaging import DataPlane, GroupAllReduce, GroupMember, handshake, wire
from moshpeer.averaging.kept_links import KeptLinks
from moshpeer.averaging.member_connector import REBIND_UNACKED_S
from moshpeer.compression import get_compression
from moshpeer.testing import netlab
from moshpeer.testing.netlab import Netlab
from moshpeer.testing.netlab.commands import in_netns, run

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120),
              pytest.mark.skipif(netlab.unavailable(sites=True) is not None,
                                 reason=str(netlab.unavailable(sites=True)))]

CLONE_NEWNET = 0x40000000
ROUND_S = 30.0  # each all-reduce's deadline: without the unacknowledged-data limit a dead rebind waits all of it


def in_namespace(netns: str, work):
    """work() in a new thread that entered network namespace `netns` (its sockets and threads live there)."""
    box = {}

    def target():
        fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                box["error"] = OSError(ctypes.get_errno(), "setns")
                return
        finally:
            os.close(fd)
        try:
            box["value"] = work()
        except BaseException as e:  # handed to the test's thread
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def allreduce(lab: Netlab, planes, pools, tensors):
    """One all-reduce of the two members' tensors (in place), each in its namespace; -> their results."""
    members = [GroupMember(node.address, plane.address[1], 1.0, ident.peer_id_bytes)
               for node, plane, ident in zip(lab.nodes, planes, identities(2))]
    tag = wire.allreduce_tag(os.urandom(20), 0)
    runs = []
    for k in range(2):
        creds = handshake.RoundCredentials.create(identities(2)[k], wire.tag_group(tag), k)
        runs.append(in_namespace(lab.nodes[k].netns, lambda k=k, creds=creds: GroupAllReduce(
            planes[k], tensors[k], members=members, my_index=k, tag=tag, secret=b"s" * 32, credentials=creds,
            compression=get_compression("none"), chunk_numel=1024, deadline=time.monotonic() + ROUND_S,
            kept=pools[k]).run()))
    results = []
    for thread, box in runs:
        thread.join(ROUND_S + 30)
        assert not thread.is_alive(), "an all-reduce outlived its deadline"
        if "error" in box:
            raise box["error"]
        results.append(box["value"])
    return results


def test_a_kept_connection_a_middlebox_dropped_is_replaced_within_seconds():
    with Netlab([None, None]) as lab:
        planes = []
        for node in lab.nodes:  # listeners in the peers' namespaces
            thread, box = in_namespace(node.netns, lambda node=node: DataPlane(node.address))
            thread.join(10)
            assert "value" in box, box.get("error", "no data plane within 10 s")
            planes.append(box["value"])
        pools = [KeptLinks(), KeptLinks()]
        try:
            tensors = [torch.randn(20000) for _ in range(2)]
            first = allreduce(lab, planes, pools, tensors)
            assert [r.connections_kept for r in first] == [0, 0] and [len(pool) for pool in pools] == [1, 1]
            # The router forgets the kept connections: their packets are dropped both ways, without a reset.
            for node, plane in zip(lab.nodes, planes):
                for line in run(in_netns(node.netns, ["ss", "-Htn", "state", "established"])).stdout.splitlines():
                    local, remote = line.split()[-2:]
                    if remote.rsplit(":", 1)[1] == str(planes[1 - node.index].address[1]):
                        port = local.rsplit(":", 1)[1]  # our kept connection to the other member
                        for direction in ("--sport", "--dport"):
                            run(in_netns(lab.router, ["iptables", "-w", "5", "-I", "FORWARD", "-p", "tcp",
                                                      direction, port, "-j", "DROP"]))
            tensors = [torch.randn(20000) for _ in range(2)]
            mean = torch.stack(tensors).mean(0)
            started = time.monotonic()
            second = allreduce(lab, planes, pools, tensors)
            took = time.monotonic() - started
            for t in tensors:
                torch.testing.assert_close(t, mean)
            assert [r.connections_kept for r in second] == [0, 0]  # both rebinds given up, new connections made
            assert all(not r.absent and r.chunks_lost == 0 for r in second)
            assert took < REBIND_UNACKED_S + 10, f"the round took {took:.1f} s: a dead rebind held it"
        finally:
            for pool, plane in zip(pools, planes):
                pool.close()
                plane.close()
