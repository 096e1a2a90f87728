"""Job policy in core (issue 28): the table's precedence, the checks of a policy's keys and
values, a job's effective settings and their sources, and what a live change does to a job
(rule 13 of core/rendezvous.py), each driven through the one apply path with a fake clock; and
that all of it replays from the log and survives a snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_client.record import ErrorCode, JobSettings, WireError, policy_settings
from rdzv_server.api.document import job_document
from rdzv_server.core import command as c
from rdzv_server.core.error import JobClosed, NoSuchPolicy, SettingsConflict
from rdzv_server.core.machine import StateMachine
from rdzv_server.core.policy import PolicyTable, literal_chars, resolve
from rdzv_server.core.rendezvous import JobState

JOB = "llm-7b-a"


class Log:
    """A machine plus the records it applied, to replay them into a fresh one."""

    def __init__(self) -> None:
        self.sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        self.records: list[dict[str, Any]] = []

    def apply(self, command: c.Command, now: float) -> dict[str, Any]:
        result = self.sm.apply(command, now).result
        self.records.append({"cmd": command.to_record(), "now": now, "rid": None})
        return result

    def join(self, node: str, now: float, *, job: str = JOB, **settings: Any) -> int:
        s = JobSettings(**{"min_nodes": 2, "max_nodes": 2, "last_call_timeout": 5.0, **settings})
        return int(self.apply(c.Join(job, node, f"{node}.host", 1, s), now)["round"])

    def set(self, pattern: str, now: float, **settings: Any) -> dict[str, Any]:
        return self.apply(c.SetPolicy("", pattern=pattern, settings=policy_settings(settings)), now)

    def unset(self, pattern: str, now: float, *keys: str) -> dict[str, Any]:
        return self.apply(c.UnsetPolicy("", pattern=pattern, keys=keys), now)

    def due(self, now: float, job: str = JOB) -> None:
        """What the timer would do at ``now``, done."""
        for command in self.sm.due(job, now):
            self.apply(command, now)

    def kinds(self, job: str = JOB) -> list[str]:
        return [e.kind.value for e in self.sm.job(job).timeline.since(0)]

    def changed(self, job: str = JOB) -> list[dict[str, Any]]:
        return [e.detail for e in self.sm.job(job).timeline.since(0) if e.kind.value == "policy_changed"]

    def replayed(self) -> StateMachine:
        fresh = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
        for record in self.records:
            fresh.replay(record)
        return fresh


# -- the table -------------------------------------------------------------------------------


def table(*policies: tuple[str, dict[str, Any]]) -> PolicyTable:
    t = PolicyTable()
    for pattern, settings in policies:
        t.set(pattern, settings, 0.0, "operator")
    return t


def test_the_job_id_beats_every_glob_and_the_most_specific_glob_wins_each_key() -> None:
    t = table(
        ("*", {"max_restarts": 1, "join_timeout": 60.0}),
        ("llm-*", {"max_restarts": 2, "min_nodes": 2}),
        ("llm-7b-*", {"min_nodes": 4}),
        ("llm-7b-a", {"join_timeout": 5.0}),
    )
    assert t.winning("llm-7b-a") == {
        "join_timeout": (5.0, "llm-7b-a"), "min_nodes": (4, "llm-7b-*"), "max_restarts": (2, "llm-*"),
    }
    assert t.winning("bert") == {"max_restarts": (1, "*"), "join_timeout": (60.0, "*")}
    assert t.winning("llm-7b") == {"max_restarts": (2, "llm-*"), "min_nodes": (2, "llm-*"), "join_timeout": (60.0, "*")}
    assert [p.pattern for p in t.listing()] == ["llm-7b-a", "llm-7b-*", "llm-*", "*"]


def test_among_globs_literal_characters_then_length_then_the_lexically_first_win() -> None:
    assert (literal_chars("llm-*"), literal_chars("l?m-[0-9]*"), literal_chars("a[b")) == (4, 3, 3)
    # llm-?b beats llm-* (5 literal characters against 4) although both match
    assert table(("llm-*", {"min_nodes": 1}), ("llm-?b", {"min_nodes": 2})).winning("llm-7b")["min_nodes"][1] == "llm-?b"
    # the same literal characters: the longer pattern wins
    assert table(("llm*", {"min_nodes": 1}), ("llm**", {"min_nodes": 2})).winning("llm-7b")["min_nodes"][1] == "llm**"
    # the same both: the lexically first
    assert table(("*-7b", {"min_nodes": 1}), ("llm*", {"min_nodes": 2})).winning("llm-7b")["min_nodes"][1] == "*-7b"
    # a job id is never a glob's match by accident, and globs compare case-sensitively
    assert table(("LLM-*", {"min_nodes": 2})).winning("llm-7b") == {}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({}, "at least one key"),
        ({"nnodes": 2}, "'nnodes' is not known"),
        ({"min_nodes": 0}, "min_nodes must be 1..1000000"),
        ({"max_nodes": 2.5}, "max_nodes takes an integer"),
        ({"max_restarts": True}, "max_restarts takes an integer"),
        ({"last_call_timeout": -1}, "last_call_timeout must be >= 0"),
        ({"heartbeat_ttl": "0"}, "heartbeat_ttl must be > 0"),
        ({"join_timeout": "soon"}, "join_timeout: 'soon' is not a number"),
        ({"min_round_seconds": 1e9}, "min_round_seconds must be"),
        ({"health_check_timeout": 0}, "health_check_timeout must be > 0"),
        ({"gpu_check": 2}, "gpu_check takes true or false"),
        ({"health_check": "a\nb"}, "health_check takes a command line"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes <= max_nodes"),
    ],
)
def test_a_bad_key_or_value_is_refused_naming_it(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(WireError, match=named) as info:
        policy_settings(settings)
    assert info.value.code is ErrorCode.BAD_POLICY


def test_values_an_operator_types_are_typed_and_every_job_key_is_a_policy_key() -> None:
    assert policy_settings({"gpu_check": "off", "max_nodes": "8", "join_timeout": 30, "health_check": ""}) == {
        "max_nodes": 8, "join_timeout": 30.0, "health_check": "", "gpu_check": False,
    }
    every = {"min_nodes": 1, "max_nodes": 2, "last_call_timeout": 1, "join_timeout": 1, "heartbeat_ttl": 1,
             "max_restarts": 0, "min_round_seconds": 1, "max_fast_failures": 1}
    assert set(policy_settings(every)) == set(JobSettings.__dataclass_fields__)


def test_a_node_count_that_a_policy_and_the_nodes_break_together_is_held() -> None:
    own = JobSettings(min_nodes=1, max_nodes=4)
    done = resolve(own, {"min_nodes": (6, "llm-*"), "max_restarts": (3, "llm-*")}, own, {})
    assert (done.settings.min_nodes, done.settings.max_nodes, done.settings.max_restarts) == (1, 4, 3)
    assert set(done.held) == {"min_nodes"} and "min_nodes=6 (policy llm-*), max_nodes=4 (node)" in done.held["min_nodes"]
    assert done.sources == {"max_restarts": "llm-*"}


# -- jobs under policies ----------------------------------------------------------------------


def test_a_new_job_runs_with_the_policies_that_match_it_and_the_document_names_each_source() -> None:
    log = Log()
    log.set("llm-*", 0.0, max_nodes=3, max_restarts=2, gpu_check=True)
    log.join("a", 1.0, max_nodes=8, join_timeout=60.0)
    doc = job_document(log.sm.job(JOB).view(1.0))
    assert (doc["min_nodes"], doc["max_nodes"], doc["max_restarts"], doc["join_timeout"]) == (2, 3, 2, 60.0)
    assert doc["gpu_check"] is True
    assert doc["settings_source"] == {
        "min_nodes": "node", "max_nodes": "policy llm-*", "last_call_timeout": "node", "join_timeout": "node",
        "heartbeat_ttl": "default", "max_restarts": "policy llm-*", "min_round_seconds": "default",
        "max_fast_failures": "default", "gpu_check": "policy llm-*",
    }
    assert "policy_changed" not in log.kinds()  # a new job starts under them: nothing changed for it


def test_nodes_that_disagree_only_on_keys_a_policy_covers_join_the_same_round() -> None:
    log = Log()
    log.set(JOB, 0.0, last_call_timeout=0.0, max_nodes=3)
    log.join("a", 1.0, last_call_timeout=5.0, max_nodes=2)
    log.join("b", 1.0, last_call_timeout=9.0, max_nodes=4)  # both covered: no settings_conflict
    job = log.sm.job(JOB)
    assert job.state is JobState.COMPLETE and job.settings.last_call_timeout == 0.0  # the policy's zero last call
    with pytest.raises(SettingsConflict, match=r"keys a policy sets are not compared: last_call_timeout, max_nodes"):
        log.join("c", 2.0, min_nodes=1)  # min_nodes is the nodes' own to agree on


def test_a_change_touches_only_the_jobs_whose_settings_it_moves_with_one_event_each() -> None:
    log = Log()
    log.join("a", 0.0, job="llm-1", min_nodes=1, max_nodes=1)
    log.join("a", 0.0, job="llm-2", min_nodes=1, max_nodes=1, max_restarts=5)
    log.join("a", 0.0, job="bert", min_nodes=1, max_nodes=1)
    version = log.sm.policies.version
    log.set("llm-*", 1.0, max_restarts=5, health_check="nvidia-smi")
    assert log.sm.policies.version == version + 1
    assert log.changed("llm-1") == [{
        "pattern": "llm-*", "by": "operator",
        "changes": {"max_restarts": {"old": None, "new": 5, "source": "policy llm-*"},
                    "health_check": {"old": None, "new": "nvidia-smi", "source": "policy llm-*"}},
    }]
    assert log.changed("llm-2")[0]["changes"] == {"health_check": {"old": None, "new": "nvidia-smi", "source": "policy llm-*"}}
    assert log.changed("bert") == []
    log.set("llm-1", 2.0, max_restarts=5)  # the same value from a more specific policy: nothing the job sees moved
    assert len(log.changed("llm-1")) == 1
    log.unset("llm-*", 3.0, "health_check")
    assert log.changed("llm-2")[-1]["changes"] == {"health_check": {"old": "nvidia-smi", "new": None, "source": "node"}}
    with pytest.raises(NoSuchPolicy):
        log.unset("gpt-*", 4.0)


def test_a_lowered_min_nodes_arms_the_last_call_of_the_round_waiting_for_nodes() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=3, max_nodes=3, last_call_timeout=5.0, heartbeat_ttl=100.0)
    log.join("b", 1.0, min_nodes=3, max_nodes=3, last_call_timeout=5.0, heartbeat_ttl=100.0)
    job = log.sm.job(JOB)
    assert job.last_call_deadline is None
    log.set(JOB, 10.0, min_nodes=2)
    assert (job.state, job.last_call_deadline) == (JobState.OPEN, 15.0)  # two in line: the last call runs
    log.due(14.9)
    assert job.state is JobState.OPEN
    log.due(15.0)
    assert job.state is JobState.COMPLETE and len(job.members) == 2
    assert log.kinds()[-2:] == ["policy_changed", "round_formed"]


def test_a_changed_last_call_timeout_retimes_an_armed_last_call_and_zero_forms_at_once() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=1, max_nodes=3, last_call_timeout=30.0)
    job = log.sm.job(JOB)
    assert job.last_call_deadline == 30.0
    log.set(JOB, 5.0, last_call_timeout=10.0)
    assert job.last_call_deadline == 10.0  # armed at 0: runs for the new timeout from then
    log.set(JOB, 6.0, last_call_timeout=0.0)
    assert job.state is JobState.COMPLETE  # zero: the round forms now


def test_min_nodes_and_a_zero_last_call_in_one_change_form_the_round_now() -> None:
    log = Log()
    for node in ("a", "b"):
        log.join(node, 0.0, min_nodes=3, max_nodes=3, last_call_timeout=30.0)
    log.set(JOB, 1.0, min_nodes=2, last_call_timeout=0.0)
    assert log.sm.job(JOB).state is JobState.COMPLETE


def test_a_raised_max_nodes_admits_spares_at_the_next_re_formation_without_restarting_the_round() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=1, max_nodes=1)
    log.join("b", 1.0, min_nodes=1, max_nodes=1)  # a spare: max_nodes are in
    job = log.sm.job(JOB)
    assert [n.role.value for n in job.nodes.values()] == ["member", "standby"]
    log.set(JOB, 2.0, max_nodes=2)
    assert job.state is JobState.COMPLETE and job.round == 0 and job.num_nodes_waiting(0) == 0  # runs on
    log.join("a", 3.0, min_nodes=1, max_nodes=1)  # its workers failed: the next round
    assert job.state is JobState.COMPLETE and sorted(job.members) == ["a", "b"]  # the spare is in


def test_a_lowered_max_nodes_bounds_a_forming_round_and_leaves_the_rest_as_spares() -> None:
    log = Log()
    for node in ("a", "b", "c"):
        log.join(node, float(ord(node)), min_nodes=4, max_nodes=4)
    log.set(JOB, 200.0, min_nodes=2, max_nodes=2)
    job = log.sm.job(JOB)
    assert job.state is JobState.COMPLETE and job.members == ["a", "b"]
    assert job.nodes["c"].role.value == "standby"
    assert log.replayed().to_snapshot() == log.sm.to_snapshot()  # the candidate turned spare replays


def test_a_lowered_max_nodes_lets_a_running_round_run_and_bounds_the_next() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    job = log.sm.job(JOB)
    log.join("b", 1.0, min_nodes=1, max_nodes=2, last_call_timeout=0.0)  # waiting: the round re-forms with both
    log.join("a", 1.0, min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    assert job.state is JobState.COMPLETE and len(job.members) == 2
    log.set(JOB, 2.0, max_nodes=1)
    assert job.state is JobState.COMPLETE and len(job.members) == 2 and job.num_nodes_waiting(job.round) == 0
    log.join("a", 3.0, min_nodes=1, max_nodes=2, last_call_timeout=0.0)  # a failure: the next round
    log.join("b", 3.0, min_nodes=1, max_nodes=2, last_call_timeout=0.0)
    assert job.state is JobState.COMPLETE and job.members == ["a"] and job.nodes["b"].role.value == "standby"


def test_a_raised_max_restarts_keeps_alive_a_job_about_to_spend_its_budget() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=1, max_nodes=1, max_restarts=1)
    log.join("a", 1.0, min_nodes=1, max_nodes=1, max_restarts=1)  # restart 1 of 1
    log.set(JOB, 2.0, max_restarts=2)
    assert log.join("a", 3.0, min_nodes=1, max_nodes=1, max_restarts=1) == 2  # restart 2 of 2: alive
    log.join("a", 4.0, min_nodes=1, max_nodes=1, max_restarts=1)
    job = log.sm.job(JOB)
    assert (job.state, job.closed_cause, job.restarts) == (JobState.CLOSED, "restart_budget_exhausted", 2)


def test_a_lowered_heartbeat_ttl_or_join_timeout_applies_to_the_next_check() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=2, max_nodes=2, heartbeat_ttl=60.0, join_timeout=600.0)
    job = log.sm.job(JOB)
    assert job.expired(20.0) == [] and job.join_timed_out(20.0) == []
    log.set(JOB, 1.0, heartbeat_ttl=10.0, join_timeout=15.0)
    assert job.expired(20.0) == ["a"] and job.join_timed_out(20.0) == ["a"]  # measured from its join at 0
    assert log.sm.deadline(JOB) == 10.0  # the timer wakes for it


def test_the_crash_loop_keys_apply_when_the_next_round_ends() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=1, max_nodes=1)
    log.set(JOB, 1.0, max_fast_failures=1, min_round_seconds=60.0)
    log.join("a", 2.0, min_nodes=1, max_nodes=1)  # ended 2 s after forming: fast, and one is a storm now
    job = log.sm.job(JOB)
    assert (job.state, job.closed_cause) == (JobState.CLOSED, "restart_storm")
    with pytest.raises(JobClosed, match="max_fast_failures=1"):
        log.join("a", 3.0, min_nodes=1, max_nodes=1)


def test_a_policy_the_nodes_counts_break_is_held_and_the_event_says_so() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=1, max_nodes=4)
    log.set("llm-*", 1.0, min_nodes=6, max_restarts=3)
    job = log.sm.job(JOB)
    assert (job.settings.min_nodes, job.settings.max_restarts) == (1, 3)
    [changed] = log.changed()
    assert set(changed["changes"]) == {"max_restarts"} and set(changed["held"]) == {"min_nodes"}
    assert job.settings_source()["min_nodes"] == "node"
    log.set("llm-*", 2.0, max_nodes=8)  # now the pair holds: both apply
    assert (job.settings.min_nodes, job.settings.max_nodes) == (6, 8)
    assert log.changed()[-1]["changes"]["min_nodes"] == {"old": 1, "new": 6, "source": "policy llm-*"}


def test_a_new_job_that_a_policy_and_its_nodes_break_together_says_so_at_its_creation() -> None:
    log = Log()
    log.set("llm-*", 0.0, min_nodes=2)
    log.join("a", 1.0, min_nodes=1, max_nodes=1)  # torchrun's default --nnodes=1:1
    job = log.sm.job(JOB)
    assert (job.settings.min_nodes, job.settings_source()["min_nodes"]) == (1, "node")
    created = job.timeline.since(0)[0]
    assert created.kind.value == "job_created" and "min_nodes=2 (policy llm-*), max_nodes=1 (node)" in created.detail["held"]["min_nodes"]


def test_a_fresh_run_takes_its_new_nodes_settings_under_the_same_policies() -> None:
    log = Log()
    log.set(JOB, 0.0, max_restarts=7)
    log.join("a", 1.0, min_nodes=1, max_nodes=1)
    log.apply(c.Close(JOB, cause="agent"), 2.0)
    log.apply(c.Leave(JOB, "a"), 2.0)
    log.join("b", 3.0, min_nodes=1, max_nodes=2, last_call_timeout=0.0)  # idle and closed: a fresh run
    job = log.sm.job(JOB)
    assert (job.own.max_nodes, job.settings.max_nodes, job.settings.max_restarts) == (2, 2, 7)


def test_policies_and_what_they_did_to_jobs_replay_and_survive_a_snapshot() -> None:
    log = Log()
    log.join("a", 0.0, min_nodes=3, max_nodes=3, last_call_timeout=0.0)
    log.join("b", 0.5, min_nodes=3, max_nodes=3, last_call_timeout=0.0)
    log.set("llm-*", 1.0, min_nodes=2, gpu_check=False)
    log.set(JOB, 2.0, max_restarts=4)
    log.unset("llm-*", 3.0, "gpu_check")
    replayed = log.replayed()
    assert replayed.to_snapshot() == log.sm.to_snapshot()
    restored = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    restored.restore(log.sm.to_snapshot())
    assert restored.to_snapshot() == log.sm.to_snapshot()
    job = restored.job(JOB)
    assert (job.own.min_nodes, job.settings.min_nodes, job.settings_source()["min_nodes"]) == (3, 2, "policy llm-*")
    assert restored.policies.version == log.sm.policies.version == 3
    assert [p.pattern for p in restored.policies.listing()] == [JOB, "llm-*"]
    assert restored.assignment(JOB, "a", 0).policy_version == 3  # type: ignore[union-attr]
