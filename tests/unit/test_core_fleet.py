"""Fleet control in core (issue 16): the cordon table, admission through it, refusals in the
timeline, the deaths automatic quarantine counts, and that all of it replays and survives a
snapshot. Driven in memory through the one apply path with a fake clock."""

from __future__ import annotations

import pytest
from machine_log import MachineLog

from rdzv_client.record import JobSettings, WireError
from rdzv_server.api.document import cordon_entry, job_document
from rdzv_server.core import command as c
from rdzv_server.core.cordon import MAX_DEATHS_PER_HOST, CordonTable
from rdzv_server.core.error import HostCordoned, JobClosed, NodeNotFound
from rdzv_server.core.machine import StateMachine
from rdzv_server.core.rank import Candidate, Tier, natural_key, place

JOB = "job"


class Log(MachineLog):
    def __init__(self) -> None:
        super().__init__(JOB)


def test_a_cordon_matches_a_node_by_address_or_host_name_until_it_ends() -> None:
    table = CordonTable()
    table.cordon("node7", 10.0, 60.0, "bad DIMM", "operator")
    assert table.match(20.0, "10.0.0.7", "node7") is not None
    assert table.match(20.0, "node7", "") is not None
    assert table.match(20.0, "node66", "node66.example") is None
    assert table.match(70.0, "node7") is None  # ended at 10 + 60
    assert [cordon_entry(one, 20.0) for one in table.listing(20.0)] == [
        {"host": "node7", "since": 10.0, "until": 70.0, "left_s": 50.0, "reason": "bad DIMM", "by": "operator"}
    ]
    assert table.prune(69.9) == [] and len(table) == 1
    assert [c.host for c in table.prune(70.0)] == ["node7"] and len(table) == 0


def test_deaths_are_counted_per_host_within_a_window_and_bounded() -> None:
    table = CordonTable()
    for t in (1.0, 2.0, 50.0):
        table.record_death("h", t)
    assert table.deaths_within("h", 50.0, 10.0) == 1
    assert table.deaths_within("h", 50.0, 60.0) == 3
    for t in range(1000):
        table.record_death("h", 100.0 + t)
    assert table.deaths_within("h", 2000.0, 1e9) == MAX_DEATHS_PER_HOST


def test_a_cordoned_host_is_refused_with_the_cordon_named_and_nothing_changes() -> None:
    log = Log()
    log.join("a", 0.0, addr="10.0.0.1")
    log.apply(c.Cordon("", host="node7", reason="bad DIMM", duration=None), 1.0)
    before = log.sm.to_snapshot()
    with pytest.raises(HostCordoned, match=r"host node7 is cordoned by an operator: bad DIMM .*until uncordoned.*rdzvctl uncordon node7"):
        log.join("b", 2.0, addr="10.0.0.2", host="node7")
    with pytest.raises(HostCordoned, match="node7"):  # by address as well
        log.join("b", 2.0, addr="node7")
    assert log.sm.to_snapshot() == before  # refused before anything changed
    assert log.apply(c.Uncordon("", host="node7"), 3.0) == {"uncordoned": True}
    assert log.apply(c.Uncordon("", host="node7"), 3.0) == {"uncordoned": False}
    log.join("b", 4.0, addr="10.0.0.2", host="node7")
    assert log.sm.job(JOB).state.value == "complete"


def test_a_cordon_and_its_lifting_reach_the_timeline_of_every_job_with_a_node_on_the_host() -> None:
    log = Log()
    log.join("a", 0.0, addr="10.0.0.1", host="node7", min_nodes=1, max_nodes=1)  # a member of a running round
    log.join("x", 0.0, addr="10.0.0.9", job="other")
    log.apply(c.Cordon("", host="node7", reason="bad DIMM"), 1.0)
    log.apply(c.Uncordon("", host="node7"), 2.0)
    assert log.events()[-2:] == [("host_cordoned", "operator", "a"), ("host_uncordoned", "operator", "a")]
    assert [k for k, _, _ in log.events("other")] == ["job_created", "node_joined"]


def test_a_refusal_is_a_node_refused_event_and_a_refusal_may_create_the_job() -> None:
    log = Log()
    log.apply(c.Refuse(JOB, node_id="n", addr="h", cause="health_check_failed", detail="ECC errors",
                       settings=JobSettings(2, 2)), 1.0)
    assert log.events() == [("job_created", "join", None), ("node_refused", "health_check_failed", "n")]
    assert log.sm.job(JOB).timeline.since(1)[0].detail == {"reason": "ECC errors"}
    log.apply(c.Refused(JOB, "m", "h2", "cordoned", "host h2 is cordoned"), 2.0)
    assert log.events()[-1] == ("node_refused", "cordoned", "m")
    assert log.sm.already_refused(c.Refused(JOB, "m", "h2", "cordoned", "host h2 is cordoned"))


def test_deaths_of_a_hosts_nodes_are_recorded_for_quarantine_and_a_flapping_cordon_starts_afresh() -> None:
    log = Log()
    log.join("a", 0.0, addr="10.0.0.1")
    log.join("b", 0.0, addr="10.0.0.2")
    log.apply(c.Expire(JOB, ("b",), "dead", "connection_closed"), 5.0)
    assert log.sm.cordons.deaths_within("10.0.0.2", 5.0, 60.0) == 1
    assert log.sm.cordons.deaths_within("10.0.0.1", 5.0, 60.0) == 0
    log.apply(c.Cordon(JOB, host="10.0.0.2", reason="3 deaths", duration=60.0, by="flapping"), 6.0)
    assert log.sm.cordons.deaths_within("10.0.0.2", 6.0, 60.0) == 0
    assert log.events()[-1] == ("host_cordoned", "flapping", None)  # its node is dead: the job still hears
    assert log.sm.cordons.listing(6.0)[0].by == "flapping"


def test_cordons_and_deaths_replay_and_survive_a_snapshot() -> None:
    log = Log()
    log.join("a", 0.0, addr="10.0.0.1")
    log.join("b", 0.0, addr="10.0.0.2")
    log.apply(c.Expire(JOB, ("b",), "dead", "heartbeat_expired"), 5.0)
    log.apply(c.Cordon("", host="node7", reason="r", duration=100.0), 6.0)
    for sm in (log.replayed(), StateMachine(max_value_bytes=1024, job_ttl=1000.0)):
        if not sm.jobs:
            sm.restore(log.sm.to_snapshot())
        assert sm.cordons.listing(7.0) == log.sm.cordons.listing(7.0)
        assert sm.cordons.deaths_within("10.0.0.2", 7.0, 10.0) == 1
        assert sm.cordons.next_end == 106.0


def test_cordon_requests_are_validated() -> None:
    for bad in (
        c.Cordon("", host=""), c.Cordon("", host="a b"), c.Cordon("", host="h", duration=0.0),
        c.Cordon("", host="h", by="someone"), c.Cordon("", host="h", reason="x" * 501),
        c.Refuse(JOB, node_id="n", addr="h", cause="tired"),
    ):
        with pytest.raises(WireError):
            bad.validate()
    with pytest.raises(WireError, match="max_restarts"):
        JobSettings(max_restarts=-1).validate()


# -- where each node's ranks land (rank.place) ------------------------------------------------------


def new(node_id: str, arrival: int, host: str, topology: str = "", nproc: int = 1) -> Candidate:
    return Candidate(node_id, Tier.NEW, arrival, nproc, host=host, topology=topology, arrival=arrival)


def old(node_id: str, rank: int, host: str, nproc: int = 1) -> Candidate:
    return Candidate(node_id, Tier.PREVIOUS, rank, nproc, host=host)


def ranks(cands: list[Candidate], max_nodes: int = 8) -> dict[str, tuple[int, int]]:
    placements, _ = place(cands, max_nodes)
    return {p.node_id: (p.node_rank, p.global_rank_start) for p in placements}


def test_a_first_round_follows_the_topology_path_then_natural_host_order() -> None:
    cands = [
        new("x", 1, "node66", "zone1/rack12/switch3"),
        new("y", 2, "node7", "zone1/rack12/switch3"),
        new("z", 3, "node1", "zone1/rack9/switch1"),  # rack9 before rack12: natural order
        new("w", 4, "node0"),  # no topology path: after every node with one
    ]
    assert ranks(cands) == {"z": (0, 0), "y": (1, 1), "x": (2, 2), "w": (3, 3)}


def test_with_no_topology_node7_comes_before_node66_and_arrival_breaks_ties() -> None:
    cands = [new("a", 1, "node66"), new("b", 2, "node7"), new("c", 3, "node7"), new("d", 4, "node10")]
    assert [n for n, _ in sorted(ranks(cands).items(), key=lambda kv: kv[1])] == ["b", "c", "d", "a"]
    assert natural_key("node7") < natural_key("node66") < natural_key("nodeb")


def test_survivors_keep_their_ranks_and_a_spare_takes_the_departed_nodes_rank_with_mixed_nproc() -> None:
    # round: a:0 (4 procs), b:1 (2), c:2 (8); b died; the spare s (2 procs) and the survivors re-form
    cands = [old("a", 0, "node1", 4), old("c", 2, "node3", 8), new("s", 9, "node0", nproc=2)]
    assert ranks(cands) == {"a": (0, 0), "s": (1, 4), "c": (2, 6)}
    # a spare with another nproc_per_node moves the global ranks after it, never a node rank
    cands = [old("a", 0, "node1", 4), old("c", 2, "node3", 8), new("s", 9, "node0", nproc=1)]
    assert ranks(cands) == {"a": (0, 0), "s": (1, 4), "c": (2, 5)}


def test_a_shrink_keeps_the_ranks_that_still_exist_and_moves_only_the_rest() -> None:
    # round of four; node rank 1 died and nobody replaces it: three remain for ranks 0..2
    cands = [old("a", 0, "h0"), old("c", 2, "h2"), old("d", 3, "h3")]
    assert ranks(cands) == {"a": (0, 0), "d": (1, 1), "c": (2, 2)}  # d (rank 3) moves into the hole


def test_a_scale_up_appends_new_nodes_after_the_survivors_in_placement_order() -> None:
    cands = [old("a", 0, "node2"), old("b", 1, "node1"), new("n", 5, "node9", "z/r2"), new("m", 6, "node8", "z/r1")]
    assert ranks(cands) == {"a": (0, 0), "b": (1, 1), "m": (2, 2), "n": (3, 3)}


# -- the job-wide restart budget (rendezvous rule 7) and topology through the apply path ------------


def budget_log(max_restarts: int | None = 2) -> Log:
    log = Log()
    for node in ("a", "b"):
        log.join(node, 0.0, max_restarts=max_restarts)
    assert log.sm.job(JOB).state.value == "complete"
    return log


def fail_round(log: Log, now: float) -> None:
    """Every worker failed: both members re-join their formed round."""
    log.join("a", now, max_restarts=2)
    log.join("b", now, max_restarts=2)


def test_worker_failures_spend_the_budget_once_per_round_and_the_third_closes_the_job() -> None:
    log = budget_log()
    fail_round(log, 1.0)
    fail_round(log, 2.0)
    job = log.sm.job(JOB)
    assert (job.state.value, job.restarts) == ("complete", 2)
    counted = [e for e in job.timeline.since(0) if e.kind.value == "restart_counted"]
    assert [(e.cause.value, e.node_id, e.detail["restarts"]) for e in counted] == [
        ("workers_failed", "a", 1), ("workers_failed", "a", 2)
    ]
    log.join("a", 3.0, max_restarts=2)  # the third failure: the budget is spent
    assert job.state.value == "closed" and job.closed_cause == "restart_budget_exhausted"
    closed = job.timeline.since(0)[-1]
    assert (closed.kind.value, closed.cause.value, closed.detail["max_restarts"]) == ("job_closed", "restart_budget_exhausted", 2)
    for node in ("a", "b"):  # a's poll and b's re-join both say why
        with pytest.raises(JobClosed, match=r"restart_budget_exhausted: .*after 2 restart\(s\), max_restarts=2"):
            if node == "a":
                log.sm.assignment(JOB, "a", 0)
            else:
                log.join("b", 3.5, max_restarts=2)
    doc = job_document(job.view(4.0))
    assert (doc["restarts"], doc["max_restarts"], doc["closed_cause"]) == (2, 2, "restart_budget_exhausted")
    assert log.sm.watch_view(JOB, job.round).cause == "restart_budget_exhausted"
    replayed = log.replayed().job(JOB)
    assert (replayed.restarts, replayed.closed_cause) == (2, "restart_budget_exhausted")


def test_a_members_death_spends_one_restart_and_the_survivors_re_join_spends_none() -> None:
    log = budget_log()
    log.apply(c.Expire(JOB, ("b",), "dead", "connection_closed"), 1.0)
    log.join("a", 2.0, max_restarts=2)  # the survivor re-joins: num_nodes_waiting said so
    job = log.sm.job(JOB)
    assert job.restarts == 1
    assert [e.cause.value for e in job.timeline.since(0) if e.kind.value == "restart_counted"] == ["member_died"]


def test_scale_up_and_a_graceful_leave_spend_nothing() -> None:
    log = Log()
    log.join("a", 0.0, max_nodes=3, max_restarts=0)
    log.join("b", 0.0, max_nodes=3, max_restarts=0)
    log.apply(c.LastCall(JOB, 0), 5.0)
    log.join("c", 6.0, max_nodes=3, max_restarts=0)  # waiting: the members restart for it
    log.join("a", 7.0, max_nodes=3, max_restarts=0)
    log.join("b", 7.0, max_nodes=3, max_restarts=0)
    job = log.sm.job(JOB)
    assert (job.state.value, job.round, job.restarts) == ("complete", 1, 0)
    log.apply(c.Leave(JOB, "c"), 8.0)
    assert (job.state.value, job.restarts) == ("complete", 0)


def test_no_budget_counts_quietly_and_never_closes() -> None:
    log = budget_log(None)
    for t in range(1, 6):
        log.join("a", float(t))
        log.join("b", float(t))
    job = log.sm.job(JOB)
    assert (job.state.value, job.restarts, job.settings.max_restarts) == ("complete", 5, None)
    assert not [e for e in job.timeline.since(0) if e.kind.value == "restart_counted"]


def test_topology_paths_order_the_ranks_and_show_in_the_document_and_survive_a_snapshot() -> None:
    log = Log()
    for node, path in (("x", "zone1/rack12"), ("y", "zone1/rack2"), ("z", "zone0/rack7")):
        s = JobSettings(3, 3, 5.0)
        log.apply(c.Join(JOB, node, f"{node}.host", 1, s, topology=path, host=f"{node}-name"), 0.0)
    job = log.sm.job(JOB)
    assert job.members == ["z", "y", "x"]
    assert [(n["node_id"], n["topology"]) for n in job_document(job.view(1.0))["nodes"]] == [
        ("z", "zone0/rack7"), ("y", "zone1/rack2"), ("x", "zone1/rack12")
    ]
    fresh = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    fresh.restore(log.sm.to_snapshot())
    assert [(n.topology, n.host) for n in fresh.job(JOB).nodes.values()] == [
        (n.topology, n.host) for n in job.nodes.values()
    ]


def test_a_member_cordoned_mid_round_finishes_its_round_and_is_refused_at_its_next_join() -> None:
    log = Log()
    log.join("a", 0.0, addr="10.0.0.1")
    log.join("b", 0.0, addr="10.0.0.2")
    job = log.sm.job(JOB)
    log.apply(c.Cordon("", host="10.0.0.2", reason="bad DIMM"), 1.0)
    assert job.state.value == "complete" and job.num_nodes_waiting(job.round) == 0  # nobody restarts for it
    assert log.sm.assignment(JOB, "b", 0) is not None  # b keeps its place and its ranks
    with pytest.raises(HostCordoned, match="10.0.0.2 is cordoned"):
        log.join("b", 2.0, addr="10.0.0.2")  # its workers restarted: refused at the next round
    assert job.state.value == "complete" and job.round == 0  # the refused join changed nothing


def test_a_cordon_takes_the_hosts_nodes_out_of_line_and_their_next_join_is_refused() -> None:
    log = Log()
    log.join("a", 0.0, addr="10.0.0.1", min_nodes=3, max_nodes=3)
    log.join("b", 0.0, addr="10.0.0.2", min_nodes=3, max_nodes=3)  # in line: the round needs three
    outcome = log.sm.apply(c.Cordon("", host="10.0.0.2", reason="bad DIMM"), 1.0)
    job = log.sm.job(JOB)
    assert "b" not in job.nodes and job.state.value == "open"
    assert [(e.kind.value, e.cause.value, e.node_id) for e in outcome.events] == [
        ("host_cordoned", "operator", "b"), ("node_departed", "cordoned", "b")
    ]
    with pytest.raises(NodeNotFound, match="join again"):  # its poll: its client joins again ...
        log.sm.assignment(JOB, "b", 0)
    with pytest.raises(HostCordoned):  # ... and is refused, naming the cordon
        log.join("b", 2.0, addr="10.0.0.2", min_nodes=3, max_nodes=3)
