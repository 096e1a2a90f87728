"""An HTTP request head as its bytes go by (``RequestHead``), and what a parser refusal says
(``RequestHead.refusal``), in memory: sizes and ends are exact however the head is split, and
a refusal names the header and byte without ever quoting the request."""

from __future__ import annotations

import asyncio
import secrets
from unittest import mock

import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser

from rdzv_server.api.aiohttp_seam import describe
from rdzv_server.api.head import RequestHead

HEAD = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc\r\n\r\n"


def feed_all(head: RequestHead, chunks: list[bytes]) -> list[int]:
    return [head.feed(chunk) for chunk in chunks]


@pytest.mark.parametrize("cut", range(1, len(HEAD) + 1))
def test_a_head_ends_at_its_empty_line_however_it_is_split(cut: int) -> None:
    head = RequestHead()
    body = b"BODY\r\n\r\n"
    taken = feed_all(head, [HEAD[:cut], HEAD[cut:] + body])
    assert head.size == len(HEAD) and not head.open
    assert sum(taken) == len(HEAD)
    assert head.feed(b"more") == 0  # after the head: the body, not counted


def test_empty_lines_before_the_request_line_do_not_end_the_head() -> None:
    head = RequestHead()
    assert head.feed(b"\r\n\r\n") == 4 and head.open
    rest = b"\r\nGET / HTTP/1.1\r\nX: " + b"y" * 100
    assert head.feed(rest) == len(rest) and head.open
    assert head.size == 4 + len(rest)
    head.reset()
    assert head.size == 0 and head.open


def test_where_names_a_known_header_the_request_line_or_the_body_never_a_value() -> None:
    head = RequestHead()
    chunk = HEAD + b"body bytes"
    taken = head.feed(chunk)
    token_at = chunk.index(b"abc")
    assert head.where(chunk, taken, token_at) == f"in header Authorization, at byte {token_at} of the request"
    assert head.where(chunk, taken, 4) == "in the request line, at byte 4 of the request"
    assert head.where(chunk, taken, chunk.index(b"body")) == "in the body"
    assert head.where(chunk, None, 4) == ""
    custom = RequestHead()
    chunk = b"GET / HTTP/1.1\r\nX-Secret-abc: v\r\n\r\n"
    assert "a header field" in custom.where(chunk, custom.feed(chunk), chunk.index(b"v\r"))


def test_a_line_split_across_reads_is_still_named() -> None:
    head = RequestHead()
    first = b"GET / HTTP/1.1\r\nAuthorization: Bea"
    second = b"rer abc\x01\r\n\r\n"
    head.feed(first)
    taken = head.feed(second)
    where = head.where(second, taken, 7)
    assert where == f"in header Authorization, at byte {len(first) + 7} of the request"


async def test_no_parser_refusal_quotes_the_request() -> None:
    token = secrets.token_urlsafe(32).encode()
    requests = [
        b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\x01\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"a" * 9000 + b"\r\n\r\n",
        b"GET /?token=" + token + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /?token=" + token + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\nHost: x\nAuthorization: Bearer " + token + b"\n\n",
        b"PRI * HTTP/1.1\r\nAuthorization: Bearer " + token + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\x00\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n" + token * 200 + b": x\r\n\r\n",
        token + b" / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/" + token + b"\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + token + b"\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + token + b"\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nCookie: rdzv_token=" + token + b"\x7f\r\n\r\n",
    ]
    loop = asyncio.get_running_loop()
    for raw in requests:
        parser = HttpRequestParser(mock.Mock(), loop, 2**16, max_line_size=8190, max_field_size=8190, max_headers=128)
        with pytest.raises(HttpProcessingError) as refused:
            parser.feed_data(raw)
        assert token.decode() in refused.value.message  # aiohttp's own message quotes it ...
        head = RequestHead()
        taken = head.feed(raw)
        text = describe(head, refused.value, raw, taken, 128).message
        assert token.decode() not in text and token[:8].decode() not in text, text  # ... ours never
        assert text.startswith("the request could not be read: ") and len(text) < 200
