"""What the server holds per job and per client, against the real server process: each limit
answers its documented error over HTTP and through the client, and changes nothing; a retry is
recognised however many writes its client sent meanwhile; a job in use is never collected."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest
from server_process import ServerProcess
from waiting import wait_until

from rdzv_client import Client, JobSettings, LimitError, NotFoundError, wire


def post(srv: ServerProcess, job: str, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{srv.url}/v1/jobs/{job}/{op}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **srv.auth},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        assert exc.headers["Content-Type"].startswith("application/json")
        return exc.code, json.loads(exc.read())


def store_job(client: Client) -> str:
    job = f"quota-{uuid.uuid4().hex[:8]}"
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    return job


def test_a_retry_after_thousands_of_writes_of_the_same_client_is_applied_once(server: ServerProcess) -> None:
    """Threads share a client: seq 1's answer is lost while 2,000 other writes of that client
    are answered (its floor stays at 1). The retry still gets the recorded result."""
    with Client(server.endpoint) as client:
        job = store_job(client)
        first = client.request(job, wire.AddRequest(job, key=b"n", amount=1, rid=("shared", 1, 1)))
        for seq in range(2, 2002):
            client.request(job, wire.AddRequest(job, key=b"other", amount=1, rid=("shared", seq, 1)))
        retry = client.request(job, wire.AddRequest(job, key=b"n", amount=1, rid=("shared", 1, 1)))
        assert retry == first == {"value": 1}
        assert client.add(job, "n", 0) == 1


def test_a_late_copy_of_an_answered_write_is_refused_and_changes_nothing(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        job = store_job(client)
        client.request(job, wire.AddRequest(job, key=b"n", amount=1, rid=("late", 1, 1)))
        client.request(job, wire.AddRequest(job, key=b"n", amount=1, rid=("late", 2, 2)))  # 1 was answered
        status, body = post(server, job, "add", {"key": "n", "amount": 1, "rid": ["late", 1, 1]})
        assert (status, body["error"]) == (400, "bad_request") and "stale duplicate" in body["message"]
        assert client.add(job, "n", 0) == 2


def test_many_threads_sharing_one_client_apply_every_add_exactly_once(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        job = store_job(client)

        def worker() -> None:
            for _ in range(200):
                client.add(job, "n", 1)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert client.add(job, "n", 0) == 1600


def test_keys_per_job_and_jobs_per_server_are_limited_and_refusals_change_nothing(server_factory: Any) -> None:
    srv = server_factory(args=("--max-keys-per-job", "3", "--max-jobs", "2"))
    with Client(srv.endpoint) as client:
        job = store_job(client)
        client.multi_set(job, ["a", "b", "c"], ["1", "2", "3"])
        status, body = post(srv, job, "set", {"key": "d", "value": "4"})
        assert (status, body["error"]) == (429, "too_many_keys") and "--max-keys-per-job" in body["message"]
        with pytest.raises(LimitError) as caught:
            client.append(job, "e", "5")
        assert caught.value.code is wire.ErrorCode.TOO_MANY_KEYS
        client.set(job, "a", "overwritten")  # no new key: fine
        assert client.num_keys(job) == 3 and client.check(job, ["d"]) is False

        store_job(client)  # the second job
        status, body = post(srv, "third-job", "create", {"min_nodes": 1, "max_nodes": 1})
        assert (status, body["error"]) == (429, "too_many_jobs")
        with pytest.raises(NotFoundError):
            client.num_keys("third-job")
        assert len(client.jobs()) == 2
    with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    for line in ("rdzv_job_keys_max 3.0", "rdzv_job_keys_max_limit 3.0", "rdzv_jobs_held 2.0", "rdzv_jobs_held_limit 2.0"):
        assert line in metrics.splitlines(), line


def test_bytes_per_job_are_limited(server_factory: Any) -> None:
    srv = server_factory(args=("--max-job-bytes", "1000", "--max-value-bytes", "600"))
    with Client(srv.endpoint) as client:
        job = store_job(client)
        client.set(job, "big", b"x" * 600)
        with pytest.raises(LimitError) as caught:
            client.set(job, "big2", b"x" * 600)
        assert caught.value.code is wire.ErrorCode.JOB_STORE_FULL
        assert client.check(job, ["big2"]) is False
        client.delete_key(job, "big")
        client.set(job, "big2", b"x" * 600)


def test_a_huge_number_in_a_duration_field_is_a_400_not_a_500(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        job = store_job(client)
    body = json.dumps({"key": "k", "timeout": 0}).replace("0}", "1" + "0" * 400 + "}")
    request = urllib.request.Request(
        f"{server.url}/v1/jobs/{job}/get",
        data=body.encode(),
        headers={"Content-Type": "application/json", **server.auth},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"] == "bad_request"
    assert "Traceback" not in server.log_text()


def test_a_store_only_job_in_constant_use_outlives_the_job_ttl(server_factory: Any) -> None:
    """RdzvStore(create=True) for init_process_group makes a job with no nodes: idle from birth.
    Store traffic is use: it is kept while used, and collected one job TTL after the last use."""
    srv = server_factory(args=("--job-ttl", "1.5"))
    with Client(srv.endpoint) as client:
        job = store_job(client)
        client.set(job, "k", "v")
        deadline = time.monotonic() + 4.0  # well past the TTL
        while time.monotonic() < deadline:  # reads alone keep it
            assert client.get(job, "k", timeout=1) == b"v"
            time.sleep(0.3)
        wait_until(lambda: job not in {j["rdzv_id"] for j in client.jobs()}, timeout=10, what="the job collected")
