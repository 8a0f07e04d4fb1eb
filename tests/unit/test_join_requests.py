"""How a leader answers join requests (`MatchmakingAdapter.join_group`), with hivemind's handler faked: an
acceptance the asker can no longer be waiting for is withdrawn, so that leader and asker agree on the group."""

from __future__ import annotations

import asyncio
import os
import time
import types

import msgpack
import pytest
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from moshpeer.averaging import matchmaking_adapter
from moshpeer.averaging.matchmaking_adapter import MatchmakingAdapter
from moshpeer.averaging.member_info import NONCE_BYTES, pack_member_info, parse_member_info
from moshpeer.errors import ProtocolError


def adapter_and_request(asker_wait: float = 0.0, request_timeout: float = 2.0):
    """A leader (our request timeout `request_timeout`) whose hivemind, faked, accepts every request and begins the
    group, and a join request from an asker whose member info says it waits `asker_wait` for a first answer (0: not
    said)."""
    async def hivemind_accepts(request, context):
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE)

    adapter = MatchmakingAdapter.__new__(MatchmakingAdapter)
    adapter._admission = types.SimpleNamespace(private=False)
    adapter._schema_refusals = {}
    adapter._mm = types.SimpleNamespace(request_timeout=request_timeout, target_group_size=4,
                                        rpc_join_group=hivemind_accepts)
    request = averaging_pb2.JoinRequest(gather=pack_member_info("127.0.0.1", 4000, 1.0, os.urandom(NONCE_BYTES),
                                                                answer_wait_s=asker_wait))
    return adapter, request, types.SimpleNamespace(remote_id=PeerID(os.urandom(32)))


def join_answers(asker_wait: float, waited_s: float) -> list:
    """The codes the leader answers that request with, `waited_s` after it arrived, read as an asker does: up to a
    final answer, then the asker closes the stream."""
    adapter, request, context = adapter_and_request(asker_wait)

    async def answers():
        codes, stream = [], adapter.join_group(request, context, time.monotonic() - waited_s)
        async for message in stream:
            codes.append(message.code)
            if message.code != averaging_pb2.ACCEPTED:
                break
        await stream.aclose()
        return codes
    return asyncio.run(answers())


def test_a_leader_withdraws_an_acceptance_the_asker_no_longer_waits_for():
    accepted = [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    withdrawn = [averaging_pb2.NOT_LOOKING_FOR_GROUP]
    assert join_answers(asker_wait=0.0, waited_s=0.3) == accepted  # within half our own request timeout
    assert join_answers(asker_wait=0.0, waited_s=1.2) == withdrawn
    # An asker with a shorter window (so a shorter request timeout) says so: its wait is the one that counts.
    assert join_answers(asker_wait=0.4, waited_s=0.3) == withdrawn
    assert join_answers(asker_wait=0.4, waited_s=0.1) == accepted
    # A longer one does not stretch ours.
    assert join_answers(asker_wait=5.0, waited_s=1.2) == withdrawn


def test_member_info_says_how_long_the_member_waits_for_an_answer():
    packed = pack_member_info("127.0.0.1", 4000, 1.0, b"n" * 16, answer_wait_s=1.5)
    assert parse_member_info(packed).answer_wait_s == 1.5
    assert parse_member_info(pack_member_info("127.0.0.1", 4000, 1.0, b"n" * 16)).answer_wait_s == 0.0
    for bad in (-1.0, float("nan"), float("inf"), "1"):
        info = msgpack.unpackb(packed)
        info["wait"] = bad
        with pytest.raises(ProtocolError, match="answer wait"):
            parse_member_info(msgpack.packb(info))


def test_a_leader_holds_the_stream_open_after_its_last_answer_until_the_asker_closes_it(monkeypatch):
    """Closing our end right after the last answer lets the p2p daemon reset the stream before the asker has read
    it (`join_group`): the handler ends when the asker closes the stream, or after ANSWERED_STREAM_HOLD_S."""
    adapter, request, context = adapter_and_request()

    async def answers_then_whether_it_ended(hold_s: float):
        monkeypatch.setattr(matchmaking_adapter, "ANSWERED_STREAM_HOLD_S", hold_s)
        stream = adapter.join_group(request, context, time.monotonic())
        codes = [(await stream.__anext__()).code for _ in range(2)]
        end = asyncio.ensure_future(stream.__anext__())
        # Held: still open 0.2 s later (the hold is 60 s). Not held: it ends at once (5 s is only the test's bound).
        await asyncio.wait({end}, timeout=0.2 if hold_s > 0 else 5.0)
        ended = end.done() and isinstance(end.exception(), StopAsyncIteration)
        if not end.done():
            end.cancel()  # the asker closed the stream: the p2p layer cancels our handler
            await asyncio.gather(end, return_exceptions=True)
        return codes, ended

    answers = [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    assert asyncio.run(answers_then_whether_it_ended(60.0)) == (answers, False)  # held until the asker closes it
    assert asyncio.run(answers_then_whether_it_ended(0.0)) == (answers, True)  # or the hold runs out


def test_a_leader_names_an_asker_refused_for_another_schema_round_after_round(caplog):
    """hivemind refuses an asker whose tensors, codec or chunk size differ (BAD_SCHEMA_HASH): the two never group,
    and the leader says so once that asker was refused SCHEMA_REFUSALS_TO_NAME times in a row. A peer only a phase
    apart (its parameters in another round: gradients mode's --params-every, a return from an outage) is refused a
    round or two and then accepted: it is not named."""
    answer = {"code": averaging_pb2.BAD_SCHEMA_HASH}

    async def hivemind_answers(request, context):
        yield averaging_pb2.MessageFromLeader(code=answer["code"])

    adapter, request, context = adapter_and_request()
    adapter._mm.rpc_join_group = hivemind_answers
    other = types.SimpleNamespace(remote_id=PeerID(os.urandom(32)))

    async def ask(asker) -> list:
        return [message.code async for message in adapter._answers(request, asker, time.monotonic())]

    refusals = matchmaking_adapter.SCHEMA_REFUSALS_TO_NAME
    with caplog.at_level("WARNING", logger="moshpeer.averaging.matchmaking_adapter"):
        for _ in range(refusals - 1):
            assert asyncio.run(ask(other)) == [averaging_pb2.BAD_SCHEMA_HASH]
        answer["code"] = averaging_pb2.ACCEPTED
        asyncio.run(ask(other))  # a phase apart: grouped at last
        answer["code"] = averaging_pb2.BAD_SCHEMA_HASH
        for _ in range(2 * refusals):
            asyncio.run(ask(context))
        for _ in range(refusals - 1):
            asyncio.run(ask(other))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(context.remote_id) in warnings[0], warnings
    assert "never average together" in warnings[0] and f"{refusals} of its requests refused in a row" in warnings[0]
