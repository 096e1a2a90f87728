"""The rules that follow from a job's state (``Job.settle``) and the node role table
(``_NODE_TRANSITIONS``, checked by ``Job._set``), driven through ``StateMachine.apply``."""

from __future__ import annotations

import copy

import pytest

from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.core import rendezvous
from rdzv_server.core.error import IllegalNodeTransition, IllegalTransition
from rdzv_server.core.machine import StateMachine
from rdzv_server.core.rendezvous import Job, JobState, Liveness, Role

RDZV_ID = "job1"


def machine() -> StateMachine:
    return StateMachine(max_value_bytes=64, job_ttl=1000.0)


def join(sm: StateMachine, node_id: str, now: float, settings: JobSettings) -> None:
    sm.apply(c.Join(RDZV_ID, node_id, f"{node_id}.example", 1, settings), now)


def spare_in_an_open_round() -> StateMachine:
    """Round 0 is a, b; s is a spare; a re-joins, so round 1 opens with a and s in line while
    b, an alive member, has not re-joined yet (its last call runs)."""
    settings = JobSettings(min_nodes=1, max_nodes=2, last_call_timeout=10.0, join_timeout=600.0, heartbeat_ttl=300.0)
    sm = machine()
    for node_id in ("a", "b"):
        join(sm, node_id, 0.0, settings)
    join(sm, "s", 1.0, settings)
    join(sm, "a", 2.0, settings)
    job = sm.job(RDZV_ID)
    assert (job.state, job.round, job.nodes["s"].role, job.last_call_deadline) == (JobState.OPEN, 1, Role.STANDBY, 12.0)
    return sm


def test_a_settled_job_settles_to_itself() -> None:
    sm = spare_in_an_open_round()
    before = copy.deepcopy(sm.to_snapshot())
    sm.job(RDZV_ID).settle(5.0)
    assert sm.to_snapshot() == before


def test_each_departure_of_one_expiry_settles_before_the_next() -> None:
    sm = spare_in_an_open_round()
    sm.apply(c.Expire(RDZV_ID, ("b", "s"), "dead"), 3.0)
    job = sm.job(RDZV_ID)
    # b's death leaves a and s, max_nodes, in line with no member to wait for: the round forms
    # at once with both (rule 2b), and s then dies as a member of it.
    assert (job.state, job.round, job.members) == (JobState.COMPLETE, 1, ["a", "s"])
    assert (job.nodes["s"].role, job.nodes["s"].liveness) == (Role.MEMBER, Liveness.DEAD)


def test_no_round_forming_clears_the_last_call_and_stops_the_spares_clocks() -> None:
    sm = spare_in_an_open_round()
    assert "s" in sm.job(RDZV_ID).join_clock
    sm.apply(c.Close(RDZV_ID), 3.0)
    job = sm.job(RDZV_ID)
    assert job.last_call_deadline is None
    assert "s" not in job.join_clock and "s" in job.untimed


def test_rules_that_never_settle_raise_an_illegal_transition(monkeypatch: pytest.MonkeyPatch) -> None:
    sm = spare_in_an_open_round()
    monkeypatch.setattr(rendezvous, "_SETTLE_RULES", (lambda job, now: True,))
    with pytest.raises(IllegalTransition, match="did not settle"):
        sm.job(RDZV_ID).settle(3.0)


def test_pending_nodes_are_alive_and_every_status_has_a_row() -> None:
    table = rendezvous._NODE_TRANSITIONS
    statuses = {(role, liveness) for role in Role for liveness in Liveness if role is Role.MEMBER or liveness is Liveness.ALIVE}
    assert set(table) == statuses
    assert all(after <= statuses for after in table.values())


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((Role.WAITING, Liveness.ALIVE), (Role.MEMBER, Liveness.ALIVE)),  # a round is never skipped
        ((Role.STANDBY, Liveness.ALIVE), (Role.CANDIDATE, Liveness.ALIVE)),
        ((Role.CANDIDATE, Liveness.ALIVE), (Role.WAITING, Liveness.ALIVE)),  # a forming round's node waits for none
        ((Role.MEMBER, Liveness.DEAD), (Role.MEMBER, Liveness.ALIVE)),  # the dead come back only by re-joining
        ((Role.MEMBER, Liveness.ALIVE), (Role.WAITING, Liveness.ALIVE)),
    ],
)
def test_a_change_missing_from_the_node_table_raises_and_changes_nothing(
    before: tuple[Role, Liveness], after: tuple[Role, Liveness]
) -> None:
    sm = spare_in_an_open_round()
    job: Job = sm.job(RDZV_ID)
    node = job.nodes["s"]
    node.role, node.liveness = before
    job.counts[(Role.STANDBY, Liveness.ALIVE)] -= 1
    job.counts[before] += 1
    counts, status = copy.deepcopy(job.counts), (node.role, node.liveness)
    with pytest.raises(IllegalNodeTransition, match="node s cannot go from"):
        job._set(node, *after)
    assert (node.role, node.liveness) == status and job.counts == counts
