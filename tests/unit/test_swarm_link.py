"""`SwarmLink` with a fake progress reader: flagged peers, waiting for trainers, the swarm moving on, closing."""

from __future__ import annotations

from dataclasses import replace
from typing import List

import pytest

from moshpeer.dht.records import MAX_FLAGGED_PEERS
from moshpeer.errors import SwarmLost
from moshpeer.peer.optimizer.swarm_link import SwarmLink
from peer_fakes import swarm_view


class ScriptedProgress:
    """Returns the scripted views one per `refresh_now`, then the last one forever."""

    def __init__(self, views):
        self.views, self.refreshes, self.waits, self.stopped = list(views), 0, 0, False

    def refresh_now(self, timeout: float = 2.0, **kwargs):
        self.refreshes += 1
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]

    def wait_for_refresh(self, timeout: float) -> bool:
        self.waits += 1
        return True

    def shutdown(self) -> None:
        self.stopped = True


def link(views, **kwargs) -> SwarmLink:
    published: List[dict] = []
    result = SwarmLink(dht=None, progress=ScriptedProgress(views), publish=lambda **f: published.append(f), **kwargs)
    result.published = published
    return result


def test_flagged_peers_are_published_on_change_most_flagged_first():
    swarm = link([swarm_view()])
    flagged = {f"peer-{i}": i for i in range(MAX_FLAGGED_PEERS + 3)}
    swarm.publish_flagged(flagged)
    swarm.publish_flagged(dict(flagged))  # unchanged: no second publication
    assert len(swarm.published) == 1
    sent = swarm.published[0]["flagged"]
    assert len(sent) == MAX_FLAGGED_PEERS and min(sent.values()) == 3


def test_wait_for_trainers_returns_once_enough_are_visible():
    swarm = link([swarm_view(trainers=1), swarm_view(trainers=1), swarm_view(trainers=3)])
    assert swarm.wait_for_trainers(3, timeout=30.0, should_stop=lambda: False) == 3
    assert swarm.progress.refreshes == 3
    alone = link([swarm_view(trainers=1)])
    assert alone.wait_for_trainers(2, timeout=30.0, should_stop=lambda: True) == 1  # a stop ends the wait


def test_wait_for_trainers_counts_only_trainers_past_their_startup():
    """A peer's record is published when its DHT starts, seconds before it can train on a loaded machine: a
    partner that counts it trains its first epoch alone and finds no group (what test_demo's CI failure looks
    like). Records now say when a trainer is past its startup (`training`), and only those count."""
    starting = replace(swarm_view(trainers=2), started_trainers=1)
    swarm = link([starting, starting, replace(swarm_view(trainers=2), started_trainers=2)])
    assert swarm.wait_for_trainers(2, timeout=30.0, should_stop=lambda: False) == 2
    assert swarm.progress.refreshes == 3


def test_moved_past_sees_a_later_epoch_within_its_grace():
    assert link([swarm_view(epoch=4)]).moved_past(3, 0.0, lambda: False) is True
    assert link([swarm_view(epoch=3)]).moved_past(3, 0.0, lambda: False) is False
    assert link([swarm_view(epoch=3), swarm_view(epoch=4)]).moved_past(3, 30.0, lambda: False) is True
    assert link([swarm_view(epoch=9)]).moved_past(3, 30.0, lambda: True) is False  # stopping: no verdict


class Failing:
    def __init__(self):
        self.calls = 0

    def withdraw(self, timeout=None):
        self.calls += 1
        raise RuntimeError("DHT gone")

    def stop(self):
        self.calls += 1


def test_close_runs_every_step_even_when_one_fails_and_only_once():
    publisher, own_dht = Failing(), Failing()
    swarm = link([swarm_view()], own_dht=own_dht, publisher=publisher)
    swarm.close()
    assert swarm.progress.stopped and publisher.calls == 1 and own_dht.calls == 1
    swarm.close()
    assert own_dht.calls == 1  # the DHT is stopped once


class ProcessAlive:
    def __init__(self, alive: bool):
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_a_link_without_a_daemon_says_when_its_dht_process_is_gone():
    own = SwarmLink(dht=ProcessAlive(True), progress=None, publish=print, publisher=object())
    own.check_alive()
    own.dht.alive = False
    with pytest.raises(SwarmLost):
        own.check_alive()
    # With a daemon (no publisher of its own), the daemon's heartbeat stops the peer instead.
    SwarmLink(dht=ProcessAlive(False), progress=None, publish=print).check_alive()
