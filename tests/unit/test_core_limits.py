"""Limits and the exactly-once window (machine.py, store.py), through ``StateMachine.apply``
with a fake clock: every refusal changes nothing, a retry is recognised however many other
writes its client sent meanwhile, replay never depends on today's limits, and a job in use
is never collected."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.core.error import (
    BadRequest,
    JobStoreFull,
    SessionFull,
    TooManyJobs,
    TooManyKeys,
    TooManySessions,
)
from rdzv_server.core.machine import DEDUP_WINDOW, Limits, StateMachine
from rdzv_server.core.store import KeyValueStore

JOB = "job"
ROOMY = Limits(
    max_jobs=100, max_keys_per_job=1000, max_job_bytes=1 << 20, max_sessions=100, max_session_writes=100,
    max_session_bytes=1 << 20,
)


def machine(limits: Limits | None = ROOMY, **kwargs: Any) -> StateMachine:
    sm = StateMachine(max_value_bytes=1 << 16, job_ttl=100.0, session_ttl=kwargs.pop("session_ttl", 60.0))
    sm.set_limits(limits)
    sm.apply(c.Create(JOB, JobSettings(1, 1, 0.0, 600.0, 60.0)), 0.0)
    return sm


def limited(**changes: int) -> Limits:
    fields = {**ROOMY.__dict__, **changes}
    return Limits(**fields)


def state(sm: StateMachine) -> Any:
    return copy.deepcopy(sm.to_snapshot())


def counter(sm: StateMachine, key: bytes = b"n") -> int:
    value = sm.kv(JOB).get(None, key)
    return int(value) if value is not None else 0


# -- exactly-once ------------------------------------------------------------------------


def test_a_retry_is_recognised_after_any_number_of_other_writes_of_its_client() -> None:
    """Many threads share one client: seq 1's answer is lost while 1,000 other writes are
    answered; the client's floor stays at 1, so its retry still gets the recorded result."""
    sm = machine(limited(max_session_writes=2000))
    first = sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", 1, 1))
    for seq in range(2, 1002):
        sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", seq, 1))
    retry = sm.apply(c.Add(JOB, b"n", 1), 2.0, ("client", 1, 1))
    assert retry.replayed and retry.result == first.result == {"value": 1}
    assert counter(sm) == 1001


def test_results_below_the_floor_are_forgotten_and_a_stale_duplicate_is_refused() -> None:
    sm = machine()
    for seq in range(1, 11):
        sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", seq, seq))  # each answered before the next
    assert list(sm.sessions["client"].results) == [10]
    before = state(sm)
    with pytest.raises(BadRequest, match="stale duplicate"):
        sm.apply(c.Add(JOB, b"n", 1), 2.0, ("client", 3, 10))  # a late copy of an answered write
    assert state(sm) == before and counter(sm) == 10


def test_a_rid_without_a_floor_keeps_the_last_dedup_window_results() -> None:
    sm = machine(limited(max_session_writes=1000))
    for seq in range(DEDUP_WINDOW + 1):
        sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", seq))
    assert len(sm.sessions["client"].results) == DEDUP_WINDOW
    assert sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", DEDUP_WINDOW)).replayed
    assert sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", 1)).replayed


def test_a_session_ends_session_ttl_after_its_last_write() -> None:
    sm = machine(session_ttl=60.0)
    sm.apply(c.Add(JOB, b"n", 1), 1.0, ("old", 1, 1))
    assert sm.apply(c.Add(JOB, b"n", 1), 60.0, ("old", 1, 1)).replayed
    sm.apply(c.Add(JOB, b"n", 1), 100.0, ("other", 1, 1))  # any write sweeps sessions past their TTL
    assert "old" not in sm.sessions and "other" in sm.sessions


def test_too_many_sessions_refuses_a_new_client_and_changes_nothing() -> None:
    sm = machine(limited(max_sessions=3), session_ttl=60.0)
    for n in range(3):
        sm.apply(c.Add(JOB, b"n", 1), 1.0, (f"c{n}", 1, 1))
    before = state(sm)
    with pytest.raises(TooManySessions, match="--max-sessions"):
        sm.apply(c.Add(JOB, b"n", 1), 2.0, ("newcomer", 1, 1))
    assert state(sm) == before
    assert sm.apply(c.Add(JOB, b"n", 1), 2.0, ("c0", 2, 2)).result == {"value": 4}  # known clients go on
    # Once the old sessions are past their TTL, the newcomer takes a free place.
    assert sm.apply(c.Add(JOB, b"n", 1), 62.0, ("newcomer", 1, 1)).result == {"value": 5}


def test_a_client_with_too_many_unanswered_writes_is_refused_until_it_reads_its_answers() -> None:
    sm = machine(limited(max_session_writes=4))
    for seq in range(1, 5):
        sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", seq, 1))  # seq 1 still unanswered
    before = state(sm)
    with pytest.raises(SessionFull, match="--max-session-writes"):
        sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", 5, 1))
    assert state(sm) == before
    # The answers arrived: the floor moves on, and so does the client.
    assert sm.apply(c.Add(JOB, b"n", 1), 1.0, ("client", 5, 5)).result == {"value": 5}


def test_results_kept_for_retries_are_bounded_in_bytes() -> None:
    sm = machine(limited(max_session_bytes=1000))
    sm.apply(c.CompareSet(JOB, b"k", b"", b"x" * 1001), 1.0, ("a", 1, 1))  # unanswered: its value is held
    assert sm.session_bytes == 1001
    before = state(sm)
    with pytest.raises(SessionFull, match="--max-session-bytes"):
        sm.apply(c.Set(JOB, b"other", b"v"), 1.0, ("b", 1, 1))
    assert state(sm) == before
    sm.apply(c.Set(JOB, b"other", b"v"), 1.0, ("a", 2, 2))  # a read its answer: the value is let go
    assert sm.session_bytes == 0


def test_replay_applies_every_logged_command_whatever_the_window_or_limits() -> None:
    """A logged command was applied once: replay never treats it as a retry nor refuses it."""
    live = machine(limits=None)
    records = [
        {"cmd": c.Set(JOB, b"a", b"1").to_record(), "now": 1.0, "rid": ["x", 1, 1]},
        {"cmd": c.Set(JOB, b"b", b"2").to_record(), "now": 1.0, "rid": ["x", 2, 2]},
        {"cmd": c.Set(JOB, b"c", b"3", round=7).to_record(), "now": 1.0, "rid": None},
    ]
    for record in records:
        live.replay(record)
    live.set_limits(limited(max_keys_per_job=2))  # today's limits are lower than when they were logged
    assert live.kv(JOB).total_keys() == 3 and live.kv(JOB).get(7, b"c") == b"3"
    with pytest.raises(TooManyKeys):
        live.apply(c.Set(JOB, b"d", b"4"), 2.0)


# -- job quotas --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "write",
    [
        c.Set(JOB, b"new", b"v"),
        c.MultiSet(JOB, (b"x", b"y"), (b"1", b"2")),
        c.Add(JOB, b"counter", 1),
        c.Append(JOB, b"log", b"line"),
        c.CompareSet(JOB, b"cas", b"", b"v"),
    ],
    ids=lambda cmd: cmd.op,
)
def test_a_write_that_adds_a_key_past_max_keys_per_job_is_refused_and_changes_nothing(write: c.Command) -> None:
    sm = machine(limited(max_keys_per_job=3))
    for key in (b"a", b"b", b"c"):
        sm.apply(c.Set(JOB, key, b"v"), 1.0)
    before = state(sm)
    with pytest.raises(TooManyKeys, match="--max-keys-per-job"):
        sm.apply(write, 2.0, ("client", 1, 1))
    assert state(sm) == before
    sm.apply(c.Set(JOB, b"a", b"overwrite"), 2.0)  # overwriting adds no key
    sm.apply(c.DeleteKey(JOB, b"b"), 2.0)
    sm.apply(c.DeleteKey(JOB, b"c"), 2.0)
    sm.apply(write, 2.0)  # deleted keys make room
    assert sm.kv(JOB).total_keys() <= 3


def test_a_write_past_max_job_bytes_is_refused_and_changes_nothing() -> None:
    sm = machine(limited(max_job_bytes=100))
    sm.apply(c.Set(JOB, b"k", b"v" * 90), 1.0)  # 91 bytes
    before = state(sm)
    with pytest.raises(JobStoreFull, match="--max-job-bytes"):
        sm.apply(c.Append(JOB, b"k", b"v" * 10), 1.0)
    with pytest.raises(JobStoreFull):
        sm.apply(c.Set(JOB, b"k2", b"v" * 8), 1.0)
    assert state(sm) == before
    sm.apply(c.Set(JOB, b"k", b"v"), 1.0)  # shrinking frees bytes
    sm.apply(c.Set(JOB, b"k2", b"v" * 8), 1.0)
    assert sm.kv(JOB).bytes == 2 + 10


def test_the_key_and_byte_counts_stay_exact_through_every_write_and_a_new_round() -> None:
    sm = machine()
    sm.apply(c.MultiSet(JOB, (b"a", b"a", b"b"), (b"1", b"22", b"333")), 1.0)
    sm.apply(c.Add(JOB, b"n", 10), 1.0)
    sm.apply(c.Append(JOB, b"b", b"4"), 1.0)
    sm.apply(c.CompareSet(JOB, b"a", b"22", b"x"), 1.0)
    sm.apply(c.Set(JOB, b"r", b"round0", round=0), 1.0)
    sm.apply(c.DeleteKey(JOB, b"n"), 1.0)
    kv = sm.kv(JOB)
    restored = KeyValueStore.from_snapshot(kv.to_snapshot(), 1 << 16)
    assert (kv.keys, kv.bytes) == (restored.keys, restored.bytes) == (3, 2 + 5 + 7)
    kv.drop_rounds_before(1)
    assert (kv.keys, kv.bytes) == (2, 2 + 5)


def test_far_future_round_key_spaces_count_toward_the_jobs_quota() -> None:
    sm = machine(limited(max_keys_per_job=3))
    for scope in (None, 7, 10**12):
        sm.apply(c.Set(JOB, b"k", b"v", round=scope), 1.0)
    with pytest.raises(TooManyKeys):
        sm.apply(c.Set(JOB, b"k", b"v", round=10**12 + 1), 1.0)


def test_too_many_jobs_refuses_a_new_job_and_changes_nothing() -> None:
    sm = machine(limited(max_jobs=2))
    sm.apply(c.Create("second", JobSettings(1, 1, 0.0, 600.0, 60.0)), 1.0)
    before = state(sm)
    with pytest.raises(TooManyJobs, match="--max-jobs"):
        sm.apply(c.Join("third", "n", "h", 1, JobSettings(1, 1, 0.0, 600.0, 60.0)), 1.0, ("agent", 1, 1))
    assert state(sm) == before
    sm.apply(c.Create("second", JobSettings(1, 1, 0.0, 600.0, 60.0)), 1.0)  # an existing job is not a new one


# -- collection ----------------------------------------------------------------------------


def test_a_store_only_job_in_use_is_never_collected() -> None:
    sm = machine()  # created at 0.0 and idle from birth (no node): job_ttl 100
    for now in range(10, 500, 10):
        assert sm.due(JOB, float(now)) == []
        if now % 20:
            sm.apply(c.Set(JOB, b"k", b"v"), float(now))  # writes are use
        else:
            sm.use(JOB, float(now))  # and so are reads
    assert sm.deadline(JOB) == 490.0 + 100.0
    assert sm.due(JOB, 590.0) == [c.Collect(JOB)]


def test_after_a_restart_every_job_gets_a_full_ttl_of_use_grace() -> None:
    sm = machine()
    recovered = StateMachine(max_value_bytes=1 << 16, job_ttl=100.0)
    recovered.restore(sm.to_snapshot())
    recovered.reset_heartbeats(500.0)
    assert recovered.due(JOB, 550.0) == []
    assert recovered.due(JOB, 600.0) == [c.Collect(JOB)]


def test_sessions_survive_a_snapshot() -> None:
    sm = machine()
    sm.apply(c.CompareSet(JOB, b"k", b"", b"value"), 1.0, ("client", 5, 3))
    restored = StateMachine(max_value_bytes=1 << 16, job_ttl=100.0, session_ttl=60.0)
    restored.restore(sm.to_snapshot())
    assert restored.session_bytes == sm.session_bytes == 5
    retry = restored.apply(c.CompareSet(JOB, b"k", b"", b"value"), 2.0, ("client", 5, 3))
    assert retry.replayed and retry.result == {"value": b"value"}
    with pytest.raises(BadRequest):
        restored.apply(c.Add(JOB, b"n", 1), 2.0, ("client", 2, 3))
