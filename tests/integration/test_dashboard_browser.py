"""The dashboard in a real browser (headless Chromium) against the real server, auth on.

Chromium is driven over the DevTools protocol in real time (:class:`Browser`): the job page
keeps a long-poll open (``/v1/jobs/ID/events?wait=25``), and ``--dump-dom``'s virtual time
stands still while a request is pending, so it could not show a page that follows events.
The browser's console, script errors and policy violations are collected from the protocol
(and its ``--enable-logging=stderr`` log). Rules checked:
- opened once as ``/jobs/ID?token=TOKEN`` (the write or the read-only token), the page
  shows that job's state, nodes, ranks and addresses, its rounds with their formation time
  and its timeline with causes; the redirect keeps the cookie for the page's own requests;
- what happens while the page is open (a node joins as a spare, then leaves) appears in the
  timeline and the node tables without the page being reloaded or its timeline redrawn;
- while a round is open the page says why (``pending_reason``);
- opened without a token it shows nothing of any job and tells the operator how to open it
  (``/?token=TOKEN``) and where the token file is; a job that does not exist stops the page
  with a message;
- what a node sends (its ``addr`` allows any text) is shown as text, in the node tables and
  in the timeline, never run as markup;
- the page's own script and style run under its policy (no violation in the console);
- the lanes draw each node across rounds (member, standby, refused, dead), each round with its
  formation time and a bar counting every node, updated as events happen;
- a 16,384-node job (joined over the stream protocol, pipelined) draws one page of lanes and
  nodes, a bar per round for all of them, and pages to its last node; the test prints how long
  the first draw took after the navigation (README "The job page").

Needs Debian's chromium at /usr/bin/chromium (``apt-get install -y chromium``); skipped,
saying so, without it. docs/dashboard.png was taken with ``--screenshot --window-size=1200,700``;
docs/job-page.png by tests/e2e/test_torchrun_e2e.py (a job with a death and a re-formed round).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import html.parser
import json
import os
import socket
import struct
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from raw_stream import FrameReader
from server_process import ServerProcess
from waiting import wait_until

from rdzv_client import AsyncClient, Client, ConflictError, JobSettings, wire

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed at /usr/bin/chromium (apt-get install -y chromium)",
)
# Wall-clock bounds: Chromium's start (about a second), one protocol call, a page's first render.
CHROMIUM_START_TIMEOUT = 30.0
CALL_TIMEOUT = 30.0
PAGE_TIMEOUT = 20.0
JOIN_TIMEOUT = 30.0
HOSTILE_ADDRS = (
    "<img src=x onerror=\"console.log('pwned-img')\">",
    "</td></tr></table><script>console.log('pwned-script')</script>",
)


# --------------------------------------------------------------------------- a small DOM


@dataclasses.dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def walk(self) -> Iterator[Element]:
        yield self
        for c in self.children:
            if isinstance(c, Element):
                yield from c.walk()

    def find(self, tag: str, **attrs: str) -> list[Element]:
        return [e for e in self.walk() if e.tag == tag and all(e.attrs.get(k) == v for k, v in attrs.items())]

    def by_id(self, id_: str) -> Element:
        (found,) = [e for e in self.walk() if e.attrs.get("id") == id_]
        return found


class _TreeBuilder(html.parser.HTMLParser):
    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__()
        self.root = Element("#document", {})
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self._stack[-1].children.append(element)
        if tag not in self.VOID:
            self._stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i].tag == tag:
                del self._stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self._stack[-1].children.append(data)


def parse(dom: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(dom)
    builder.close()
    return builder.root


# --------------------------------------------------------------------------- the browser


@dataclasses.dataclass(frozen=True)
class Rendered:
    dom: Element
    console: str  # the page's console, script errors and policy violations, one a line

    def node_rows(self, section: str = "nodes") -> list[list[str]]:
        return [
            [td.text for td in tr.find("td")]
            for tr in self.dom.by_id(f"members-{section}").find("tr", **{"class": "node"})
        ]

    def timeline(self) -> list[list[str]]:
        """The timeline's rows, newest first: time, round, event, cause, node, addr, details."""
        return [[td.text for td in tr.find("td")] for tr in self.dom.by_id("timeline").find("tbody")[0].find("tr")]

    def rounds(self) -> list[list[str]]:
        """The rounds table, newest first: round, formed at, reason, nodes, world size, standby, formation."""
        return [[td.text for td in tr.find("td")] for tr in self.dom.by_id("rounds").find("tbody")[0].find("tr")]


class Browser:
    """Headless Chromium over the DevTools protocol, its files in ``profile``.

    The protocol's websocket is served by an event loop in a thread of its own, so a test
    calls it synchronously while it also drives the server (joins, kills) from its own thread.
    """

    def __init__(self, profile: Path, window: tuple[int, int] = (1200, 800)) -> None:
        self.profile = profile
        self.console: list[str] = []
        self._log_path = profile / "chromium.log"
        cmd = [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--window-size={window[0]},{window[1]}",
            f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
            "--enable-logging=stderr", "--log-level=0", "about:blank",
        ]  # fmt: skip
        # Everything Chromium keeps goes to the profile, not to the tests' shared config folder.
        env = {**os.environ, "HOME": str(profile), "XDG_CONFIG_HOME": str(profile), "XDG_CACHE_HOME": str(profile)}
        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}
        try:
            self._run(self._connect(self._page_socket()))
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    # -- the protocol --------------------------------------------------------------------

    def _page_socket(self) -> str:
        """The page target's websocket address (Chromium writes its port to DevToolsActivePort)."""
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + CHROMIUM_START_TIMEOUT
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None, f"chromium exited: {self.log_text()[-3000:]}"
            assert time.monotonic() < deadline, f"chromium opened no DevTools port: {self.log_text()[-3000:]}"
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=CALL_TIMEOUT) as answer:
            targets = json.load(answer)
        return str(next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page"))

    async def _connect(self, url: str) -> None:
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                self._record(data["method"], data.get("params", {}))

    def _record(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"CONSOLE {params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console.append(
                f"Uncaught: {details.get('text')} {details.get('exception', {}).get('description', '')}"
            )
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.console.append(f"LOG {entry.get('source')} {entry.get('level')}: {entry.get('text')}")

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[self._next_id] = future
        await self._ws.send_str(json.dumps({"id": self._next_id, "method": method, "params": params}))
        answer: dict[str, Any] = await asyncio.wait_for(future, CALL_TIMEOUT)
        return answer

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT + 5)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        answer = self._run(self._call(method, params))
        assert "error" not in answer, (method, answer)
        result: dict[str, Any] = answer.get("result", {})
        return result

    # -- what a test does ----------------------------------------------------------------

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, (expression, result)
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = PAGE_TIMEOUT) -> Any:
        """Poll a script expression until it is truthy (bounded); fails with the page's text."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except AssertionError:
                value = None  # the page is navigating: no document to ask yet
            if value:
                return value
            if time.monotonic() >= deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}; page text:\n{text}\nconsole: {self.console}"
                )
            time.sleep(0.1)

    def render(self, url: str, until: str, what: str) -> Rendered:
        """Open ``url``, wait until ``until`` holds, and return the page as it is then."""
        self.open(url)
        self.wait_for(until, what)
        return self.snapshot()

    def snapshot(self) -> Rendered:
        dom = self.evaluate("document.documentElement.outerHTML")
        return Rendered(parse(dom), "\n".join(self.console))

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def log_text(self) -> str:
        return self._log_path.read_text(errors="replace") if self._log_path.exists() else ""

    def close(self) -> None:
        if getattr(self, "_ws", None) is not None:
            try:
                self._run(self._shutdown())
            except Exception:  # noqa: BLE001, S110 (the browser is killed below anyway)
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    async def _shutdown(self) -> None:
        await self._ws.close()
        await self._session.close()
        self._reader.cancel()


def assert_page_ran_clean(page: Rendered) -> None:
    """No policy violation, script error or injected code's output in the page's console."""
    console = page.console.splitlines()
    for word in ("Content Security Policy", "Uncaught", "pwned"):
        assert not [line for line in console if word in line], console


@contextmanager
def job_page_in_chromium(
    server: ServerProcess, job: str, tmp_path: Path, ready: str, what: str
) -> Iterator[tuple[Browser, Rendered]]:
    """The end-to-end tests' look at a job's page: rendered until ``ready`` holds, checked to
    have run clean, with the browser for further questions; skipped where Debian's chromium is
    not installed (.ci/run installs it)."""
    if not CHROMIUM.exists():
        pytest.skip("the job page part needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    browser = Browser(profile, window=(1200, 800))
    try:
        shot = browser.render(f"{server.url}/jobs/{job}?token={server.token}", ready, what)
        assert_page_ran_clean(shot)
        yield browser, shot
    finally:
        browser.close()


# The job page's first render: its nodes and its timeline are in.
def job_page_ready(nodes: int) -> str:
    return (
        f"document.querySelectorAll('#members-nodes tr.node').length >= {nodes}"
        " && document.querySelectorAll('#timeline tbody tr').length > 0"
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def read_token(tmp_path_factory: pytest.TempPathFactory) -> str:
    return "read-" + uuid.uuid4().hex + uuid.uuid4().hex


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, read_token: str) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("browser-server")
    token_file = workdir / "read-token"
    token_file.write_text(read_token + "\n")
    token_file.chmod(0o600)
    srv = ServerProcess(workdir, durable=False, args=("--read-token-file", str(token_file)))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    """A fresh browser profile: no cookie from an earlier test."""
    path = tmp_path / "chromium-profile"
    path.mkdir()
    return path


@pytest.fixture
def browser(profile: Path) -> Iterator[Browser]:
    b = Browser(profile)
    yield b
    b.close()


def form_job(srv: ServerProcess, nodes: dict[str, str]) -> tuple[str, dict[str, int]]:
    """A job whose round formed with ``nodes`` (node_id -> addr), 4 workers each, joined
    from threads by the real client. Returns the job id and each node's node_rank."""
    job = f"browser-{uuid.uuid4().hex[:10]}"
    ranks: dict[str, int] = {}
    errors: list[BaseException] = []
    with Client(srv.endpoint, token=srv.token) as client:

        def join(node_id: str, addr: str) -> None:
            try:
                assignment = client.join(
                    job, node_id=node_id, addr=addr, nproc_per_node=4, settings=JobSettings(min_nodes=len(nodes), max_nodes=len(nodes)),
                    timeout=JOIN_TIMEOUT,
                )  # fmt: skip
                ranks[node_id] = assignment.node_rank
            except BaseException as exc:  # noqa: BLE001 (reported by the test thread below)
                errors.append(exc)

        threads = [threading.Thread(target=join, args=item) for item in nodes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_TIMEOUT + 10)
    assert not errors, errors
    assert len(ranks) == len(nodes)
    return job, ranks


# --------------------------------------------------------------------------- tests


def test_the_job_page_opened_with_the_token_shows_the_job_its_rounds_and_timeline(
    server: ServerProcess, browser: Browser
) -> None:
    job, ranks = form_job(server, {"node-a": "10.0.0.1", "node-b": "10.0.0.2"})
    page = browser.render(f"{server.url}/jobs/{job}?token={server.token}", job_page_ready(2), "the job's page")
    assert_page_ran_clean(page)
    assert page.dom.by_id("notice").attrs.get("hidden") is not None
    expected = sorted(
        [str(rank), node, f"10.0.0.{1 if node == 'node-a' else 2}", "4", f"{4 * rank}-{4 * rank + 3}", "alive"]
        for node, rank in ranks.items()
    )
    assert sorted(row[:6] for row in page.node_rows()) == expected
    assert all(row[6].endswith("s") for row in page.node_rows()), page.node_rows()  # heartbeat ages
    assert page.dom.by_id("job-name").text == job
    assert page.dom.find("title")[0].text == f"{job} \u2013 rdzv-server"
    summary = " ".join(page.dom.by_id("summary").text.split())
    assert summary.startswith("complete, round 0, 2 nodes (2..2), world size 8"), summary
    assert page.dom.by_id("pending").attrs.get("hidden") is not None  # the round formed: nothing pending
    assert page.dom.by_id("overview").attrs.get("hidden") is not None  # the jobs list is on / only
    # The timeline, newest first: the round formed (max_nodes reached) after both joins.
    timeline = page.timeline()
    assert [row[1:4] for row in timeline] == [
        ["0", "round_formed", "max_nodes"],
        ["0", "node_joined", "candidate"],
        ["0", "node_joined", "candidate"],
        ["0", "job_created", "join"],
    ], timeline
    assert sorted(tuple(row[4:6]) for row in timeline[1:3]) == [("node-a", "10.0.0.1"), ("node-b", "10.0.0.2")]
    assert timeline[0][6].startswith("2 nodes, world size 8, formed in "), timeline[0]
    assert all(len(row[0].split(":")) == 3 for row in timeline), timeline  # HH:MM:SS.mmm
    (formed,) = page.rounds()
    assert [formed[0], *formed[2:6]] == ["0", "max_nodes", "2", "8", "0"], formed
    assert formed[6].endswith(" s"), formed


def test_what_happens_while_the_page_is_open_appears_without_redrawing_it(
    server: ServerProcess, browser: Browser
) -> None:
    job, _ = form_job(server, {"live-a": "10.0.3.1", "live-b": "10.0.3.2"})
    browser.render(f"{server.url}/jobs/{job}?token={server.token}", job_page_ready(2), "the job's page")
    # Mark the rows drawn so far: a page that redrew its timeline would lose the marks.
    marked = browser.evaluate(
        "(() => { const rows = [...document.querySelectorAll('#timeline tbody tr')];"
        " rows.forEach(r => { r.seenBefore = true; }); return rows.length; })()"
    )
    assert marked == 4

    # A spare arrives (max_nodes are in: standby) while the page is open; its join waits.
    errors: list[BaseException] = []

    def spare() -> None:
        try:
            with Client(server.endpoint, token=server.token) as client:
                client.join(job, node_id="late-spare", addr="10.0.3.9", nproc_per_node=4,
                            settings=JobSettings(min_nodes=2, max_nodes=2),
                            timeout=JOIN_TIMEOUT)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 (a spare's join ends when it leaves)
            errors.append(exc)

    joiner = threading.Thread(target=spare, daemon=True)
    joiner.start()
    browser.wait_for(
        "[...document.querySelectorAll('#members-standby tr.node td:nth-child(2)')].some(td => td.textContent === 'late-spare')"
        " && !document.getElementById('members-standby').hidden",
        "the spare in the page's standby table",
    )
    with Client(server.endpoint, token=server.token) as client:
        client.leave(job, "live-b")
    browser.wait_for(
        "[...document.querySelectorAll('#timeline tbody tr')].some(r => r.cells[2].textContent === 'node_departed'"
        " && r.cells[4].textContent === 'live-b')",
        "live-b's departure in the timeline",
    )
    page = browser.snapshot()
    assert_page_ran_clean(page)
    timeline = page.timeline()
    assert ["node_joined", "standby", "late-spare", "10.0.3.9"] in [row[2:6] for row in timeline], timeline
    departed = next(row for row in timeline if row[2] == "node_departed")
    assert departed[3:6] == ["left", "live-b", "10.0.3.2"], departed
    assert timeline.index(departed) < [row[4] for row in timeline].index("late-spare"), "newest first"
    # The first rows are the same elements: the new ones were added above them.
    kept = browser.evaluate("[...document.querySelectorAll('#timeline tbody tr')].filter(r => r.seenBefore).length")
    assert kept == 4
    assert [row[2] for row in timeline[-4:]] == ["round_formed", "node_joined", "node_joined", "job_created"]
    with Client(server.endpoint, token=server.token) as client:
        client.close_job(job)  # the spare's join ends
    joiner.join(JOIN_TIMEOUT + 10)
    assert not joiner.is_alive()


def test_while_a_round_is_open_the_page_says_why(server: ServerProcess, browser: Browser) -> None:
    job = f"browser-{uuid.uuid4().hex[:10]}"
    errors: list[BaseException] = []

    def first_of_three() -> None:
        try:
            with Client(server.endpoint, token=server.token) as client:
                client.join(job, node_id="first", addr="10.0.4.1", nproc_per_node=1,
                            settings=JobSettings(min_nodes=3, max_nodes=3),
                            timeout=JOIN_TIMEOUT)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 (ends when the job is closed)
            errors.append(exc)

    joiner = threading.Thread(target=first_of_three, daemon=True)
    joiner.start()
    browser.render(
        f"{server.url}/jobs/{job}?token={server.token}",
        "!document.getElementById('pending').hidden && document.querySelectorAll('#members-joining tr.node').length === 1",
        "the open round's pending reason",
    )
    page = browser.snapshot()
    assert_page_ran_clean(page)
    assert page.dom.by_id("pending").text == "Round pending: waiting for min_nodes: 1 of 3 joined"
    assert [row[1:3] for row in page.node_rows("joining")] == [["first", "10.0.4.1"]]
    assert page.node_rows() == [] and page.dom.by_id("members-nodes").attrs.get("hidden") is None
    assert " ".join(page.dom.by_id("summary").text.split()).startswith("open, round 0, 0 nodes (3..3)")
    assert page.rounds() == []
    with Client(server.endpoint, token=server.token) as client:
        client.close_job(job)
    joiner.join(JOIN_TIMEOUT + 10)


def test_the_read_only_token_is_enough_for_the_page(server: ServerProcess, browser: Browser, read_token: str) -> None:
    job, _ = form_job(server, {"reader-a": "10.0.1.1"})
    page = browser.render(f"{server.url}/jobs/{job}?token={read_token}", job_page_ready(1), "the job's page")
    assert_page_ran_clean(page)
    assert [row[1:3] for row in page.node_rows()] == [["reader-a", "10.0.1.1"]]
    assert [row[2] for row in page.timeline()] == ["round_formed", "node_joined", "job_created"]


def test_the_jobs_list_links_each_job_to_its_page(server: ServerProcess, browser: Browser) -> None:
    job, _ = form_job(server, {"listed-a": "10.0.5.1"})
    page = browser.render(
        f"{server.url}/?token={server.token}",
        f"[...document.querySelectorAll('#jobs a')].some(a => a.textContent === {json.dumps(job)})",
        "the job in the list",
    )
    assert_page_ran_clean(page)
    links = {a.text: a.attrs["href"] for a in page.dom.by_id("jobs").find("a")}
    assert links[job] == f"/jobs/{job}"
    assert page.dom.by_id("job").attrs.get("hidden") is not None


def test_without_a_token_the_page_shows_no_job_and_says_how_to_open_it(server: ServerProcess, browser: Browser) -> None:
    job, _ = form_job(server, {"secret-node": "10.0.2.1"})
    page = browser.render(f"{server.url}/jobs/{job}", "!document.getElementById('notice').hidden", "the notice")
    assert_page_ran_clean(page)
    notice = page.dom.by_id("notice")
    text = " ".join(notice.text.split())
    assert "requires a token" in text and "stopped updating" in text
    assert f"{server.url}/jobs/{job}?token=TOKEN" in text
    assert "~/.config/rdzv-server/token" in text and "--token-file" in text and "--read-token-file" in text
    assert page.node_rows() == [] and page.timeline() == []
    assert "secret-node" not in page.dom.text


def test_a_job_that_does_not_exist_stops_the_page_with_a_message(server: ServerProcess, browser: Browser) -> None:
    page = browser.render(
        f"{server.url}/jobs/no-such-job?token={server.token}", "!document.getElementById('notice').hidden", "the notice"
    )
    text = " ".join(page.dom.by_id("notice").text.split())
    assert "No job no-such-job on this server" in text and "stopped updating" in text, text
    assert page.timeline() == []


def test_a_wrong_token_sets_no_cookie_and_the_page_still_asks_for_one(server: ServerProcess, browser: Browser) -> None:
    wrong = browser.render(
        f"{server.url}/?token=not-the-token-at-all",
        "document.body && document.body.innerText.includes('unauthorized')",
        "the 401 answer",
    )
    assert "unauthorized" in wrong.dom.text
    page = browser.render(f"{server.url}/", "!document.getElementById('notice').hidden", "the notice")
    assert "requires a token" in page.dom.by_id("notice").text


def test_what_a_node_sends_is_shown_as_text_and_never_runs(server: ServerProcess, browser: Browser) -> None:
    nodes = {f"hostile-{i}": addr for i, addr in enumerate(HOSTILE_ADDRS)}
    job, _ = form_job(server, nodes)
    page = browser.render(f"{server.url}/jobs/{job}?token={server.token}", job_page_ready(2), "the job's page")
    time.sleep(0.5)  # what an injected handler would log has had time to run
    page = browser.snapshot()
    assert_page_ran_clean(page)
    assert sorted(tuple(row[1:3]) for row in page.node_rows()) == sorted(nodes.items())
    joined = sorted(tuple(row[4:6]) for row in page.timeline() if row[2] == "node_joined")
    assert joined == sorted(nodes.items()), page.timeline()  # the timeline shows them as text too
    labels = " ".join(th.text for th in page.dom.by_id("lanes").find("th", **{"class": "label"}))
    assert all(addr in labels for addr in HOSTILE_ADDRS), labels  # and the lanes
    body = page.dom.find("body")[0]
    assert body.find("img") == [] and body.find("script") == []
    assert not [e.tag for e in page.dom.walk() if any(name.startswith("on") for name in e.attrs)]
    assert page.dom.find("title")[0].text == f"{job} \u2013 rdzv-server"
    assert browser.evaluate("document.images.length") == 0


def test_a_follower_replica_points_the_page_at_the_leader(tmp_path: Path, browser: Browser) -> None:
    from etcd_cluster import EtcdCluster, require_etcd
    from replica_cluster import ReplicaCluster

    require_etcd()
    etcd = EtcdCluster(1).start()
    try:
        cluster = ReplicaCluster(etcd, tmp_path, 2).start()
        try:
            leader = cluster.replicas[cluster.wait_for_leader()]
            follower = next(r for r in cluster.replicas if r is not leader)
            page = browser.render(
                f"{follower.url}/?token={follower.token}", "!document.getElementById('notice').hidden", "the notice"
            )
            assert_page_ran_clean(page)
            notice = page.dom.by_id("notice")
            assert "This replica follows" in notice.text
            assert [a.attrs.get("href") for a in notice.find("a")] == [leader.url + "/"]
        finally:
            cluster.close()
    finally:
        etcd.close()


# --------------------------------------------------------------------------- lanes


def lanes(page: Rendered) -> dict[str, list[str]]:
    """The lanes drawn, by node id: each round's cell state ('' for none)."""
    return {
        tr.attrs["data-node-id"]: [td.attrs.get("data-state", "") for td in tr.find("td")]
        for tr in page.dom.by_id("lanes").find("tr", **{"class": "lane"})
    }


def kill_watch(srv: ServerProcess, job: str, node_id: str, round_: int) -> None:
    """``node_id``'s agent dies: its watch, parked on a raw stream connection, is reset."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    hello = wire.frame([1, wire.HELLO_OP, "", {"token": srv.token}])
    watch = wire.frame([2, "watch", job, {"node_id": node_id, "round": round_, "known": 0, "hold": 20.0}])
    sock.sendall(wire.STREAM_PREFACE + hello + watch)
    assert FrameReader(sock).recv()[:2] == [1, 200]  # the hello's answer: the watch is parked behind it
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_the_lanes_draw_each_node_across_rounds_standby_refused_dead_and_member(
    server: ServerProcess, browser: Browser
) -> None:
    job, ranks = form_job(server, {"lane-a": "10.0.6.1", "lane-b": "10.0.6.2"})  # round 0
    url = f"{server.url}/jobs/{job}?token={server.token}"
    browser.render(url, "document.querySelectorAll('#lanes tr.lane').length === 2", "the first lanes")
    spare: list[Any] = []

    def join_spare() -> None:
        with Client(server.endpoint, token=server.token) as client:
            spare.append(client.join(job, node_id="lane-s", addr="10.0.6.9", nproc_per_node=4,
                settings=JobSettings(min_nodes=2, max_nodes=2), timeout=JOIN_TIMEOUT))  # fmt: skip

    joiner = threading.Thread(target=join_spare, daemon=True)
    joiner.start()  # max_nodes are in: a spare, until round 1 takes it
    with Client(server.endpoint, token=server.token) as client:
        with pytest.raises(ConflictError):  # other --nnodes: refused, and the timeline says so
            client.join(job, node_id="lane-x", addr="10.0.6.7", nproc_per_node=4,
                        settings=JobSettings(min_nodes=1, max_nodes=3),
                        timeout=JOIN_TIMEOUT)  # fmt: skip
        wait_until(lambda: client.job(job)["standby"], timeout=JOIN_TIMEOUT, what="the spare in line")
        kill_watch(server, job, "lane-b", 0)  # lane-b's agent dies (connection_closed)
        browser.wait_for(
            "[...document.querySelectorAll('#lanes tr.lane td')].some(td => td.dataset.state === 'dead')",
            "lane-b's death in its lane, without a reload",
        )
        client.join(job, node_id="lane-a", addr="10.0.6.1", nproc_per_node=4,
                    settings=JobSettings(min_nodes=2, max_nodes=2),
                    timeout=JOIN_TIMEOUT)  # fmt: skip  # the survivor re-joins; the spare fills round 1
    joiner.join(JOIN_TIMEOUT + 10)
    assert spare and spare[0].round == 1
    page = browser.render(url, "document.querySelectorAll('#lanes thead tr:first-child th').length === 3", "round 1")
    assert_page_ran_clean(page)
    assert lanes(page) == {
        "lane-a": ["member", "member"],
        "lane-s": ["standby", "member"],
        "lane-b": ["dead", ""],
        "lane-x": ["refused", ""],
    }, lanes(page)
    head = page.dom.by_id("lanes").find("thead")[0].find("tr")
    assert [th.text for th in head[0].find("th")] == ["round", "0", "1"]
    formed = [th.text for th in head[1].find("th")][1:]  # each round's formation time
    assert len(formed) == 2 and all(t.endswith("s") and float(t[:-1]) >= 0 for t in formed), formed
    round_1 = head[0].find("th")[2].attrs["title"]  # when, how long, why
    assert "formed at " in round_1 and "(members_back)" in round_1, round_1
    bars = [td.attrs["title"] for td in head[2].find("td")]  # every node of each round, counted
    assert bars == ["round 0: dead 1, refused 1, member 1, standby 1", "round 1: member 2"], bars
    cell = page.dom.by_id("lanes").find("tr", **{"data-node-id": "lane-b"})[0].find("td")[0]
    assert cell.attrs["title"] == "lane-b, round 0: dead (connection_closed)"
    legend = [span.text for span in page.dom.by_id("legend").find("span")]
    assert legend == [
        "member", "joining or waiting", "standby", "left", "workers failed", "cordoned", "refused", "dead"
    ]  # fmt: skip
    assert page.dom.by_id("pager").attrs.get("hidden") is not None  # 4 lanes: one page
    assert ranks["lane-a"] in (0, 1)


# 16,384 nodes, 8 workers each: the biggest jobs the page is made for.
BIG_JOB_NODES = 16_384
JOIN_BATCH = 1024  # joins pipelined at once over the async client's stream connections


async def join_many(srv: ServerProcess, job: str, nodes: int) -> dict[str, Any]:
    """``nodes`` nodes join ``job`` through the real server's stream protocol, pipelined (a join
    that does not wait for its round: ``hold=0``); returns the membership document."""
    async with AsyncClient(srv.endpoint, token=srv.token, retry_budget=60.0) as client:
        settings = wire.JobSettings(nodes, nodes, 30.0, 600.0, 3600.0)  # no node's heartbeat expires meanwhile
        for start in range(0, nodes, JOIN_BATCH):
            await asyncio.gather(*(
                client.request(job, wire.JoinRequest(
                    job, node_id=f"node-{i:05d}", addr=f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", nproc_per_node=8,
                    settings=settings, hold=0.0,
                ))
                for i in range(start, min(nodes, start + JOIN_BATCH))
            ))  # fmt: skip
        return await client.job(job)


def test_a_16k_node_job_page_draws_one_page_of_lanes_and_nodes_and_a_bar_for_all(
    tmp_path: Path, browser: Browser
) -> None:
    srv = ServerProcess(tmp_path, durable=False)
    srv.start()
    try:
        job = "big-job"
        document = asyncio.run(join_many(srv, job, BIG_JOB_NODES))
        assert document["state"] == "complete" and document["num_nodes"] == BIG_JOB_NODES
        drawn = (
            "document.querySelectorAll('#lanes tr.lane').length === 100"
            " && document.querySelectorAll('#members-nodes tr.node').length === 100"
            " && performance.getEntriesByName('job-drawn').length === 1"
        )
        page = browser.render(f"{srv.url}/jobs/{job}?token={srv.token}", drawn, "the 16K-node job's first page")
        # From the navigation to the first complete draw (both fetches, the lanes and the tables),
        # as the browser measured it; printed, not asserted (README "Job page"; the issue asks <= 2 s).
        first_draw_ms = browser.evaluate("performance.getEntriesByName('job-drawn')[0].startTime")
        fetches = browser.evaluate(
            "performance.getEntriesByType('resource').filter(e => e.name.includes('/v1/'))"
            ".map(e => `${new URL(e.name).pathname}${new URL(e.name).search}: ${e.duration.toFixed(0)} ms`).join(', ')"
        )
        print(f"\n16,384-node job page: first complete draw {first_draw_ms:.0f} ms after navigation ({fetches})")
        assert_page_ran_clean(page)
        assert page.dom.by_id("page-range").text == f"nodes 1\u2013100 of {BIG_JOB_NODES}"
        assert [row[0] for row in page.node_rows()] == [str(r) for r in range(100)]
        assert set(map(tuple, lanes(page).values())) == {("member",)}
        # 16,384 joins: the timeline kept the last 1,024 events, and the page says so.
        assert "are no longer kept" in page.dom.by_id("lanes-note").text
        (bar,) = page.dom.by_id("lanes").find("tr", **{"class": "summary"})[0].find("td")
        assert bar.attrs["title"] == f"round 0: member {BIG_JOB_NODES}"
        summary = " ".join(page.dom.by_id("summary").text.split())
        assert summary.startswith(f"complete, round 0, {BIG_JOB_NODES} nodes ({BIG_JOB_NODES}..{BIG_JOB_NODES}), "
                                  f"world size {8 * BIG_JOB_NODES}")  # fmt: skip
        # The last page, through the pager.
        browser.evaluate(
            f"(() => {{ for (let i = 0; i < {BIG_JOB_NODES // 100}; i++)"
            " document.getElementById('page-next').click(); })()"
        )
        browser.wait_for(
            "document.getElementById('page-range').textContent"
            f" === 'nodes 16301\\u2013{BIG_JOB_NODES} of {BIG_JOB_NODES}'"
            " && document.querySelector('#members-nodes tr.node td').textContent === '16300'",
            "the last page",
        )
        page = browser.snapshot()
        assert [row[0] for row in page.node_rows()] == [str(r) for r in range(16_300, BIG_JOB_NODES)]
        assert len(lanes(page)) == BIG_JOB_NODES - 16_300
        assert page.dom.by_id("page-next").attrs.get("disabled") is not None
    finally:
        srv.close()


# --------------------------------------------------------------------------- progress (issue 27, part 3)


def test_the_job_page_draws_the_steps_per_round_the_restarts_and_the_goodput(
    server: ServerProcess, browser: Browser
) -> None:
    job = f"browser-{uuid.uuid4().hex[:10]}"
    settings = JobSettings(min_nodes=1, max_nodes=1, min_round_seconds=0.0, max_fast_failures=5)
    with Client(server.endpoint, token=server.token) as client:

        def join(step: int | None) -> int:
            return client.join(job, node_id="a", addr="10.0.0.1", nproc_per_node=1, settings=settings,
                               timeout=JOIN_TIMEOUT, step=step).round

        assert join(None) == 0
        client.watch(job, "a", round=0, step=3)  # a beat carrying the workers' step (soft)
        assert join(5) == 1  # round 0 reached step 5: its workers failed, it re-joins
        assert join(5) == 2  # round 1 got no further: a fast failure (no progress)
    page = browser.render(f"{server.url}/jobs/{job}?token={server.token}",
                          "document.querySelectorAll('#progress tbody tr').length >= 3", "the progress table")
    assert_page_ran_clean(page)
    assert page.dom.by_id("progress-section").attrs.get("hidden") is None
    rows = [[td.text for td in tr.find("td")] for tr in page.dom.by_id("progress").find("tbody")[0].find("tr")]
    assert [[r[0], r[2], r[3]] for r in rows] == [["2", "", ""], ["1", "5", "no_progress"], ["0", "5", ""]], rows
    assert rows[0][1] == "running" and rows[1][1].endswith(" s")
    assert page.dom.by_id("goodput").text.startswith("goodput ")
    assert page.dom.by_id("fast-failures").text.startswith("fast failures in a row 1 of 5")
    chart = page.dom.by_id("steps")
    restarts = chart.find("line")
    assert [line.attrs.get("class") for line in restarts] == ["restart", "restart fast"]  # rounds 1 and 2 formed
    steps = sorted(title.text for circle in chart.find("circle") for title in circle.find("title"))
    assert steps == ["round 0: step 3", "round 0: step 5", "round 1: step 5"], steps
