"""What ``rdzv_server/api/aiohttp_seam.py`` relies on in aiohttp beyond its documented API, one
test per name in ``PRIVATE_NAMES``: an aiohttp upgrade that removes or changes one fails here,
naming it, instead of breaking the server's accounting or refusals silently.

Each test drives aiohttp itself, in memory (a fake transport, no socket), the way the seam does.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any
from unittest import mock

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.http_parser import SINGLETON_HEADERS

from rdzv_server.api import aiohttp_seam

REQUEST = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc\r\n\r\n"
REFUSED = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n"


async def answer(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


def fake_transport() -> Any:
    transport = mock.Mock(spec=asyncio.Transport)
    transport.get_extra_info.return_value = None
    transport.is_closing.return_value = False
    return transport


def handler(server: web.Server | None = None) -> web_protocol.RequestHandler:
    return web_protocol.RequestHandler(server or web.Server(answer), loop=asyncio.get_running_loop())


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
    assert hasattr(protocol, "_messages"), "aiohttp's RequestHandler._messages is gone"
    before = len(protocol._messages)
    protocol.data_received(REQUEST)
    queued = list(protocol._messages)[before:]
    assert len(queued) == 1, "RequestHandler._messages no longer gets one (message, payload) per request"
    message, _payload = queued[0]
    assert message.headers.get("Authorization") == "Bearer abc", "RequestHandler._messages holds no parsed message"


async def test_err_info_carries_the_parsers_exception() -> None:
    assert hasattr(web_protocol, "_ErrInfo"), "aiohttp's web_protocol._ErrInfo is gone"
    protocol = handler()
    protocol.data_received(REFUSED)
    message, _payload = protocol._messages[-1]
    assert isinstance(message, web_protocol._ErrInfo), "a refused request no longer queues a web_protocol._ErrInfo"
    assert isinstance(getattr(message, "exc", None), HttpProcessingError), "web_protocol._ErrInfo.exc is gone"


async def test_server_request_factory_is_copied_by_each_handler_and_called_per_request() -> None:
    server = web.Server(answer)
    inner = server.request_factory
    assert list(inspect.signature(inner).parameters)[:5] == ["message", "payload", "protocol", "writer", "task"], (
        "web.Server.request_factory takes other arguments"
    )
    dispatched = asyncio.Event()
    seen: list[object] = []

    def wrapped(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        seen.append(protocol)
        dispatched.set()
        return inner(message, payload, protocol, writer, task)

    server.request_factory = wrapped  # before the handler exists: it copies the factory
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
    protocol.transport = None
    protocol.connection_lost(None)
    protocol.force_close()
    assert not transport.close.called and not transport.write.called, (
        "RequestHandler.transport = None no longer lets go of the transport"
    )


def test_finish_response_is_overridden_with_these_parameters() -> None:
    parameters = list(inspect.signature(web_protocol.RequestHandler.finish_response).parameters)
    assert parameters == ["self", "request", "resp", "start_time"], f"RequestHandler.finish_response: {parameters}"
    assert inspect.iscoroutinefunction(web_protocol.RequestHandler.finish_response)


def test_handle_error_is_overridden_with_these_parameters() -> None:
    parameters = list(inspect.signature(web_protocol.RequestHandler.handle_error).parameters)
    assert parameters == ["self", "request", "status", "exc", "message"], f"RequestHandler.handle_error: {parameters}"


async def test_line_too_long_carries_the_lines_start_and_the_limit() -> None:
    protocol = handler()
    value = b"v" * 9000
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + value + b"\r\n\r\n")
    message, _payload = protocol._messages[-1]
    exc = message.exc
    assert isinstance(exc, LineTooLong)
    start, limit = exc.args[:2]
    assert isinstance(start, (bytes, bytearray)) and value.startswith(bytes(start)[:-3]), "LineTooLong.args[0] changed"
    assert isinstance(limit, int) and limit < len(value), "LineTooLong.args[1] is no longer the limit"


def test_the_fields_aiohttp_refuses_twice_include_host_and_content_length() -> None:
    # head.py names a duplicate from this set (public, but the parser's own rule).
    assert {"host", "content-length"} <= {name.lower() for name in SINGLETON_HEADERS}
