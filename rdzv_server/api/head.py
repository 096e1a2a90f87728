"""An HTTP request head as its bytes go by, and what was wrong with one aiohttp's parser refused.

What it owns:
- :class:`RequestHead`: the head (request line and header fields) of the request arriving on
  one connection: its size (for ``--max-head-bytes``), where it ends, how many lines it has;
- :meth:`RequestHead.refusal`: why and where the parser refused it (:class:`Refusal`), found
  from the refusal's *type* and from the request's own bytes, never from the parser's message
  text (llhttp's words and aiohttp's quote of the line are neither stable nor safe to show).

Rules:
- No I/O and no clock: bytes in, numbers and words out. ``feed`` is on every request's path and
  does a few C-speed scans per read; everything else runs only for a refused request.
- Nothing here quotes the request: aiohttp's parser messages quote the line they refuse,
  credentials included, so a refusal says what was wrong in our words, and where by line (the
  request line, a header HTTP itself names, or "a header field") and byte offset.
- The byte scan flags only what llhttp's strict request parser (aiohttp's) refuses too: a
  control byte in the request line or in a header value, a byte that is no token character in
  a field name, a line without a colon, a line that starts with whitespace, a line ending in a
  bare LF or a CR without LF. What llhttp refuses for other reasons (a duplicate field, a
  Content-Length that is not a number, ...) is found by reading the head's fields, then by the
  refusal's type; what cannot be told is "a malformed request", with no place.

What it must not know: connections, the table, aiohttp's protocol classes (``aiohttp_seam``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from aiohttp import hdrs
from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine, InvalidHeader, InvalidURLError, LineTooLong
from aiohttp.http_parser import SINGLETON_HEADERS
from multidict import istr

# A header is named in a refusal when it is one of HTTP's own (aiohttp's ``hdrs``): a name the
# client made up is bytes it sent, and could be anything, a token pasted in the wrong place too.
_KNOWN_HEADERS = {str(name).lower(): str(name) for name in vars(hdrs).values() if isinstance(name, istr)}
# Bytes of a line kept to name its header: the longest known name and its colon.
_NAME_BYTES = max(map(len, _KNOWN_HEADERS)) + 1
_HEAD_END = b"\r\n\r\n"
_FIELD_NAME = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):")
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
# Bytes no request line may hold (HTTP/1.1's grammar; llhttp's strict parser refuses them):
# the controls, DEL and, in the request target, anything not ASCII.
_LINE_FORBIDDEN = frozenset([*range(0x00, 0x20), *range(0x7F, 0x100)])
# A field value may hold HTAB and bytes above DEL (obs-text), no other control.
_VALUE_FORBIDDEN = frozenset([*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F])
# What the first bytes of a TLS ClientHello look like (a handshake record, version 3.x).
_TLS_RECORD = b"\x16\x03"
_ONCE = frozenset(name.lower() for name in SINGLETON_HEADERS)
_DIGITS = frozenset(b"0123456789")

# The words of each refusal.
TLS_ON_PLAIN_PORT = "TLS on a plain HTTP port (use http://, or give the server --tls-cert)"
NO_HOST = "no Host header (HTTP/1.1 requires one)"
TOO_MANY_FIELDS = "too many header fields"
MALFORMED = "a malformed request"
MALFORMED_BODY = "a malformed body (its chunk sizes or length)"
_PREFACE = "HTTP/2's connection preface (this server speaks HTTP/1.1)"
# By the refusal's type, when neither the bytes nor the fields tell more.
_TYPE_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (InvalidURLError, "a request target that is not a valid path or URL"),
    (BadHttpMethod, "an unknown method"),
    (BadStatusLine, "a malformed method, target or HTTP version"),
    (InvalidHeader, "a forbidden byte in a header field"),
)
# The refusals of these types are about the request line.
_REQUEST_LINE_TYPES = (InvalidURLError, BadHttpMethod, BadStatusLine)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request was refused (``reason``) and where (``where``: "" when unknown), neither
    quoting the request; ``too_large``: it passed one of the parser's size limits (431)."""

    reason: str
    where: str = ""
    too_large: bool = False

    @property
    def message(self) -> str:
        """The answer's message and the log's reason."""
        return f"the request could not be read: {self.reason}{' ' + self.where if self.where else ''}"


@dataclasses.dataclass(frozen=True)
class _Line:
    """One line of the head within the refused chunk: ``start``/``end`` index the chunk (the
    end excludes CR LF); a line that began in an earlier read has its kept start in ``prefix``."""

    start: int
    end: int
    request_line: bool
    continued: bool  # began in an earlier read: ``prefix`` holds its first bytes
    prefix: bytes


class RequestHead:
    """The head of the HTTP request arriving on one connection (see the module rules).

    The head starts at the request's first byte other than CR or LF (a server ignores empty
    lines before a request line, and so does aiohttp's parser) and ends with its first empty
    line (CRLF CRLF: aiohttp's parser refuses a bare LF, and a head it accepts otherwise is
    closed by :meth:`close`). Only the start of the line still arriving is kept (enough to
    name a known header), never a value.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new request: its head starts with the next byte."""
        self.size = 0  # bytes of the head received so far
        self.open = True  # still arriving
        self.lines = 0  # line ends (LF) in the head so far
        self._started = False  # a byte other than CR or LF went by
        self._request_line_at = 0
        self._tail = b""  # its last 3 bytes: an empty line may span two reads
        self._line = b""  # the start of the line still arriving ...
        self._line_at = 0  # ... and where it starts in the head
        self._chunk = (0, b"", 0, 0, False)  # (size, _line, _line_at, lines, _started) when the last chunk came

    def close(self) -> None:
        """The parser has the whole head, whatever this reader saw of it."""
        self.open = False

    def feed(self, data: bytes) -> int:
        """Count the bytes of ``data`` that belong to the head; return how many (all while the
        head goes on, the bytes up to its empty line in the chunk that ends it, 0 after)."""
        if not self.open:
            return 0
        self._chunk = (self.size, self._line, self._line_at, self.lines, self._started)
        start = 0
        if not self._started:
            if data[:1] in (b"\r", b"\n"):
                start = len(data) - len(data.lstrip(b"\r\n"))
                if start == len(data):
                    self.size += start
                    return start
            self._started = True
            self._request_line_at = self._line_at = self.size + start
        end, ended = len(data), False
        if self._tail and not start:
            found = (self._tail + data[:3]).find(_HEAD_END)
            if found >= 0:
                end, ended = found + len(_HEAD_END) - len(self._tail), True
        if not ended:
            found = data.find(_HEAD_END, start)
            if found >= 0:
                end, ended = found + len(_HEAD_END), True
        newline = data.rfind(b"\n", start, end)
        if newline >= 0:
            self._line = data[newline + 1 : min(end, newline + 1 + _NAME_BYTES)]
            self._line_at = self.size + newline + 1
            self.lines += data.count(b"\n", start, end)
        elif len(self._line) < _NAME_BYTES:
            self._line += data[start : min(end, start + _NAME_BYTES - len(self._line))]
        self._tail = (self._tail + data[max(start, end - 3) : end])[-3:]
        self.size += end
        self.open = not ended
        return end

    # -- refusals (cold: only for a request the parser refused) -------------------------------

    def refusal(self, exc: BaseException | None, chunk: bytes, head_bytes: int | None, max_fields: int) -> Refusal:
        """Why and where aiohttp's parser refused the request, which it did while reading
        ``chunk`` (the last one fed; its first ``head_bytes`` belong to the head, None: no
        head was being read). ``max_fields``: the parser's limit on header fields. A line too
        long is :meth:`long_line`'s (what it needs is in aiohttp's exception: the seam's)."""
        if isinstance(exc, LineTooLong):  # its line and limit: see long_line
            return Refusal("a line longer than the server's limit", too_large=True)
        if head_bytes is None:
            return Refusal(_type_reason(exc))
        if self._chunk[0] == 0 and chunk[:2] == _TLS_RECORD:
            return Refusal(TLS_ON_PLAIN_PORT)
        # aiohttp refuses the field past max_fields when it has read it whole, so a fault in a
        # later line is never reached: only the lines up to that one are looked at.
        lines, more = self._lines_within(chunk, head_bytes, max_fields + 1)
        fault = _byte_fault(chunk, lines)
        if fault is not None:
            reason, at = fault
            return Refusal(reason, self.where(chunk, head_bytes, at))
        fields = self.lines - 1  # the head's line ends so far, less the request line's
        if more or fields > max_fields + int(head_bytes < len(chunk) or not self.open):  # the empty line ends one
            return Refusal(TOO_MANY_FIELDS, too_large=True)
        preface = _preface(chunk, lines)
        if preface is not None:
            return Refusal(_PREFACE, self.where(chunk, head_bytes, preface))
        if isinstance(exc, _REQUEST_LINE_TYPES):
            where = self.where(chunk, head_bytes, lines[0].start) if lines and lines[0].request_line else ""
            return Refusal(_type_reason(exc), where)
        fault = self._field_fault(chunk, lines, head_bytes)
        if fault is not None:
            reason, at = fault
            return Refusal(reason, self.where(chunk, head_bytes, at) if at >= 0 else "")
        if head_bytes < len(chunk):
            return Refusal(MALFORMED_BODY)
        return Refusal(_type_reason(exc))

    def long_line(self, start: bytes, limit: object, chunk: bytes, head_bytes: int | None) -> Refusal:
        """A line (or part of one: a target, a name, a value) passed the parser's ``limit``;
        ``start``: its first bytes, to be found in ``chunk`` (never shown)."""
        found = chunk.find(start) if start else -1
        where = self.where(chunk, head_bytes, found) if found >= 0 else ""
        return Refusal(f"a line longer than {limit} bytes", where, too_large=True)

    def where(self, chunk: bytes, head_bytes: int | None, at: int) -> str:
        """Where the byte ``at`` of ``chunk`` (the last one fed; its first ``head_bytes`` belong
        to the head, None: unknown) is: which line and which byte, quoting nothing."""
        if head_bytes is None:
            return ""
        if at >= head_bytes:
            return "in the body"
        size, line, line_at = self._chunk[:3]
        newline = chunk.rfind(b"\n", 0, at)
        if newline >= 0:
            line, line_at = chunk[newline + 1 : newline + 1 + _NAME_BYTES], size + newline + 1
        else:
            line = (line + chunk[:_NAME_BYTES])[:_NAME_BYTES]
        if line_at == self._request_line_at:
            what = "the request line"
        else:
            what = _field_words(line)
        return f"in {what}, at byte {size + at} of the request"

    def _lines_within(self, chunk: bytes, head_bytes: int, max_fields: int) -> tuple[list[_Line], bool]:
        """The head's lines in ``chunk`` up to its ``max_fields``-th header field, and whether
        a field line follows those."""
        ended = self._chunk[3]  # line ends before this chunk: the request line's is the first
        number = max(0, ended - 1)  # header fields whose lines ended before this chunk
        kept: list[_Line] = []
        for line in self._lines(chunk, head_bytes):
            if not line.request_line:
                number += 1
                if number > max_fields:
                    return kept, True
            kept.append(line)
        return kept, False

    def _lines(self, chunk: bytes, head_bytes: int) -> Iterator[_Line]:
        """The head's lines in ``chunk`` (the last may be unfinished), empty lines left out."""
        size, prefix, line_at, _, started = self._chunk
        start = 0
        if not started:
            start = len(chunk[:head_bytes]) - len(chunk[:head_bytes].lstrip(b"\r\n"))
        continued = started and size > line_at
        while start < head_bytes:
            newline = chunk.find(b"\n", start, head_bytes)
            end = head_bytes if newline < 0 else newline
            stop = end - 1 if end > start and chunk[end - 1 : end] == b"\r" and newline >= 0 else end
            if stop > start or continued:
                request_line = (size + start if not continued else line_at) == self._request_line_at
                yield _Line(start, stop, request_line, continued, prefix if continued else b"")
            continued = False
            start = end + 1

    def _field_fault(self, chunk: bytes, lines: list[_Line], head_bytes: int) -> tuple[str, int] | None:
        """A rule of the head's fields broken (read from the fields, not the parser's words):
        ``(reason, at)``, ``at`` -1 when no one line is to blame."""
        seen: dict[str, int] = {}
        request: _Line | None = None
        for line in lines:
            if line.request_line:
                request = line
                continue
            text = (line.prefix + chunk[line.start : line.end]) if line.continued else chunk[line.start : line.end]
            name, colon, value = text.partition(b":")
            if not colon:
                continue
            key = name.decode("ascii", "replace").lower()
            seen[key] = seen.get(key, 0) + 1
            known = _KNOWN_HEADERS.get(key)
            if key in _ONCE and seen[key] > 1 and known is not None:
                return f"header {known} given twice", line.start
            if key == "content-length" and not (set(value.strip(b" \t")) <= _DIGITS and value.strip(b" \t")):
                return "a Content-Length that is not a number", line.start
            if key == "transfer-encoding" and not value.strip(b" \t").lower().endswith(b"chunked"):
                return "a Transfer-Encoding other than chunked (the only one a request may use)", line.start
            if "content-length" in seen and "transfer-encoding" in seen:
                return "both Content-Length and Transfer-Encoding (a request may have one)", line.start
        if request is not None:
            complete = head_bytes < len(chunk) or chunk[:head_bytes].endswith(_HEAD_END)
            if complete and self._chunk[0] == 0 and "host" not in seen:
                if chunk[request.start : request.end].endswith(b"HTTP/1.1"):
                    return NO_HOST, -1
        return None


def _preface(chunk: bytes, lines: list[_Line]) -> int | None:
    """Where HTTP/2's preface ("PRI * HTTP/2.0", an empty line, "SM") went wrong for HTTP/1.1
    (the line after the request line, else the request line), or None: not a PRI request."""
    if not lines or not lines[0].request_line or chunk[lines[0].start : lines[0].start + 4] != b"PRI ":
        return None
    return lines[1].start if len(lines) > 1 else lines[0].start


def _byte_fault(chunk: bytes, lines: list[_Line]) -> tuple[str, int] | None:
    """The first byte of the head's lines in ``chunk`` that HTTP/1.1's grammar forbids where
    it stands: ``(reason, index in chunk)``."""
    for line in lines:
        start, end = line.start, line.end
        if line.request_line:
            for at in range(start, end):
                if chunk[at] in _LINE_FORBIDDEN:
                    return "a forbidden byte (a control character, or one that is not ASCII)", at
            if end > start and chunk[end - 1] == 0x20:
                return "a space at the end of the request line", end - 1
        else:
            prefix = line.prefix if line.continued else b""
            in_value = b":" in prefix
            if not in_value and len(prefix) >= _NAME_BYTES:
                continue  # what came between its kept start and this read is unknown
            if not line.continued and chunk[start : start + 1] in (b" ", b"\t"):
                return "a header line that starts with whitespace (obsolete line folding)", start
            for at in range(start, end):
                byte = chunk[at]
                if in_value:
                    if byte in _VALUE_FORBIDDEN:
                        return "a forbidden byte (a control character)", at
                elif byte == 0x3A:
                    in_value = True
                elif byte not in _TOKEN:
                    return "a header field name that is not a token", at
            if not in_value and end < len(chunk):
                return "a header line without a colon", end
        fault = _line_end_fault(chunk, line)
        if fault is not None:
            return fault
    return None


def _line_end_fault(chunk: bytes, line: _Line) -> tuple[str, int] | None:
    """A line that ends in LF without CR, or holds a CR not followed by LF."""
    end = line.end
    if chunk[end : end + 1] == b"\n":
        return "a line that ends in LF without CR (HTTP needs CRLF)", end
    if chunk[end : end + 1] == b"\r" and end + 1 < len(chunk) and chunk[end + 1 : end + 2] != b"\n":
        return "a CR not followed by LF", end
    return None


def _field_words(line_start: bytes) -> str:
    """How a refusal names a header line: by its name if HTTP names it, else anonymously."""
    name = _FIELD_NAME.match(line_start)
    known = _KNOWN_HEADERS.get(name.group(1).decode("ascii").lower()) if name else None
    return f"header {known}" if known else "a header field"


def _type_reason(exc: BaseException | None) -> str:
    for kind, reason in _TYPE_REASONS:
        if isinstance(exc, kind):
            return reason
    return MALFORMED
