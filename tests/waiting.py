"""Bounded waits on the event a test expects, instead of fixed sleeps.

A test that needs "the server has parked my long-poll" or "the log says X" waits for exactly
that, polling cheaply, and fails with a message naming what never happened once ``timeout``
has passed. The timeout only bounds a broken run; a passing run waits as long as the event
takes and no longer. Nothing here asserts how fast anything is.

- :func:`wait_until` / :func:`wait_until_async`: until a predicate returns a true value
  (which is returned).
- :func:`call_within`: a blocking call's result (or its error), failing if it has not
  returned within ``timeout`` (for "ended by X, not by a longer timeout").
- :func:`parked_long_polls` / :func:`wait_for_parked`: the server's ``rdzv_waiters`` gauge
  (``GET /metrics``), and a wait until it reaches a count.
- :func:`wait_for_log`: until a server's log holds a text.
- :func:`metrics` / :func:`served`: a server's ``/metrics`` samples, and how many requests of
  one operation it has answered (e.g. a long-poll's re-polls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from server_process import ServerProcess

T = TypeVar("T")

# Far longer than any event a passing test waits for on a loaded 2-core runner.
PATIENCE = 15.0
# How often a condition is polled: cheap for the server, short against the events awaited.
INTERVAL = 0.02


def wait_until(
    predicate: Callable[[], T], *, timeout: float = PATIENCE, interval: float = INTERVAL, what: str = ""
) -> T:
    """``predicate()``'s first true value, polled every ``interval`` s; AssertionError naming
    ``what`` (and the last value seen) when none came within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what or predicate!r} (last: {value!r})")
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], Awaitable[T]], *, timeout: float = PATIENCE, interval: float = INTERVAL, what: str = ""
) -> T:
    """:func:`wait_until` for an async predicate, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what or predicate!r} (last: {value!r})")
        await asyncio.sleep(interval)


def call_within(call: Callable[[], T], *, timeout: float = PATIENCE, what: str = "") -> T:
    """``call()``'s result, or the exception it raised, run in a daemon thread; AssertionError
    naming ``what`` when it has not returned within ``timeout`` s (the thread is left behind)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    concurrent.futures.wait([done], timeout)
    if not done.done():  # (not result(timeout): the call's own TimeoutError would read as ours)
        raise AssertionError(f"not returned within {timeout} s: {what or call!r}")
    return done.result()


def _metrics_text(srv: ServerProcess) -> str:
    context = None
    if srv.tls is not None:
        context = ssl.create_default_context(cafile=str(srv.tls.ca))
    with urllib.request.urlopen(srv.url + "/metrics", timeout=PATIENCE, context=context) as answer:
        return str(answer.read().decode())


def metric(srv: ServerProcess, name: str) -> float:
    """The value of the unlabelled sample ``name`` in ``srv``'s ``/metrics``."""
    lines = [line for line in _metrics_text(srv).splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"{name} is not one unlabelled sample in /metrics: {lines}"
    return float(lines[0].split()[1])


def metrics(srv: ServerProcess) -> dict[str, float]:
    """Every sample in ``srv``'s ``/metrics``, by its name with its labels
    (``'rdzv_requests_total{code="ok",op="get"}'``)."""
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in _metrics_text(srv).splitlines())
        if name and not name.startswith("#")
    }


def served(srv: ServerProcess, op: str) -> int:
    """How many ``op`` requests ``srv`` has answered, whatever their result."""
    label = f'op="{op}"'
    return int(sum(
        value for name, value in metrics(srv).items() if name.startswith("rdzv_requests_total{") and label in name
    ))


def parked_long_polls(srv: ServerProcess) -> int:
    """The server's ``rdzv_waiters`` gauge: the long-polls it holds right now."""
    return int(metric(srv, "rdzv_waiters"))


def wait_for_parked(srv: ServerProcess, count: int, *, timeout: float = PATIENCE) -> None:
    """Until ``srv`` holds at least ``count`` parked long-polls."""
    wait_until(lambda: parked_long_polls(srv) >= count, timeout=timeout, what=f"{count} long-polls parked")


def wait_for_log(srv: ServerProcess, text: str, *, timeout: float = PATIENCE) -> str:
    """Until ``srv``'s log holds ``text``; returns the whole log."""
    def found() -> str:
        log = srv.log_text()
        return log if text in log else ""

    return wait_until(found, timeout=timeout, what=f"{text!r} in the log")
