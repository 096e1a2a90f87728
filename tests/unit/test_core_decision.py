"""What the server decides on its own (core/decision.py), against core directly with a fake
clock value: which hosts quarantine cordons, what a refused join leaves on its job's
timeline, whether a node whose watch dropped died, and what an expiry is about to remove."""

from __future__ import annotations

from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.core import decision
from rdzv_server.core.error import HostCordoned, JobClosed, SettingsConflict
from rdzv_server.core.machine import StateMachine

JOB = "job"
SETTINGS = JobSettings(min_nodes=2, max_nodes=2, last_call_timeout=5.0, join_timeout=600.0, heartbeat_ttl=30.0)
POLICY = decision.QuarantinePolicy(after=2, window=60.0, duration=3600.0)
GRACE = 1.0


def machine_with(*nodes: tuple[str, str], now: float = 0.0) -> StateMachine:
    """A machine whose job has ``nodes`` (node_id, addr) joined at ``now``."""
    sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    for node_id, addr in nodes:
        sm.apply(c.Join(JOB, node_id, addr, 1, SETTINGS), now)
    return sm


def die(sm: StateMachine, node_id: str, now: float) -> None:
    sm.apply(c.Expire(JOB, (node_id,), "dead", "connection_closed"), now)


# -- quarantine ------------------------------------------------------------------------------------


def test_a_host_is_quarantined_once_its_nodes_died_often_enough_within_the_window() -> None:
    sm = machine_with(("a", "10.0.0.1"), ("b", "10.0.0.2"))
    die(sm, "b", 10.0)
    assert decision.quarantine(sm, JOB, ("10.0.0.2",), 10.0, POLICY) == []  # one death: not yet
    sm.apply(c.Join(JOB, "b", "10.0.0.2", 1, SETTINGS), 11.0)
    die(sm, "b", 20.0)
    [cordon] = decision.quarantine(sm, JOB, ("10.0.0.2",), 20.0, POLICY)
    assert cordon == c.Cordon(
        JOB, host="10.0.0.2", reason="2 deaths of its nodes within 60 s (--quarantine-after 2)", duration=3600.0,
        by="flapping",
    )
    # The same deaths, read after the window has passed them by: nothing to quarantine.
    assert decision.quarantine(sm, JOB, ("10.0.0.2",), 80.0, POLICY) == []


def test_no_quarantine_when_it_is_off_or_the_host_is_cordoned_already() -> None:
    sm = machine_with(("a", "10.0.0.1"), ("b", "10.0.0.2"))
    die(sm, "b", 10.0)
    sm.apply(c.Join(JOB, "b", "10.0.0.2", 1, SETTINGS), 11.0)
    die(sm, "b", 12.0)
    off = decision.QuarantinePolicy(after=0, window=60.0, duration=3600.0)
    assert decision.quarantine(sm, JOB, ("10.0.0.2",), 12.0, off) == []
    sm.apply(c.Cordon("", host="10.0.0.2", reason="an operator's", duration=None), 13.0)
    assert decision.quarantine(sm, JOB, ("10.0.0.2",), 13.0, POLICY) == []


# -- what an expiry is about to remove ---------------------------------------------------------------


def test_dying_names_each_host_once_and_the_last_heartbeats_of_a_death_only() -> None:
    sm = machine_with(("a", "10.0.0.1"), ("b", "10.0.0.1"))
    sm.heartbeat(JOB, "a", 3.0)
    sm.heartbeat(JOB, "b", 4.0)
    dead = c.Expire(JOB, ("a", "b", "gone"), "dead")
    assert decision.dying(sm, dead) == decision.Dying(("10.0.0.1",), (3.0, 4.0))
    assert decision.dying(sm, c.Expire(JOB, ("a",), "join_timeout")) is decision.NOBODY
    assert decision.dying(sm, c.LastCall(JOB, 1)) is decision.NOBODY
    assert decision.dying(sm, c.Expire("no-such-job", ("a",), "dead")) is decision.NOBODY


# -- a refused join ----------------------------------------------------------------------------------


def test_a_first_node_refused_creates_its_job_to_say_why_then_the_refusal_is_logged_once() -> None:
    sm = StateMachine(max_value_bytes=1024, job_ttl=1000.0)
    join = c.Join(JOB, "n", "10.0.0.9", 1, SETTINGS)
    refused = HostCordoned("host 10.0.0.9 is cordoned")
    logged = decision.refusal(sm, join, refused)
    assert logged == [c.Create(JOB, SETTINGS), c.Refused(JOB, "n", "10.0.0.9", "cordoned", "host 10.0.0.9 is cordoned")]
    for command in logged or []:
        sm.apply(command, 1.0)
    assert decision.refusal(sm, join, refused) == []  # the timeline says so already


def test_a_refusal_for_other_settings_names_its_cause_and_other_errors_are_no_refusal() -> None:
    sm = machine_with(("a", "10.0.0.1"))
    join = c.Join(JOB, "n", "10.0.0.9", 1, SETTINGS)
    assert decision.refusal(sm, join, SettingsConflict("other --nnodes")) == [
        c.Refused(JOB, "n", "10.0.0.9", "settings_conflict", "other --nnodes")
    ]
    assert decision.refusal(sm, join, JobClosed("closed")) is None


def test_a_failed_health_check_is_logged_once_per_repeated_refusal() -> None:
    sm = machine_with(("a", "10.0.0.1"))
    refuse = c.Refuse(JOB, node_id="n", addr="h", cause="health_check_failed", detail="ECC errors", settings=SETTINGS)
    assert decision.self_refusal(sm, refuse) == [refuse]
    sm.apply(refuse, 1.0)
    assert decision.self_refusal(sm, refuse) == []
    other = c.Refuse(JOB, node_id="n", addr="h", cause="health_check_failed", detail="disk full", settings=SETTINGS)
    assert decision.self_refusal(sm, other) == [other]


# -- a dropped watch ---------------------------------------------------------------------------------


def test_a_node_whose_watch_dropped_is_dead_once_the_grace_passed_without_it_returning() -> None:
    sm = machine_with(("a", "10.0.0.1"), ("b", "10.0.0.2"))
    sm.heartbeat(JOB, "b", 5.0)  # its last request, before the drop at 6.0
    assert decision.death_after_drop(sm, JOB, "b", 6.0, 6.5, GRACE, polling=False) is None  # the grace runs
    assert decision.death_after_drop(sm, JOB, "b", 6.0, 7.0, GRACE, polling=False) == c.Expire(
        JOB, ("b",), "dead", "connection_closed"
    )


def test_a_node_that_came_back_or_still_polls_or_is_gone_is_not_lost() -> None:
    sm = machine_with(("a", "10.0.0.1"), ("b", "10.0.0.2"))
    sm.heartbeat(JOB, "b", 6.5)  # a request after the drop at 6.0: it came back
    assert decision.death_after_drop(sm, JOB, "b", 6.0, 8.0, GRACE, polling=False) is None
    assert decision.death_after_drop(sm, JOB, "a", 6.0, 8.0, GRACE, polling=True) is None  # another poll still open
    assert decision.death_after_drop(sm, JOB, "zed", 6.0, 8.0, GRACE, polling=False) is None  # no such node
    assert decision.death_after_drop(sm, "other", "a", 6.0, 8.0, GRACE, polling=False) is None  # no such job
