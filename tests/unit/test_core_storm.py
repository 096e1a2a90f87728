"""The crash-loop rule and progress (rendezvous rule 8, core/progress.py), with a fake clock:
the time is the ``now`` each command is applied at."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_client.record import JobSettings, WireError
from rdzv_server.api.document import job_document
from rdzv_server.core import command as c
from rdzv_server.core.error import JobClosed, SettingsConflict
from rdzv_server.core.machine import StateMachine
from rdzv_server.core.progress import MAX_ROUNDS_KEPT, RoundLog

JOB = "job"
STORM = {"min_round_seconds": 10.0, "max_fast_failures": 3}


class Log:
    """A machine plus the records it applied, to replay them into a fresh one."""

    def __init__(self, **settings: Any) -> None:
        self.sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        self.records: list[dict[str, Any]] = []
        self.settings = JobSettings(**{"min_nodes": 2, "max_nodes": 2, "last_call_timeout": 5.0, **settings})
        for node in ("a", "b"):
            self.join(node, 0.0)

    def apply(self, command: c.Command, now: float) -> None:
        self.sm.apply(command, now)
        self.records.append({"cmd": command.to_record(), "now": now, "rid": None})

    def join(self, node: str, now: float, step: int | None = None) -> None:
        self.apply(c.Join(JOB, node, f"{node}.host", 1, self.settings, step=step), now)

    def fail(self, now: float, step: int | None = None) -> None:
        """Every worker failed at ``now``: both members re-join their formed round."""
        self.join("a", now, step)
        self.join("b", now, step)

    def kinds(self, kind: str) -> list[Any]:
        return [e for e in self.sm.job(JOB).timeline.since(0) if e.kind.value == kind]


def test_fast_failures_in_a_row_close_the_job_with_restart_storm_whatever_the_restart_budget() -> None:
    log = Log(max_restarts=20, **STORM)
    for t in (1.0, 2.0):
        log.fail(t)
    job = log.sm.job(JOB)
    assert (job.state.value, job.progress.fast_failures) == ("complete", 2)
    log.join("a", 3.0)  # the third fast failure in a row
    assert (job.state.value, job.closed_cause, job.restarts) == ("closed", "restart_storm", 3)
    fast = log.kinds("fast_failure")
    assert [(e.cause.value, e.node_id, e.detail["fast_failures"], e.round) for e in fast] == [
        ("short_round", "a", 1, 0), ("short_round", "a", 2, 1), ("short_round", "a", 3, 2)
    ]
    closed = log.kinds("job_closed")[-1]
    assert (closed.cause.value, closed.detail["fast_failures"], closed.detail["min_round_seconds"]) == ("restart_storm", 3, 10.0)
    with pytest.raises(JobClosed, match=r"restart_storm: 3 rounds in a row .*min_round_seconds=10 .*max_fast_failures=3"):
        log.join("b", 3.5)  # the other node's re-join, once its workers stop, is told why
    with pytest.raises(JobClosed, match="restart_storm"):
        log.sm.assignment(JOB, "a", 0)  # the failing node's poll too
    assert log.sm.watch_view(JOB, job.round).cause == "restart_storm"  # the watchers stop their workers
    replayed = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    for record in log.records:
        replayed.replay(record)
    assert (replayed.job(JOB).closed_cause, replayed.job(JOB).progress.fast_failures) == ("restart_storm", 3)


def test_a_round_that_lasted_min_round_seconds_resets_the_count() -> None:
    log = Log(**STORM)
    log.fail(1.0)
    log.fail(2.0)
    log.fail(12.5)  # the round formed at 2.0 ran 10.5 s: healthy
    log.fail(13.0)
    log.fail(14.0)
    job = log.sm.job(JOB)
    assert (job.state.value, job.progress.fast_failures) == ("complete", 2)
    assert [r.fast for r in job.progress.rounds.values()] == ["short_round", "short_round", "", "short_round", "short_round", ""]


def test_the_rule_is_off_by_default_and_a_death_or_a_scale_up_is_not_judged() -> None:
    off = Log()
    for t in range(1, 8):
        off.fail(float(t))
    assert (off.sm.job(JOB).state.value, off.kinds("fast_failure")) == ("complete", [])
    log = Log(**STORM)
    log.apply(c.Expire(JOB, ("b",), "dead", "connection_closed"), 1.0)
    log.join("a", 1.5)  # the survivor re-joins for the death: no failure of its own
    log.join("b", 1.5)
    assert log.kinds("fast_failure") == [] and log.sm.job(JOB).progress.fast_failures == 0


def test_with_progress_a_round_without_a_higher_step_is_fast_however_long_it_ran() -> None:
    log = Log(min_round_seconds=0.0, max_fast_failures=2)
    log.fail(100.0, step=50)  # round 0 reached step 50: progress
    log.fail(200.0, step=50)  # round 1 resumed at 50 and got no further
    job = log.sm.job(JOB)
    assert (job.state.value, job.progress.fast_failures) == ("complete", 1)
    log.join("a", 300.0)  # round 2 reported nothing at all: no progress either
    assert (job.state.value, job.closed_cause) == ("closed", "restart_storm")
    fast = log.kinds("fast_failure")
    assert [(e.cause.value, e.detail["step"], e.detail["best_step"]) for e in fast] == [
        ("no_progress", 50, 50), ("no_progress", None, 50)
    ]


def test_the_document_has_the_last_step_per_round_steps_over_time_and_the_goodput() -> None:
    log = Log(min_round_seconds=0.0, max_fast_failures=5)
    job = log.sm.job(JOB)
    job.progress.seen(0, 10, 20.0)  # soft: beats while round 0 runs
    job.progress.seen(0, 40, 40.0)
    log.fail(60.0, step=50)  # round 0: 0..60 s, progress
    log.fail(100.0, step=50)  # round 1: 60..100 s, none
    doc = job_document(job.view(120.0))  # round 2 runs, no step yet
    assert [(r["round"], r["step"], r["fast_failure"]) for r in doc["progress"]] == [
        (0, 50, ""), (1, 50, "no_progress"), (2, None, "")
    ]
    assert [s[1:] for s in doc["steps"]] == [[0, 10], [0, 40]]
    assert doc["goodput"] == pytest.approx(60.0 / 120.0)
    assert (doc["min_round_seconds"], doc["max_fast_failures"], doc["fast_failures"]) == (0.0, 5, 1)
    restored = RoundLog.from_snapshot(job.progress.to_snapshot())
    assert [r.step for r in restored.rounds.values()] == [50, 50, None] and restored.best == 50


def test_goodput_is_unknown_without_progress_reports() -> None:
    log = Log()
    log.fail(30.0)
    assert job_document(log.sm.job(JOB).view(40.0))["goodput"] is None


def test_the_settings_are_validated_and_old_settings_bytes_stay_the_same() -> None:
    for bad in ({"min_round_seconds": -1.0}, {"max_fast_failures": -1}, {"min_round_seconds": 1e9}):
        with pytest.raises(WireError):
            JobSettings(**bad).validate()  # type: ignore[arg-type]
    join = c.Join(JOB, "a", "a.host", 1, JobSettings())
    assert "min_round_seconds" not in join.to_record() and "step" not in join.to_record()
    assert c.Join(JOB, "a", "a.host", 1, JobSettings(max_fast_failures=5), step=7).to_record()["step"] == 7


def test_other_crash_loop_settings_are_a_conflict_and_a_fresh_run_counts_afresh() -> None:
    log = Log(**STORM)
    other = JobSettings(min_nodes=2, max_nodes=2, last_call_timeout=5.0, min_round_seconds=10.0, max_fast_failures=4)
    with pytest.raises(SettingsConflict, match="max_fast_failures=4"):
        log.apply(c.Join(JOB, "c", "c.host", 1, other), 0.5)
    for t in (1.0, 2.0):
        log.fail(t)
    log.join("a", 3.0)  # closed: restart_storm
    for node in ("a", "b"):
        log.apply(c.Leave(JOB, node), 4.0)
    log.fail(5.0)  # a fresh run under the same id (its first round forms at 5.0)
    job = log.sm.job(JOB)
    assert (job.state.value, job.runs, job.progress.fast_failures) == ("complete", 1, 0)
    assert [r.round for r in job.progress.rounds.values()] == [job.round]


def test_a_job_keeps_its_newest_rounds_and_older_rounds_goodput_as_a_sum() -> None:
    log = RoundLog()
    for r in range(MAX_ROUNDS_KEPT + 10):
        log.formed(r, 10.0 * r)
        log.report(r + 1)  # every round got one step further: all progress
        log.ended(10.0 * r + 10.0)
    assert len(log.rounds) == MAX_ROUNDS_KEPT and next(iter(log.rounds)) == 10
    assert log.goodput(10.0 * (MAX_ROUNDS_KEPT + 10)) == pytest.approx(1.0)
    restored = RoundLog.from_snapshot(log.to_snapshot())
    assert restored.goodput(10.0 * (MAX_ROUNDS_KEPT + 10)) == pytest.approx(1.0)
