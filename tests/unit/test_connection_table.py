"""The connection rules (``rdzv_server/api/connection.py``), in memory: admission and shedding at
``--max-connections``, the buffer budget and its pre-authentication share, and the idle, read
and authentication deadlines, driven by fake connections and a clock the test moves (no socket,
no sleep)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from rdzv_client import wire
from rdzv_server.api.connection import RESCAN_PAUSE, SLOW_READ, ConnectionTable, LogThrottle, TrackedConnection

IDLE = 30.0
READ = 10.0
AUTH = 5.0


class FakeTimer:
    def __init__(self, timers: FakeTimers, when: float, callback: Callable[[], object]) -> None:
        self._when = when
        self.callback = callback
        self.cancelled = False
        timers.scheduled.append(self)

    def cancel(self) -> None:
        self.cancelled = True

    def when(self) -> float:
        return self._when


class FakeTimers:
    """A clock the test moves; scheduled calls run when it passes their time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.scheduled: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> FakeTimer:
        return FakeTimer(self, when, callback)

    def move_to(self, when: float) -> None:
        while True:
            due = [t for t in self.scheduled if not t.cancelled and t.when() <= when]
            if not due:
                break
            timer = min(due, key=FakeTimer.when)
            self.scheduled.remove(timer)
            self.now = max(self.now, timer.when())
            timer.callback()
        self.now = when


class Conn(TrackedConnection):
    """A connection as the table sees it: what it was told to do is recorded."""

    protocol = "stream"
    article = "a stream"
    must_authenticate = "hello"

    def __init__(self, table: ConnectionTable, timers: FakeTimers, *, serving: bool = False) -> None:
        self.serving = serving
        self.told: list[tuple[wire.ErrorCode | None, str]] = []
        self.track(table)

    def busy(self) -> bool:
        return self.serving

    def shed(self, code: wire.ErrorCode | None, message: str) -> None:
        self.told.append((code, message))

    @property
    def closed(self) -> bool:
        return bool(self.told)

    def start_request(self, now: float) -> None:
        self.last_active = now
        self.start_reading(now)


class Undecided:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def make_table(
    timers: FakeTimers, *, max_connections: int = 3, auth: bool = False, max_buffered: int = 1000, pre_auth: int = 100
) -> ConnectionTable:
    return ConnectionTable(
        timers=timers,
        max_connections=max_connections,
        max_buffered_bytes=max_buffered,
        idle_timeout=IDLE,
        read_timeout=READ,
        max_pre_auth_bytes=pre_auth,
        max_head_bytes=16384,
        auth_timeout=AUTH if auth else None,
    )


@pytest.fixture
def timers() -> FakeTimers:
    return FakeTimers()


# -- admission at --max-connections ---------------------------------------------------------


def test_a_newcomer_at_the_limit_sheds_the_oldest_connection_that_never_spoke(timers: FakeTimers) -> None:
    table = make_table(timers, max_connections=2)
    first, second, third = Undecided(), Undecided(), Undecided()
    assert table.admit(first, timers.now) and table.admit(second, timers.now)
    assert table.admit(third, timers.now)
    assert first.closed and not second.closed and not third.closed
    assert table.count == 2 and table.shed_total["connection_limit"] == 1


def test_then_the_least_recently_active_idle_connection_is_closed_silently(timers: FakeTimers) -> None:
    table = make_table(timers, max_connections=2)
    older = Conn(table, timers)
    timers.move_to(timers.now + 1)
    newer = Conn(table, timers)
    assert table.admit(Undecided(), timers.now)
    assert older.told == [(None, "")] and not newer.closed
    assert older not in table.open and table.count == 2


def test_then_a_slow_request_is_shed_with_too_many_connections(timers: FakeTimers) -> None:
    table = make_table(timers, max_connections=2)
    watching = Conn(table, timers, serving=True)
    slow = Conn(table, timers)
    slow.start_request(timers.now)
    timers.move_to(timers.now + SLOW_READ / 2)
    assert not table.admit(Undecided(), timers.now)  # not slow yet, and a watch is never shed
    timers.move_to(timers.now + RESCAN_PAUSE + SLOW_READ)
    assert table.admit(Undecided(), timers.now)
    assert [code for code, _ in slow.told] == [wire.ErrorCode.TOO_MANY_CONNECTIONS]
    assert not watching.closed


def test_with_nothing_to_shed_newcomers_are_refused_without_a_rescan_for_a_while(timers: FakeTimers) -> None:
    table = make_table(timers, max_connections=1)
    busy = Conn(table, timers, serving=True)
    assert not table.admit(Undecided(), timers.now)
    busy.serving = False  # idle now, but the table looks again only after RESCAN_PAUSE
    assert not table.admit(Undecided(), timers.now + RESCAN_PAUSE / 2)
    assert table.admit(Undecided(), timers.now + RESCAN_PAUSE)
    assert busy.told == [(None, "")]
    assert table.rejected_total[wire.ErrorCode.TOO_MANY_CONNECTIONS.value] == 2


# -- deadlines --------------------------------------------------------------------------------


def test_an_idle_connection_is_closed_silently_after_the_idle_timeout(timers: FakeTimers) -> None:
    table = make_table(timers)
    conn = Conn(table, timers)
    start = timers.now
    timers.move_to(start + IDLE - 0.001)
    assert not conn.closed
    timers.move_to(start + IDLE)
    assert conn.told == [(None, "")] and conn not in table.open
    assert table.shed_total["idle_timeout"] == 1


def test_activity_moves_the_idle_deadline(timers: FakeTimers) -> None:
    table = make_table(timers)
    conn = Conn(table, timers)
    timers.move_to(timers.now + IDLE / 2)
    conn.last_active = timers.now  # a request was served
    timers.move_to(timers.now + IDLE / 2 + 1)
    assert not conn.closed
    timers.move_to(conn.last_active + IDLE)
    assert conn.closed


def test_a_request_not_whole_within_the_read_timeout_is_answered_request_timeout(timers: FakeTimers) -> None:
    table = make_table(timers)
    conn = Conn(table, timers)
    conn.start_request(timers.now + 1)
    timers.move_to(timers.now + 1 + READ - 0.001)
    assert not conn.closed
    timers.move_to(timers.now + 0.001)
    assert [code for code, _ in conn.told] == [wire.ErrorCode.REQUEST_TIMEOUT]
    assert table.shed_total["read_timeout"] == 1


def test_a_connection_serving_a_request_is_never_idle(timers: FakeTimers) -> None:
    table = make_table(timers)
    conn = Conn(table, timers, serving=True)
    timers.move_to(timers.now + 10 * IDLE)
    assert not conn.closed


def test_a_stranger_must_authenticate_within_the_auth_timeout(timers: FakeTimers) -> None:
    table = make_table(timers, auth=True)
    stranger = Conn(table, timers)
    holder = Conn(table, timers)
    table.trust(holder)
    timers.move_to(timers.now + AUTH)
    assert [code for code, _ in stranger.told] == [wire.ErrorCode.REQUEST_TIMEOUT]
    assert "--auth-timeout" in stranger.told[0][1]
    assert table.shed_total["auth_timeout"] == 1 and not holder.closed


def test_check_deadlines_decides_at_the_time_it_is_given(timers: FakeTimers) -> None:
    table = make_table(timers)
    conn = Conn(table, timers)
    conn.check_deadlines(timers.now + IDLE / 2)
    assert not conn.closed
    conn.check_deadlines(timers.now + IDLE)
    assert conn.closed


# -- buffered bytes -------------------------------------------------------------------------


def test_bytes_past_the_budget_shed_a_larger_holder(timers: FakeTimers) -> None:
    table = make_table(timers, max_buffered=1000)
    big, small = Conn(table, timers), Conn(table, timers)
    assert table.charge(big, 900)
    assert table.charge(small, 200)
    assert [code for code, _ in big.told] == [wire.ErrorCode.BUFFERS_FULL]
    assert table.buffered == 200 and not small.closed


def test_bytes_past_the_budget_with_no_larger_holder_refuse_the_receiver(timers: FakeTimers) -> None:
    table = make_table(timers, max_buffered=1000)
    holder, greedy = Conn(table, timers), Conn(table, timers)
    assert table.charge(holder, 500)
    assert not table.charge(greedy, 600)
    assert [code for code, _ in greedy.told] == [wire.ErrorCode.BUFFERS_FULL]
    assert table.buffered == 500 and greedy not in table.open


def test_released_bytes_make_room_again(timers: FakeTimers) -> None:
    table = make_table(timers, max_buffered=1000)
    conn = Conn(table, timers)
    assert table.charge(conn, 1000)
    table.release(conn, 1000)
    assert table.charge(conn, 1000) and not conn.closed


def test_strangers_hold_no_more_than_their_share_and_a_token_holder_is_not_charged_to_it(
    timers: FakeTimers,
) -> None:
    table = make_table(timers, auth=True, max_buffered=1000, pre_auth=100)
    stranger, other, holder = Conn(table, timers), Conn(table, timers), Conn(table, timers)
    table.trust(holder)
    assert table.charge(stranger, 40)
    assert not table.charge(other, 70)  # past the share, and no stranger holds more than 70
    assert [code for code, _ in other.told] == [wire.ErrorCode.BUFFERS_FULL]
    assert table.pre_auth_buffered == 40
    assert table.charge(holder, 500) and table.pre_auth_buffered == 40
    table.trust(stranger)  # it showed its token: its bytes leave the share
    assert table.pre_auth_buffered == 0 and table.buffered == 540


def test_a_stranger_holding_more_is_shed_for_a_smaller_newcomer(timers: FakeTimers) -> None:
    table = make_table(timers, auth=True, max_buffered=1000, pre_auth=100)
    hoarder, newcomer = Conn(table, timers), Conn(table, timers)
    assert table.charge(hoarder, 90)
    assert table.charge(newcomer, 20)
    assert [code for code, _ in hoarder.told] == [wire.ErrorCode.BUFFERS_FULL]
    assert table.pre_auth_buffered == 20 and not newcomer.closed


def test_unregistering_a_connection_releases_what_it_held(timers: FakeTimers) -> None:
    table = make_table(timers)
    conn = Conn(table, timers)
    assert table.charge(conn, 300)
    table.unregister(conn)
    assert table.buffered == 0 and table.by_protocol["stream"] == 0


# -- the log throttle -----------------------------------------------------------------------


def test_a_flood_of_warnings_is_a_burst_then_one_summary(timers: FakeTimers, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test_connection_table")
    throttle = LogThrottle(logger, timers, interval=10.0, burst=2)
    with caplog.at_level(logging.WARNING, logger="test_connection_table"):
        for n in range(5):
            throttle.warning("refused %d", n)
        assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1"]
        timers.move_to(timers.now + 10.0)
    assert "3 more like it" in caplog.records[-1].getMessage()
