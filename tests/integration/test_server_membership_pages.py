"""The membership document in pages: ``GET /v1/jobs/{rdzv_id}?offset=M&limit=K`` keeps every
field of the document and cuts its node lists, so a page of a 16K-node job need not fetch
every node every second; ``counts`` says how many each list holds in all."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from server_process import ServerProcess

from rdzv_client import Client

NODES = 5


def get(srv: ServerProcess, path: str) -> tuple[int, Any]:
    request = urllib.request.Request(f"{srv.url}{path}", headers={"Accept": "application/json", **srv.auth})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def formed(server: ServerProcess) -> str:
    job = "paged"
    with Client(server.endpoint) as client, ThreadPoolExecutor(NODES) as pool:
        joins = [
            pool.submit(client.join, job, node_id=f"n{i}", addr="127.0.0.1", nproc_per_node=2,
                        min_nodes=NODES, max_nodes=NODES, timeout=30)
            for i in range(NODES)
        ]  # fmt: skip
        assert sorted(j.result().node_rank for j in joins) == list(range(NODES))
    return job


def test_without_paging_every_node_is_listed_and_counted(server: ServerProcess, formed: str) -> None:
    status, doc = get(server, f"/v1/jobs/{formed}")
    assert status == 200
    assert [n["node_rank"] for n in doc["nodes"]] == list(range(NODES))
    assert doc["counts"] == {"nodes": NODES, "joining": 0, "waiting": 0, "standby": 0}
    assert "page" not in doc


def test_a_page_holds_limit_nodes_from_offset_by_node_rank_and_keeps_every_field(
    server: ServerProcess, formed: str
) -> None:
    _, whole = get(server, f"/v1/jobs/{formed}")
    status, doc = get(server, f"/v1/jobs/{formed}?offset=1&limit=2")
    assert status == 200
    assert [n["node_rank"] for n in doc["nodes"]] == [1, 2]
    assert [n["node_id"] for n in doc["nodes"]] == [n["node_id"] for n in whole["nodes"][1:3]]
    assert doc["page"] == {"offset": 1, "limit": 2}
    assert doc["counts"]["nodes"] == NODES and doc["num_nodes"] == NODES and doc["world_size"] == 2 * NODES
    assert set(whole) <= set(doc)  # every field of the whole document is there


def test_limit_zero_is_the_summary_and_an_offset_past_the_end_is_empty(server: ServerProcess, formed: str) -> None:
    _, summary = get(server, f"/v1/jobs/{formed}?limit=0")
    assert summary["nodes"] == [] and summary["counts"]["nodes"] == NODES and summary["state"] == "complete"
    _, past = get(server, f"/v1/jobs/{formed}?offset={NODES}")
    assert past["nodes"] == [] and past["page"] == {"offset": NODES, "limit": None}


@pytest.mark.parametrize("query", ["limit=-1", "offset=-3", "limit=x", "offset=1.5"])
def test_a_bad_page_is_a_400_that_says_which_parameter(server: ServerProcess, formed: str, query: str) -> None:
    status, body = get(server, f"/v1/jobs/{formed}?{query}")
    assert status == 400 and body["error"] == "bad_request", body
    assert query.split("=")[0] in body["message"], body
