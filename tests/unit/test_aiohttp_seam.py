"""What ``rdzv_server/api/aiohttp_seam.py`` relies on in aiohttp beyond its documented API, one
test per name in ``PRIVATE_NAMES``: an aiohttp upgrade that removes or changes one fails here,
naming it, instead of breaking the server's accounting or refusals silently.

Each test drives the real aiohttp through the seam's own accessor, in memory (a fake transport,
no socket); none imports ``aiohttp.web_protocol`` (the seam is the only module that does).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any
from unittest import mock

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.http_parser import SINGLETON_HEADERS

from rdzv_server.api import aiohttp_seam
from rdzv_server.api.aiohttp_seam import RequestHandler

REQUEST = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc\r\n\r\n"
REFUSED = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n"


async def answer(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


def fake_transport() -> Any:
    transport = mock.Mock(spec=asyncio.Transport)
    transport.get_extra_info.return_value = None
    transport.is_closing.return_value = False
    return transport


def handler(server: web.Server | None = None) -> RequestHandler:
    return RequestHandler(server or web.Server(answer), loop=asyncio.get_running_loop())


def test_every_name_the_seam_relies_on_has_a_test_here() -> None:
    tested = {
        "RequestHandler._messages",
        "web_protocol._ErrInfo.exc",
        "web.Server.request_factory",
        "RequestHandler.transport = None",
        "RequestHandler.finish_response",
        "RequestHandler.handle_error",
        "LineTooLong.args",
    }
    assert set(aiohttp_seam.PRIVATE_NAMES) == tested


async def test_request_handler_messages_queues_each_parsed_request() -> None:
    protocol = handler()
    before = aiohttp_seam.queued(protocol)
    protocol.data_received(REQUEST)
    parsed = aiohttp_seam.parsed_since(protocol, before)
    assert len(parsed) == 1, "RequestHandler._messages no longer gets one entry per parsed request"
    message, refused = parsed[0]
    assert refused is None
    assert message.headers.get("Authorization") == "Bearer abc", "RequestHandler._messages holds no parsed message"


async def test_err_info_exc_is_the_parsers_error() -> None:
    protocol = handler()
    before = aiohttp_seam.queued(protocol)
    protocol.data_received(REFUSED)
    parsed = aiohttp_seam.parsed_since(protocol, before)
    assert len(parsed) == 1
    assert isinstance(parsed[0][1], HttpProcessingError), "web_protocol._ErrInfo.exc no longer holds the error"


async def test_server_request_factory_is_copied_by_each_handler_and_called_per_request() -> None:
    server = web.Server(answer)
    parameters = list(inspect.signature(server.request_factory).parameters)
    assert parameters[:5] == ["message", "payload", "protocol", "writer", "task"], (
        f"web.Server.request_factory takes {parameters}"
    )
    dispatched = asyncio.Event()
    seen: list[object] = []

    def started(protocol: object, payload: Any) -> None:
        seen.append(protocol)
        dispatched.set()

    aiohttp_seam.on_dispatch(server, started)  # before the handler exists: it copies the factory
    protocol = handler(server)
    protocol.connection_made(fake_transport())
    protocol.data_received(REQUEST)
    await asyncio.wait_for(dispatched.wait(), 10)
    assert seen == [protocol], "a handler no longer dispatches through web.Server.request_factory"
    protocol.connection_lost(None)


async def test_a_transport_set_to_none_is_neither_written_nor_closed() -> None:
    protocol = handler()
    transport = fake_transport()
    protocol.connection_made(transport)
    aiohttp_seam.let_go(protocol)
    protocol.connection_lost(None)
    protocol.force_close()
    assert not transport.close.called and not transport.write.called, (
        "RequestHandler.transport = None no longer lets go of the transport"
    )


def test_finish_response_is_overridden_with_these_parameters() -> None:
    parameters = list(inspect.signature(RequestHandler.finish_response).parameters)
    assert parameters == ["self", "request", "resp", "start_time"], f"RequestHandler.finish_response: {parameters}"
    assert inspect.iscoroutinefunction(RequestHandler.finish_response)


def test_handle_error_is_overridden_with_these_parameters() -> None:
    parameters = list(inspect.signature(RequestHandler.handle_error).parameters)
    assert parameters == ["self", "request", "status", "exc", "message"], f"RequestHandler.handle_error: {parameters}"


async def test_line_too_long_args_carry_the_lines_start_and_the_limit() -> None:
    protocol = handler()
    value = b"v" * 9000
    before = aiohttp_seam.queued(protocol)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + value + b"\r\n\r\n")
    (_, exc), = aiohttp_seam.parsed_since(protocol, before)
    assert isinstance(exc, LineTooLong)
    start, limit = aiohttp_seam.long_line(exc)
    assert start and value.startswith(start), "LineTooLong.args[0] is no longer the line's first bytes"
    assert isinstance(limit, int) and limit < len(value), "LineTooLong.args[1] is no longer the limit"


def test_the_fields_aiohttp_refuses_twice_include_host_and_content_length() -> None:
    # head.py names a duplicate from this set (public, but the parser's own rule).
    assert {"host", "content-length"} <= {name.lower() for name in SINGLETON_HEADERS}
