"""A peer's group-key entry is withdrawn beside the round, not before it (`MatchmakingAdapter`): hivemind awaits that
DHT store between assembling a group and returning it, 2 round trips of every round's matchmaking. Driven through
hivemind's own `PotentialLeaders` with a fake key manager whose stores take as long as the test says."""

from __future__ import annotations

import asyncio
import os
import types

from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from moshpeer.averaging.matchmaking_adapter import MatchmakingAdapter


class SlowKeyManager:
    """hivemind's GroupKeyManager as PotentialLeaders uses it; a store takes until the test releases it."""

    current_key = "run_averaging.0b"

    def __init__(self):
        self.stores, self.released = [], asyncio.Event()
        self.declared = asyncio.Event()

    async def declare_averager(self, group_key, peer_id, expiration_time: float, looking_for_group: bool = True):
        self.stores.append((group_key, looking_for_group))
        if looking_for_group:
            self.declared.set()
            return True
        await self.released.wait()
        self.stores.append(("stored", looking_for_group))
        return True

    async def get_averagers(self, group_key, only_active: bool):
        return []

    async def update_key_on_not_enough_peers(self):
        pass


def adapter_for(key_manager) -> MatchmakingAdapter:
    adapter = MatchmakingAdapter.__new__(MatchmakingAdapter)
    adapter._withdrawals = set()
    adapter._withdraw_in_background(key_manager)
    return adapter


def test_a_search_ends_without_waiting_for_its_withdrawal_which_still_lands():
    async def run():
        key_manager = SlowKeyManager()
        adapter = adapter_for(key_manager)
        leaders = PotentialLeaders(PeerID(os.urandom(32)), min_matchmaking_time=5.0, target_group_size=4)
        step = types.SimpleNamespace(scheduled_time=get_dht_time() + 5.0, deadline=get_dht_time() + 5.0)
        async with leaders.begin_search(step, key_manager):
            await asyncio.wait_for(key_manager.declared.wait(), 5.0)
        # hivemind's search is over (its finally withdrew the entry) while the withdrawal's store is still pending.
        assert key_manager.stores == [("run_averaging.0b", True), ("run_averaging.0b", False)]
        assert len(adapter._withdrawals) == 1
        key_manager.released.set()
        await asyncio.wait_for(asyncio.gather(*adapter._withdrawals), 5.0)
        assert key_manager.stores[-1] == ("stored", False) and not adapter._withdrawals
    asyncio.run(run())


def test_a_declaration_is_still_awaited():
    async def run():
        key_manager = SlowKeyManager()
        adapter_for(key_manager)
        assert await key_manager.declare_averager("k", None, get_dht_time() + 1.0) is True
        assert key_manager.declared.is_set()
    asyncio.run(run())


def test_a_failed_withdrawal_is_forgotten(caplog):
    async def run():
        key_manager = SlowKeyManager()

        async def fails(*args):
            raise ConnectionError("DHT down")
        key_manager.declare_averager = fails
        adapter = adapter_for(key_manager)
        await key_manager.declare_averager("k", None, 1.0, looking_for_group=False)
        await asyncio.gather(*adapter._withdrawals, return_exceptions=True)  # its done callback ran before gather's
        return adapter
    caplog.set_level("DEBUG", logger="moshpeer.averaging.matchmaking_adapter")
    assert not asyncio.run(run())._withdrawals
    assert "DHT down" in caplog.text
