"""The rendezvous rules (rendezvous.py's docstring) and the apply path (machine.py), driven
through ``StateMachine.apply`` with commands and a fake clock: every ``now`` is a float argument."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rdzv_client.record import JobSettings
from rdzv_server.api.document import job_document, job_summary
from rdzv_server.core import command as c
from rdzv_server.core.error import (
    BadRequest,
    IllegalTransition,
    JobClosed,
    JobClosedInLine,
    JobNotFound,
    JoinTimeout,
    NodeNotFound,
    NotAnInteger,
    SettingsConflict,
    ValueTooLarge,
)
from rdzv_server.core.machine import (
    DEDUP_WINDOW,
    StateMachine,
    key_topic,
    node_topic,
    round_topic,
    watch_topic,
)
from rdzv_server.core.rendezvous import Event, Job, JobState, Liveness, Role

RDZV_ID = "job1"
JOB_TTL = 1000.0
MAX_VALUE_BYTES = 64


class Cluster:
    """A StateMachine plus the log of what it applied (for replay) and one job's default settings."""

    def __init__(
        self,
        *,
        min_nodes: int = 2,
        max_nodes: int = 4,
        last_call_timeout: float = 10.0,
        join_timeout: float = 600.0,
        heartbeat_ttl: float = 300.0,
    ) -> None:
        self.sm = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
        self.settings: dict[str, Any] = {
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "last_call_timeout": last_call_timeout,
            "join_timeout": join_timeout,
            "heartbeat_ttl": heartbeat_ttl,
        }
        self.log: list[tuple[c.Command, float, tuple[str, int] | None]] = []

    # -- commands --------------------------------------------------------------------------

    def apply(self, command: c.Command, now: float, rid: tuple[str, int] | None = None) -> dict[str, Any]:
        outcome = self.sm.apply(command, now, rid)
        if not outcome.replayed:
            self.log.append((command, now, rid))
        return outcome.result

    def join_command(self, node_id: str, nproc: int = 1, **overrides: Any) -> c.Join:
        settings = {**self.settings, **overrides}
        port = settings.pop("master_port", 0)
        return c.Join(RDZV_ID, node_id, f"{node_id}.example", nproc, JobSettings(**settings), master_port=port)

    def join(self, node_id: str, now: float, nproc: int = 1, **overrides: Any) -> int:
        round_: int = self.apply(self.join_command(node_id, nproc, **overrides), now)["round"]
        return round_

    def leave(self, node_id: str, now: float) -> bool:
        left: bool = self.apply(c.Leave(RDZV_ID, node_id), now)["left"]
        return left

    def die(self, node_id: str, now: float) -> None:
        self.apply(c.Expire(RDZV_ID, (node_id,), "dead"), now)

    def close(self, now: float) -> None:
        self.apply(c.Close(RDZV_ID), now)

    def tick(self, now: float) -> list[c.Command]:
        """What the timer does at ``now``: detect, then apply through the one apply path."""
        due = self.sm.due(RDZV_ID, now)
        for command in due:
            self.apply(command, now)
        return due

    # -- reads -----------------------------------------------------------------------------

    @property
    def job(self) -> Job:
        return self.sm.job(RDZV_ID)

    def role(self, node_id: str) -> Role | None:
        node = self.job.nodes.get(node_id)
        return None if node is None else node.role

    def ranks(self) -> dict[str, int]:
        """node_id -> node_rank of the formed round (asserting a formed round)."""
        assert self.job.state is JobState.COMPLETE
        out = {}
        for node_id in self.job.members:
            a = self.sm.assignment(RDZV_ID, node_id, self.job.round)
            assert a is not None
            out[node_id] = a.node_rank
        return out

    def members(self) -> list[str]:
        return list(self.job.members)

    def waiting(self, round_: int | None = None) -> int:
        return self.job.num_nodes_waiting(self.job.round if round_ is None else round_)

    def replay(self) -> StateMachine:
        fresh = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
        for command, now, rid in self.log:
            fresh.apply(command, now, rid)
        return fresh


def snapshot(sm: StateMachine) -> dict[str, Any]:
    return copy.deepcopy(sm.to_snapshot())


def describe(job: Job, now: float) -> dict[str, Any]:
    """The membership document of ``GET /v1/jobs/{rdzv_id}`` (api/document.py) of ``job`` at ``now``."""
    return job_document(job.view(now))


def without_heartbeat_ages(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for list_name in ("nodes", "joining", "waiting", "standby"):
        for entry in doc[list_name]:
            entry.pop("last_heartbeat_age_s")
    return doc


def ids(entries: list[dict[str, Any]]) -> list[str]:
    return [e["node_id"] for e in entries]


def form(cl: Cluster, nodes: list[str], now: float = 0.0, nprocs: list[int] | None = None) -> None:
    """Join ``nodes`` (in this order) and let the round form (by max_nodes or the last call)."""
    for i, node_id in enumerate(nodes):
        cl.join(node_id, now, nprocs[i] if nprocs else 1)
    if cl.job.state is JobState.OPEN:
        cl.tick(now + cl.settings["last_call_timeout"])
    assert cl.job.state is JobState.COMPLETE
    assert cl.members() == nodes


# -- rule 1: settings --------------------------------------------------------------------------------


def test_first_join_creates_the_job_with_its_settings() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=7.0, join_timeout=70.0, heartbeat_ttl=17.0)
    with pytest.raises(JobNotFound):
        cl.sm.job(RDZV_ID)
    assert cl.join("a", 0.0) == 0
    job = cl.job
    assert (job.settings.min_nodes, job.settings.max_nodes) == (2, 3)
    assert (job.settings.last_call_timeout, job.settings.join_timeout, job.settings.heartbeat_ttl) == (7.0, 70.0, 17.0)
    assert job.state is JobState.OPEN
    assert job.round == 0
    assert cl.role("a") is Role.CANDIDATE


def test_join_with_the_same_settings_is_accepted() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.join("b", 1.0)
    assert cl.role("b") is Role.CANDIDATE


@pytest.mark.parametrize(
    "override",
    [
        {"min_nodes": 1},
        {"max_nodes": 5},
        {"last_call_timeout": 11.0},
        {"join_timeout": 1.0},
        {"heartbeat_ttl": 1.0},
    ],
)
def test_join_with_conflicting_settings_while_a_node_is_pending_is_settings_conflict(override: dict[str, Any]) -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    before = snapshot(cl.sm)
    with pytest.raises(SettingsConflict) as info:
        cl.join("b", 1.0, **override)
    assert info.value.status == 409
    assert "b" in info.value.message and RDZV_ID in info.value.message
    assert snapshot(cl.sm) == before


def test_join_with_conflicting_settings_while_members_are_alive_is_settings_conflict() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    before = snapshot(cl.sm)
    with pytest.raises(SettingsConflict):
        cl.join("c", 1.0, max_nodes=3)
    with pytest.raises(SettingsConflict):
        cl.join("a", 1.0, max_nodes=3)  # a member re-joining may not change them either
    assert snapshot(cl.sm) == before


def test_conflicting_settings_are_adopted_when_the_job_is_idle() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.leave("a", 1.0)
    cl.leave("b", 1.0)
    assert cl.job.idle()
    cl.join("c", 2.0, min_nodes=1, max_nodes=3, last_call_timeout=0.0)
    assert cl.job.settings.max_nodes == 3
    assert cl.job.settings.min_nodes == 1
    # and the job runs by them: one node is enough now
    assert cl.job.state is JobState.COMPLETE
    assert cl.members() == ["c"]


def test_conflicting_settings_are_adopted_after_every_pending_node_departed() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.leave("a", 1.0)
    cl.join("b", 2.0, max_nodes=8)
    assert cl.job.settings.max_nodes == 8


def test_create_fixes_the_settings_before_any_join() -> None:
    cl = Cluster()
    cl.apply(c.Create(RDZV_ID, JobSettings(3, 5, 1.0, 2.0, 3.0)), 0.0)
    s = cl.job.settings
    assert (s.min_nodes, s.max_nodes, s.last_call_timeout, s.join_timeout, s.heartbeat_ttl) == (3, 5, 1.0, 2.0, 3.0)
    assert cl.job.nodes == {}
    # same settings again: a no-op
    before = snapshot(cl.sm)
    cl.apply(c.Create(RDZV_ID, JobSettings(3, 5, 1.0, 2.0, 3.0)), 1.0)
    assert snapshot(cl.sm)["jobs"] == before["jobs"]
    # a join with exactly these settings just joins
    cl.join("a", 2.0, min_nodes=3, max_nodes=5, last_call_timeout=1.0, join_timeout=2.0, heartbeat_ttl=3.0)
    assert cl.job.settings == s


def test_create_with_other_settings_is_settings_conflict_while_nodes_live() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    before = snapshot(cl.sm)
    with pytest.raises(SettingsConflict):
        cl.apply(c.Create(RDZV_ID, JobSettings(1, 1, 0.0, 1.0, 1.0)), 1.0)
    assert snapshot(cl.sm) == before


def test_create_with_other_settings_is_adopted_while_idle() -> None:
    cl = Cluster()
    cl.apply(c.Create(RDZV_ID, JobSettings(3, 5, 1.0, 2.0, 3.0)), 0.0)
    cl.apply(c.Create(RDZV_ID, JobSettings(1, 2, 1.0, 2.0, 3.0)), 1.0)
    assert (cl.job.settings.min_nodes, cl.job.settings.max_nodes) == (1, 2)


# -- rule 2: round completion ---------------------------------------------------------------------------


def test_round_completes_at_once_when_max_nodes_join() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=100.0)
    cl.join("a", 0.0)
    cl.join("b", 1.0)
    assert cl.job.state is JobState.OPEN
    assert cl.sm.assignment(RDZV_ID, "a", 0) is None
    cl.join("c", 2.0)
    assert cl.job.state is JobState.COMPLETE
    assert cl.job.last_call_deadline is None
    assert cl.ranks() == {"a": 0, "b": 1, "c": 2}


def test_round_with_min_nodes_completes_only_after_the_last_call_timeout() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=10.0)
    cl.join("a", 0.0)
    assert cl.job.last_call_deadline is None
    cl.join("b", 3.0)  # the min_nodes-th join sets the deadline
    assert cl.job.last_call_deadline == 13.0
    assert cl.sm.deadline(RDZV_ID) == 13.0
    cl.join("c", 5.0)  # later joins do not move it
    assert cl.job.last_call_deadline == 13.0
    assert [x for x in cl.sm.due(RDZV_ID, 12.999) if isinstance(x, c.LastCall)] == []
    assert cl.tick(12.999) == []
    assert cl.job.state is JobState.OPEN
    assert cl.sm.due(RDZV_ID, 13.0) == [c.LastCall(RDZV_ID, 0)]
    assert cl.apply(c.LastCall(RDZV_ID, 0), 13.0) == {"formed": True}
    assert cl.job.state is JobState.COMPLETE
    assert cl.ranks() == {"a": 0, "b": 1, "c": 2}
    assert cl.job.last_call_deadline is None
    assert cl.sm.due(RDZV_ID, 20.0) == []


def test_last_call_before_the_deadline_does_not_form() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=10.0)
    cl.join("a", 0.0)
    cl.join("b", 0.0)
    assert cl.apply(c.LastCall(RDZV_ID, 0), 9.0) == {"formed": False}
    assert cl.job.state is JobState.OPEN


def test_stale_last_call_for_another_round_is_a_no_op() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    before = snapshot(cl.sm)["jobs"]
    assert cl.apply(c.LastCall(RDZV_ID, 0), 50.0) == {"formed": False}
    assert cl.apply(c.LastCall(RDZV_ID, 7), 50.0) == {"formed": False}
    assert cl.apply(c.LastCall("no-such-job", 0), 50.0) == {"formed": False}
    assert snapshot(cl.sm)["jobs"] == before


def test_last_call_deadline_is_cleared_when_the_count_drops_below_min_nodes() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=10.0)
    cl.join("a", 0.0)
    cl.join("b", 1.0)
    assert cl.job.last_call_deadline == 11.0
    cl.leave("b", 2.0)
    assert cl.job.last_call_deadline is None
    assert cl.tick(11.0) == []
    assert cl.job.state is JobState.OPEN
    cl.join("c", 20.0)  # reaching min_nodes again starts a fresh last call
    assert cl.job.last_call_deadline == 30.0
    cl.tick(30.0)
    assert cl.ranks() == {"a": 0, "c": 1}


def test_last_call_timeout_zero_completes_at_min_nodes() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=0.0)
    cl.join("a", 0.0)
    assert cl.job.state is JobState.OPEN
    cl.join("b", 1.0)
    assert cl.job.state is JobState.COMPLETE
    assert cl.ranks() == {"a": 0, "b": 1}


def test_a_first_round_ranks_its_nodes_in_natural_host_order_not_by_arrival() -> None:
    cl = Cluster(min_nodes=1, max_nodes=4)
    for i, node_id in enumerate(["d", "b", "c", "a"]):  # addresses d.example, b.example ...
        cl.join(node_id, float(i))
    assert cl.ranks() == {"a": 0, "b": 1, "c": 2, "d": 3}


def test_retried_join_of_a_candidate_changes_nothing() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    node = copy.deepcopy(cl.job.nodes["a"])
    assert cl.join("a", 1.0) == 0
    assert cl.job.nodes["a"] == node
    assert cl.job.arrivals == 1


# -- ranks -------------------------------------------------------------------------------------------------


def test_global_ranks_are_prefix_sums_of_heterogeneous_nproc_per_node() -> None:
    cl = Cluster(min_nodes=3, max_nodes=3)
    form(cl, ["a", "b", "c"], nprocs=[2, 1, 3])
    expected = {"a": (0, 0, 2), "b": (1, 2, 1), "c": (2, 3, 3)}
    for node_id, (rank, start, nproc) in expected.items():
        a = cl.sm.assignment(RDZV_ID, node_id, 0)
        assert a is not None
        assert (a.node_rank, a.global_rank_start, a.nproc_per_node) == (rank, start, nproc)
        assert (a.num_nodes, a.world_size, a.round) == (3, 6, 0)
        assert a.master_addr == "a.example"
    doc = describe(cl.job, 0.0)
    assert [e["global_ranks"] for e in doc["nodes"]] == [[0, 1], [2], [3, 4, 5]]
    assert doc["world_size"] == 6


def test_every_node_gets_node_rank_0s_addr_and_the_port_it_offered_with_its_join() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    cl.join("a", 0.0, master_port=29501)
    cl.join("b", 0.1, master_port=29502)
    for node_id in ("a", "b"):
        a = cl.sm.assignment(RDZV_ID, node_id, 0)
        assert a is not None and (a.master_addr, a.master_port) == ("a.example", 29501)
    cl.join("a", 1.0, master_port=29600)  # the next round: node rank 0 offers a new port
    cl.join("b", 1.1, master_port=29700)
    a = cl.sm.assignment(RDZV_ID, "b", 1)
    assert a is not None and (a.round, a.master_addr, a.master_port) == (1, "a.example", 29600)
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(snapshot(cl.sm))  # the offered ports survive a snapshot
    assert restored.assignment(RDZV_ID, "b", 1) == a


def test_members_keep_their_node_ranks_in_the_next_round_and_new_nodes_fill_the_vacancies() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=10.0)
    form(cl, ["a", "b", "c"])  # round 0 by last call
    cl.join("e", 20.0)  # waiting
    cl.join("c", 21.0)  # a member re-joins first: opens round 1
    assert cl.job.round == 1
    cl.join("a", 22.0)
    cl.leave("b", 23.0)
    cl.join("f", 24.0)  # fourth: max_nodes
    assert cl.job.state is JobState.COMPLETE
    assert cl.job.round == 1
    assert cl.ranks() == {"a": 0, "e": 1, "c": 2, "f": 3}  # e takes b's rank; f the one past the old round


def test_the_next_round_reorders_heterogeneous_global_ranks() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=5.0)
    form(cl, ["a", "b", "c"], nprocs=[1, 2, 3])
    cl.leave("a", 1.0)
    cl.join("c", 2.0, nproc=3)
    cl.join("b", 3.0, nproc=2)
    cl.join("d", 4.0, nproc=2)
    # b and c keep node ranks 1 and 2; d takes a's node rank 0, and with it other global ranks
    a = cl.sm.assignment(RDZV_ID, "d", 1)
    assert a is not None and (a.node_rank, a.global_rank_start, a.world_size) == (0, 0, 7)
    a = cl.sm.assignment(RDZV_ID, "b", 1)
    assert a is not None and (a.node_rank, a.global_rank_start) == (1, 2)
    a = cl.sm.assignment(RDZV_ID, "c", 1)
    assert a is not None and (a.node_rank, a.global_rank_start) == (2, 4)


def test_an_assignment_says_whether_every_node_of_its_round_runs_as_many_workers() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"], nprocs=[2, 2])
    assert all(cl.sm.assignment(RDZV_ID, n, 0).uniform_nproc for n in ("a", "b"))  # type: ignore[union-attr]
    cl.join("b", 1.0, nproc=4)  # the next round: b brings 4
    cl.join("a", 2.0, nproc=2)
    assert not any(cl.sm.assignment(RDZV_ID, n, 1).uniform_nproc for n in ("a", "b"))  # type: ignore[union-attr]
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(snapshot(cl.sm))
    assert restored.assignment(RDZV_ID, "a", 1) == cl.sm.assignment(RDZV_ID, "a", 1)
    assert cl.replay().assignment(RDZV_ID, "a", 1) == cl.sm.assignment(RDZV_ID, "a", 1)
    cl.join("b", 3.0, nproc=2)  # and back to uniform, snapshot and all
    cl.join("a", 4.0, nproc=2)
    restored.restore(snapshot(cl.sm))
    assert restored.assignment(RDZV_ID, "b", 2).uniform_nproc  # type: ignore[union-attr]


def test_a_member_may_change_its_nproc_per_node_when_it_rejoins() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"], nprocs=[2, 2])
    cl.join("b", 1.0, nproc=4)
    cl.join("a", 2.0, nproc=1)
    assert cl.job.world_size() == 5
    a = cl.sm.assignment(RDZV_ID, "b", 1)
    assert a is not None and (a.node_rank, a.global_rank_start, a.nproc_per_node) == (1, 1, 4)


# -- rule 3: joins while COMPLETE ------------------------------------------------------------------------


def test_a_member_that_rejoins_opens_the_next_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    assert cl.join("b", 1.0) == 1
    assert cl.job.state is JobState.OPEN
    assert cl.job.round == 1
    assert cl.role("b") is Role.CANDIDATE
    assert cl.role("a") is Role.MEMBER
    assert cl.sm.assignment(RDZV_ID, "b", 1) is None
    assert cl.join("a", 2.0) == 1
    assert cl.ranks() == {"a": 0, "b": 1}


def test_a_new_node_after_completion_is_waiting_while_alive_members_plus_waiting_are_below_max() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    assert cl.join("c", 1.0) == 1
    assert cl.role("c") is Role.WAITING
    assert cl.job.state is JobState.COMPLETE  # the formed round keeps running
    assert cl.sm.assignment(RDZV_ID, "c", 1) is None


def test_a_new_node_is_standby_once_alive_members_plus_waiting_reach_max() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.join("d", 2.0)
    assert cl.role("c") is Role.WAITING
    assert cl.role("d") is Role.STANDBY
    cl.die("a", 3.0)  # a dead member frees a place: the next newcomer waits
    cl.join("e", 4.0)
    assert cl.role("e") is Role.WAITING


def test_a_new_node_of_a_full_round_is_standby() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    assert cl.join("c", 1.0) == 1
    assert cl.role("c") is Role.STANDBY


def test_retried_join_of_a_waiting_node_changes_nothing() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    node = copy.deepcopy(cl.job.nodes["c"])
    assert cl.join("c", 2.0) == 1
    assert cl.job.nodes["c"] == node
    assert cl.job.state is JobState.COMPLETE


def test_waiting_nodes_become_candidates_of_the_next_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=5.0)
    form(cl, ["a", "b"])
    cl.join("c", 10.0)
    cl.join("d", 11.0)
    cl.join("a", 12.0)
    assert cl.role("c") is Role.CANDIDATE
    assert cl.role("d") is Role.CANDIDATE
    cl.join("b", 13.0)
    assert cl.ranks() == {"a": 0, "b": 1, "c": 2, "d": 3}


def test_any_join_opens_the_next_round_when_no_member_is_alive() -> None:
    cl = Cluster(min_nodes=1, max_nodes=2, last_call_timeout=5.0)
    form(cl, ["a", "b"])
    cl.leave("a", 1.0)
    cl.die("b", 1.0)
    assert (cl.job.state, cl.job.round) == (JobState.COMPLETE, 0)  # nobody waiting: the round stays
    assert cl.join("z", 2.0) == 1
    assert (cl.job.state, cl.job.round) == (JobState.OPEN, 1)
    assert cl.role("z") is Role.CANDIDATE
    assert cl.job.last_call_deadline == 7.0
    cl.tick(7.0)
    assert cl.ranks() == {"z": 0}


# -- rule 2b: standby fills the slots -------------------------------------------------------------------


def test_round_completes_at_once_when_alive_members_rejoined_and_standby_fills_max() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, last_call_timeout=100.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    assert cl.role("c") is Role.STANDBY
    cl.die("a", 2.0)
    assert cl.waiting(0) == 1
    cl.join("b", 3.0)  # the only alive member re-joins; b + standby c reach max_nodes
    assert cl.job.state is JobState.COMPLETE
    assert cl.job.round == 1
    assert cl.ranks() == {"c": 0, "b": 1}  # b keeps its rank; the spare takes the dead a's


def test_standby_does_not_complete_the_round_while_an_alive_member_has_not_rejoined() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, last_call_timeout=100.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.join("a", 2.0)
    assert cl.job.state is JobState.OPEN  # a + c would fill max_nodes, but b is expected
    cl.join("b", 3.0)
    assert cl.ranks() == {"a": 0, "b": 1}
    assert cl.role("c") is Role.STANDBY  # overflow stays standby
    assert cl.sm.assignment(RDZV_ID, "c", 1) is None


def test_standby_completes_the_round_when_the_missing_member_dies() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, last_call_timeout=100.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.join("a", 2.0)
    cl.die("b", 3.0)  # the expected member will not come back
    assert cl.ranks() == {"a": 0, "c": 1}


def test_standby_fills_slots_after_new_nodes_at_the_last_call() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=5.0)
    form(cl, ["a", "b"])  # round 0 by last call at t=5
    cl.join("w", 10.0)  # waiting (2 + 0 < 3)
    cl.join("s", 11.0)  # standby (2 + 1 = 3)
    cl.join("t", 12.0)  # standby
    cl.join("a", 13.0)  # round 1 opens: a, w candidates; s, t standby; b expected
    assert cl.job.last_call_deadline == 18.0
    cl.tick(18.0)
    assert cl.ranks() == {"a": 0, "s": 1, "w": 2}  # admitted by tier, ranked by host: s.example < w.example
    assert cl.role("t") is Role.STANDBY
    assert "b" not in cl.job.nodes  # an alive member that did not come back is not in the round


def test_overflow_beyond_max_nodes_stays_standby_with_no_rank() -> None:
    cl = Cluster(min_nodes=1, max_nodes=2, last_call_timeout=5.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.join("d", 2.0)
    cl.join("a", 3.0)
    cl.tick(8.0)  # b never came back: a + c + d standby... only two places
    assert cl.ranks() == {"a": 0, "c": 1}
    assert cl.role("d") is Role.STANDBY
    assert cl.job.nodes["d"].node_rank is None
    doc = describe(cl.job, 8.0)
    assert ids(doc["standby"]) == ["d"]
    assert doc["standby"][0]["node_rank"] is None and doc["standby"][0]["global_ranks"] == []


# -- rule 4: num_nodes_waiting ----------------------------------------------------------------------------


def test_num_nodes_waiting_is_zero_for_a_fresh_full_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    assert cl.waiting(0) == 0


def test_num_nodes_waiting_counts_waiting_nodes_but_not_standby() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    assert cl.waiting(0) == 1
    cl.join("d", 2.0)
    assert cl.role("d") is Role.STANDBY
    assert cl.waiting(0) == 1


def test_a_standby_node_does_not_disturb_a_full_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    assert cl.waiting(0) == 0


def test_graceful_leave_of_a_member_does_not_make_num_nodes_waiting_positive() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3)
    form(cl, ["a", "b", "c"])
    assert cl.leave("b", 1.0) is True
    assert cl.job.nodes["b"].liveness is Liveness.LEFT
    assert cl.waiting(0) == 0
    assert cl.job.state is JobState.COMPLETE


def test_death_of_a_member_makes_num_nodes_waiting_positive() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3)
    form(cl, ["a", "b", "c"])
    cl.die("b", 1.0)
    assert cl.job.nodes["b"].liveness is Liveness.DEAD
    assert cl.waiting(0) == 1
    cl.die("c", 2.0)
    assert cl.waiting(0) == 2


def test_num_nodes_waiting_counts_waiting_plus_dead_members() -> None:
    cl = Cluster(min_nodes=3, max_nodes=4, last_call_timeout=0.0)
    form(cl, ["a", "b", "c"])
    cl.join("d", 1.0)
    cl.die("c", 2.0)
    assert cl.waiting(0) == 2


def test_num_nodes_waiting_is_at_least_one_for_an_agent_of_an_older_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, last_call_timeout=5.0)
    form(cl, ["a", "b"])
    cl.join("a", 1.0)  # round 1 opens, nobody waiting in it
    assert cl.job.round == 1
    assert cl.waiting(0) >= 1
    cl.join("b", 2.0)  # round 1 formed
    assert cl.job.state is JobState.COMPLETE
    assert cl.waiting(0) >= 1
    assert cl.waiting(1) == 0


def test_num_nodes_waiting_is_zero_for_a_closed_job() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.close(2.0)
    assert cl.waiting(0) == 0


# -- rule 5: departures ------------------------------------------------------------------------------------


def test_a_pending_node_that_leaves_is_removed() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    assert cl.leave("a", 1.0) is True
    assert "a" not in cl.job.nodes
    with pytest.raises(NodeNotFound):
        cl.sm.assignment(RDZV_ID, "a", 0)


def test_a_pending_node_that_dies_is_removed() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.die("c", 2.0)
    assert "c" not in cl.job.nodes
    assert cl.waiting(0) == 0


def test_leave_of_an_unknown_node_is_a_no_op() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    before = snapshot(cl.sm)["jobs"]
    assert cl.leave("nobody", 1.0) is False
    assert snapshot(cl.sm)["jobs"] == before


def test_leave_of_an_unknown_job_is_job_not_found() -> None:
    cl = Cluster()
    with pytest.raises(JobNotFound):
        cl.leave("a", 0.0)


def test_last_alive_member_leaving_opens_the_next_round_for_waiting_nodes() -> None:
    cl = Cluster(min_nodes=1, max_nodes=3, last_call_timeout=5.0)
    form(cl, ["a", "b"])
    cl.join("c", 6.0)
    assert cl.role("c") is Role.WAITING
    cl.leave("a", 7.0)
    assert cl.job.state is JobState.COMPLETE
    cl.leave("b", 8.0)
    assert cl.job.state is JobState.OPEN
    assert cl.job.round == 1
    assert cl.role("c") is Role.CANDIDATE
    assert cl.job.last_call_deadline == 13.0
    cl.tick(13.0)
    assert cl.ranks() == {"c": 0}


def test_last_alive_member_dying_opens_the_next_round_for_waiting_nodes() -> None:
    cl = Cluster(min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    form(cl, ["a"])
    cl.join("b", 1.0)
    cl.die("a", 2.0)
    assert cl.job.round == 1
    assert cl.ranks() == {"b": 0}


def test_a_departed_member_cannot_poll_its_assignment() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.leave("a", 1.0)
    with pytest.raises(NodeNotFound) as info:
        cl.sm.assignment(RDZV_ID, "a", 0)
    assert "left" in info.value.message
    cl.die("b", 2.0)
    with pytest.raises(NodeNotFound) as info:
        cl.sm.assignment(RDZV_ID, "b", 0)
    assert "dead" in info.value.message


def test_a_node_that_never_joined_is_node_not_found() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    with pytest.raises(NodeNotFound):
        cl.sm.assignment(RDZV_ID, "zz", 0)


def test_a_dead_member_that_rejoins_keeps_its_place_among_the_members() -> None:
    cl = Cluster(min_nodes=3, max_nodes=3)
    form(cl, ["a", "b", "c"])
    cl.die("a", 1.0)
    cl.join("c", 2.0)
    cl.join("b", 3.0)
    cl.join("a", 4.0)
    assert cl.ranks() == {"a": 0, "b": 1, "c": 2}


# -- join_timeout and heartbeats ------------------------------------------------------------------------


def test_join_timeout_expires_a_pending_node_and_assignment_raises_join_timeout() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, join_timeout=60.0, heartbeat_ttl=1000.0)
    cl.join("a", 0.0)
    assert cl.sm.deadline(RDZV_ID) == 60.0
    assert cl.sm.due(RDZV_ID, 59.999) == []
    assert cl.sm.due(RDZV_ID, 60.0) == [c.Expire(RDZV_ID, ("a",), "join_timeout")]
    cl.tick(60.0)
    assert "a" not in cl.job.nodes
    with pytest.raises(JoinTimeout) as info:
        cl.sm.assignment(RDZV_ID, "a", 0)
    assert info.value.status == 408


def test_join_timeout_expires_nodes_oldest_first_and_only_those_due() -> None:
    cl = Cluster(min_nodes=5, max_nodes=5, join_timeout=60.0, heartbeat_ttl=1000.0)
    cl.join("a", 0.0)
    cl.join("b", 10.0)
    cl.join("c", 20.0)
    assert cl.sm.due(RDZV_ID, 70.0) == [c.Expire(RDZV_ID, ("a", "b"), "join_timeout")]
    cl.tick(70.0)
    assert sorted(cl.job.nodes) == ["c"]
    assert cl.sm.deadline(RDZV_ID) == 80.0


def test_a_rejoin_after_join_timeout_starts_afresh() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, join_timeout=60.0)
    cl.join("a", 0.0)
    cl.tick(60.0)
    cl.join("a", 61.0)
    assert cl.role("a") is Role.CANDIDATE
    assert cl.sm.assignment(RDZV_ID, "a", 0) is None


def test_heartbeat_expiry_marks_a_member_dead_after_the_ttl() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, heartbeat_ttl=30.0)
    form(cl, ["a", "b"])
    cl.sm.heartbeat(RDZV_ID, "a", 20.0)
    assert cl.sm.deadline(RDZV_ID) == 30.0  # b's beat at 0 + ttl
    assert cl.sm.due(RDZV_ID, 29.999) == []
    assert cl.sm.due(RDZV_ID, 30.0) == [c.Expire(RDZV_ID, ("b",), "dead")]
    cl.tick(30.0)
    assert cl.job.nodes["b"].liveness is Liveness.DEAD
    assert cl.waiting(0) == 1
    assert cl.sm.deadline(RDZV_ID) == 50.0  # a's beat at 20 + ttl
    a = cl.sm.assignment(RDZV_ID, "a", 0)
    assert a is not None and a.node_rank == 0


def test_heartbeat_refreshes_liveness() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, heartbeat_ttl=30.0)
    form(cl, ["a", "b"])
    for t in (10.0, 20.0, 30.0, 40.0):
        cl.sm.heartbeat(RDZV_ID, "a", t)
        cl.sm.heartbeat(RDZV_ID, "b", t)
        assert cl.tick(t) == []
    assert cl.sm.due(RDZV_ID, 69.0) == []
    assert cl.sm.due(RDZV_ID, 70.0) == [c.Expire(RDZV_ID, ("a", "b"), "dead")]


def test_heartbeats_are_soft_state_and_never_change_the_snapshot() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    before = snapshot(cl.sm)
    cl.sm.heartbeat(RDZV_ID, "a", 5.0)
    cl.sm.heartbeat(RDZV_ID, "nobody", 5.0)
    assert snapshot(cl.sm) == before


def test_heartbeat_of_a_dead_or_unknown_node_is_ignored() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, heartbeat_ttl=30.0)
    form(cl, ["a", "b"])
    cl.die("b", 1.0)
    cl.sm.heartbeat(RDZV_ID, "b", 2.0)
    cl.sm.heartbeat(RDZV_ID, "zz", 2.0)
    assert set(cl.job.heartbeats) == {"a"}
    with pytest.raises(JobNotFound):
        cl.sm.heartbeat("no-such-job", "a", 2.0)


def test_a_dead_waiting_node_is_forgotten_and_not_counted() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0, heartbeat_ttl=30.0)
    form(cl, ["a", "b"])
    cl.join("c", 10.0)
    cl.sm.heartbeat(RDZV_ID, "a", 35.0)
    cl.sm.heartbeat(RDZV_ID, "b", 35.0)
    assert cl.sm.due(RDZV_ID, 40.0) == [c.Expire(RDZV_ID, ("c",), "dead")]
    cl.tick(40.0)
    assert "c" not in cl.job.nodes
    assert cl.waiting(0) == 0


# -- rule 5: join_timeout and standby nodes ------------------------------------------------------------


def beat(cl: Cluster, nodes: list[str], now: float) -> None:
    for node_id in nodes:
        cl.sm.heartbeat(RDZV_ID, node_id, now)


def test_a_standby_node_of_a_formed_round_never_passes_join_timeout() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, join_timeout=60.0, heartbeat_ttl=300.0)
    form(cl, ["a", "b"])
    cl.join("s", 1.0)
    assert cl.role("s") is Role.STANDBY
    assert cl.sm.deadline(RDZV_ID) == 300.0  # the heartbeats' TTL, no join deadline at 61
    for now in (61.0, 250.0, 500.0, 10_000.0):
        beat(cl, ["a", "b", "s"], now)
        assert cl.tick(now) == []
    assert cl.role("s") is Role.STANDBY
    assert cl.job.join_timed_out(1e9) == []
    assert cl.sm.assignment(RDZV_ID, "s", 1) is None  # still in line, as long as the job runs


def test_a_standby_node_still_dies_by_the_heartbeat_ttl() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, join_timeout=1e6, heartbeat_ttl=30.0)
    form(cl, ["a", "b"])
    cl.join("s", 1.0)
    beat(cl, ["a", "b"], 25.0)
    assert cl.sm.deadline(RDZV_ID) == 31.0
    assert cl.sm.due(RDZV_ID, 31.0) == [c.Expire(RDZV_ID, ("s",), "dead")]
    cl.tick(31.0)
    assert "s" not in cl.job.nodes
    with pytest.raises(NodeNotFound):
        cl.sm.assignment(RDZV_ID, "s", 1)
    assert cl.job.state is JobState.COMPLETE and cl.members() == ["a", "b"]  # the round never noticed


def test_candidates_and_waiting_nodes_still_pass_join_timeout_beside_a_spare() -> None:
    cl = Cluster(min_nodes=3, max_nodes=4, last_call_timeout=5.0, join_timeout=60.0, heartbeat_ttl=1e6)
    cl.join("x", 0.0)  # a candidate of round 0, which never gets its third node
    cl.join("y", 10.0)
    assert cl.sm.due(RDZV_ID, 60.0) == [c.Expire(RDZV_ID, ("x",), "join_timeout")]
    cl.tick(60.0)
    with pytest.raises(JoinTimeout):
        cl.sm.assignment(RDZV_ID, "x", 0)

    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0, join_timeout=60.0, heartbeat_ttl=1e6)
    form(cl, ["a", "b"])
    cl.join("w", 10.0)  # waiting (its agent-side peers never restart for it, say)
    cl.join("s", 11.0)  # standby: 2 alive members + 1 waiting reach max_nodes
    assert (cl.role("w"), cl.role("s")) == (Role.WAITING, Role.STANDBY)
    assert cl.sm.deadline(RDZV_ID) == 70.0
    assert cl.sm.due(RDZV_ID, 70.0) == [c.Expire(RDZV_ID, ("w",), "join_timeout")]
    cl.tick(70.0)
    assert "w" not in cl.job.nodes and cl.role("s") is Role.STANDBY
    assert cl.tick(1e5) == []


def test_a_standby_nodes_join_timeout_runs_from_the_opening_of_a_round_it_cannot_be_placed_in() -> None:
    """A spare that waited long is not timed out the moment a round opens (it gets the whole
    join_timeout to be placed), but one that cannot be placed does not wait forever either."""
    cl = Cluster(min_nodes=3, max_nodes=3, join_timeout=60.0, heartbeat_ttl=1e6)
    form(cl, ["a", "b", "c"])
    cl.join("s", 5.0)
    cl.die("b", 90.0)
    cl.die("c", 91.0)
    assert cl.tick(99.0) == []  # s in line for 94 s > join_timeout: still a spare
    cl.join("a", 100.0)  # the survivor re-joins: round 1 opens; a + s cannot reach min_nodes=3
    assert cl.job.state is JobState.OPEN and cl.role("s") is Role.STANDBY
    assert cl.sm.deadline(RDZV_ID) == 160.0
    assert cl.sm.due(RDZV_ID, 159.0) == []
    assert sorted(cl.tick(160.0)[0].node_ids) == ["a", "s"]
    assert "s" not in cl.job.nodes and not cl.job.nodes["a"].pending  # a stays listed as its old round's member
    with pytest.raises(JoinTimeout):
        cl.sm.assignment(RDZV_ID, "s", 1)


def test_a_standby_node_left_over_by_a_new_round_is_a_spare_again() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, join_timeout=60.0, heartbeat_ttl=1e6)
    form(cl, ["a", "b"])
    cl.join("s", 1.0)
    cl.join("t", 2.0)
    cl.die("a", 100.0)
    cl.join("b", 101.0)  # round 1 opens and forms at once: b keeps its rank, s takes a's; t overflows
    assert cl.members() == ["s", "b"] and cl.role("t") is Role.STANDBY
    assert cl.job.untimed == {"t": None} and not cl.job.join_clock
    assert cl.tick(1e5) == []
    assert cl.role("t") is Role.STANDBY


def test_a_stale_join_timeout_spares_a_node_that_became_a_spare_of_a_formed_round() -> None:
    """The timer saw s's join_timeout pass while a round formed; an earlier command of the same
    batch formed it and left s over as a spare: the expiry must not remove it (rule 5)."""
    cl = Cluster(min_nodes=2, max_nodes=2, last_call_timeout=5.0, join_timeout=60.0, heartbeat_ttl=1e6)
    form(cl, ["a", "b"])
    cl.join("s", 1.0)
    cl.join("t", 2.0)
    cl.die("b", 9.0)
    cl.join("a", 10.0)  # round 1 opens at 10: a, with s and t timed from 10; b is dead
    assert cl.job.state is JobState.COMPLETE  # a + s + t >= max_nodes and nobody expected: formed
    assert cl.role("t") is Role.STANDBY
    assert cl.apply(c.Expire(RDZV_ID, ("t",), "join_timeout"), 70.0) == {"expired": 0}
    assert cl.role("t") is Role.STANDBY


# -- rule 6: closed -----------------------------------------------------------------------------------------


def test_join_of_a_closed_job_with_live_nodes_is_job_closed_and_changes_nothing() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("w", 0.5)
    cl.close(1.0)
    assert cl.job.state is JobState.CLOSED
    before = snapshot(cl.sm)
    for node_id in ("c", "a", "w"):
        with pytest.raises(JobClosed) as info:
            cl.join(node_id, 2.0)
        assert info.value.status == 410
    assert snapshot(cl.sm) == before


def test_join_of_a_closed_job_with_live_nodes_is_job_closed_even_with_other_settings() -> None:
    """Rule 6: joins fail with JobClosed while a node of the closed run is alive or pending
    (the agent must stop, not be told to fix its --nnodes)."""
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.close(1.0)
    before = snapshot(cl.sm)
    with pytest.raises(JobClosed):
        cl.join("d", 2.0, max_nodes=9)
    assert snapshot(cl.sm) == before


def test_a_closed_job_stays_closed_while_one_member_is_alive() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.close(1.0)
    cl.leave("a", 2.0)
    with pytest.raises(JobClosed):
        cl.join("a", 3.0)
    cl.die("b", 4.0)
    cl.join("a", 5.0)  # every node departed: a fresh run
    assert cl.job.state is JobState.OPEN


def test_a_join_after_every_node_of_a_closed_job_departed_starts_a_fresh_run() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.apply(c.Set(RDZV_ID, b"k", b"job"), 0.5)
    cl.apply(c.Set(RDZV_ID, b"k", b"r0", round=0), 0.5)
    cl.close(1.0)
    cl.leave("a", 2.0)
    cl.leave("b", 2.0)
    assert cl.job.idle()
    assert cl.join("b", 3.0, min_nodes=1, max_nodes=3) == 1  # next round number, new settings adopted
    job = cl.job
    assert job.runs == 1
    assert (job.state, job.round) == (JobState.OPEN, 1)
    assert (job.settings.min_nodes, job.settings.max_nodes) == (1, 3)
    assert job.closed_at is None
    assert sorted(job.nodes) == ["b"]
    assert cl.role("b") is Role.CANDIDATE
    assert job.members == []
    kv = cl.sm.kv(RDZV_ID)
    assert kv.total_keys() == 0  # the fresh run starts with no keys
    cl.join("a", 4.0, min_nodes=1, max_nodes=3)
    cl.tick(4.0 + cl.settings["last_call_timeout"])
    assert cl.ranks() == {"a": 0, "b": 1}  # new nodes by host: nothing carried over from the closed run


def test_a_fresh_run_replays_and_restores_exactly() -> None:
    cl = Cluster(min_nodes=1, max_nodes=1)
    cl.join("a", 0.0)
    cl.apply(c.Set(RDZV_ID, b"k", b"v"), 0.5)
    cl.close(1.0)
    cl.leave("a", 2.0)
    cl.join("a", 3.0)
    assert cl.replay().to_snapshot() == cl.sm.to_snapshot()
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(copy.deepcopy(cl.sm.to_snapshot()))
    assert restored.job(RDZV_ID).runs == 1
    assert restored.to_snapshot() == cl.sm.to_snapshot()


def test_assignment_of_a_closed_job_is_job_closed() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.close(1.0)
    with pytest.raises(JobClosed):
        cl.sm.assignment(RDZV_ID, "a", 0)
    with pytest.raises(JobClosed):
        cl.sm.assignment(RDZV_ID, "nobody", 0)


def test_standby_and_waiting_nodes_of_a_closed_job_are_told_they_were_in_line() -> None:
    """They waited for a round that will never come and were no part of the run: their agents
    exit gracefully (torch's redundancy list); members and candidates get JobClosed."""
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("w", 1.0)  # waiting
    cl.join("s", 2.0)  # standby
    cl.close(3.0)
    for node_id in ("w", "s"):
        with pytest.raises(JobClosedInLine) as in_line:
            cl.sm.assignment(RDZV_ID, node_id, 1)
        assert (in_line.value.code, in_line.value.status) == ("job_closed_in_line", 410)
        assert node_id in in_line.value.message and RDZV_ID in in_line.value.message
    for node_id in ("a", "b", "nobody"):
        with pytest.raises(JobClosed) as closed:
            cl.sm.assignment(RDZV_ID, node_id, 0)
        assert type(closed.value) is JobClosed


def test_a_candidate_of_a_round_that_was_forming_when_the_job_closed_is_job_closed() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=10.0, join_timeout=60.0, heartbeat_ttl=1e6)
    cl.join("a", 0.0)
    cl.join("b", 0.0)
    cl.tick(10.0)
    cl.join("w", 11.0)  # waiting
    cl.join("s", 12.0)  # standby
    cl.join("a", 13.0)  # round 1 opens: a and w candidates, s standby (timed while it forms)
    assert (cl.role("w"), cl.role("s")) == (Role.CANDIDATE, Role.STANDBY)
    cl.close(14.0)
    for node_id in ("a", "w"):
        with pytest.raises(JobClosed) as closed:
            cl.sm.assignment(RDZV_ID, node_id, 1)
        assert type(closed.value) is JobClosed
    with pytest.raises(JobClosedInLine):
        cl.sm.assignment(RDZV_ID, "s", 1)
    assert cl.job.untimed == {"s": None}  # no round forms any more: it goes when its agent leaves
    assert cl.job.join_timed_out(73.0) == ["w", "a"]  # joined at 11, re-joined at 13


def test_a_retried_join_of_a_standby_node_of_a_closed_job_is_job_closed_in_line_and_changes_nothing() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.join("s", 1.0)
    cl.close(2.0)
    before = snapshot(cl.sm)
    with pytest.raises(JobClosedInLine):
        cl.join("s", 3.0)
    with pytest.raises(JobClosed) as closed:
        cl.join("newcomer", 3.0)
    assert type(closed.value) is JobClosed
    assert snapshot(cl.sm) == before


def test_close_of_an_open_job_drops_its_last_call() -> None:
    cl = Cluster(min_nodes=2, max_nodes=4, last_call_timeout=10.0, join_timeout=1e6, heartbeat_ttl=1e6)
    cl.join("a", 0.0)
    cl.join("b", 0.0)
    cl.close(1.0)
    assert cl.job.last_call_deadline is None
    assert [x for x in cl.sm.due(RDZV_ID, 10.0) if isinstance(x, c.LastCall)] == []
    assert cl.apply(c.LastCall(RDZV_ID, 0), 10.0) == {"formed": False}
    assert cl.job.state is JobState.CLOSED


def test_close_twice_is_a_no_op() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.close(1.0)
    before = snapshot(cl.sm)["jobs"]
    cl.close(2.0)
    assert snapshot(cl.sm)["jobs"] == before
    assert cl.job.closed_at == 1.0


def test_departures_from_a_closed_job_just_forget_nodes() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    cl.join("c", 1.0)
    cl.close(2.0)
    assert cl.leave("c", 3.0) is True
    assert "c" not in cl.job.nodes
    cl.die("a", 3.0)
    cl.leave("b", 3.0)
    assert cl.job.state is JobState.CLOSED
    assert cl.job.round == 0


def test_close_of_an_unknown_job_is_job_not_found() -> None:
    cl = Cluster()
    with pytest.raises(JobNotFound):
        cl.close(0.0)


# -- collect ------------------------------------------------------------------------------------------------


def test_a_closed_job_is_collected_after_the_job_ttl() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, heartbeat_ttl=1e9, join_timeout=1e9)
    form(cl, ["a", "b"])
    cl.close(10.0)
    assert cl.sm.deadline(RDZV_ID) == 10.0 + JOB_TTL
    assert cl.sm.due(RDZV_ID, 10.0 + JOB_TTL - 0.001) == []
    assert cl.sm.due(RDZV_ID, 10.0 + JOB_TTL) == [c.Collect(RDZV_ID)]
    outcome = cl.sm.apply(c.Collect(RDZV_ID), 10.0 + JOB_TTL)
    assert outcome.result == {"collected": True}
    assert round_topic(RDZV_ID) in outcome.wakes
    with pytest.raises(JobNotFound):
        cl.sm.job(RDZV_ID)
    assert cl.sm.due(RDZV_ID, 1e9) == []
    assert cl.sm.deadline(RDZV_ID) is None
    assert cl.sm.apply(c.Collect(RDZV_ID), 1e9).result == {"collected": False}


def test_an_idle_job_is_collected_after_the_job_ttl() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2, heartbeat_ttl=1e9, join_timeout=1e9)
    form(cl, ["a", "b"])
    assert cl.job.idle_since is None
    assert cl.sm.deadline(RDZV_ID) == 1e9
    cl.leave("a", 5.0)
    cl.leave("b", 6.0)
    assert cl.job.idle_since == 6.0
    assert cl.sm.deadline(RDZV_ID) == 6.0 + JOB_TTL
    assert cl.sm.due(RDZV_ID, 6.0 + JOB_TTL - 0.001) == []
    assert cl.sm.due(RDZV_ID, 6.0 + JOB_TTL) == [c.Collect(RDZV_ID)]
    cl.tick(6.0 + JOB_TTL)
    assert RDZV_ID not in cl.sm.jobs


def test_a_created_job_that_nobody_joins_is_collected() -> None:
    cl = Cluster()
    cl.apply(c.Create(RDZV_ID, JobSettings(1, 2, 0.0, 1.0, 1.0)), 3.0)
    assert cl.job.idle_since == 3.0
    assert cl.sm.due(RDZV_ID, 3.0 + JOB_TTL) == [c.Collect(RDZV_ID)]


def test_a_join_cancels_the_idle_collection() -> None:
    cl = Cluster(heartbeat_ttl=1e9, join_timeout=1e9)
    cl.join("a", 0.0)
    cl.leave("a", 1.0)
    assert cl.job.idle_since == 1.0
    cl.join("b", 2.0)
    assert cl.job.idle_since is None
    assert cl.sm.due(RDZV_ID, 1.0 + JOB_TTL) == []


def test_the_last_member_leaving_with_nobody_waiting_keeps_the_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.leave("a", 1.0)
    cl.leave("b", 2.0)
    assert (cl.job.state, cl.job.round) == (JobState.COMPLETE, 0)
    assert cl.waiting(0) == 0  # both left gracefully
    assert cl.job.idle() and cl.job.idle_since == 2.0


def test_a_collected_job_id_can_be_used_again() -> None:
    cl = Cluster(min_nodes=1, max_nodes=1)
    cl.join("a", 0.0)
    cl.close(1.0)
    cl.tick(1.0 + JOB_TTL)
    assert cl.join("a", 2.0 + JOB_TTL) == 0
    assert cl.ranks() == {"a": 0}


# -- describe --------------------------------------------------------------------------------------------------


def test_describe_has_the_membership_document_of_the_design() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=5.0, heartbeat_ttl=100.0)
    form(cl, ["a", "b"], nprocs=[2, 3])  # formed at t=5 by the last call
    cl.join("w", 10.0)
    cl.join("s", 11.0)
    cl.sm.heartbeat(RDZV_ID, "a", 12.0)
    doc = describe(cl.job, 12.5)
    for name in (
        "rdzv_id", "state", "round", "min_nodes", "max_nodes", "num_nodes", "world_size", "nodes", "waiting", "standby",
    ):
        assert name in doc
    assert doc["rdzv_id"] == RDZV_ID
    assert doc["state"] == "complete"
    assert (doc["round"], doc["min_nodes"], doc["max_nodes"]) == (0, 2, 3)
    assert (doc["num_nodes"], doc["world_size"]) == (2, 5)
    assert doc["num_nodes_waiting"] == 1
    a, b = doc["nodes"]
    for entry in (a, b):
        assert {"node_id", "addr", "node_rank", "nproc_per_node", "global_ranks", "alive", "last_heartbeat_age_s"} <= set(entry)
    assert a == {
        "node_id": "a", "addr": "a.example", "node_rank": 0, "nproc_per_node": 2, "global_ranks": [0, 1],
        "alive": True, "status": "alive", "last_heartbeat_age_s": 0.5, "topology": None,
    }
    assert (b["node_id"], b["node_rank"], b["global_ranks"], b["last_heartbeat_age_s"]) == ("b", 1, [2, 3, 4], 12.5)
    assert ids(doc["waiting"]) == ["w"]
    assert ids(doc["standby"]) == ["s"]
    assert doc["waiting"][0]["node_rank"] is None and doc["waiting"][0]["status"] == "waiting"


def test_describe_marks_a_dead_member_not_alive() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.die("b", 1.0)
    doc = describe(cl.job, 2.0)
    entry = doc["nodes"][1]
    assert (entry["node_id"], entry["alive"], entry["status"], entry["last_heartbeat_age_s"]) == ("b", False, "dead", None)
    assert entry["node_rank"] == 1


def test_describe_of_an_open_job_has_no_formed_round_size() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    doc = describe(cl.job, 1.0)
    assert (doc["state"], doc["num_nodes"], doc["world_size"], doc["nodes"]) == ("open", 0, 0, [])
    assert ids(doc["joining"]) == ["a"]


def test_describe_of_a_closed_job() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.close(1.0)
    doc = describe(cl.job, 1.0)
    # a closed job still shows its last formed round
    assert (doc["state"], doc["num_nodes"], doc["world_size"], doc["num_nodes_waiting"]) == ("closed", 2, 2, 0)
    assert ids(doc["nodes"]) == ["a", "b"]


def test_summary_lists_state_round_and_node_count() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"], nprocs=[2, 2])
    cl.join("c", 1.0)
    assert job_summary(cl.job.summary()) == {
        "rdzv_id": RDZV_ID, "state": "complete", "round": 0, "num_nodes": 2, "world_size": 4,
        "min_nodes": 2, "max_nodes": 3, "pending": 1,
    }


# -- the transition table ----------------------------------------------------------------------------------


def test_last_call_in_a_complete_job_is_an_illegal_transition() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    with pytest.raises(IllegalTransition):
        cl.job._dispatch(Event.LAST_CALL, 1.0)


@pytest.mark.parametrize("event", [Event.LAST_CALL, Event.CLOSE])
def test_pairs_missing_from_the_table_in_a_closed_job_are_illegal_transitions(event: Event) -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.close(1.0)
    with pytest.raises(IllegalTransition) as info:
        cl.job._dispatch(event, 2.0)
    assert RDZV_ID in str(info.value)


def test_illegal_transition_is_not_a_client_error() -> None:
    from rdzv_server.core.error import RdzvError

    assert not issubclass(IllegalTransition, RdzvError)


# -- the exactly-once window -----------------------------------------------------------------------------------


def test_a_retry_with_the_same_rid_gets_the_recorded_result_and_applies_once() -> None:
    cl = Cluster()
    cl.apply(c.Create(RDZV_ID, JobSettings(1, 1, 0.0, 1.0, 1.0)), 0.0)
    first = cl.sm.apply(c.Add(RDZV_ID, b"n", 5), 1.0, ("client", 1))
    retry = cl.sm.apply(c.Add(RDZV_ID, b"n", 5), 2.0, ("client", 1))
    assert first.result == retry.result == {"value": 5}
    assert (first.replayed, retry.replayed) == (False, True)
    assert retry.wakes == ()
    assert cl.sm.kv(RDZV_ID).get(None, b"n") == b"5"


def test_a_new_seq_or_another_client_applies_again() -> None:
    cl = Cluster()
    cl.apply(c.Create(RDZV_ID, JobSettings(1, 1, 0.0, 1.0, 1.0)), 0.0)
    assert cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 1.0, ("client", 1)).result == {"value": 1}
    assert cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 1.0, ("client", 2)).result == {"value": 2}
    assert cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 1.0, ("other", 1)).result == {"value": 3}
    assert cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 1.0).result == {"value": 4}
    assert cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 1.0).result == {"value": 5}  # no rid: no dedup


def test_a_retried_join_gets_the_recorded_round() -> None:
    cl = Cluster(min_nodes=1, max_nodes=1)
    first = cl.sm.apply(cl.join_command("a"), 0.0, ("agent-a", 7))
    assert first.result == {"round": 0}
    cl.join("a", 1.0)  # a member re-joins: round 1
    retry = cl.sm.apply(cl.join_command("a"), 2.0, ("agent-a", 7))
    assert retry.replayed and retry.result == {"round": 0}
    assert cl.job.round == 1


def test_the_window_keeps_the_last_dedup_window_results_per_client() -> None:
    cl = Cluster()
    cl.apply(c.Create(RDZV_ID, JobSettings(1, 1, 0.0, 1.0, 1.0)), 0.0)
    for seq in range(DEDUP_WINDOW + 1):
        cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 1.0, ("client", seq))
    assert len(cl.sm.sessions["client"].results) == DEDUP_WINDOW
    assert 0 not in cl.sm.sessions["client"].results
    newest = cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 2.0, ("client", DEDUP_WINDOW))
    assert newest.replayed and newest.result == {"value": DEDUP_WINDOW + 1}
    oldest = cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 2.0, ("client", 1))
    assert oldest.replayed and oldest.result == {"value": 2}
    forgotten = cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 2.0, ("client", 0))
    assert not forgotten.replayed  # fell out of the window: applied again
    assert forgotten.result == {"value": DEDUP_WINDOW + 2}
    assert len(cl.sm.sessions["client"].results) == DEDUP_WINDOW


@pytest.mark.parametrize(
    "command",
    [
        c.Add(RDZV_ID, b"text", 1),
        c.Set(RDZV_ID, b"k", b"x" * (MAX_VALUE_BYTES + 1)),
        c.Append(RDZV_ID, b"text", b"x" * MAX_VALUE_BYTES),
        c.CompareSet(RDZV_ID, b"text", b"abc", b"x" * (MAX_VALUE_BYTES + 1)),
        c.MultiSet(RDZV_ID, (b"a", b"b"), (b"1", b"x" * (MAX_VALUE_BYTES + 1))),
        c.MultiSet(RDZV_ID, (b"a", b"b"), (b"1",)),
        c.Set("no-such-job", b"k", b"v"),
        c.Leave("no-such-job", "a"),
    ],
    ids=["add-not-integer", "set-too-large", "append-too-large", "cas-too-large", "multi-set-too-large",
         "multi-set-mismatch", "set-unknown-job", "leave-unknown-job"],
)
def test_a_failed_command_changes_nothing_not_even_the_window_or_clock(command: c.Command) -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.apply(c.Set(RDZV_ID, b"text", b"abc"), 1.0, ("client", 1))
    before = snapshot(cl.sm)
    with pytest.raises((NotAnInteger, ValueTooLarge, BadRequest, JobNotFound)):
        cl.sm.apply(command, 5.0, ("client", 2))
    assert snapshot(cl.sm) == before
    assert cl.sm.clock == 1.0
    assert 2 not in cl.sm.sessions["client"].results


def test_a_failed_command_in_a_new_round_space_changes_nothing() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    before = snapshot(cl.sm)
    for command in (
        c.CompareSet(RDZV_ID, b"k", b"", b"x" * (MAX_VALUE_BYTES + 1), round=0),
        c.Append(RDZV_ID, b"k", b"x" * (MAX_VALUE_BYTES + 1), round=0),
    ):
        with pytest.raises(ValueTooLarge):
            cl.sm.apply(command, 5.0, ("client", 2))
        assert snapshot(cl.sm) == before


def test_a_failed_command_with_a_rid_may_be_retried() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.apply(c.Set(RDZV_ID, b"n", b"abc"), 1.0)
    with pytest.raises(NotAnInteger):
        cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 2.0, ("client", 1))
    cl.apply(c.Set(RDZV_ID, b"n", b"41"), 3.0)
    assert cl.sm.apply(c.Add(RDZV_ID, b"n", 1), 4.0, ("client", 1)).result == {"value": 42}


def test_store_commands_on_an_unknown_job_are_job_not_found() -> None:
    sm = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    with pytest.raises(JobNotFound) as info:
        sm.apply(c.Set("nope", b"k", b"v"), 0.0)
    assert info.value.status == 404
    with pytest.raises(JobNotFound):
        sm.kv("nope")
    assert sm.jobs == {}


# -- the apply path: store ops, clock, wakes ---------------------------------------------------------------------


def test_store_commands_reach_the_jobs_key_spaces() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    cl.apply(c.Set(RDZV_ID, b"k", b"job"), 1.0)
    cl.apply(c.Set(RDZV_ID, b"k", b"r0", round=0), 1.0)
    assert cl.apply(c.Add(RDZV_ID, b"n", 3, round=0), 1.0) == {"value": 3}
    assert cl.apply(c.CompareSet(RDZV_ID, b"k", b"job", b"new"), 1.0) == {"value": b"new"}
    cl.apply(c.Append(RDZV_ID, b"k", b"+"), 1.0)
    cl.apply(c.MultiSet(RDZV_ID, (b"x", b"y"), (b"1", b"2")), 1.0)
    assert cl.apply(c.DeleteKey(RDZV_ID, b"x"), 1.0) == {"deleted": True}
    assert cl.apply(c.DeleteKey(RDZV_ID, b"x"), 1.0) == {"deleted": False}
    kv = cl.sm.kv(RDZV_ID)
    assert kv.get(None, b"k") == b"new+"
    assert kv.get(0, b"k") == b"r0"
    assert kv.list_keys(None, b"") == [b"k", b"y"]
    assert kv.list_keys(0, b"") == [b"k", b"n"]


def test_jobs_never_see_each_others_keys() -> None:
    cl = Cluster()
    cl.apply(c.Create("j1", JobSettings(1, 1, 0.0, 1.0, 1.0)), 0.0)
    cl.apply(c.Create("j2", JobSettings(1, 1, 0.0, 1.0, 1.0)), 0.0)
    cl.apply(c.Set("j1", b"k", b"one"), 1.0)
    assert cl.sm.kv("j2").get(None, b"k") is None
    cl.apply(c.Set("j2", b"k", b"two"), 1.0)
    assert cl.sm.kv("j1").get(None, b"k") == b"one"


def test_a_store_write_wakes_its_key_topic() -> None:
    cl = Cluster()
    cl.join("a", 0.0)
    assert cl.sm.apply(c.Set(RDZV_ID, b"k", b"v", round=0), 1.0).wakes == (key_topic(RDZV_ID, 0, b"k"),)
    assert cl.sm.apply(c.MultiSet(RDZV_ID, (b"a", b"b"), (b"1", b"2")), 1.0).wakes == (
        key_topic(RDZV_ID, None, b"a"),
        key_topic(RDZV_ID, None, b"b"),
    )


def test_a_departure_from_the_line_wakes_only_that_nodes_poll() -> None:
    # Thousands of nodes in line: one leaving (or expiring) must not wake every other's poll.
    cl = Cluster(min_nodes=3, max_nodes=3, heartbeat_ttl=10.0)
    for i, node in enumerate("abc"[:2]):
        cl.join(node, float(i))
    outcome = cl.sm.apply(c.Leave(RDZV_ID, "a"), 3.0)
    assert outcome.wakes[0] == node_topic(RDZV_ID, "a")
    assert round_topic(RDZV_ID) not in outcome.wakes
    outcome = cl.sm.apply(c.Expire(RDZV_ID, ("b",), "dead", ""), 4.0)
    assert node_topic(RDZV_ID, "b") in outcome.wakes and round_topic(RDZV_ID) not in outcome.wakes


def test_while_the_next_round_is_open_more_joins_do_not_wake_the_watchers() -> None:
    # Rule 4: watchers of the formed round see "at least 1" once the next round is open; each
    # of thousands of re-joins must not wake (and answer) every parked watch.
    cl = Cluster(min_nodes=3, max_nodes=3)
    form(cl, ["a", "b", "c"])
    first = cl.sm.apply(cl.join_command("a"), 5.0)
    assert watch_topic(RDZV_ID) in first.wakes  # the round opened: watchers must re-join
    second = cl.sm.apply(cl.join_command("b"), 6.0)
    assert watch_topic(RDZV_ID) not in second.wakes
    assert cl.job.num_nodes_waiting(cl.job.round - 1) >= 1
    third = cl.sm.apply(cl.join_command("c"), 7.0)
    assert watch_topic(RDZV_ID) in third.wakes  # formed: state and round changed


def test_forming_a_round_wakes_round_and_watch_waiters() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    cl.join("a", 0.0)
    outcome = cl.sm.apply(cl.join_command("b"), 1.0)
    assert round_topic(RDZV_ID) in outcome.wakes
    assert watch_topic(RDZV_ID) in outcome.wakes


def test_a_waiting_node_wakes_watchers_of_the_formed_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=0.0)
    form(cl, ["a", "b"])
    outcome = cl.sm.apply(cl.join_command("c"), 1.0)
    assert watch_topic(RDZV_ID) in outcome.wakes


def test_the_clock_is_the_latest_now_applied() -> None:
    cl = Cluster()
    cl.join("a", 5.0)
    cl.join("b", 3.0)
    assert cl.sm.clock == 5.0
    cl.sm.heartbeat(RDZV_ID, "a", 9.0)  # reads and soft state do not move it
    assert cl.sm.clock == 5.0


def test_forming_a_round_drops_key_spaces_older_than_the_previous_round() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"])
    cl.apply(c.Set(RDZV_ID, b"k", b"job"), 1.0)
    cl.apply(c.Set(RDZV_ID, b"k", b"r0", round=0), 1.0)
    cl.join("a", 2.0)
    cl.join("b", 2.0)  # round 1 forms: round 0 is still the previous one
    kv = cl.sm.kv(RDZV_ID)
    assert kv.get(0, b"k") == b"r0"
    cl.apply(c.Set(RDZV_ID, b"k", b"r1", round=1), 3.0)
    cl.join("a", 4.0)
    cl.join("b", 4.0)  # round 2 forms
    assert kv.get(0, b"k") is None
    assert kv.get(1, b"k") == b"r1"
    assert kv.get(None, b"k") == b"job"


# -- snapshot / restore / replay ----------------------------------------------------------------------------------


def busy_cluster() -> Cluster:
    """A job with members, a dead member, waiting and standby nodes, keys and a session window."""
    cl = Cluster(min_nodes=2, max_nodes=3, last_call_timeout=5.0, join_timeout=500.0, heartbeat_ttl=50.0)
    form(cl, ["a", "b", "c"], nprocs=[1, 2, 3])
    cl.join("d", 6.0)  # standby
    cl.die("b", 7.0)
    cl.join("e", 8.0, nproc=2)  # waiting (2 alive members + 0 waiting < 3)
    cl.apply(c.Set(RDZV_ID, b"k", b"v"), 9.0, ("client", 1))
    cl.apply(c.Add(RDZV_ID, b"n", 3, round=0), 9.0, ("client", 2))
    cl.apply(c.Create("other", JobSettings(1, 1, 0.0, 1.0, 1.0)), 9.5)
    cl.join("a", 10.0)  # round 1 opens: a and e candidates, c expected
    cl.join("f", 11.0)  # third candidate: round 1 forms as a, e, f; d stays standby; c is dropped
    cl.join("c", 12.0)  # c comes back as a newcomer to a full round: standby
    cl.join("g", 13.0)
    cl.leave("a", 14.0)
    return cl


def assert_same_behaviour(live: StateMachine, restored: StateMachine, now: float) -> None:
    assert restored.to_snapshot() == live.to_snapshot()
    for rdzv_id in live.jobs:
        lj, rj = live.job(rdzv_id), restored.job(rdzv_id)
        assert without_heartbeat_ages(describe(rj, now)) == without_heartbeat_ages(describe(lj, now))
        assert rj.summary() == lj.summary()
        assert +rj.counts == +lj.counts
        assert dict(rj.join_clock) == dict(lj.join_clock) and rj.untimed == lj.untimed
        assert rj.world_size() == lj.world_size()
        for round_ in range(lj.round + 1):
            assert rj.num_nodes_waiting(round_) == lj.num_nodes_waiting(round_)
        for node_id in lj.nodes:
            for round_ in range(lj.round + 1):
                assert outcome_of(rj.assignment, node_id, round_) == outcome_of(lj.assignment, node_id, round_)


def outcome_of(call: Any, *args: Any) -> Any:
    """What ``call(*args)`` returns, or the type and text of what it raises: comparable."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - compared by type and text
        return (type(exc), str(exc))


def test_a_snapshot_of_an_earlier_release_with_a_job_version_restores_to_the_same_state() -> None:
    cl = busy_cluster()
    data = copy.deepcopy(cl.sm.to_snapshot())
    for job, _kv in data["jobs"]:
        job["version"] = 17  # earlier releases counted membership changes here; nothing read it
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(data)
    assert restored.to_snapshot() == cl.sm.to_snapshot()
    assert_same_behaviour(cl.sm, restored, 20.0)


def test_restore_reproduces_snapshot_describe_and_assignments() -> None:
    cl = busy_cluster()
    data = copy.deepcopy(cl.sm.to_snapshot())
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(data)
    assert_same_behaviour(cl.sm, restored, 20.0)
    assert restored.clock == cl.sm.clock
    assert restored.sessions == cl.sm.sessions


def test_restore_gives_every_live_node_one_ttl_of_grace() -> None:
    cl = busy_cluster()
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(copy.deepcopy(cl.sm.to_snapshot()))
    restored.reset_heartbeats(100.0)
    job = restored.job(RDZV_ID)
    live = {n.node_id for n in job.nodes.values() if n.pending or (n.role is Role.MEMBER and n.liveness is Liveness.ALIVE)}
    assert set(job.heartbeats) == live
    assert set(job.heartbeats.values()) == {100.0}
    assert [x for x in restored.due(RDZV_ID, 149.0) if isinstance(x, c.Expire) and x.why == "dead"] == []
    assert sorted(next(x for x in restored.due(RDZV_ID, 150.0) if isinstance(x, c.Expire)).node_ids) == sorted(live)


def test_a_restored_machine_goes_on_exactly_like_the_live_one() -> None:
    cl = busy_cluster()
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(copy.deepcopy(cl.sm.to_snapshot()))
    more = [
        (cl.join_command("h"), 20.0),  # waiting
        (cl.join_command("c"), 20.5),  # a retried join of a standby node
        (cl.join_command("f"), 21.0),  # round 2 opens; e expected
        (c.Expire(RDZV_ID, ("e",), "dead"), 22.0),  # rule 2b: f, h, then standby d
        (cl.join_command("g"), 23.0),
        (c.LastCall(RDZV_ID, 2), 40.0),
        (c.Add(RDZV_ID, b"n", 1, round=0), 41.0),
        (c.Close(RDZV_ID), 42.0),
    ]
    for command, now in more:
        assert outcome_of(restored.apply, command, now) == outcome_of(cl.sm.apply, command, now)
        assert restored.to_snapshot() == cl.sm.to_snapshot()


def test_replaying_the_applied_commands_rebuilds_the_same_state() -> None:
    cl = busy_cluster()
    cl.tick(60.0)  # heartbeat expiry and last call, through commands
    cl.close(61.0)
    cl.tick(61.0 + JOB_TTL)
    replayed = cl.replay()
    assert replayed.to_snapshot() == cl.sm.to_snapshot()


def test_replay_with_rids_rebuilds_the_window() -> None:
    cl = busy_cluster()
    replayed = cl.replay()
    assert replayed.to_snapshot() == cl.sm.to_snapshot()
    assert replayed.apply(c.Add(RDZV_ID, b"n", 3, round=0), 30.0, ("client", 2)).replayed


def test_the_busy_scenario_is_what_the_snapshot_tests_think_it_is() -> None:
    cl = busy_cluster()
    job = cl.job
    assert job.state is JobState.COMPLETE and job.round == 1
    roles = {n.node_id: (n.role, n.liveness) for n in job.nodes.values()}
    assert roles["a"] == (Role.MEMBER, Liveness.LEFT)
    assert job.members == ["a", "e", "f"]
    assert [roles[n] for n in ("e", "f")] == [(Role.MEMBER, Liveness.ALIVE)] * 2
    assert [n for n, (r, _) in roles.items() if r is Role.STANDBY] == ["d", "c", "g"]
    assert "b" not in job.nodes
    assert job.world_size() == 1 + 2 + 1


def test_a_join_timeout_made_stale_by_an_earlier_command_of_the_same_batch_spares_a_formed_member() -> None:
    """due() detects both expiries at once; applying the first (a's death) admits b into round 1,
    so b is no longer pending when its join_timeout expiry is applied (rule 5 removes *pending*
    nodes that pass join_timeout; like a stale LastCall, a stale expiry must not hit a member)."""
    cl = Cluster(min_nodes=1, max_nodes=2, last_call_timeout=0.0, join_timeout=10.0, heartbeat_ttl=5.0)
    cl.join("a", 0.0)  # round 0 forms at once
    cl.join("b", 1.0)  # waiting
    cl.sm.heartbeat(RDZV_ID, "b", 8.0)
    assert cl.sm.due(RDZV_ID, 11.0) == [
        c.Expire(RDZV_ID, ("a",), "dead"),
        c.Expire(RDZV_ID, ("b",), "join_timeout"),
    ]
    cl.tick(11.0)
    assert cl.job.state is JobState.COMPLETE
    assert cl.job.round == 1
    assert cl.job.nodes["b"].liveness is Liveness.ALIVE
    assert cl.ranks() == {"b": 0}


def test_restore_keeps_the_world_size_of_a_job_closed_while_a_member_rejoined_with_another_nproc() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"], nprocs=[1, 1])  # world_size 2
    cl.join("a", 1.0, nproc=2)  # round 1 opens; a is back in line with 2 workers
    cl.close(2.0)
    assert cl.job.world_size() == 2  # a closed job shows its last formed round
    restored = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
    restored.restore(copy.deepcopy(cl.sm.to_snapshot()))
    assert restored.job(RDZV_ID).world_size() == cl.job.world_size()
    assert restored.job(RDZV_ID).summary() == cl.job.summary()


def test_describe_keeps_the_last_rounds_global_ranks_disjoint_after_a_member_rejoined_with_another_nproc() -> None:
    cl = Cluster(min_nodes=2, max_nodes=2)
    form(cl, ["a", "b"], nprocs=[1, 1])
    cl.join("a", 1.0, nproc=2)  # round 1 opens
    cl.die("a", 2.0)  # a is a dead member of round 0 again
    doc = describe(cl.job, 2.0)
    ranks = [r for entry in doc["nodes"] for r in entry["global_ranks"]]
    assert len(ranks) == len(set(ranks)), doc["nodes"]
