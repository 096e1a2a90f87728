"""A job's timeline (core/event.py) as the apply path writes it: each event with its cause,
the round's formation time and reason, the same events after replay and after a snapshot,
and the pending reason an operator reads while a round is open."""

from __future__ import annotations

from typing import Any

from rdzv_client.record import JobSettings
from rdzv_server.api.document import event_entry, pending_reason
from rdzv_server.core import command as c
from rdzv_server.core.event import Cause, Kind, Timeline
from rdzv_server.core.machine import StateMachine

JOB = "job"


class Log:
    """A machine plus the records it applied, to replay them into a fresh one."""

    def __init__(self) -> None:
        self.sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        self.records: list[dict[str, Any]] = []

    def apply(self, command: c.Command, now: float) -> None:
        self.sm.apply(command, now)
        self.records.append({"cmd": command.to_record(), "now": now, "rid": None})

    def join(self, node: str, now: float, *, min_nodes: int = 2, max_nodes: int = 3, last_call: float = 5.0) -> None:
        self.apply(c.Join(JOB, node, f"{node}.host", 2, JobSettings(min_nodes, max_nodes, last_call, 600.0, 30.0)), now)

    def events(self) -> list[tuple[str, str, str | None]]:
        return [(e.kind.value, e.cause.value, e.node_id) for e in self.sm.job(JOB).timeline.since(0)]


def test_a_round_records_its_joins_then_its_formation_with_reason_and_duration() -> None:
    log = Log()
    log.join("a", 10.0)
    log.join("b", 11.0)
    assert pending_reason(log.sm.job(JOB).pending(12.0)) == "last call ends in 4.0 s (2 of up to 3 joined)"
    log.join("c", 12.5)  # max_nodes: forms at once
    assert log.events() == [
        ("job_created", "join", None),
        ("node_joined", "candidate", "a"),
        ("node_joined", "candidate", "b"),
        ("node_joined", "candidate", "c"),
        ("round_formed", "max_nodes", None),
    ]
    formed = log.sm.job(JOB).timeline.since(4)[0]
    assert event_entry(formed) == {
        "seq": 5, "time": 12.5, "kind": "round_formed", "cause": "max_nodes", "round": 0, "node_id": None,
        "addr": None, "num_nodes": 3, "world_size": 6, "formation_s": 2.5, "standby": 0,
    }
    assert pending_reason(log.sm.job(JOB).pending(13.0)) is None


def test_a_round_formed_at_its_last_call_says_so() -> None:
    log = Log()
    log.join("a", 0.0)
    assert pending_reason(log.sm.job(JOB).pending(0.0)) == "waiting for min_nodes: 1 of 2 joined"
    log.join("b", 1.0)
    log.apply(c.LastCall(JOB, 0), 6.0)
    assert log.events()[-1] == ("round_formed", "last_call", None)
    assert log.sm.job(JOB).timeline.since(0)[-1].detail["formation_s"] == 6.0


def test_deaths_say_how_they_were_noticed_and_the_next_round_why_it_formed() -> None:
    log = Log()
    for node in "abc":
        log.join(node, 0.0)
    log.apply(c.Expire(JOB, ("a",), "dead", Cause.CONNECTION_CLOSED.value), 5.0)  # its watch dropped
    log.apply(c.Expire(JOB, ("b",), "dead"), 40.0)  # the timer: its heartbeat TTL passed
    assert log.events()[-2:] == [
        ("node_departed", "connection_closed", "a"),
        ("node_departed", "heartbeat_expired", "b"),
    ]
    log.join("c", 41.0)  # the survivor restarts its workers and re-joins
    log.join("d", 41.5)  # a replacement
    assert pending_reason(log.sm.job(JOB).pending(42.0)).startswith("last call ends in 4.5 s")
    log.apply(c.LastCall(JOB, 1), 46.5)
    assert log.events()[-3:] == [
        ("node_joined", "rejoined", "c"),
        ("node_joined", "candidate", "d"),
        ("round_formed", "last_call", None),
    ]
    formed = log.sm.job(JOB).timeline.since(0)[-1]
    assert (formed.round, formed.detail["formation_s"]) == (1, 5.5)  # from the re-join that opened it


def test_a_member_the_next_round_formed_without_departs_on_the_timeline_though_its_death_went_unnoticed() -> None:
    """A host that vanishes without closing its connection is noticed only at its heartbeat
    TTL; the survivors may re-form before that. The member must not vanish from the job with
    no word on the timeline (found by the torchrun e2e over replicas)."""
    log = Log()
    for node in "abc":
        log.join(node, 0.0)
    log.join("b", 10.1)  # the survivors' workers failed: they re-join
    log.join("a", 10.2)
    log.apply(c.LastCall(JOB, 1), 15.2)  # c's TTL (30 s) has not passed
    assert log.events()[-3:] == [
        ("node_joined", "rejoined", "a"),
        ("node_departed", "not_rejoined", "c"),
        ("round_formed", "last_call", None),
    ]
    departed = log.sm.job(JOB).timeline.since(0)[-2]
    assert (departed.round, departed.addr, departed.detail) == (1, "c.host", {"role": "member"})
    # A member whose death was noticed already has its event: no second one.
    log.apply(c.Expire(JOB, ("a",), "dead", Cause.CONNECTION_CLOSED.value), 20.0)
    log.join("b", 21.0)
    log.apply(c.LastCall(JOB, 2), 26.0)
    assert [e for e in log.events() if e[0] == "node_departed"] == [
        ("node_departed", "not_rejoined", "c"),
        ("node_departed", "connection_closed", "a"),
    ]


def test_a_spare_is_recorded_and_its_promotion_too() -> None:
    log = Log()
    for node in "abc":
        log.join(node, 0.0, min_nodes=1, max_nodes=3)
    log.join("spare", 1.0, min_nodes=1, max_nodes=3)
    assert log.events()[-1] == ("node_joined", "standby", "spare")
    log.apply(c.Expire(JOB, ("a",), "dead"), 50.0)
    for node in "bc":
        log.join(node, 51.0, min_nodes=1, max_nodes=3)
    kinds = log.events()[-3:]
    assert ("standby_promoted", "members_back", "spare") in kinds and kinds[-1][0] == "round_formed"


def test_a_graceful_leave_a_join_timeout_and_a_close_each_have_their_cause() -> None:
    log = Log()
    log.join("a", 0.0)
    log.apply(c.Expire(JOB, ("a",), "join_timeout"), 600.0)
    log.join("b", 601.0, min_nodes=1)
    log.apply(c.LastCall(JOB, log.sm.job(JOB).round), 700.0)
    log.apply(c.Leave(JOB, "b"), 701.0)
    log.apply(c.Close(JOB), 702.0)
    assert [e for e in log.events() if e[0] in ("node_departed", "job_closed")] == [
        ("node_departed", "join_timeout", "a"),
        ("node_departed", "left", "b"),
        ("job_closed", "closed", None),
    ]


def test_replay_and_snapshots_make_the_same_timeline() -> None:
    log = Log()
    for node in "abc":
        log.join(node, float(ord(node)))
    log.apply(c.Expire(JOB, ("a",), "dead", Cause.CONNECTION_CLOSED.value), 200.0)
    replayed = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    for record in log.records:
        replayed.replay(record)
    restored = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    restored.restore(log.sm.to_snapshot())
    want = [event_entry(e) for e in log.sm.job(JOB).timeline.since(0)]
    assert [event_entry(e) for e in replayed.job(JOB).timeline.since(0)] == want
    assert [event_entry(e) for e in restored.job(JOB).timeline.since(0)] == want
    log.join("b", 201.0)
    restored.apply(c.Join(JOB, "b", "b.host", 2, JobSettings(2, 3, 5.0, 600.0, 30.0)), 201.0)
    assert restored.job(JOB).timeline.since(len(want))[0].seq == len(want) + 1  # numbering goes on


def test_the_timeline_keeps_its_capacity_and_says_what_a_reader_missed() -> None:
    timeline = Timeline(capacity=3)
    for n in range(5):
        timeline.add(float(n), Kind.NODE_JOINED, Cause.CANDIDATE, 0, f"n{n}")
    assert len(timeline) == 3 and timeline.first_seq == 3 and timeline.next_seq == 6
    assert [e.seq for e in timeline.since(0)] == [3, 4, 5]
    assert [e.seq for e in timeline.since(4)] == [5]
    assert timeline.since(5) == [] and [e.seq for e in timeline.since(3, limit=1)] == [4]


def test_who_closed_a_job_a_refused_join_and_a_restart_are_on_the_timeline() -> None:
    log = Log()
    log.join("a", 0.0)
    log.apply(c.Refused(JOB, "b", "b.host", "settings_conflict", "asks for max_nodes=8"), 1.0)
    log.apply(c.Restarted(""), 2.0)  # the server recovered its log: every job hears of it
    log.apply(c.Close(JOB, cause="operator"), 3.0)
    assert log.events()[-3:] == [
        ("join_refused", "settings_conflict", "b"),
        ("server_restarted", "recovery", None),
        ("job_closed", "operator", None),
    ]
    assert log.sm.job(JOB).timeline.since(0)[-3].detail == {"reason": "asks for max_nodes=8"}
    assert "b" not in log.sm.job(JOB).nodes  # a refusal changes nothing else


def test_a_refusal_already_on_the_timeline_since_its_last_other_event_is_not_news() -> None:
    run = Log()
    run.join("a", 0.0)
    odd = c.Refused(JOB, "odd", "odd.host", Cause.SETTINGS_CONFLICT.value, "max_nodes=8 differs")
    assert not run.sm.already_refused(odd)
    run.apply(odd, 1.0)
    assert run.sm.already_refused(odd)
    other = c.Refused(JOB, "other", "other.host", Cause.SETTINGS_CONFLICT.value, "max_nodes=9 differs")
    assert not run.sm.already_refused(other)
    run.apply(other, 2.0)
    assert run.sm.already_refused(odd) and run.sm.already_refused(other)  # refusals in a row: each known
    assert not run.sm.already_refused(c.Refused(JOB, "odd", "odd.host", Cause.SETTINGS_CONFLICT.value, "new reason"))
    run.join("b", 3.0)  # something else happened since: a refusal is news again
    assert not run.sm.already_refused(odd)
    assert not run.sm.already_refused(c.Refused("no-such-job", "odd", "odd.host", "settings_conflict", ""))


def test_a_tick_moves_only_the_clock_and_replays_the_same() -> None:
    run = Log()
    run.join("a", 0.0)
    before = run.sm.to_snapshot()
    run.apply(c.Tick(""), 7.5)
    after = run.sm.to_snapshot()
    assert after["clock"] == 7.5 and {**after, "clock": before["clock"]} == before
    replica = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    for record in run.records:
        replica.replay(record)
    assert replica.to_snapshot() == after
