"""The job page's data over HTTP, from the real server: a page of the membership document
(``GET /v1/jobs/{rdzv_id}?offset=O&limit=L``) and the lanes (``GET /v1/jobs/{rdzv_id}/lanes``).

Rules checked (``rdzv_server/api/page.py`` states them):
- without paging parameters the membership document is exactly what it was;
- with them, its four node lists hold their part of one order, with ``page`` and ``counts``;
- the lanes hold one lane per node with a cell per round, the rounds with their formation
  time, and a summary over every node, whatever the page;
- a bad parameter is ``400 bad_request`` naming it, and changes nothing; an unknown job is
  ``404``; the lanes need a token like every ``/v1`` read.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from server_process import ServerProcess

from rdzv_client import Client, JobSettings

JOIN_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own
    job."""
    srv = ServerProcess(tmp_path_factory.mktemp("page-server"), durable=False)
    srv.start()
    yield srv
    srv.close()


def get(srv: ServerProcess, path: str, token: str | None = "") -> tuple[int, Any]:
    headers = {"Accept": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token or srv.token}"
    request = urllib.request.Request(srv.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def job_with_a_spare(srv: ServerProcess) -> tuple[str, threading.Thread]:
    """A formed round of three nodes and one spare in line (its join waits until the job closes)."""
    job = f"page-{uuid.uuid4().hex[:8]}"
    with Client(srv.endpoint, token=srv.token) as client:
        threads = [
            threading.Thread(
                target=client.join, args=(job,),
                kwargs={"node_id": f"n{i}", "addr": f"10.1.0.{i}", "nproc_per_node": 2,
                        "settings": JobSettings(min_nodes=3, max_nodes=3), "timeout": JOIN_TIMEOUT},
            )
            for i in range(3)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_TIMEOUT + 5)

    def spare() -> None:
        with Client(srv.endpoint, token=srv.token) as client:
            try:
                client.join(job, node_id="n9", addr="10.1.0.9", nproc_per_node=2,
                            settings=JobSettings(min_nodes=3, max_nodes=3),
                            timeout=JOIN_TIMEOUT)  # fmt: skip
            except Exception:  # noqa: BLE001, S110 (the job closes under it at the end of the test)
                pass

    waiter = threading.Thread(target=spare, daemon=True)
    waiter.start()
    with Client(srv.endpoint, token=srv.token) as client:
        for _ in range(600):  # bounded: until the spare is in line
            if client.job(job)["standby"]:
                break
            waiter.join(0.05)
        assert client.job(job)["standby"]
    return job, waiter


def close(srv: ServerProcess, job: str, waiter: threading.Thread) -> None:
    with Client(srv.endpoint, token=srv.token) as client:
        client.close_job(job)
    waiter.join(JOIN_TIMEOUT + 5)


def test_the_document_pages_its_nodes_in_one_order_and_is_unchanged_without_parameters(server: ServerProcess) -> None:
    job, waiter = job_with_a_spare(server)
    status, whole = get(server, f"/v1/jobs/{job}")
    assert status == 200 and "page" not in whole and "counts" not in whole
    assert sorted(n["node_id"] for n in whole["nodes"]) == ["n0", "n1", "n2"]
    status, first = get(server, f"/v1/jobs/{job}?offset=1&limit=3")
    assert status == 200
    ids = [n["node_id"] for n in whole["nodes"]]
    assert [n["node_id"] for n in first["nodes"]] == ids[1:] and [n["node_id"] for n in first["standby"]] == ["n9"]
    assert first["page"] == {"offset": 1, "limit": 3, "total": 4}
    assert first["counts"] == {"nodes": 3, "joining": 0, "waiting": 0, "standby": 1}
    assert first["state"] == "complete" and first["world_size"] == 6
    status, bare = get(server, f"/v1/jobs/{job}?limit=0")
    assert status == 200 and bare["nodes"] == [] and bare["standby"] == [] and bare["page"]["total"] == 4
    status, past = get(server, f"/v1/jobs/{job}?offset=100")
    assert status == 200 and past["nodes"] == [] and past["page"] == {"offset": 100, "limit": 100, "total": 4}
    close(server, job, waiter)


def test_the_lanes_show_every_node_across_rounds_with_a_summary_over_every_page(server: ServerProcess) -> None:
    job, waiter = job_with_a_spare(server)
    status, answer = get(server, f"/v1/jobs/{job}/lanes?offset=2&limit=1")
    assert status == 200
    (formed,) = answer["rounds"]
    assert formed["round"] == 0 and formed["cause"] == "max_nodes" and formed["num_nodes"] == 3
    assert formed["formation_s"] >= 0 and formed["formed_at"] <= answer["now"]
    assert answer["summary"] == [{"member": 3, "standby": 1}]
    assert answer["page"] == {"offset": 2, "limit": 1, "total": 4}
    (lane,) = answer["lanes"]
    assert lane["cells"] == ["member"] and lane["node_rank"] == 2
    status, answer = get(server, f"/v1/jobs/{job}/lanes")
    assert [(lane["node_id"], lane["cells"]) for lane in answer["lanes"]][-1] == ("n9", ["standby"])
    close(server, job, waiter)


@pytest.mark.parametrize(
    "query, name",
    [("offset=-1", "offset"), ("offset=x", "offset"), ("limit=1001", "limit"), ("limit=1.5", "limit")],
)
def test_a_bad_paging_parameter_is_400_naming_it(server: ServerProcess, query: str, name: str) -> None:
    job, waiter = job_with_a_spare(server)
    for path in (f"/v1/jobs/{job}?{query}", f"/v1/jobs/{job}/lanes?{query}"):
        status, body = get(server, path)
        assert status == 400 and body["error"] == "bad_request" and f"query parameter {name}" in body["message"], body
    status, body = get(server, f"/v1/jobs/{job}/lanes?limit=0")  # a page of lanes holds at least one
    assert status == 400 and "limit must be 1..1000" in body["message"], body
    assert get(server, f"/v1/jobs/{job}")[1]["standby"]  # nothing changed
    close(server, job, waiter)


def test_the_lanes_of_an_unknown_job_are_404_and_need_a_token(server: ServerProcess) -> None:
    status, body = get(server, "/v1/jobs/no-such-job/lanes")
    assert status == 404 and body["error"] == "job_not_found", body
    status, body = get(server, "/v1/jobs/no-such-job/lanes", token=None)
    assert status == 401 and body["error"] == "unauthorized"
