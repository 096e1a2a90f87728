"""What a hostile web page can try through an operator's browser, against the real server.

Rules checked (rdzv_server/api/app.py's docstring states them):
- a write (any method but GET/HEAD/OPTIONS) with a foreign ``Origin`` is ``403 forbidden``
  and changes nothing, even with a valid token; the server's own origin, and requests with
  no ``Origin`` (programs), are served;
- with ``--allowed-hosts`` a request whose ``Host`` names another host is ``421
  host_not_allowed`` (DNS rebinding), the page included; ``/livez``, ``/healthz``,
  ``/readyz`` and ``/metrics`` answer whatever the Host;
- every answer carries the browser hardening headers, the page a Content-Security-Policy
  with no inline script or style, and the page's markup holds no inline script or style;
- ``/livez`` answers without a token; ``/jobs/{rdzv_id}?token=`` redirects to its page.
"""

from __future__ import annotations

import dataclasses
import email.message
import html.parser
import http.client
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from server_process import ServerProcess

from rdzv_client import JobSettings, wire
from rdzv_server.api.app import authority
from rdzv_server.api.header import DATA_POLICY, PAGE_POLICY

JSON = "application/json"
ALLOWED = ("rdzv.test", "127.0.0.1", "::1")
HARDENING = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
}


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    headers: email.message.Message
    body: bytes

    def json(self) -> Any:
        assert self.headers.get_content_type() == JSON, (self.status, self.headers.get_content_type(), self.body[:200])
        return json.loads(self.body)

    @property
    def error(self) -> Any:
        return self.json().get("error")


def send(srv: ServerProcess, method: str, path: str, headers: dict[str, str] | None = None, body: Any = None) -> Answer:
    """One raw request; ``headers`` may set Host and Origin as a browser would."""
    headers = dict(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers.setdefault("Content-Type", JSON)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, resp.headers, resp.read())
    finally:
        conn.close()


def new_job() -> str:
    return f"web-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("web-server"), durable=False)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server that answers for ALLOWED only."""
    srv = ServerProcess(tmp_path_factory.mktemp("web-guarded"), durable=False, args=("--allowed-hosts", ",".join(ALLOWED)))
    srv.start()
    yield srv
    srv.close()


def key_value(srv: ServerProcess, rdzv_id: str, key: str) -> Any:
    answer = send(srv, "POST", wire.op_path(rdzv_id, "get"), srv.auth, {"key": key})
    assert answer.status == 200, answer
    return answer.json()


# --------------------------------------------------------------------------- Origin


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "https://evil.example:{port}",
        "null",  # sandboxed frames, file: pages
        "http://127.0.0.1:1",  # another service on this host (same site, other origin)
        "http://127.0.0.1.evil.example:{port}",
        "http://evil.example@127.0.0.1:{port}",  # no second host hidden in the authority
        "http://127.0.0.1:{port}/",  # an origin has no path: malformed is foreign
        "chrome-extension://abcdef",
        "",
    ],
)
def test_a_write_from_a_foreign_origin_is_403_forbidden_and_changes_nothing(server: ServerProcess, origin: str) -> None:
    job = new_job()
    assert send(server, "POST", wire.op_path(job, "create"), server.auth, {}).status == 200
    headers = {**server.auth, "Origin": origin.format(port=server.port)}
    answer = send(server, "POST", wire.op_path(job, "set"), headers, {"key": "k", "value": "from-evil"})
    assert answer.status == 403
    assert answer.error == "forbidden"
    assert "cross-site" in answer.json()["message"]
    assert key_value(server, job, "k")["found"] is False


def test_a_cross_site_create_or_close_is_refused_before_it_applies(server: ServerProcess) -> None:
    job = new_job()
    evil = {**server.auth, "Origin": "http://evil.example"}
    assert send(server, "POST", wire.op_path(job, "create"), evil, {}).status == 403
    assert send(server, "GET", f"/v1/jobs/{job}", server.auth).status == 404
    assert send(server, "POST", wire.op_path(job, "create"), server.auth, {}).status == 200
    assert send(server, "POST", wire.op_path(job, "close"), evil, {}).status == 403
    assert send(server, "GET", f"/v1/jobs/{job}", server.auth).json()["state"] != "closed"


@pytest.mark.parametrize(
    "host, origin",
    [
        ("127.0.0.1:{port}", "http://127.0.0.1:{port}"),
        ("127.0.0.1:{port}", "HTTP://127.0.0.1:{port}"),  # origins compare case-insensitively
        ("LocalHost:{port}", "http://localhost:{port}"),
        ("rdzv.test", "http://rdzv.test"),  # the default port on both sides
        ("rdzv.test:80", "http://rdzv.test"),
        ("rdzv.test:443", "https://rdzv.test"),  # behind a TLS proxy: whatever is at host:port is us
    ],
)
def test_a_write_from_the_servers_own_origin_is_served(server: ServerProcess, host: str, origin: str) -> None:
    job = new_job()
    headers = {**server.auth, "Host": host.format(port=server.port), "Origin": origin.format(port=server.port)}
    assert send(server, "POST", wire.op_path(job, "create"), headers, {}).status == 200
    answer = send(server, "POST", wire.op_path(job, "set"), headers, {"key": "k", "value": "ours"})
    assert answer.status == 200, answer
    assert key_value(server, job, "k") == {"found": True, "value": "ours"}


def test_a_write_without_origin_is_served_as_from_a_program(server: ServerProcess) -> None:
    job = new_job()
    assert send(server, "POST", wire.op_path(job, "create"), server.auth, {}).status == 200
    assert send(server, "POST", wire.op_path(job, "set"), server.auth, {"key": "k", "value": "v"}).status == 200


def test_a_read_from_a_foreign_origin_is_answered_without_cors_so_the_page_cannot_read_it(server: ServerProcess) -> None:
    answer = send(server, "GET", "/v1/jobs", {**server.auth, "Origin": "http://evil.example"})
    assert answer.status == 200
    assert "Access-Control-Allow-Origin" not in answer.headers


def test_the_origin_check_comes_before_authentication(server: ServerProcess) -> None:
    """A foreign page learns nothing about tokens: refused whether or not it has one."""
    answer = send(server, "POST", wire.op_path(new_job(), "create"), {"Origin": "http://evil.example"}, {})
    assert (answer.status, answer.error) == (403, "forbidden")


# --------------------------------------------------------------------------- Host


@pytest.mark.parametrize("path", ["/", "/v1/jobs", "/jobs/some-job", "/static/dashboard.js", "/nowhere"])
def test_a_request_for_an_unlisted_host_is_421_host_not_allowed(guarded: ServerProcess, path: str) -> None:
    answer = send(guarded, "GET", path, {**guarded.auth, "Host": f"evil.example:{guarded.port}"})
    assert answer.status == 421
    assert answer.error == "host_not_allowed"
    message = answer.json()["message"]
    assert "rdzv.test" in message and "--allowed-hosts" in message and "evil.example" in message
    assert wire.HTTP_STATUS[wire.ErrorCode.HOST_NOT_ALLOWED] == 421


def test_a_write_for_an_unlisted_host_is_refused_and_changes_nothing(guarded: ServerProcess) -> None:
    job = new_job()
    rebound = {**guarded.auth, "Host": f"attacker.example:{guarded.port}", "Origin": f"http://attacker.example:{guarded.port}"}
    assert send(guarded, "POST", wire.op_path(job, "create"), rebound, {}).status == 421
    assert send(guarded, "GET", f"/v1/jobs/{job}", guarded.auth).status == 404


@pytest.mark.parametrize("host", ["", "rdzv.test@evil.example", "evil.example, rdzv.test", "rdzv.test:99999", "[::1"])
def test_a_malformed_host_is_refused(guarded: ServerProcess, host: str) -> None:
    answer = send(guarded, "GET", "/v1/jobs", {**guarded.auth, "Host": host})
    assert (answer.status, answer.error) == (421, "host_not_allowed")


@pytest.mark.parametrize("host", ["rdzv.test", "RDZV.test:{port}", "127.0.0.1:{port}", "[::1]:{port}"])
def test_a_listed_host_is_served_with_any_port_and_case(guarded: ServerProcess, host: str) -> None:
    answer = send(guarded, "GET", "/v1/jobs", {**guarded.auth, "Host": host.format(port=guarded.port)})
    assert answer.status == 200, answer


@pytest.mark.parametrize("path", ["/livez", "/healthz", "/readyz", "/metrics"])
def test_probes_and_metrics_answer_whatever_the_host(guarded: ServerProcess, path: str) -> None:
    answer = send(guarded, "GET", path, {"Host": f"10.1.2.3:{guarded.port}"})
    assert answer.status == 200, answer


def test_the_real_client_works_with_allowed_hosts_when_it_uses_a_listed_name(guarded: ServerProcess) -> None:
    from rdzv_client import Client

    with Client(guarded.endpoint, token=guarded.token) as client:
        job = new_job()
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.set(job, b"k", b"v")
        assert job in {j["rdzv_id"] for j in client.jobs()}


def test_without_allowed_hosts_any_host_is_served(server: ServerProcess) -> None:
    assert send(server, "GET", "/v1/jobs", {**server.auth, "Host": "anything.example"}).status == 200


# --------------------------------------------------------------------------- headers


def assert_hardened(answer: Answer, policy: str) -> None:
    for name, value in HARDENING.items():
        assert answer.headers.get(name) == value, (name, answer.status)
    assert answer.headers.get("Content-Security-Policy") == policy
    assert "frame-ancestors 'none'" in policy


@pytest.mark.parametrize(
    "method, path, with_token, status",
    [
        ("GET", "/v1/jobs", True, 200),
        ("GET", "/v1/jobs", False, 401),
        ("GET", "/v1/jobs/no-such-job", True, 404),
        ("GET", "/v1/jobs/no-such-job/lanes", True, 404),
        ("GET", "/v1/jobs/no-such-job?offset=0&limit=5", True, 404),
        ("GET", "/nowhere", False, 404),
        ("DELETE", "/v1/jobs", True, 405),
        ("GET", "/livez", False, 200),
        ("GET", "/metrics", False, 200),
        ("GET", "/static/dashboard.js", False, 200),
        ("GET", "/static/dashboard.css", False, 200),
    ],
)
def test_every_answer_carries_the_hardening_headers(
    server: ServerProcess, method: str, path: str, with_token: bool, status: int
) -> None:
    answer = send(server, method, path, server.auth if with_token else {})
    assert answer.status == status
    assert_hardened(answer, DATA_POLICY)


def test_the_token_redirect_carries_the_headers_and_keeps_the_token_out_of_referers(server: ServerProcess) -> None:
    answer = send(server, "GET", f"/?token={server.token}")
    assert answer.status == 303
    assert answer.headers["Location"] == "/"
    assert_hardened(answer, DATA_POLICY)


def test_a_job_pages_token_redirect_goes_back_to_that_job(server: ServerProcess) -> None:
    answer = send(server, "GET", f"/jobs/some.job-1?token={server.token}")
    assert answer.status == 303
    assert answer.headers["Location"] == "/jobs/some.job-1"
    assert "rdzv_token=" in answer.headers["Set-Cookie"]
    assert send(server, "GET", "/jobs/bad%20id").error == "invalid_id"


class _Markup(html.parser.HTMLParser):
    """Collects what a Content-Security-Policy without 'unsafe-inline' would block."""

    def __init__(self) -> None:
        super().__init__()
        self.inline: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if tag == "style" or "style" in names or any(name.startswith("on") for name in names):
            self.inline.append(tag)
        if tag == "script":
            self.scripts.append(dict(attrs).get("src") or "")
            self._in_script = True

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append("script")


@pytest.mark.parametrize("path", ["/", "/jobs/some-job"])
def test_the_page_has_a_strict_policy_and_no_inline_script_or_style(server: ServerProcess, path: str) -> None:
    answer = send(server, "GET", path)
    assert answer.status == 200
    assert answer.headers.get_content_type() == "text/html"
    assert_hardened(answer, PAGE_POLICY)
    assert "default-src 'self'" in PAGE_POLICY and "unsafe-inline" not in PAGE_POLICY
    markup = _Markup()
    markup.feed(answer.body.decode())
    assert markup.inline == []
    assert markup.scripts == ["/static/dashboard.js"]


def test_the_pages_script_builds_the_page_from_text_only(server: ServerProcess) -> None:
    script = send(server, "GET", "/static/dashboard.js")
    assert script.headers.get_content_type() == "text/javascript"
    code = script.body.decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in code


@pytest.mark.parametrize("name", ["dashboard.html", "app.py", "..%2Fapp.py", "%2E%2E"])
def test_static_serves_only_the_pages_files(server: ServerProcess, name: str) -> None:
    assert send(server, "GET", f"/static/{name}").status == 404


# --------------------------------------------------------------------------- /livez


def test_livez_answers_without_a_token(server: ServerProcess) -> None:
    answer = send(server, "GET", "/livez")
    assert answer.status == 200
    assert answer.json() == {"status": "ok"}


# --------------------------------------------------------------------------- authority()


@pytest.mark.parametrize(
    "value, scheme, expected",
    [
        ("example.com", "http", ("example.com", 80)),
        ("Example.COM:8080", "https", ("example.com", 8080)),
        ("example.com", "https", ("example.com", 443)),
        ("[::1]:29400", "http", ("::1", 29400)),
        ("127.0.0.1:29400", "http", ("127.0.0.1", 29400)),
        ("example.com", "ftp", None),
        ("example.com:0", "http", None),
        ("example.com:65536", "http", None),
        ("a@b", "http", None),
        ("a b", "http", None),
        ("a/b", "http", None),
        ("", "http", None),
        ("[::1", "http", None),
    ],
)
def test_authority_parses_host_and_port_strictly(value: str, scheme: str, expected: tuple[str, int] | None) -> None:
    assert authority(value, scheme) == expected
