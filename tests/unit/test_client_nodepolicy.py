"""The job policy as a torchrun node takes it (issue 28): a policy's keys replace the node's own
``--nnodes`` / ``--rdzv-conf`` values, and the node asks for the policy before its first join and
afterwards only when the server reported a new policy version (a re-formation of a job whose
policy did not change costs no request)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rdzv_client import wire
from rdzv_client.conf import NodeConf
from rdzv_client.error import NotFoundError, RdzvConnectionError, RdzvError
from rdzv_client.nodepolicy import NodePolicy, describe, policy_keys


def own(min_nodes: int = 1, max_nodes: int = 1, **conf: str) -> NodeConf:
    """A node started with nothing but endpoint, id and --nnodes (torchrun's default 1:1)."""
    return NodeConf.read(RendezvousParameters("rdzv-server", "h:29400", "pol-a", min_nodes, max_nodes,
                                              local_addr="10.0.0.7", **conf))  # fmt: skip


def test_a_policys_node_side_keys_replace_the_nodes_own_and_its_job_settings_stay_its_own() -> None:
    node = own(1, 8, last_call_timeout="5", health_check="true")
    merged = node.with_policy({"min_nodes": 2, "max_nodes": 2, "max_restarts": 1, "last_call_timeout": 30,
                               "heartbeat_ttl": 6, "health_check": "/opt/check.sh", "health_check_timeout": 9,
                               "gpu_check": False})  # fmt: skip
    # The server applies the job's keys; the node's proposal stays what it was told (the job's own,
    # which it falls back to when the policy is unset).
    assert merged.settings == node.settings
    assert (merged.health_check, merged.health_check_timeout, merged.gpu_check) == ("/opt/check.sh", 9.0, False)
    assert (merged.node_id, merged.addr, merged.run_id) == (node.node_id, node.addr, node.run_id)
    assert node.with_policy({}) == node
    assert node.with_policy({"some_future_key": 1}) == node
    assert node.with_policy({"health_check": ""}).health_check == ""  # a policy that turns the check off


def test_only_the_keys_a_policy_sets_count_and_the_log_names_their_patterns() -> None:
    doc = {"job": "pol-a", "version": 3, "settings": {"min_nodes": 2, "gpu_check": False, "join_timeout": 600.0},
           "sources": {"min_nodes": "policy pol-*", "gpu_check": "policy pol-a", "join_timeout": "default"}}  # fmt: skip
    assert policy_keys(doc) == {"min_nodes": 2, "gpu_check": False}
    assert describe(doc) == "min_nodes=2 from policy pol-*; gpu_check=0 from policy pol-a"
    assert policy_keys({"settings": {"min_nodes": 2}}) == {"min_nodes": 2}  # no sources: all of them


class FakeClient:
    """What NodePolicy calls of a Client: ``effective_policy``, answering ``answers`` in turn."""

    def __init__(self, *answers: dict[str, Any] | RdzvError, announced: int | None = None) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.announced = announced  # the policy version the server's hello announced (None: not known)

    def announced_policy_version(self) -> int | None:
        return self.announced

    def effective_policy(self, job: str) -> dict[str, Any]:
        assert job == "pol-a"
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, RdzvError):
            raise answer
        return answer


def doc(version: int, **settings: Any) -> dict[str, Any]:
    return {"job": "pol-a", "version": version, "settings": settings, "sources": {k: "policy pol-*" for k in settings}}


def test_the_node_asks_before_its_first_join_and_again_only_after_the_version_moved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = FakeClient(doc(1, min_nodes=2, max_nodes=2),
                        doc(2, min_nodes=2, max_nodes=2, health_check="/opt/check.sh", heartbeat_ttl=3))  # fmt: skip
    policy = NodePolicy(own(1, 8))
    assert policy.heartbeat_ttl == 10.0  # torch's keep_alive 2 s x 5 until a policy says
    with caplog.at_level(logging.INFO, logger="rdzv_client"):
        first = policy.before_join(client)  # type: ignore[arg-type]
    assert (client.asked, first.settings.min_nodes, first.settings.max_nodes) == (1, 1, 8)  # its own: the server applies 2:2
    assert "takes settings min_nodes=2, max_nodes=2 from policy pol-* (over its own --nnodes / --rdzv-conf)" in caplog.text
    for _ in range(3):  # re-formations: the joins' answers say version 1, nothing is asked
        policy.seen(1)
        assert policy.before_join(client) is first  # type: ignore[arg-type]
        policy.seen(None)  # an answer that does not say (a server older than versions) changes nothing
    assert client.asked == 1
    policy.seen(2)  # an operator changed a policy meanwhile: the next join asks
    second = policy.before_join(client)  # type: ignore[arg-type]
    assert (client.asked, second.health_check, policy.heartbeat_ttl) == (2, "/opt/check.sh", 3.0)
    assert not policy.due


def test_a_node_whose_job_no_policy_covers_says_so_and_keeps_its_own(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeClient({"job": "pol-a", "version": 0, "settings": {}, "sources": {}})
    node = own(2, 4)
    with caplog.at_level(logging.INFO, logger="rdzv_client"):
        assert NodePolicy(node).before_join(client) == node  # type: ignore[arg-type]
    assert "no policy covers job pol-a; its own --nnodes / --rdzv-conf apply" in caplog.text


def test_a_server_without_policies_is_asked_once_and_a_failed_fetch_keeps_the_last_settings() -> None:
    old = FakeClient(NotFoundError("no route", code=wire.ErrorCode.NOT_FOUND))
    node = own()
    policy = NodePolicy(node)
    assert policy.before_join(old) == node  # type: ignore[arg-type]
    assert not policy.due  # never asked again: the server has no policies
    flaky = FakeClient(doc(1, gpu_check=False), RdzvConnectionError("gone"), doc(2, gpu_check=False))
    policy = NodePolicy(own())
    taken = policy.before_join(flaky)  # type: ignore[arg-type]
    policy.seen(2)
    assert policy.before_join(flaky) is taken  # type: ignore[arg-type]  # the fetch failed: keep what it had
    assert policy.due  # and ask again before the next join
    assert policy.before_join(flaky).gpu_check is False  # type: ignore[arg-type]
    assert flaky.asked == 3


def test_a_version_reported_by_a_watch_while_the_round_ran_makes_the_next_join_ask() -> None:
    client = FakeClient(doc(4, min_nodes=2), doc(5, min_nodes=2, gpu_check=False))
    policy = NodePolicy(own())
    policy.before_join(client)  # type: ignore[arg-type]
    policy.seen(4)  # the join's answer
    policy.seen(0)  # a watch answered before the node heard anything: no news
    assert not policy.due
    policy.seen(5)  # a watch's answer after an operator's change
    assert policy.before_join(client).gpu_check is False  # type: ignore[arg-type]
    policy.seen(4)  # an older report (a watch answered before the join's) changes nothing
    assert not policy.due and client.asked == 2


def test_a_server_whose_hello_says_no_policy_was_ever_set_is_not_asked_until_an_answer_reports_one() -> None:
    client = FakeClient(doc(3, gpu_check=False), announced=0)
    node = own(2, 4)
    policy = NodePolicy(node)
    assert policy.before_join(client) == node  # type: ignore[arg-type]
    policy.seen(0)  # the join's answer: still no policy
    assert policy.before_join(client) == node and client.asked == 0  # type: ignore[arg-type]
    policy.seen(3)  # an operator set one meanwhile: the next join asks
    assert policy.before_join(client).gpu_check is False and client.asked == 1  # type: ignore[arg-type]
    # A hello that announced a version (some policy exists), or none (an older server, HTTP): asked first.
    for announced in (5, None):
        asking = FakeClient(doc(5), announced=announced)
        NodePolicy(own()).before_join(asking)  # type: ignore[arg-type]
        assert asking.asked == 1
