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


GET = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n"
# (request, words of the reason, where, 431): what aiohttp's parser refuses, said in our words.
REFUSED = [
    (GET + b"Authorization: Bearer t\x01\r\n\r\n", "forbidden byte", "in header Authorization, at byte 55", False),
    (GET + b"Cookie: a\x7f\r\n\r\n", "forbidden byte", "in header Cookie", False),
    (GET + b"X-Big: " + b"b" * 9000 + b"\r\n\r\n", "longer than 8190 bytes", "in a header field", True),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", "longer than 8190 bytes", "in the request line", True),
    (GET + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", "too many header fields", "", True),
    (b"GET /?a=\x01 HTTP/1.1\r\nHost: x\r\n\r\n", "forbidden byte", "in the request line, at byte 8", False),
    (b"GET / HTTP/1.1\nHost: x\n\n", "LF without CR", "in the request line", False),
    (GET + b"Authorization: t\nX: y\n\n", "LF without CR", "in header Authorization", False),
    (b"PRI * HTTP/1.1\r\nAuthorization: t\r\n\r\n", "HTTP/2's connection preface", "in header Authorization", False),
    (b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n", "an unknown method", "in the request line", False),
    (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", "HTTP version", "in the request line", False),
    (b"GET / HTTP/1.1\r\n\r\n", "no Host header", "", False),
    (GET + b"Host: y\r\n\r\n", "header Host given twice", "in header Host", False),
    (GET + b"Content-Length: abc\r\n\r\n", "Content-Length that is not a number", "in header Content-Length", False),
    (GET + b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", "both", "in header Transfer-Encoding", False),
    (GET + b"Transfer-Encoding: gzip\r\n\r\n", "other than chunked", "in header Transfer-Encoding", False),
    (GET + b"nocolon\r\n\r\n", "without a colon", "in a header field", False),
    (GET + b" X: y\r\n\r\n", "starts with whitespace", "in a header field", False),
    (GET + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "a malformed body", "", False),
    (bytes.fromhex("16030100a5010000a10303") + bytes(32), "TLS on a plain HTTP port", "", False),
]


@pytest.mark.parametrize(("raw", "reason", "where", "too_large"), REFUSED, ids=[r[1] for r in REFUSED])
async def test_a_refusal_says_what_and_where_from_the_type_and_the_bytes(
    raw: bytes, reason: str, where: str, too_large: bool
) -> None:
    parser = HttpRequestParser(
        mock.Mock(), asyncio.get_running_loop(), 2**16, max_line_size=8190, max_field_size=8190, max_headers=128
    )
    with pytest.raises(HttpProcessingError) as refused:
        parser.feed_data(raw)
    head = RequestHead()
    refusal = describe(head, refused.value, raw, head.feed(raw), 128)
    assert reason in refusal.reason and refusal.too_large is too_large
    assert refusal.where.startswith(where) if where else refusal.where == ""


def test_the_same_refusal_is_found_when_the_head_arrives_in_pieces() -> None:
    raw = GET + b"Authorization: Bearer t\x01\r\n\r\n"
    cut = raw.index(b"Bearer")
    head = RequestHead()
    head.feed(raw[:cut])
    chunk = raw[cut:]
    refusal = head.refusal(HttpProcessingError(), chunk, head.feed(chunk), 128)
    bad = raw.index(b"\x01")
    assert refusal.reason.startswith("a forbidden byte")
    assert refusal.where == f"in header Authorization, at byte {bad} of the request"
