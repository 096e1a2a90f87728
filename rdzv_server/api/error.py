"""The one error table: every failure becomes a status and ``{"error": CODE, "message": TEXT}``.

:func:`error_reply` is the table, for both protocols: core's :class:`RdzvError` carries
its own code and status; a wire validation error is a 4xx with its code; anything else is
a bug: a 500 ``internal`` whose traceback goes to the server log, never to the client.
:func:`error_middleware` renders it over HTTP and adds aiohttp's own HTTP errors (unknown
route, wrong method, body over ``client_max_size``), which only HTTP has. What aiohttp
refuses before any handler runs (its parser's errors) is rendered by
:class:`.aiohttp_seam.HttpConnection` with the same codes.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from rdzv_client import wire

from ..core.error import NotLeader, RdzvError
from .codec import encode

log = logging.getLogger("rdzv_server.api")

# The codes of the errors aiohttp raises itself (an unknown route, a wrong method, a body over
# client_max_size, ...), which come with a status and no code. Each status is the code's own,
# read from the one table (record.HTTP_STATUS), never written here a second time.
_AIOHTTP_CODES = (
    wire.ErrorCode.NOT_FOUND,
    wire.ErrorCode.METHOD_NOT_ALLOWED,
    wire.ErrorCode.REQUEST_TIMEOUT,
    wire.ErrorCode.BODY_TOO_LARGE,
    wire.ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    wire.ErrorCode.EXPECTATION_FAILED,
    wire.ErrorCode.HEADERS_TOO_LARGE,
)
_CODE_OF_STATUS = {wire.HTTP_STATUS[code]: code for code in _AIOHTTP_CODES}


def code_for_status(status: int, otherwise: wire.ErrorCode) -> wire.ErrorCode:
    """The wire code of an error aiohttp answered with ``status`` alone (``otherwise`` for a
    status without a code of its own here)."""
    return _CODE_OF_STATUS.get(status, otherwise)


INTERNAL_MESSAGE = "internal server error; the server log has details"


def error_reply(exc: Exception, serving: str) -> tuple[int, dict[str, Any]]:
    """The status and body that answer ``exc``; ``serving`` names the request in the log."""
    if isinstance(exc, NotLeader):
        return exc.status, wire.error_body(wire.ErrorCode.NOT_LEADER, exc.message, leader=exc.leader)
    if isinstance(exc, RdzvError):
        return exc.status, wire.error_body(wire.ErrorCode(exc.code), exc.message)
    if isinstance(exc, wire.WireError):
        code = wire.ErrorCode(exc.code)
        return wire.HTTP_STATUS[code], wire.error_body(code, str(exc))
    log.error("Unhandled error serving %s.", serving, exc_info=exc)
    return 500, wire.error_body(wire.ErrorCode.INTERNAL, INTERNAL_MESSAGE)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = code_for_status(exc.status, wire.ErrorCode.BAD_REQUEST)
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"request body too large: {exc.text}"
        return encode(request, wire.error_body(code, message), status=exc.status)
    except Exception as exc:  # noqa: BLE001 (error_reply logs the traceback of anything unmapped)
        status, body = error_reply(exc, f"{request.method} {request.path}")
        return encode(request, body, status=status)
