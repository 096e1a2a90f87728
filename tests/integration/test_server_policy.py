"""Job policy against a real server on loopback (issue 28): the routes with an operator's and
a read-only token, bad policies refused naming the key and changing nothing, the effective
policy of a job (existing or not), ``settings_source`` in the job document, nodes that
disagree on a key a policy covers both joining, live changes (a lowered ``min_nodes`` forms a
waiting round, a raised ``max_restarts`` keeps a failing job open past its old budget) with
``policy_changed`` on the timeline, and a policy that survives SIGKILL and a restart, and a
leader's fail-over over etcd. The real-torchrun tests of the same are in tests/e2e."""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_cluster import require_etcd, running_etcd
from integration.test_server_fleet import http_request as json_request
from integration.test_stream_then_watch import FrameCountingProxy
from replica_cluster import ReplicaCluster
from server_process import ServerProcess
from waiting import call_within, parked_long_polls, wait_until

from rdzv_client import Client, JobSettings, wire
from rdzv_client.stream import PipelinedSocketTransport
from rdzv_client.error import BadRequestError, ConflictError, JobClosedError, NotFoundError


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module; every test uses its own job ids and patterns."""
    srv = ServerProcess(tmp_path_factory.mktemp("policy-server"), durable=False)
    srv.start()
    yield srv
    srv.close()


def http_request(srv: ServerProcess, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """A JSON request with the server's operator token unless ``token`` says another."""
    return json_request(srv, method, path, body, srv.token if token is None else token)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def join(client: Client, job: str, node: str, settings: JobSettings, **kw: Any) -> Any:
    return client.join(job, node_id=node, addr=f"10.0.0.{ord(node[0]) % 200}", nproc_per_node=1, settings=settings,
                       timeout=20, **kw)


def test_policies_are_set_read_merged_and_unset_over_the_routes(server: ServerProcess) -> None:
    family = unique("fam")
    with Client(server.endpoint) as client:
        made = client.set_policy(f"{family}-*", {"min_nodes": "2", "max_nodes": 4, "gpu_check": "true"})
        assert made["pattern"] == f"{family}-*" and made["changed_by"] == "operator"
        assert made["settings"] == {"min_nodes": 2, "max_nodes": 4, "gpu_check": True}  # typed by the server
        merged = client.set_policy(f"{family}-*", {"last_call_timeout": 5})
        assert merged["settings"] == {"min_nodes": 2, "max_nodes": 4, "last_call_timeout": 5.0, "gpu_check": True}
        client.set_policy(f"{family}-a", {"max_nodes": 8})
        shown = client.policy(f"{family}-*")
        assert (shown["settings"], shown["changed_at"]) == (merged["settings"], merged["changed_at"])
        assert 0 <= shown["age_s"] <= shown["now"] - shown["changed_at"] + 0.001  # rdzvctl shows how long ago
        mine = [p["pattern"] for p in client.policies() if p["pattern"].startswith(family)]
        assert mine == [f"{family}-a", f"{family}-*"]  # the exact job id first: it wins

        # A job that does not exist yet: the policies that would win, and their sources; the
        # client reads it with the policy operation, the same document as the page's.
        effective = client.effective_policy(f"{family}-a")
        assert http_request(server, "GET", f"/v1/policy?job={family}-a") == (200, effective)
        assert effective["job"] == f"{family}-a"
        assert effective["settings"] == {"max_nodes": 8, "min_nodes": 2, "last_call_timeout": 5.0, "gpu_check": True}
        assert effective["sources"]["max_nodes"] == f"policy {family}-a"
        assert effective["sources"]["min_nodes"] == f"policy {family}-*"
        version = effective["version"]

        assert client.unset_policy(f"{family}-*", ["gpu_check"]) == {"pattern": f"{family}-*", "removed": ["gpu_check"]}
        assert client.effective_policy(f"{family}-b")["version"] > version
        assert "gpu_check" not in client.effective_policy(f"{family}-b")["settings"]
        assert client.unset_policy(f"{family}-*")["removed"] == ["min_nodes", "max_nodes", "last_call_timeout"]
        with pytest.raises(NotFoundError, match=f"no policy has the pattern {family}-\\*"):
            client.policy(f"{family}-*")
        client.unset_policy(f"{family}-a")
        assert client.effective_policy(f"{family}-a")["settings"] == {}


def test_an_unknown_policy_is_a_404_to_read_and_to_unset(server: ServerProcess) -> None:
    for method in ("GET", "DELETE"):
        status, answer = http_request(server, method, "/v1/policies/nobody-here")
        assert (status, answer["error"]) == (404, "no_such_policy"), method


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"min_nodez": 2}, "min_nodez"),
        ({"min_nodes": 0}, "min_nodes"),
        ({"max_restarts": "many"}, "max_restarts"),
        ({"heartbeat_ttl": 0}, "heartbeat_ttl"),
        ({"gpu_check": "perhaps"}, "gpu_check"),
        ({"min_nodes": 5, "max_nodes": 2}, "min_nodes and max_nodes"),
    ],
)
def test_a_bad_key_or_value_is_a_400_naming_it_and_changes_nothing(
    server: ServerProcess, settings: dict[str, Any], named: str
) -> None:
    pattern = unique("bad")
    status, _ = http_request(server, "PUT", f"/v1/policies/{pattern}", {"settings": {"max_restarts": 3}})
    assert status == 200
    version = http_request(server, "GET", f"/v1/policy?job={pattern}")[1]["version"]
    status, answer = http_request(server, "PUT", f"/v1/policies/{pattern}", {"settings": {"join_timeout": 9, **settings}})
    assert (status, answer["error"]) == (400, "bad_policy")
    assert named in answer["message"]
    status, policy = http_request(server, "GET", f"/v1/policies/{pattern}")
    assert (status, policy["settings"]) == (200, {"max_restarts": 3})  # join_timeout did not land either
    assert http_request(server, "GET", f"/v1/policy?job={pattern}")[1]["version"] == version
    with Client(server.endpoint) as client, pytest.raises(BadRequestError, match=named.split()[0]):
        client.set_policy(pattern, settings)  # the client refuses it before sending
    http_request(server, "DELETE", f"/v1/policies/{pattern}")


def test_a_read_only_token_reads_policies_but_cannot_change_them(read_server: tuple[ServerProcess, str]) -> None:
    srv, read_token = read_server
    assert http_request(srv, "PUT", "/v1/policies/llm-*", {"settings": {"min_nodes": 2}})[0] == 200
    status, answer = http_request(srv, "PUT", "/v1/policies/llm-*", {"settings": {"min_nodes": 3}}, read_token)
    assert (status, answer["error"]) == (403, "forbidden")
    assert "policies need a write token" in answer["message"]
    status, answer = http_request(srv, "DELETE", "/v1/policies/llm-*", None, read_token)
    assert (status, answer["error"]) == (403, "forbidden")
    status, answer = http_request(srv, "GET", "/v1/policies", None, read_token)
    assert status == 200 and [(p["pattern"], p["settings"]) for p in answer["policies"]] == [("llm-*", {"min_nodes": 2})]
    status, answer = http_request(srv, "GET", "/v1/policy?job=llm-7b", None, read_token)
    assert (status, answer["settings"], answer["sources"]) == (200, {"min_nodes": 2}, {"min_nodes": "policy llm-*"})
    # The policy operation is a read too: on the stream, and as POST /v1/jobs/ID/policy.
    with Client(srv.endpoint, token=read_token, transport=PipelinedSocketTransport(token=read_token)) as reader:
        assert reader.request("llm-7b", wire.PolicyRequest()) == answer
    assert http_request(srv, "POST", "/v1/jobs/llm-7b/policy", {}, read_token) == (200, answer)


def test_nodes_that_disagree_on_a_key_a_policy_covers_both_join_and_the_document_names_each_source(
    server: ServerProcess,
) -> None:
    family = unique("pj")
    job = f"{family}-1"
    with Client(server.endpoint) as client:
        client.set_policy(f"{family}-*", {"last_call_timeout": 0, "health_check": "nvidia-smi -L"})
        version = client.effective_policy(job)["version"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            places = [
                pool.submit(join, client, job, node, JobSettings(min_nodes=2, max_nodes=2, last_call_timeout=t))
                for node, t in (("a", 5.0), ("b", 9.0))
            ]
            assigned = [p.result(timeout=30) for p in places]
        assert sorted(a.node_rank for a in assigned) == [0, 1]
        assert {a.policy_version for a in assigned} == {version}  # the plug-in refetches only when it moves
        doc = client.job(job)
        assert doc["last_call_timeout"] == 0.0 and doc["health_check"] == "nvidia-smi -L"
        sources = doc["settings_source"]
        assert sources["last_call_timeout"] == sources["health_check"] == f"policy {family}-*"
        assert (sources["min_nodes"], sources["max_nodes"], sources["heartbeat_ttl"]) == ("node", "node", "default")
        assert not [e for e in client.events(job)["events"] if e["kind"] == "join_refused"]
        # A key no policy covers still has to agree.
        with pytest.raises(ConflictError, match="max_nodes=3"):
            join(client, job, "c", JobSettings(min_nodes=2, max_nodes=3, last_call_timeout=5.0))


def test_a_lowered_min_nodes_forms_the_round_that_waits_for_nodes(server: ServerProcess) -> None:
    job = unique("short")
    settings = JobSettings(min_nodes=3, max_nodes=3, last_call_timeout=0.0)
    with Client(server.endpoint) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        places = [pool.submit(join, client, job, node, settings) for node in ("a", "b")]
        wait_until(lambda: len(client.job(job)["joining"]) == 2, what="two nodes in line")
        assert client.job(job)["pending_reason"] == "waiting for min_nodes: 2 of 3 joined"
        client.set_policy(job, {"min_nodes": 2})
        assigned = [p.result(timeout=30) for p in places]
        assert {a.num_nodes for a in assigned} == {2}
        events = client.events(job)["events"]
        kinds = [e["kind"] for e in events]
        assert kinds.index("policy_changed") < kinds.index("round_formed")
        [changed] = [e for e in events if e["kind"] == "policy_changed"]
        assert changed["changes"] == {"min_nodes": {"old": 3, "new": 2, "source": f"policy {job}"}}
        assert (changed["pattern"], changed["by"], changed["cause"]) == (job, "operator", "operator")
        assert client.job(job)["settings_source"]["min_nodes"] == f"policy {job}"
        client.unset_policy(job)


def test_a_raised_max_restarts_keeps_a_failing_job_open_past_its_old_budget(server: ServerProcess) -> None:
    job = unique("budget")
    settings = JobSettings(min_nodes=1, max_nodes=1, max_restarts=1)
    with Client(server.endpoint) as client:
        assert join(client, job, "a", settings).round == 0
        assert join(client, job, "a", settings).round == 1  # its workers failed: restart 1 of 1
        client.set_policy(job, {"max_restarts": 2})
        assert join(client, job, "a", settings).round == 2  # past the old budget: restart 2 of 2
        with pytest.raises(JobClosedError, match="restart_budget_exhausted"):
            join(client, job, "a", settings)
        story = [(e["kind"], e.get("restarts"), e.get("max_restarts")) for e in client.events(job)["events"]
                 if e["kind"] in ("restart_counted", "policy_changed", "job_closed")]
        assert story == [
            ("restart_counted", 1, 1), ("policy_changed", None, None), ("restart_counted", 2, 2), ("job_closed", 2, 2),
        ]
        client.unset_policy(job)


def test_a_policy_change_answers_the_jobs_parked_watch_with_the_new_policy_version(server: ServerProcess) -> None:
    """A node whose beats go one-way learns of a policy change from its parked watch, which the
    change answers (not from its next answered beat), so a node-side key applies at its next join."""
    job = unique("watched")
    with Client(server.endpoint) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        place = join(client, job, "a", JobSettings(min_nodes=1, max_nodes=1))
        before = place.policy_version
        parked = parked_long_polls(server)
        watch = pool.submit(client.watch, job, "a", round=place.round, known=0, hold=120.0)
        wait_until(lambda: parked_long_polls(server) > parked, what="the watch to park")
        client.set_policy(job, {"health_check": "/opt/checks/gpu.sh"})
        # Answered by the change, not by the end of its hold (over 10 s here, jittered): a bound
        # far under that hold and far over an answer. Without the wake it fails.
        seen = call_within(lambda: watch.result(), timeout=5.0, what="the parked watch answered by the policy change")
        assert seen.policy_version > before and not seen.closed
        assert client.effective_policy(job)["settings"] == {"health_check": "/opt/checks/gpu.sh"}
        client.unset_policy(job)


def test_a_policy_survives_sigkill_and_a_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, durable=True)
    srv.start()
    try:
        with Client(srv.endpoint) as client:
            join(client, "durable-1", "a", JobSettings(min_nodes=1, max_nodes=1))
            client.set_policy("durable-*", {"max_restarts": 4, "gpu_check": False})
            version = client.effective_policy("durable-1")["version"]
        srv.restart()  # SIGKILL, then a start on the same data directory
        with Client(srv.endpoint) as client:
            assert [(p["pattern"], p["settings"]) for p in client.policies()] == [
                ("durable-*", {"max_restarts": 4, "gpu_check": False})
            ]
            assert client.effective_policy("durable-1")["version"] == version
            doc = client.job("durable-1")
            assert (doc["max_restarts"], doc["settings_source"]["max_restarts"]) == (4, "policy durable-*")
    finally:
        srv.close()


def test_a_policy_outlives_the_leader_over_replicas(tmp_path: Path) -> None:
    """Two replicas over a one-member etcd: the policy is a logged command, so the replica that
    takes over holds it and applies it to a job created after the fail-over."""
    require_etcd()
    with running_etcd(1) as etcd, ReplicaCluster(etcd, tmp_path, size=2).start() as replicas:
        with Client(replicas.endpoint, retry_budget=60) as client:
            client.set_policy("ha-*", {"min_nodes": 1, "max_nodes": 1, "max_restarts": 2})
        leader = replicas.wait_for_leader()
        replicas.replicas[leader].kill()
        replicas.wait_for_leader(other_than=leader)
        with Client(replicas.endpoint, retry_budget=60) as client:
            assert client.policy("ha-*")["settings"] == {"min_nodes": 1, "max_nodes": 1, "max_restarts": 2}
            # --nnodes=1:8 from the node; the policy makes it a round of exactly one.
            join(client, "ha-1", "a", JobSettings(min_nodes=1, max_nodes=8, last_call_timeout=30.0))
            doc = client.job("ha-1")
            assert (doc["max_nodes"], doc["max_restarts"]) == (1, 2)
            assert doc["settings_source"]["max_nodes"] == "policy ha-*"


def test_a_node_of_a_server_that_never_had_a_policy_fetches_none_until_an_answer_reports_one(tmp_path: Path) -> None:
    """Thousands of nodes starting at once each fetched the policy before their first join, over
    an HTTP connection of its own; the hello now says the server's policy version, and at 0
    (no policy ever set) the node's only connection is its stream."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.conf import NodeConf
    from rdzv_client.nodepolicy import NodePolicy

    srv = ServerProcess(tmp_path, durable=False)
    srv.start()
    proxy = FrameCountingProxy(srv)
    job, settings = unique("fresh"), JobSettings(1, 1)
    own = NodeConf.read(RendezvousParameters("rdzv-server", proxy.endpoint, job, 1, 1, local_addr="10.0.0.7"))
    try:
        with Client(proxy.endpoint, token=srv.token, transport=PipelinedSocketTransport(token=srv.token)) as node, \
                Client(srv.endpoint, token=srv.token) as operator:
            policy = NodePolicy(own)
            assert node.announced_policy_version() == 0
            assert policy.before_join(node) == own
            placed = join(node, job, "n1", settings)
            policy.seen(placed.policy_version)
            assert not policy.due and proxy.accepted == 1  # the stream alone: no fetch
            operator.set_policy(job, {"gpu_check": False})
            seen = node.watch(job, "n1", round=placed.round, known=0, hold=0.0)
            policy.seen(seen.policy_version)  # an answer reports the new version: the next join asks
            assert policy.due and policy.before_join(node).gpu_check is False
            # ... on its stream: the policy operation, no HTTP connection of its own.
            assert proxy.accepted == 1 and proxy.sent[-1] == "policy", proxy.sent
            with Client(srv.endpoint, token=srv.token, transport=PipelinedSocketTransport(token=srv.token)) as late:
                assert late.announced_policy_version() == seen.policy_version >= 1  # a node starting now asks first
    finally:
        proxy.close()
        srv.close()
