"""One middleware renders every failure as ``{"error": CODE, "message": TEXT}``.

The table: core's :class:`RdzvError` carries its own code and status; a wire validation
error is a 4xx with its code; aiohttp's own HTTP errors (unknown route, wrong method,
body over ``client_max_size``) are mapped to our codes; anything else is a bug: a 500
``internal`` whose traceback goes to the server log, never to the client.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from rdzv_client import wire

from ..core.error import RdzvError
from .codec import encode

log = logging.getLogger("rdzv_server.api")

_HTTP_CODES: dict[int, wire.ErrorCode] = {
    404: wire.ErrorCode.NOT_FOUND,
    405: wire.ErrorCode.METHOD_NOT_ALLOWED,
    413: wire.ErrorCode.BODY_TOO_LARGE,
}


def error_response(request: web.Request, code: str, status: int, message: str) -> web.Response:
    return encode(request, wire.error_body(wire.ErrorCode(code), message), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RdzvError as exc:
        return error_response(request, exc.code, exc.status, exc.message)
    except wire.WireError as exc:
        code = wire.ErrorCode(exc.code)
        return error_response(request, code.value, wire.HTTP_STATUS[code], str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, wire.ErrorCode.BAD_REQUEST)
        message = exc.text or exc.reason
        if exc.status == 413:
            message = f"request body too large: {exc.text}"
        return error_response(request, code.value, exc.status, message)
    except Exception:
        log.exception("Unhandled error serving %s %s", request.method, request.path)
        return error_response(request, "internal", 500, "internal server error; the server log has details")
