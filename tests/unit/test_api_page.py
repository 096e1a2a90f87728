"""The job page's data (``api/page.py``): lanes replayed from the events a real state machine
made (commands applied with a fake clock), and the pages of the membership document.

The events here are the ones ``core`` emits today; kinds added later (``node_refused``,
``host_cordoned``, ...) are written out by hand in the tests that name them, in the shape the
timeline gives every event (``document.event_entry``)."""

from __future__ import annotations

from typing import Any

from rdzv_client.record import JobSettings
from rdzv_server.api import page
from rdzv_server.api.document import event_entry, job_document
from rdzv_server.core import command as c
from rdzv_server.core.machine import StateMachine

JOB = "lanes"


class Run:
    """A state machine with one job, and the job page's reads of it."""

    def __init__(self, min_nodes: int = 2, max_nodes: int = 2) -> None:
        self.sm = StateMachine(max_value_bytes=64, job_ttl=1000.0)
        self.settings = JobSettings(min_nodes, max_nodes, last_call_timeout=10.0, join_timeout=600.0,
                                    heartbeat_ttl=300.0)  # fmt: skip
        self.now = 0.0

    def at(self, now: float) -> Run:
        self.now = now
        return self

    def join(self, node_id: str, settings: JobSettings | None = None) -> None:
        self.sm.apply(c.Join(JOB, node_id, f"10.0.0.{node_id[-1]}", 1, settings or self.settings), self.now)

    def refuse(self, node_id: str) -> None:
        """What the service records when a join's settings conflict (Service.begin_join)."""
        self.sm.apply(c.Refused(JOB, node_id, f"10.0.0.{node_id[-1]}", "settings_conflict", "other --nnodes"), self.now)

    def die(self, node_id: str) -> None:
        self.sm.apply(c.Expire(JOB, (node_id,), "dead", "heartbeat_expired"), self.now)

    def leave(self, node_id: str) -> None:
        self.sm.apply(c.Leave(JOB, node_id), self.now)

    def document(self) -> dict[str, Any]:
        return job_document(self.sm.job(JOB).view(self.now))

    def events(self) -> list[dict[str, Any]]:
        return [event_entry(e) for e in self.sm.job(JOB).timeline.since(0)]

    def lanes(self, offset: int = 0, limit: int = 100, extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        timeline = self.sm.job(JOB).timeline
        return page.lanes(self.document(), self.events() + (extra or []), timeline.first_seq, self.now, offset, limit)


def cells(answer: dict[str, Any]) -> dict[str, list[str | None]]:
    return {lane["node_id"]: lane["cells"] for lane in answer["lanes"]}


def test_a_formed_round_makes_one_member_cell_per_node_with_the_rounds_formation_time() -> None:
    run = Run()
    run.at(1.0).join("node-1")
    run.at(1.5).join("node-2")
    answer = run.lanes()
    assert [r["round"] for r in answer["rounds"]] == [0]
    (formed,) = answer["rounds"]
    assert formed["formed_at"] == 1.5 and formed["formation_s"] == 0.5 and formed["cause"] == "max_nodes"
    assert formed["num_nodes"] == 2 and formed["world_size"] == 2
    assert cells(answer) == {"node-1": ["member"], "node-2": ["member"]}
    assert [lane["node_rank"] for lane in answer["lanes"]] == [0, 1]
    assert answer["summary"] == [{"member": 2}]
    assert answer["page"] == {"offset": 0, "limit": 100, "total": 2}
    assert answer["first_seq"] == 1 and answer["states"] == list(page.STATES)


def test_a_death_a_spare_and_a_refusal_each_show_in_their_round() -> None:
    run = Run()
    run.at(1.0).join("node-1")
    run.join("node-2")  # round 0 formed
    run.at(2.0).join("node-3")  # max_nodes are in: a spare
    run.at(3.0).refuse("node-4")  # its settings conflict: refused, never in the job
    run.at(4.0).die("node-2")  # round 0 loses a member...
    run.at(5.0).join("node-1")  # ... the survivor re-joins, the spare fills in: round 1
    answer = run.lanes()
    assert [r["round"] for r in answer["rounds"]] == [0, 1]
    assert cells(answer) == {
        "node-1": ["member", "member"],
        "node-3": ["standby", "member"],
        "node-2": ["dead", None],  # known from the timeline only: after the document's nodes
        "node-4": ["refused", None],
    }
    by_node = {lane["node_id"]: lane for lane in answer["lanes"]}
    assert by_node["node-2"]["causes"] == ["heartbeat_expired", None]
    assert by_node["node-4"]["causes"] == ["settings_conflict", None]
    assert answer["summary"] == [{"member": 1, "standby": 1, "dead": 1, "refused": 1}, {"member": 2}]
    assert answer["rounds"][1]["cause"] == "members_back"


def test_a_graceful_leave_is_left_not_dead_and_an_open_round_shows_who_joined_it() -> None:
    run = Run(min_nodes=2, max_nodes=3)
    run.at(1.0).join("node-1")
    run.join("node-2")
    run.at(11.0)
    run.sm.apply(c.LastCall(JOB, 0), 11.0)  # the last call ends: round 0 forms with two
    run.at(12.0).leave("node-2")
    run.at(13.0).join("node-1")  # round 1 opens: node-1 is in line, nobody else yet
    answer = run.lanes()
    assert answer["state"] == "open" and [r["round"] for r in answer["rounds"]] == [0, 1]
    # node-1 came back with nothing asking it to (rule 7): its workers failed, with no report.
    assert cells(answer) == {"node-1": ["failed", "joining"], "node-2": ["left", None]}
    assert answer["rounds"][1]["formed_at"] is None  # still forming


def test_the_membership_document_is_authoritative_for_the_current_round() -> None:
    run = Run(min_nodes=2, max_nodes=2)
    run.at(1.0).join("node-1")
    run.join("node-2")
    run.join("node-3")  # a spare
    run.at(2.0).die("node-2")  # the document still holds it, marked dead, until the next round
    # Drop every event but the round's: as a 16K-node job whose joins the timeline no longer keeps.
    formed = [e for e in run.events() if e["kind"] == "round_formed"]
    answer = page.lanes(run.document(), formed, formed[0]["seq"], run.now, 0, 100)
    assert cells(answer) == {"node-1": ["member"], "node-2": ["dead"], "node-3": ["standby"]}
    assert [lane["causes"] for lane in answer["lanes"]] == [[None], [None], ["standby"]]
    assert answer["first_seq"] > 1


def test_kinds_added_by_fleet_control_show_as_cordoned_or_refused_and_notes() -> None:
    run = Run()
    run.at(1.0).join("node-1")
    run.join("node-2")
    seq = run.sm.job(JOB).timeline.next_seq

    def event(kind: str, cause: str, node_id: str | None = None, **detail: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"seq": seq, "time": 2.0, "kind": kind, "cause": cause, "round": 0, "node_id": node_id,
                "addr": None, **detail}  # fmt: skip

    extra = [
        event("host_cordoned", "operator", "node-1", host="10.0.0.1", reason="bad HBM"),
        event("node_refused", "health_check_failed", "node-8", reason="nvidia-smi failed"),
        event("node_refused", "cordoned", "node-9", reason="cordoned by operator"),
        event("node_joined", "candidate", "node-7"),
        event("node_departed", "cordoned", "node-7", role="candidate"),  # a cordon took it out of line
        event("host_uncordoned", "operator", host="10.0.0.7"),
        event("job_closed", "restart_budget_exhausted"),
        event("something_new", "whatever"),
    ]
    answer = run.lanes(extra=extra)
    assert cells(answer) == {
        "node-1": ["cordoned"], "node-2": ["member"], "node-8": ["refused"], "node-9": ["cordoned"],
        "node-7": ["cordoned"],
    }  # fmt: skip
    notes = [(n["kind"], n["cause"]) for n in answer["rounds"][0]["notes"]]
    assert notes == [("host_uncordoned", "operator"), ("job_closed", "restart_budget_exhausted"),
                     ("something_new", "whatever")]  # fmt: skip


def test_lanes_page_in_the_document_order_and_the_summary_counts_every_lane() -> None:
    run = Run(min_nodes=5, max_nodes=5)
    for i in range(5):
        run.at(1.0).join(f"node-{i}")
    run.at(2.0).refuse("node-9")
    answer = run.lanes(offset=3, limit=2)
    assert [lane["node_id"] for lane in answer["lanes"]] == ["node-3", "node-4"]
    assert answer["page"] == {"offset": 3, "limit": 2, "total": 6}
    assert answer["summary"] == [{"member": 5, "refused": 1}]
    assert run.lanes(offset=5, limit=2)["lanes"][0]["node_id"] == "node-9"
    assert run.lanes(offset=6, limit=2)["lanes"] == []


def test_only_the_newest_rounds_are_drawn() -> None:
    run = Run(min_nodes=1, max_nodes=1)
    for r in range(page.MAX_ROUNDS + 5):
        run.at(float(r)).join("node-1")  # a member's re-join opens and forms the next round at once
    answer = run.lanes()
    rounds = [r["round"] for r in answer["rounds"]]
    assert len(rounds) == page.MAX_ROUNDS and rounds[-1] == answer["round"] == page.MAX_ROUNDS + 4
    # Each re-join with nothing asking for it is a failure of the round before (rule 7, no report).
    assert cells(answer)["node-1"] == ["failed"] * (page.MAX_ROUNDS - 1) + ["member"]


def test_a_document_page_cuts_its_lists_in_one_order_and_counts_them() -> None:
    run = Run(min_nodes=2, max_nodes=2)
    run.at(1.0).join("node-1")
    run.join("node-2")
    run.join("node-3")  # standby
    run.join("node-4")  # standby
    document = run.document()
    first = page.document_page(document, 0, 3)
    assert [n["node_id"] for n in first["nodes"]] == ["node-1", "node-2"]
    assert [n["node_id"] for n in first["standby"]] == ["node-3"]
    assert first["joining"] == [] and first["waiting"] == []
    assert first["page"] == {"offset": 0, "limit": 3, "total": 4}
    assert first["counts"] == {"nodes": 2, "joining": 0, "waiting": 0, "standby": 2}
    second = page.document_page(document, 3, 3)
    assert second["nodes"] == [] and [n["node_id"] for n in second["standby"]] == ["node-4"]
    summary = page.document_page(document, 0, 0)
    assert all(summary[name] == [] for name in page.NODE_LISTS) and summary["page"]["total"] == 4
    # Everything else is the document's own.
    assert {k: v for k, v in first.items() if k not in (*page.NODE_LISTS, "page", "counts")} == {
        k: v for k, v in document.items() if k not in page.NODE_LISTS
    }


def test_a_nodes_failed_workers_mark_its_lane_in_the_round_they_ran_in_with_the_message() -> None:
    run = Run()
    run.at(1.0).join("node-1")
    run.join("node-2")
    cuda = "RuntimeError: CUDA error: an illegal memory access was encountered"
    failure = {"failed_workers": 1,
               "failures": [{"global_rank": 1, "local_rank": 0, "exit_code": 1, "age_s": 0.5, "message": cuda}]}
    run.sm.apply(c.Join(JOB, "node-2", "10.0.0.2", 1, run.settings, failure=failure), 5.0)
    run.at(5.5).join("node-1")  # round 1 forms at max_nodes
    answer = run.lanes()
    assert cells(answer) == {"node-1": ["member", "member"], "node-2": ["failed", "member"]}
    by_node = {lane["node_id"]: lane for lane in answer["lanes"]}
    assert by_node["node-2"]["causes"][0] == f"rank 1 (local 0) exit code 1: {cuda}"
    assert answer["summary"][0] == {"member": 1, "failed": 1}
    formed = answer["rounds"][1]
    assert (formed["opened_by"], formed["opened_by_node"]) == ("workers_failed", "node-2")
