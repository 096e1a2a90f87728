"""Why each restart happened (core, fake clock): a failure report that comes with a re-join or
with an agent's final close is one ``workers_failed`` event of the round the workers ran in,
before anything it causes, and the next ``round_formed`` names why the round before it gave
way (``opened_by``: workers_failed, member_died, member_left, scale_up). Replaying the log,
and a snapshot, give the same timeline. Then rule 12: the node that failed first, alone or
ahead of the others by the lead, counts against its host, and automatic quarantine cordons
a host with enough such failures; the same error on every node blames nobody."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_client.record import NO_DETAIL, FailureReport, JobSettings, WireError, WorkerFailure
from rdzv_client.wire import decode_request, to_mapping
from rdzv_server.core import command as c
from rdzv_server.core import decision
from rdzv_server.core.event import Cause, Kind
from rdzv_server.core.machine import StateMachine

JOB = "job"
CUDA = "RuntimeError: CUDA error: an illegal memory access was encountered"


def report(*failures: tuple[int, int, int, float, str], total: int | None = None) -> dict[str, Any]:
    """A report as a node sends it, each failure ``age`` seconds old."""
    made = tuple(WorkerFailure(g, lr, code, -age, msg) for g, lr, code, age, msg in failures)
    return FailureReport(made, len(made) if total is None else total).to_wire(0.0)


class Log:
    """A machine plus the records it applied, to replay them into a fresh one."""

    def __init__(self, max_restarts: int | None = None) -> None:
        self.sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        self.records: list[dict[str, Any]] = []
        self.settings = JobSettings(2, 2, 5.0, 600.0, 30.0, max_restarts)

    def apply(self, command: c.Command, now: float) -> None:
        self.sm.apply(command, now)
        self.records.append({"cmd": command.to_record(), "now": now, "rid": None})

    def join(self, node: str, now: float, failure: dict[str, Any] | None = None) -> None:
        self.apply(c.Join(JOB, node, f"{node}.host", 2, self.settings, failure=failure), now)

    def events(self, since: int = 0) -> list[tuple[str, str, int, str | None]]:
        return [(e.kind.value, e.cause.value, e.round, e.node_id) for e in self.sm.job(JOB).timeline.since(since)]

    def last(self, kind: Kind) -> Any:
        return next(e for e in self.sm.job(JOB).timeline.newest_first() if e.kind is kind)

    def formed(self) -> int:
        """Nodes a and b form round 0; returns the next sequence number."""
        self.join("a", 0.0)
        self.join("b", 0.5)
        return self.sm.job(JOB).timeline.next_seq - 1


def test_a_rejoin_with_a_report_records_workers_failed_before_the_restart_it_counts_and_the_next_round_names_it() -> None:
    log = Log(max_restarts=2)
    seen = log.formed()
    log.join("b", 10.0, report((3, 1, 1, 0.5, CUDA), (2, 0, -15, 0.25, "SIGTERM")))
    log.join("a", 10.2)  # its agent restarts for the round that opened
    assert log.events(seen) == [
        ("workers_failed", "rejoined", 0, "b"),
        ("restart_counted", "workers_failed", 0, "b"),
        ("node_joined", "rejoined", 1, "b"),
        ("node_joined", "rejoined", 1, "a"),
        ("round_formed", "max_nodes", 1, None),
    ]
    failed = log.last(Kind.WORKERS_FAILED)
    assert failed.addr == "b.host"
    assert failed.detail == {
        "node_rank": 1,
        "failed_workers": 2,
        "failures": [
            {"global_rank": 3, "local_rank": 1, "exit_code": 1, "signal": "", "failed_at": 9.5, "message": CUDA},
            {"global_rank": 2, "local_rank": 0, "exit_code": -15, "signal": "SIGTERM", "failed_at": 9.75,
             "message": "SIGTERM"},
        ],
        "summary": f"rank 3 (local 1) exit code 1: {CUDA}; 1 more failed",
    }  # fmt: skip
    formed = log.last(Kind.ROUND_FORMED)
    assert (formed.detail["opened_by"], formed.detail["opened_by_node"]) == ("workers_failed", "b")


def test_a_report_that_comes_after_the_next_round_opened_is_recorded_in_the_round_it_failed_in() -> None:
    log = Log()
    seen = log.formed()
    log.join("a", 10.0, report((1, 1, 1, 0.0, CUDA)))
    log.join("b", 10.1, report((3, 1, -6, 0.0, "SIGABRT")))  # its workers failed too, a moment later
    assert [e for e in log.events(seen) if e[0] == "workers_failed"] == [
        ("workers_failed", "rejoined", 0, "a"),
        ("workers_failed", "rejoined", 0, "b"),
    ]
    assert log.last(Kind.ROUND_FORMED).detail["opened_by_node"] == "a"  # the first failure ended the round


def test_a_rejoin_that_rule_7_calls_a_failure_without_a_report_is_workers_failed_with_no_detail() -> None:
    log = Log()
    log.formed()
    log.join("b", 10.0)  # a client that sends no report
    failed = log.last(Kind.WORKERS_FAILED)
    assert (failed.node_id, failed.round, failed.detail["failures"], failed.detail["summary"]) == ("b", 0, [], NO_DETAIL)


def test_a_restart_for_a_peer_is_not_a_failure() -> None:
    log = Log()
    log.formed()
    log.join("b", 10.0, report((3, 1, 1, 0.0, CUDA)))
    log.join("a", 10.2)  # round 1 is open: a restarts for b, it did not fail
    assert [e.node_id for e in log.sm.job(JOB).timeline.since(0) if e.kind is Kind.WORKERS_FAILED] == ["b"]


def test_a_death_ends_the_round_and_the_next_round_names_it() -> None:
    log = Log()
    log.formed()
    log.apply(c.Expire(JOB, ("a",), "dead", Cause.CONNECTION_CLOSED.value), 20.0)
    log.join("b", 20.5)  # the survivor restarts for the death: not a failure of its own
    log.join("c", 21.0)  # a replacement
    assert not [e for e in log.sm.job(JOB).timeline.since(0) if e.kind is Kind.WORKERS_FAILED]
    formed = log.last(Kind.ROUND_FORMED)
    assert (formed.round, formed.detail["opened_by"], formed.detail["opened_by_node"]) == (1, "member_died", "a")


def test_a_node_arriving_for_the_next_round_is_a_scale_up() -> None:
    log = Log()
    log.settings = JobSettings(2, 3, 5.0, 600.0, 30.0)
    log.join("a", 0.0)
    log.join("b", 0.5)
    log.apply(c.LastCall(JOB, 0), 5.5)
    log.join("c", 30.0)  # waiting: the running nodes restart for it
    log.join("a", 30.5)
    log.join("b", 30.6)
    formed = log.last(Kind.ROUND_FORMED)
    assert (formed.round, formed.detail["opened_by"], formed.detail["opened_by_node"]) == (1, "scale_up", "c")


def test_a_members_leave_names_the_round_only_until_something_else_ends_it() -> None:
    log = Log()
    log.settings = JobSettings(2, 3, 5.0, 600.0, 30.0)
    for node in "abc":
        log.join(node, 0.0)  # max_nodes: round 0 forms at once
    log.apply(c.Leave(JOB, "c"), 10.0)  # finished: ends nothing by itself
    log.join("a", 11.0, report((0, 0, 1, 0.0, "ValueError: bad batch")))
    log.join("b", 11.5)
    log.apply(c.LastCall(JOB, 1), 16.5)
    formed = log.last(Kind.ROUND_FORMED)
    assert (formed.round, formed.detail["opened_by"], formed.detail["opened_by_node"]) == (1, "workers_failed", "a")


def test_a_spare_that_takes_the_place_of_a_member_that_left_names_the_leave() -> None:
    log = Log()
    log.settings = JobSettings(1, 1, 0.0, 600.0, 30.0)
    log.join("a", 0.0)
    log.join("d", 1.0)  # max_nodes are in: a spare
    log.apply(c.Leave(JOB, "a"), 10.0)
    assert log.events()[-2:] == [("standby_promoted", "members_back", 1, "d"), ("round_formed", "members_back", 1, None)]
    formed = log.last(Kind.ROUND_FORMED)
    assert (formed.detail["opened_by"], formed.detail["opened_by_node"]) == ("member_left", "a")


def test_the_first_round_has_no_cause() -> None:
    log = Log()
    log.formed()
    assert "opened_by" not in log.last(Kind.ROUND_FORMED).detail


def test_an_agents_final_close_records_its_failure_then_closes() -> None:
    log = Log()
    seen = log.formed()
    log.apply(c.Close(JOB, cause="agent", node_id="b", failure=report((3, 1, 3, 1.0, "exit code 3"))), 30.0)
    log.apply(c.Close(JOB, cause="agent", node_id="a", failure=report((1, 1, 1, 0.0, CUDA))), 31.0)  # closed already
    assert log.events(seen) == [
        ("workers_failed", "agent", 0, "b"),
        ("job_closed", "agent", 0, None),
        ("workers_failed", "agent", 0, "a"),
    ]


def test_replay_and_a_snapshot_give_the_same_failures_and_causes() -> None:
    log = Log()
    log.formed()
    log.join("b", 10.0, report((3, 1, 1, 0.5, CUDA)))
    log.apply(c.Expire(JOB, ("a",), "dead"), 12.0)  # before the round re-formed: the failure stays the cause
    twin = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    for record in log.records:
        twin.replay(record)
    assert twin.job(JOB).timeline.since(0) == log.sm.job(JOB).timeline.since(0)
    restored = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    restored.restore(log.sm.to_snapshot())
    assert restored.job(JOB).opened_by == ("workers_failed", "b")
    restored.apply(c.Join(JOB, "c", "c.host", 2, log.settings), 13.0)
    restored.apply(c.LastCall(JOB, 1), 18.0)
    formed = next(e for e in restored.job(JOB).timeline.newest_first() if e.kind is Kind.ROUND_FORMED)
    assert formed.detail["opened_by"] == "workers_failed"


def test_a_report_goes_on_the_wire_as_ages_and_old_joins_read_as_none() -> None:
    body = to_mapping(c.Join(JOB, "b", "b.host", 2, JobSettings(2, 2), failure=report((3, 1, 1, 2.0, CUDA))))
    assert body["failure"] == {
        "failed_workers": 1,
        "failures": [{"global_rank": 3, "local_rank": 1, "exit_code": 1, "age_s": 2.0, "message": CUDA}],
    }
    assert decode_request("join", body, JOB) == c.Join(JOB, "b", "b.host", 2, JobSettings(2, 2), failure=body["failure"])
    old = {k: v for k, v in body.items() if k != "failure"}
    assert decode_request("join", old, JOB).failure is None  # type: ignore[attr-defined]
    assert "failure" not in to_mapping(decode_request("join", old, JOB))


@pytest.mark.parametrize(
    "failure, error",
    [
        ({"failed_workers": 1}, "a failure report is a map"),
        ({"failed_workers": 1, "failures": [{"global_rank": 1}]}, "a failure is a map"),
        (report(*[(i, i, 1, 0.0, "x") for i in range(9)]), "at most 8 workers"),
        (report((1, 1, 1, 0.0, "x" * 513)), "at most 512 characters"),
        ({"failed_workers": 1, "failures": [{**report((1, 1, 1, 0.0, "x"))["failures"][0], "age_s": -1.0}]},
         "0 or more"),
    ],
)
def test_a_report_that_breaks_the_bounds_is_refused(failure: dict[str, Any], error: str) -> None:
    body = to_mapping(c.Join(JOB, "b", "b.host", 2, JobSettings(2, 2)))
    with pytest.raises(WireError, match=error):
        decode_request("join", {**body, "failure": failure}, JOB)


def test_a_close_with_a_report_names_its_node() -> None:
    with pytest.raises(WireError, match="must name its node_id"):
        decode_request("close", {"cause": "agent", "failure": report((1, 1, 1, 0.0, CUDA))}, JOB)


# -- rule 12: failures that follow a host ----------------------------------------------------------

POLICY = decision.QuarantinePolicy(after=3, window=3600.0, duration=600.0, failures=3, failure_lead=5.0)


def restart(log: Log, now: float, a: dict[str, Any] | None, b: dict[str, Any] | None) -> None:
    """Both nodes of the formed round re-join (b first), with these reports: the next round forms."""
    log.join("b", now, b)
    log.join("a", now + 0.5, a)


def test_a_node_that_fails_alone_is_blamed_and_its_host_cordoned_after_three_such_rounds() -> None:
    log = Log()
    log.formed()
    for i in range(3):
        assert decision.failure_quarantine(log.sm, JOB, 100.0 * i, POLICY) == []
        restart(log, 100.0 * (i + 1), None, report((3, 1, 1, 0.5, CUDA)))
        assert log.sm.job(JOB).blamed == ("b.host", 100.0 * (i + 1) - 0.5, None, CUDA)
    [cordon] = decision.failure_quarantine(log.sm, JOB, 301.0, POLICY)
    assert (cordon.host, cordon.by, cordon.duration) == ("b.host", "workers_failed", 600.0)
    assert cordon.reason == f"workers failed on it first 3 times within 3600 s (--quarantine-failures 3): {CUDA[:120]}"
    log.apply(cordon, 301.0)
    assert log.sm.cordons.active("b.host", 301.0) is not None
    assert log.events()[-1] == ("host_cordoned", "workers_failed", 3, "b")
    assert decision.failure_quarantine(log.sm, JOB, 302.0, POLICY) == []  # counted afresh after its cordon


def test_a_failure_on_every_node_with_the_same_error_blames_nobody() -> None:
    log = Log()
    log.formed()
    for i in range(3):
        bug = "ValueError: bad config key 'lr'"
        restart(log, 100.0 * (i + 1), report((1, 1, 1, 0.2, bug)), report((3, 1, 1, 20.0, bug)))  # b long before a
        assert log.sm.job(JOB).blamed is None
    assert decision.failure_quarantine(log.sm, JOB, 400.0, POLICY) == []


def test_a_node_that_failed_first_counts_only_with_its_lead() -> None:
    log = Log()
    log.formed()
    echo = "RuntimeError: [gloo] Connection closed by peer"
    for i in range(3):  # b failed 2.5 s before a's collective noticed it: under the 5 s lead
        restart(log, 100.0 * (i + 1), report((1, 1, 1, 1.0, echo)), report((3, 1, 1, 3.0, CUDA)))
        assert log.sm.job(JOB).blamed == ("b.host", 100.0 * (i + 1) - 3.0, 2.5, CUDA)  # a re-joined 0.5 s later
    assert decision.failure_quarantine(log.sm, JOB, 400.0, POLICY) == []
    lenient = decision.QuarantinePolicy(3, 3600.0, 600.0, failures=3, failure_lead=2.0)
    assert [c.host for c in decision.failure_quarantine(log.sm, JOB, 400.0, lenient)] == ["b.host"]


def test_a_failure_with_no_detail_or_at_the_same_time_blames_nobody() -> None:
    log = Log()
    log.formed()
    restart(log, 100.0, None, report())  # no detail: no time to order by
    assert log.sm.job(JOB).blamed is None
    restart(log, 200.0, report((1, 1, 1, 1.5, "A")), report((3, 1, 1, 1.0, "B")))  # both at 199.0
    assert log.sm.job(JOB).blamed is None


def test_failures_outside_the_window_do_not_add_up() -> None:
    log = Log()
    log.formed()
    for i in range(3):
        restart(log, 2000.0 * (i + 1), None, report((3, 1, 1, 0.0, CUDA)))
    assert decision.failure_quarantine(log.sm, JOB, 6001.0, POLICY) == []  # 2000 s apart, window 3600 s
    twin = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    twin.restore(log.sm.to_snapshot())
    assert twin.cordons.failures_within("b.host", 6001.0, 3600.0, 5.0) == [CUDA, CUDA]


def test_a_line_blamed_on_another_host_of_the_run_is_the_scripts_and_never_blamed_again() -> None:
    log = Log()
    log.formed()
    bug = "KeyError: 'lr'"
    restart(log, 100.0, None, report((3, 1, 1, 0.5, bug)))  # a restarted for b before its own failure showed
    assert log.sm.job(JOB).blamed == ("b.host", 99.5, None, bug)
    log.join("a", 200.0, report((1, 1, 1, 0.5, bug)))  # next time a's agent was first: the same line
    log.join("b", 200.5)
    assert log.sm.job(JOB).blamed is None
    restart(log, 300.0, None, report((3, 1, 1, 0.5, bug)))  # b alone again: the script's line all the same
    assert log.sm.job(JOB).blamed is None
    restart(log, 400.0, None, report((3, 1, 1, 0.5, CUDA)))  # another line: b's own
    assert log.sm.job(JOB).blamed == ("b.host", 399.5, None, CUDA)
    twin = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    twin.restore(log.sm.to_snapshot())
    assert twin.job(JOB).script_lines == {bug} and twin.job(JOB).blamed_lines == {bug: "b.host", CUDA: "b.host"}
