"""Bodies in and out: msgpack for the client, JSON for people, one error shape for both.

Request bodies are read as msgpack when the Content-Type says ``application/msgpack`` and
as JSON when it says ``application/json``. Anything else is a 415 ``unsupported_media_type``,
a missing Content-Type, ``text/plain`` and form types (curl's ``-d`` default) included: a
browser sends those three cross-site without asking the server first, so accepting them
would let any web page a user opens post operations (a CSRF). The same holds for an empty
body: it is ``{}`` under either accepted type and a 415 under any other, because a
cross-site ``fetch`` may POST with no body and no Content-Type. From a shell:
``curl -H 'Content-Type: application/json' -d '{...}'``. Responses are msgpack when the
Accept header asks for it, else JSON.
"""

from __future__ import annotations

from typing import Any

from aiohttp import hdrs, web

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
    """The request body as plain data. Raises :class:`wire.WireError` (400/413/415 codes).

    The type is checked before the body is read, so a refused body is never buffered.
    """
    ctype = request.content_type
    if hdrs.CONTENT_TYPE not in request.headers:
        raise UnsupportedMediaType(
            f"an operation request needs a Content-Type header: send {wire.CONTENT_TYPE_JSON} or {wire.CONTENT_TYPE_MSGPACK}"
        )
    if ctype not in (wire.CONTENT_TYPE_MSGPACK, wire.CONTENT_TYPE_JSON):
        raise UnsupportedMediaType(
            f"Content-Type {ctype!r} is not supported: send {wire.CONTENT_TYPE_JSON} or {wire.CONTENT_TYPE_MSGPACK}"
        )
    data = await request.read()
    if not data:
        return {}
    if ctype == wire.CONTENT_TYPE_MSGPACK:
        return wire.unpack(data, max_bytes)
    return wire.load_json(data, max_bytes)
