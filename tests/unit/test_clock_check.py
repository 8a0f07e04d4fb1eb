"""The clock check after a round without a group (moshpeer/dht/clock.py): the verdict from ping samples, and when
`ClockWatch` measures, on a fake clock and with the measurement run in place."""

from __future__ import annotations

import logging

from moshpeer.dht.clock import ALLOWED_OFFSET_S, ClockWatch, clock_offset, describe_offset


def test_the_verdict_is_the_median_peer_and_only_past_the_allowed_offset():
    assert clock_offset([]) is None  # nobody answered: no verdict
    assert clock_offset([ALLOWED_OFFSET_S - 0.1, -1.0, 0.2]) is None
    # Peers' clocks ahead of ours by ~10 s (one liar far off cannot move the median): ours is 10 s behind.
    assert clock_offset([10.2, 9.9, -500.0]) == -9.9
    assert clock_offset([-12.0, -11.0, -13.0]) == 12.0
    assert describe_offset(-9.9).startswith("this machine's clock is 9.9 s behind its peers' (they must agree within 3 s)")
    assert "12.0 s ahead of" in describe_offset(12.0)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_watch_measures_at_most_once_per_interval_and_says_what_it_found(caplog):
    samples, calls, now = [[10.5, 10.4, 10.6]], [], FakeClock()

    def measure():
        calls.append(now.t)
        return samples[0]

    watch = ClockWatch(measure, interval_s=60.0, now=now, start=lambda work: work())
    with caplog.at_level(logging.INFO, logger="moshpeer.dht.clock"):
        assert "10.5 s behind its peers'" in watch.after_no_group()
        now.t = 30.0
        assert "10.5 s behind" in watch.after_no_group() and calls == [0.0]  # not measured again within the interval
        samples[0] = [0.1, -0.2, 0.0]  # set right
        now.t = 61.0
        assert watch.after_no_group() is None and calls == [0.0, 61.0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "10.5 s behind" in warnings[0]  # once per change, not once per round
    assert any("agrees with its peers' again" in r.getMessage() for r in caplog.records)


def test_a_slow_measurement_never_blocks_a_round_nor_runs_twice():
    pending, now = [], FakeClock()
    watch = ClockWatch(lambda: [20.0], interval_s=60.0, now=now, start=pending.append)
    assert watch.after_no_group() is None  # the measurement has not finished: no verdict yet, no waiting for it
    now.t = 120.0
    assert watch.after_no_group() is None and len(pending) == 1  # still running: not a second one
    pending[0]()
    assert "20.0 s behind" in watch.after_no_group()


def test_a_failed_measurement_keeps_the_verdict_and_lets_the_next_one_run():
    results, now = [[15.0]], FakeClock()

    def measure():
        if isinstance(results[0], Exception):
            raise results[0]
        return results[0]

    watch = ClockWatch(measure, interval_s=1.0, now=now, start=lambda work: work())
    assert "15.0 s behind" in watch.after_no_group()
    results[0], now.t = RuntimeError("DHT stopping"), 5.0
    assert "15.0 s behind" in watch.after_no_group()
    results[0], now.t = [0.0], 10.0
    assert watch.after_no_group() is None
