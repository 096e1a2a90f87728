"""Bodies in and out: msgpack for the client, JSON for people, one error shape for both.

Requests are read as msgpack when the Content-Type says ``application/msgpack`` and as
JSON when it says ``application/json`` (or nothing, or curl's default form type); anything else is a
415. Responses are msgpack when the Accept header asks for it, else JSON.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from rdzv_client import wire


def wants_msgpack(request: web.Request) -> bool:
    return wire.CONTENT_TYPE_MSGPACK in request.headers.get("Accept", "")


def encode(request: web.Request, body: Any, status: int = 200) -> web.Response:
    if wants_msgpack(request):
        return web.Response(body=wire.pack(body), status=status, content_type=wire.CONTENT_TYPE_MSGPACK)
    return web.Response(body=wire.dump_json(body), status=status, content_type=wire.CONTENT_TYPE_JSON)


class UnsupportedMediaType(wire.WireError):
    code = wire.ErrorCode.UNSUPPORTED_MEDIA_TYPE


async def decode(request: web.Request, max_bytes: int) -> Any:
    """The request body as plain data. Raises :class:`wire.WireError` (400/413/415 codes)."""
    data = await request.read()
    if not data:
        return {}
    ctype = request.content_type
    if ctype == wire.CONTENT_TYPE_MSGPACK:
        return wire.unpack(data, max_bytes)
    # curl -d sends form-urlencoded by default: read it as the JSON it almost always is.
    if ctype in (wire.CONTENT_TYPE_JSON, "application/x-www-form-urlencoded", "text/plain", ""):
        return wire.load_json(data, max_bytes)
    raise UnsupportedMediaType(
        f"Content-Type {ctype!r} is not supported: send {wire.CONTENT_TYPE_MSGPACK} or {wire.CONTENT_TYPE_JSON}"
    )
