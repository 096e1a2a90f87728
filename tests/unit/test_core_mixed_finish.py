"""Rendezvous rule 9, a mixed finish: torch's exit barrier ends at once when a round can no
longer complete it (core/finish.py), driven through the one apply path with a fake clock.

torch's agent, once its workers succeeded, adds 1 to ``EXIT_BARRIER_COUNT_KEY`` in its round's
key space and waits for ``EXIT_BARRIER_LAST_MEMBER_KEY``; these tests send those same store
commands, and the membership commands a failing node's agent sends (a re-join with restarts
left; a close and a leave with none), in both orders.
"""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_client.record import (
    EXIT_BARRIER_COUNT_KEY,
    EXIT_BARRIER_LAST_MEMBER_KEY,
    EXIT_BARRIER_RELEASE_VALUE,
    JobSettings,
)
from rdzv_server.core import command as c
from rdzv_server.core.error import JobClosed
from rdzv_server.core.machine import Outcome, StateMachine, key_topic

JOB = "job"


class Job:
    """A machine holding one job of ``nodes`` formed in round 0, and the records it applied."""

    def __init__(self, nodes: tuple[str, ...] = ("a", "b"), max_restarts: int | None = None, **settings: Any) -> None:
        self.sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        self.records: list[dict[str, Any]] = []
        self.settings = JobSettings(min_nodes=len(nodes), max_nodes=len(nodes), max_restarts=max_restarts, **settings)
        for node in nodes:
            self.join(node, 0.0)
        assert (self.job.state.value, self.job.round) == ("complete", 0)

    @property
    def job(self) -> Any:
        return self.sm.job(JOB)

    def apply(self, command: c.Command, now: float) -> Outcome:
        outcome = self.sm.apply(command, now)
        self.records.append({"cmd": command.to_record(), "now": now, "rid": None})
        return outcome

    def join(self, node: str, now: float) -> Outcome:
        return self.apply(c.Join(JOB, node, f"{node}.host", 1, self.settings), now)

    def finish(self, now: float, round_: int = 0) -> Outcome:
        """A node's agent reaches the exit barrier: its workers succeeded (torch's ``add``)."""
        return self.apply(c.Add(JOB, EXIT_BARRIER_COUNT_KEY, 1, round=round_), now)

    def released(self, round_: int = 0) -> bool:
        """Whether the barrier's key is set: what the finished agents' ``wait`` returns on."""
        return self.sm.kv(JOB).get(round_, EXIT_BARRIER_LAST_MEMBER_KEY) == EXIT_BARRIER_RELEASE_VALUE

    def events(self) -> list[tuple[str, str, str | None]]:
        return [(e.kind.value, e.cause.value, e.node_id) for e in self.job.timeline.since(0)]

    def replayed(self) -> StateMachine:
        fresh = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        for record in self.records:
            fresh.replay(record)
        return fresh


FORMED = [("job_created", "join", None), ("node_joined", "candidate", "a"), ("node_joined", "candidate", "b"),
          ("round_formed", "max_nodes", None)]  # fmt: skip


def test_when_every_node_finishes_torchs_last_add_releases_the_barrier_and_nothing_closes_early() -> None:
    j = Job()
    assert j.finish(1.0).result == {"value": 1}
    assert j.finish(1.1).result == {"value": 2}  # torch's last member sets the key itself
    assert not j.released() and j.job.state.value == "complete"
    j.apply(c.Close(JOB, cause="agent"), 1.2)  # the agents' shutdown: close, then leave
    j.apply(c.Leave(JOB, "a"), 1.3)
    j.apply(c.Leave(JOB, "b"), 1.3)
    assert j.events() == [*FORMED, ("job_closed", "agent", None), ("node_departed", "left", "a"),
                          ("node_departed", "left", "b")]  # fmt: skip
    assert not j.released()


def test_a_member_that_re_joins_after_another_finished_releases_the_barrier_and_closes_the_job() -> None:
    j = Job(max_restarts=2)
    j.finish(1.0)  # a's workers succeeded: it waits in the barrier
    assert not j.released()
    outcome = j.join("b", 1.5)  # b's workers failed: its agent re-joins (restarts left)
    assert j.released()
    assert key_topic(JOB, 0, EXIT_BARRIER_LAST_MEMBER_KEY) in outcome.wakes  # a's wait returns now
    assert j.events() == [
        *FORMED,
        ("workers_failed", "rejoined", "b"),  # rule 11: a re-join with nothing waiting, no detail
        ("node_joined", "rejoined", "b"),
        ("exit_barrier_released", "workers_failed_after_finish", "b"),
        ("job_closed", "workers_failed_after_finish", "b"),
    ]
    closed = j.job.timeline.since(0)[-1]
    assert (closed.round, closed.detail["finished"], closed.detail["num_nodes"]) == (1, 1, 2)
    assert j.job.restarts == 0  # the job ends: its failure spends no restart (rule 7)
    with pytest.raises(JobClosed, match=r"workers_failed_after_finish: node b of round 0 re-joined .* after 1 of its 2 "
                                        r"nodes had finished"):  # fmt: skip
        j.sm.assignment(JOB, "b", 1)  # b's poll: its agent exits non-zero with this
    assert j.sm.watch_view(JOB, 0).cause == "workers_failed_after_finish"
    replayed = j.replayed()
    assert replayed.kv(JOB).get(0, EXIT_BARRIER_LAST_MEMBER_KEY) == EXIT_BARRIER_RELEASE_VALUE
    assert replayed.job(JOB).closed_cause == "workers_failed_after_finish"


def test_a_barrier_reached_after_the_failing_member_re_joined_is_released_at_once() -> None:
    j = Job()
    j.join("b", 1.0)  # b failed first: the next round opens, a is asked to restart ...
    assert (j.job.state.value, j.job.round) == ("open", 1)
    outcome = j.finish(1.05)  # ... but a's workers had already succeeded: it reaches round 0's barrier
    assert outcome.result == {"value": 1} and j.released()
    assert [e.kind.value for e in outcome.events] == ["exit_barrier_released", "job_closed"]
    assert j.events()[-2:] == [("exit_barrier_released", "workers_failed_after_finish", "b"),
                               ("job_closed", "workers_failed_after_finish", "b")]  # fmt: skip
    with pytest.raises(JobClosed, match="workers_failed_after_finish"):
        j.sm.assignment(JOB, "b", 1)


def test_with_no_restarts_left_the_failing_agents_close_and_leave_release_the_finished_nodes() -> None:
    j = Job()
    j.finish(1.0)
    j.apply(c.Close(JOB, cause="agent"), 1.5)  # b's shutdown closes the job ...
    assert not j.released()  # (a close alone: the members still running may all finish yet)
    outcome = j.apply(c.Leave(JOB, "b"), 1.5)  # ... and leaves: b will never reach the barrier
    assert j.released() and key_topic(JOB, 0, EXIT_BARRIER_LAST_MEMBER_KEY) in outcome.wakes
    assert j.events()[len(FORMED):] == [("job_closed", "agent", None), ("node_departed", "left", "b"),
                                        ("exit_barrier_released", "member_departed_after_finish", "b")]  # fmt: skip


def test_with_no_restarts_left_a_barrier_reached_after_the_failing_agent_left_is_released_at_once() -> None:
    j = Job()
    j.apply(c.Close(JOB, cause="agent"), 1.0)
    j.apply(c.Leave(JOB, "b"), 1.0)
    j.finish(1.2)
    assert j.released()
    assert j.events()[-1] == ("exit_barrier_released", "member_departed_after_finish", "b")


def test_a_member_that_dies_after_another_finished_ends_the_job_without_spending_a_restart() -> None:
    j = Job(max_restarts=0)  # a death would close the job as restart_budget_exhausted otherwise
    j.finish(1.0)
    j.apply(c.Expire(JOB, ("b",), "dead", "connection_closed"), 2.0)
    assert j.released()
    assert (j.job.closed_cause, j.job.restarts) == ("member_departed_after_finish", 0)
    assert j.events()[-2:] == [("exit_barrier_released", "member_departed_after_finish", "b"),
                               ("job_closed", "member_departed_after_finish", "b")]  # fmt: skip


def test_with_three_nodes_a_node_still_training_finds_the_barrier_released_or_the_job_closed() -> None:
    j = Job(("a", "b", "c"))
    j.finish(1.0)
    j.join("b", 1.5)
    assert j.released() and j.job.closed_cause == "workers_failed_after_finish"
    assert j.finish(2.0).result == {"value": 2}  # c finishes too: its wait returns at once
    assert [e for e in j.events() if e[0] == "exit_barrier_released"] == [
        ("exit_barrier_released", "workers_failed_after_finish", "b")
    ]
    with pytest.raises(JobClosed, match="workers_failed_after_finish"):  # or c failed: its re-join is refused
        j.join("c", 2.0)


def test_a_close_alone_releases_nothing_and_counts_in_other_key_spaces_are_not_the_barrier() -> None:
    j = Job()
    j.apply(c.Close(JOB, cause="operator"), 0.5)
    j.finish(1.0)  # every member is still in the round: the other may still finish
    assert not j.released()
    j.apply(c.Add(JOB, EXIT_BARRIER_COUNT_KEY, 1), 1.1)  # the job-wide key space: someone's own key
    j.apply(c.Add(JOB, EXIT_BARRIER_COUNT_KEY, 1, round=7), 1.1)  # a round that never formed
    assert not j.released() and not j.released(7)
    j.finish(1.2)
    assert not j.released()  # torch's last member sets it
    assert [e for e in j.events() if e[0] == "exit_barrier_released"] == []


def test_a_barrier_of_an_earlier_round_is_torchs_own() -> None:
    j = Job(("a", "b", "c"))
    settings = JobSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    j.settings = settings  # (a fresh run adopts new settings)
    for node in ("a", "b", "c"):
        j.apply(c.Leave(JOB, node), 0.5)
    j.apply(c.Close(JOB, cause="agent"), 0.5)
    j.join("a", 1.0)  # a fresh run: round 1, formed at the last call (zero) with a and b
    j.join("b", 1.0)
    assert (j.job.state.value, j.job.round) == ("complete", 1)
    j.finish(1.5, round_=0)  # a late add in the earlier run's round 0: not this run's barrier
    j.join("a", 2.0)
    assert not j.released(0) and j.job.state.value == "open"


def test_the_barrier_survives_a_snapshot() -> None:
    j = Job()
    j.finish(1.0)
    restored = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    restored.restore(j.sm.to_snapshot())
    restored.apply(c.Join(JOB, "b", "b.host", 1, j.settings), 2.0)
    assert restored.kv(JOB).get(0, EXIT_BARRIER_LAST_MEMBER_KEY) == EXIT_BARRIER_RELEASE_VALUE
    assert restored.job(JOB).closed_cause == "workers_failed_after_finish"


def test_the_release_is_never_refused_by_the_jobs_key_quota() -> None:
    j = Job()
    j.finish(1.0)
    kv = j.sm.kv(JOB)
    kv.max_keys = kv.keys  # full: no client may add a key now
    j.join("b", 2.0)
    assert j.released() and kv.keys == kv.max_keys + 1


@pytest.mark.parametrize("finish_first", [True, False], ids=["finished-then-failed", "failed-then-finished"])
def test_a_failure_beside_a_finished_node_releases_it_even_when_the_crash_loop_rule_closes_the_job(
    finish_first: bool,
) -> None:
    """With the crash-loop rule on (rule 8: one fast failure closes the job): a failure after
    another node finished is a mixed finish, not a crash loop; a failure before it closes the
    job as a crash loop, and the node that finishes after is released at once all the same."""
    j = Job(min_round_seconds=600.0, max_fast_failures=1)
    if finish_first:
        j.finish(1.0)
        j.join("b", 1.5)
    else:
        j.join("b", 1.0)
        assert j.job.closed_cause == "restart_storm"
        j.finish(1.05)
    assert j.released()
    closed = "workers_failed_after_finish" if finish_first else "restart_storm"
    assert j.job.closed_cause == closed
    assert ("exit_barrier_released", "workers_failed_after_finish", "b") in j.events()
    assert ("fast_failure" in [kind for kind, _, _ in j.events()]) is not finish_first


def test_a_node_that_finishes_after_the_budget_closed_the_job_is_released_at_once() -> None:
    j = Job(max_restarts=0)
    j.join("b", 1.0)  # b's workers failed with no restart left: the job closes ...
    assert j.job.closed_cause == "restart_budget_exhausted"
    j.finish(1.05)  # ... while a's had succeeded: it must not wait out torch's 300 s
    assert j.released()
    assert j.events()[-1] == ("exit_barrier_released", "workers_failed_after_finish", "b")
