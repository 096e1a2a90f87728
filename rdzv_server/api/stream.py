"""The stream protocol, server side: the operations as msgpack frames on a plain TCP connection.

What it owns: one :class:`StreamConnection` per connection (preface, framing, pipelining,
flow control, cancellation) and :class:`StreamServer`, their factory and shutdown. The
protocol itself is specified in ``rdzv_client.wire`` ("stream protocol"); each request is
served by :func:`.operation.run_operation`, exactly as its HTTP twin, so a reply frame
carries the same status and body as the HTTP response would.

Rules:
- The connection opens with ``wire.STREAM_PREFACE``; anything else is answered with one
  ``[0, 400, bad_request]`` frame and the connection is closed.
- A frame header announcing more than the body limit (plus :data:`FRAME_OVERHEAD`) is
  answered ``[0, 413, body_too_large]`` and the connection is closed: the framing can no
  longer be trusted. A frame that is read whole but is not a valid request is answered
  with its tag (0 if none can be read) and a 400; the connection stays usable.
- With auth on, the first frame after the preface must be the hello with a valid token
  (``wire.HELLO_OP``); an operation before it, or a wrong token, is answered with a tag-0
  ``401 unauthorized`` frame and the connection is closed. The hello's grant then covers
  every request on the connection (a read-only token gets ``403 forbidden`` for writes).
- The hello's reply lists the operations taken one-way (``wire.ONE_WAY_OPS``: the beat): one
  that succeeds is not answered at all (no reply to pack, no ``send``), one refused is
  answered with its tag, as any request.
- The hello's reply also lists the operations that may carry ``then_watch``
  (``wire.THEN_WATCH_OPS``: a join, an await_round): the field is taken out of the request
  here, before the operation sees it (a malformed one answers the request 400 and nothing is
  applied), and once the request is answered 200 with an assignment the connection serves the
  node's watch of that round under the field's tag, as if its frame had just arrived
  (:meth:`StreamConnection._answer`). What waits for that answer is bound into the request's
  own callback: no attribute of the connection holds it.
- A valid request is served at once (:func:`.operation.start_operation`), inside the read
  that brought it: one that does not wait is answered there, one that waits for its log
  append is answered from that append's completion, and only one that parks (a long-poll)
  runs as a task. Replies are written in completion order; the replies of the requests one
  read brings that answer at once go out in one write.
- The connection closing (EOF or reset) cancels every request in flight, as aiohttp's
  ``handler_cancellation`` does for HTTP: a node's dropped watch is how the service
  notices fast that it died.
- At most :data:`MAX_IN_FLIGHT` requests run per connection, and none are read while the
  transport's write buffer is over its high-water mark: a client that does not read its
  replies stops being read, so the server buffers at most one reply per request in flight.
- After a fatal error the reply is flushed, our side half-closed and further bytes
  discarded for a while (:class:`.connection.Closing`), so the client reads the error
  instead of a reset.
- Limits (:mod:`.connection`): bytes of a partly received frame (or preface) are charged to
  the server's buffer budget before they are buffered (over it: ``[0, 429, buffers_full]``
  and close); a frame must arrive whole within ``read_timeout`` of its first byte (else
  ``[0, 408, request_timeout]`` and close); a connection with nothing in flight and nothing
  received for ``idle_timeout`` is closed (clients reconnect).
- Before its hello a connection is a stranger's (:mod:`.connection`): its bytes count
  against the pre-authentication share, it is taken a piece at a time (the preface, then
  the frame arriving) so that only the hello is ever buffered as a stranger's and what a
  client pipelines behind it is charged once the hello is in, and it must complete its hello
  within ``auth_timeout`` of its first byte (else ``[0, 408, request_timeout]`` and close).

This is the hot path: nothing here logs, copies or allocates per request beyond the
decoded request and its reply frame (plus a future for a request that waits); the limits
cost one stored time per read unless a frame spans reads.

What it must not know: HTTP, what the operations do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from typing import Any, cast

import msgpack

from rdzv_client import frame, wire

from ..core.error import RdzvError
from ..service import Service
from .auth import Grant, TokenTable
from .connection import Closing, ConnectionTable, TrackedConnection
from .metric import Metrics
from .operation import Durable, Reply, start_operation

log = logging.getLogger("rdzv_server.api")

# A request frame is the body limit plus its tag, op and id; 1 KiB covers a 64-bit tag, any
# operation name and a 200-character id with their msgpack headers.
FRAME_OVERHEAD = 1024
# The largest frame before the hello (which carries a token of a few dozen bytes): a stranger
# cannot make the server buffer a body's worth of bytes before it has said who it is.
PRE_HELLO_FRAME_LIMIT = 4096
# Requests running per connection before it stops reading: deep enough for any client's
# pipelining, small enough that one client cannot make the server buffer without bound.
MAX_IN_FLIGHT = 1024

_PREFACE = wire.STREAM_PREFACE
_PREFACE_LEN = len(_PREFACE)
_HEADER_LEN = frame.HEADER_LEN
_frame_end = frame.frame_end
_MAX_TAG = 2**63
_FRAME_HEADER = wire.FRAME_HEADER
# wire.frame's bytes from one Packer (the loop's thread only): msgpack.packb builds a Packer,
# with its buffer, per call, which costs more than encoding a reply.
_pack_reply = msgpack.Packer(use_bin_type=True).pack
_ONE_WAY = frozenset(wire.ONE_WAY_OPS)
_THEN_WATCH = wire.THEN_WATCH
_THEN_WATCH_OPS = frozenset(wire.THEN_WATCH_OPS)
_HELLO_REPLY_OPS = {wire.HELLO_ONE_WAY: list(wire.ONE_WAY_OPS), wire.HELLO_THEN_WATCH: list(wire.THEN_WATCH_OPS)}
_WATCH = wire.WatchRequest.op
_BEAT = wire.BeatRequest.op
_ID = wire.ID_PATTERN.match
_MAX_STEP = 2**63
_SHAPE = "a request frame is [tag: int 0..2**63-1, op: str, rdzv_id: str, fields: map]"


def _tag_of(msg: Any) -> int:
    """The tag of a malformed request, so its error finds its caller; 0 if there is none."""
    if isinstance(msg, list) and msg and type(msg[0]) is int and 0 <= msg[0] < _MAX_TAG:
        return msg[0]
    return 0


#: The watch a request's ``then_watch`` parks once it is answered with an assignment: its tag,
#: hold, job and node.
_Then = tuple[int, float, str, Any]


class StreamConnection(asyncio.Protocol, TrackedConnection):
    """One stream connection (see the module docstring for its rules).

    It keeps at most 28 instance attributes (CPython's compact split dict; one more made each
    of 16,384 connections' dicts ~1.6 KB instead of ~0.3 KB): a new piece of per-connection
    state goes into an existing attribute, or into a callback's arguments.
    """

    protocol = "stream"
    article = "a stream"
    must_authenticate = "hello"

    def __init__(self, server: StreamServer) -> None:
        self._server = server
        self._svc = server.svc
        self._metrics = server.metrics
        # The last read that was one whole beat, taken, and its service call: the same bytes again
        # are the same beat (a client sends one frame per round, tag and all), taken at once.
        # (One attribute for both, and none for the service's beat: a connection past 28
        # attributes gets a dict of ~1.6 KB instead of ~0.3 KB, 21 MB at 16,384 nodes.)
        self._same_beat: tuple[bytes, tuple[str, str, tuple[int, int] | None]] | None = None
        self._read: bytes | None = None  # the read being served, while it is whole frames
        self._loop = asyncio.get_running_loop()
        self._full_limit = server.svc.config.max_body_bytes + FRAME_OVERHEAD
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._greeted = False  # the preface has been read
        self._grant: Grant | None = server.tokens.grant(None)  # OPEN with auth off; None until the hello
        # Until the hello a stranger may send a hello and nothing else: it fits in a few KiB.
        self._limit = self._full_limit if self._grant is not None else PRE_HELLO_FRAME_LIMIT
        self._unpack = server.unpack_full if self._grant is not None else server.unpack_stranger  # (self._limit's)
        self._accepting = True  # new requests are read (False once closing)
        self._replying = True  # replies are written (False after a fatal error)
        self._writing_paused = False
        self._reading_paused = False
        self._replies: list[bytes] | None = None  # while a read's frames are served: their replies
        # What waits: a parked request's task, or the future a request waiting for its append
        # completes when it has answered (cancelled: it will not answer).
        self.in_flight: set[asyncio.Future[Any]] = set()
        self.closed: asyncio.Future[None] = self._loop.create_future()

    # -- transport events ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # As aiohttp does for HTTP: a peer that vanished without a reset is found eventually.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._server.connections.add(self)
        self.track(self._server.table)

    def data_received(self, data: bytes) -> None:
        now = self.last_active = self.timers.time()
        same = self._same_beat
        if same is not None and data == same[0] and not self._buffer and self._accepting and self._take_same_beat(same[1]):
            return
        if not self._accepting:
            return  # closing: what the client still sends is drained, not served
        if not self.trusted:  # before the hello: a piece at a time (see the module rules)
            view = memoryview(data)  # (pieces without copies)
            while self._accepting and not self.trusted and len(view) > (need := self._stranger_needs()):
                self._receive(view[:need], now)
                view = view[need:]
            if view and self._accepting:
                self._receive(view, now)
            return
        self._receive(data, now)

    def _stranger_needs(self) -> int:
        """Bytes that complete the preface or the frame arriving (before the hello)."""
        if not self._greeted:
            return _PREFACE_LEN - len(self._buffer)
        return max(1, frame.missing(self._buffer))

    def _receive(self, data: bytes | memoryview, now: float) -> None:
        buf = self._buffer
        if not self._greeted:
            if not self._hold(len(data), now):
                return
            buf += data
            seen = bytes(buf[:_PREFACE_LEN])
            if seen != _PREFACE[: len(seen)]:
                self.table.rejected(wire.ErrorCode.BAD_REQUEST)
                self._fail(400, wire.ErrorCode.BAD_REQUEST, f"the stream must open with {_PREFACE!r}")
                return
            if len(seen) < _PREFACE_LEN:
                return
            self._greeted = True
            del buf[:_PREFACE_LEN]
            self.table.release(self, _PREFACE_LEN)
            if not buf:
                self.reading_since = None
            self._parse_buffer()
            return
        if buf:
            if not self._hold(len(data), now):
                return
            buf += data
            self._parse_buffer()
            return
        self._read = data if type(data) is bytes else None
        try:
            consumed = self._parse(data)  # the common case: whole frames, parsed where they lie
        finally:
            self._read = None
        if consumed < len(data) and self._accepting:
            if not self._hold(len(data) - consumed, now):
                return
            buf += memoryview(data)[consumed:]
        self._update_reading()

    def eof_received(self) -> bool | None:
        # A dead process's kernel sends FIN, not a reset: treat EOF as the connection lost
        # (returning None closes the transport), as aiohttp does for HTTP.
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._transport = None
        self._accepting = False
        self._replying = False
        self._buffer = bytearray()  # a fatal error may have left a partial frame
        self.untrack()
        if self.in_flight:
            # On the next pass, not now: a request that came with the bytes before the close has
            # its task's first step scheduled already, and takes it first (a watch counts its
            # node's open poll there), so the cancellation reaches it where it waits.
            self._loop.call_soon(self._cancel_in_flight)
        self._server.connections.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)

    def _cancel_in_flight(self) -> None:
        for waiting in list(self.in_flight):
            waiting.cancel()

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._parse_buffer()

    # -- limits ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.in_flight)

    def reading_counts(self) -> bool:
        return not self._held()  # a frame we stopped reading is not late by the client's doing

    def _hold(self, n: int, now: float) -> bool:
        """Charge ``n`` bytes about to be buffered; False: the budget refused them (we are closed)."""
        if not self.table.charge(self, n):
            return False
        if self.reading_since is None:
            self.start_reading(now)
        return True

    def shed(self, code: wire.ErrorCode | None, message: str) -> None:
        if code is not None:
            self._fail(wire.HTTP_STATUS[code], code, message)
        elif self._transport is not None:
            self._transport.close()

    # -- framing ---------------------------------------------------------------------------

    def _held(self) -> bool:
        """Whether reading must wait: too many requests in flight, or replies not read."""
        return self._writing_paused or len(self.in_flight) >= MAX_IN_FLIGHT

    def _parse(self, data: bytes | bytearray | memoryview) -> int:
        """Serve the whole frames at the start of ``data``; return how many bytes they took."""
        if self._replies is not None:  # (never expected: nothing serves frames while a read is served)
            return self._parse_frames(data)
        self._replies = []
        try:
            return self._parse_frames(data)
        finally:
            self._flush_replies()

    def _parse_frames(self, data: bytes | bytearray | memoryview) -> int:
        pos = 0
        with memoryview(data) as view:
            while self._accepting and not self._held():
                try:
                    stop = _frame_end(data, pos, self._limit)
                except frame.FrameTooLarge as exc:
                    self.table.rejected(wire.ErrorCode.BODY_TOO_LARGE)
                    self._fail(413, wire.ErrorCode.BODY_TOO_LARGE, str(exc))
                    return len(data)
                if stop is None:
                    break
                self._request(view[pos + _HEADER_LEN : stop])
                pos = stop
        return pos

    def _parse_buffer(self) -> None:
        buf = self._buffer
        if buf and self._greeted:
            consumed = self._parse(buf)
            if consumed and self._buffer is buf:  # (a fatal error gave the buffer up)
                try:
                    del buf[:consumed]
                except BufferError:  # a frame's view outlived its request (never expected)
                    self._buffer = buf[consumed:]
                self.table.release(self, consumed)
                # What is left is the start of the next frame, which arrived with this read.
                self.reading_since = self.timers.time() if self._buffer else None
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self._transport
        held = self._accepting and self._held()  # closing drains, it never holds
        if transport is None or held == self._reading_paused:
            return
        self._reading_paused = held
        if held:
            transport.pause_reading()
        else:
            if self.reading_since is not None:
                self.reading_since = self.timers.time()  # the client could not send while held
            transport.resume_reading()

    # -- requests --------------------------------------------------------------------------

    def _request(self, payload: memoryview) -> None:
        try:
            msg = self._unpack(payload)
        except wire.WireError as exc:
            self._send(0, 400, wire.error_body(wire.ErrorCode.BAD_REQUEST, str(exc)))
            return
        if type(msg) is list and len(msg) == 4:
            tag, op, rdzv_id, fields = msg
            valid_tag = type(tag) is int and 0 <= tag < _MAX_TAG
            if valid_tag and type(op) is str and type(rdzv_id) is str and type(fields) is dict:
                if op == wire.HELLO_OP:
                    self._hello(tag, fields)
                elif self._grant is None:
                    self._metrics.auth_failed("missing")
                    self._fail(401, wire.ErrorCode.UNAUTHORIZED, f"send {wire.HELLO_OP!r} with the token first")
                elif op == _BEAT and self._take_beat(self._grant, rdzv_id, fields, len(payload)):
                    pass  # taken: a one-way beat has no reply
                else:
                    then: _Then | None = None
                    if _THEN_WATCH in fields and op in _THEN_WATCH_OPS:
                        try:
                            watch_tag, hold = wire.then_watch_of(fields.pop(_THEN_WATCH), tag)
                        except wire.WireError as exc:
                            self._send(tag, 400, wire.error_body(wire.ErrorCode.BAD_REQUEST, str(exc)))
                            return
                        then = (watch_tag, hold, rdzv_id, fields.get("node_id"))
                    try:
                        self._serve(tag, op, rdzv_id, fields, then)
                    except Exception:  # (never expected: the operation maps every failure to a reply)
                        log.exception("Answering a stream request failed.")
                return
        self._send(_tag_of(msg), 400, wire.error_body(wire.ErrorCode.BAD_REQUEST, _SHAPE))

    def _take_beat(self, grant: Grant, rdzv_id: str, fields: dict[str, Any], size: int) -> bool:
        """Take a one-way beat (its frame's payload ``size`` bytes) here when it is plainly valid
        and accepted; False: serve it as any request (:meth:`_serve`: the operation table says
        what is wrong, answered with its tag).

        The hot path of a job's thousands of nodes, a few thousand a second: no request record
        built, no reply, no latency timed; the same service call as the operation table's. A
        beat that came alone in its read is remembered: the same bytes again are taken at once
        (:meth:`_take_same_beat`)."""
        node_id = fields.get("node_id")
        round_ = fields.get("round")
        step = fields.get("step")
        if (
            type(node_id) is not str
            or type(round_) is not int
            or len(fields) != (2 if step is None else 3)  # nothing else (a step of None spelled out included)
            or (step is not None and (type(step) is not int or not 0 <= step < _MAX_STEP))
            or not _ID(node_id)
            or not grant.allows(True, rdzv_id)
        ):
            return False
        args = (rdzv_id, node_id, None if step is None else (round_, step))
        try:
            self._svc.beat(*args)
        except Exception:  # not ready, not the leader, no such job: the table's path answers why
            return False
        self._metrics.beat_taken()
        read = self._read
        if read is not None and len(read) == _HEADER_LEN + size:  # the read was this frame alone
            self._same_beat = (read, args)
        return True

    def _take_same_beat(self, args: tuple[str, str, tuple[int, int] | None]) -> bool:
        """The read is the last beat taken (its service call ``args``), byte for byte: take it
        again; False when the service refuses it now (then the read is served as any, and its
        refusal answered)."""
        try:
            self._svc.beat(*args)
        except Exception:  # (the full path answers why)
            return False
        self._metrics.beat_taken()
        return True

    def _hello(self, tag: int, fields: dict[str, Any]) -> None:
        """Authenticate the connection (see wire: "stream protocol"): a wrong token closes it."""
        token = fields.get("token")
        grant = self._server.tokens.grant(token if type(token) is str else None)
        if grant is None:
            self._metrics.auth_failed("missing" if not token else "wrong")
            self._fail(401, wire.ErrorCode.UNAUTHORIZED, "the token in the hello is not this server's")
            return
        self._grant = grant
        self._same_beat = None  # (taken under the grant it replaces)
        self._limit = self._full_limit
        self._unpack = self._server.unpack_full
        self.table.trust(self)
        reply: dict[str, Any] = {"access": grant.access.value, **_HELLO_REPLY_OPS}
        svc = self._svc
        try:
            svc.pipeline.check_ready()  # a recovering server or a follower's table may be behind
        except RdzvError:
            pass
        else:
            # 0 while no job policy was ever set here: a node starting then fetches none (with
            # thousands starting at once, each fetch was an HTTP connection of its own).
            reply[wire.HELLO_POLICY_VERSION] = svc.machine.policies.version
        self._send(tag, 200, reply)

    def _serve(self, tag: int, op: str, rdzv_id: str, fields: dict[str, Any], then: _Then | None = None) -> None:
        """Answer now, or once the request's append is durable, or from its task if it parks
        (``then``: the watch its answer parks, if it brings an assignment)."""
        assert self._grant is not None  # checked by _request
        started = start_operation(self._svc, self._metrics, self._grant, op, rdzv_id, fields)
        if type(started) is tuple:
            if started[0] != 200 or op not in _ONE_WAY:  # a one-way request is answered only when refused
                self._answer(tag, started[0], started[1], then)
            return
        waiting: asyncio.Future[Any]
        if type(started) is Durable:
            waiting = self._loop.create_future()
            started.append.add_done_callback(functools.partial(self._durable, tag, started, waiting, then))
            waiting.add_done_callback(self._finished)
        else:
            waiting = self._loop.create_task(started)  # type: ignore[arg-type]  # (the coroutine)
            waiting.add_done_callback(functools.partial(self._parked, tag, then))
        self.in_flight.add(waiting)

    def _answer(self, tag: int, status: int, body: dict[str, Any], then: _Then | None) -> None:
        """Send a request's reply; then, if it asked for it (``then``) and the reply is an
        assignment, serve the node's watch of that round as if its frame had just arrived (the
        same path: auth, metrics, the node's beat and its open poll all apply)."""
        self._send(tag, status, body)
        if then is None or status != 200 or not self._replying or self._transport is None:
            return
        assignment = body.get("assignment")
        if type(assignment) is not dict:
            return
        watch_tag, hold, rdzv_id, node_id = then
        if not self._accepting:  # shutting down: no new request is served; the client sends its watch elsewhere
            self._send(watch_tag, 503, wire.error_body(wire.ErrorCode.SHUTTING_DOWN, "the server is shutting down"))
            return
        self._serve(watch_tag, _WATCH, rdzv_id, {"node_id": node_id, "round": assignment["round"], "known": 0, "hold": hold})

    def _durable(
        self, tag: int, durable: Durable, waiting: asyncio.Future[None], then: _Then | None, append: asyncio.Future[None]
    ) -> None:
        """The append a request waited on is done: answer it (unless the connection closed)."""
        if waiting.done():
            return  # cancelled: the connection closed, or the server is closing it
        if append.cancelled():
            waiting.cancel()  # as a task awaiting it would end: nothing to answer
            return
        try:
            status, body = durable.reply()
            self._answer(tag, status, body, then)
        finally:
            waiting.set_result(None)

    def _parked(self, tag: int, then: _Then | None, task: asyncio.Task[Reply]) -> None:
        """A parked request's task ended: answer it (a cancelled one is not answered)."""
        try:
            if not task.cancelled():
                failure = task.exception()
                if failure is None:
                    status, body = task.result()
                    self._answer(tag, status, body, then)
                else:  # (never expected: the operation maps every failure to a reply)
                    log.error("Answering a stream request failed.", exc_info=failure)
        finally:
            self._finished(task)

    def _finished(self, waiting: asyncio.Future[Any]) -> None:
        self.in_flight.discard(waiting)
        if not self.in_flight:
            self.last_active = self.timers.time()  # idle from now, not from the request's arrival
        if self._reading_paused:
            self._parse_buffer()

    def _send(self, tag: int, status: int, body: dict[str, Any]) -> None:
        if self._replying and self._transport is not None:
            packed = _pack_reply([tag, status, body])
            if self._replies is not None:
                self._replies.append(_FRAME_HEADER.pack(len(packed)))
                self._replies.append(packed)
            else:
                self._transport.write(_FRAME_HEADER.pack(len(packed)) + packed)

    def _flush_replies(self) -> None:
        """Write the replies held back while a read's frames were served, in one write."""
        replies, self._replies = self._replies, None
        if replies and self._replying and self._transport is not None:
            self._transport.write(b"".join(replies))

    # -- closing ---------------------------------------------------------------------------

    def _fail(self, status: int, code: wire.ErrorCode, message: str) -> None:
        """A protocol error or refusal: answer with tag 0, stop serving, half-close, drain, close."""
        transport = self._transport
        if transport is None or not self._replying:
            return
        self._flush_replies()  # the answers before the failure go first
        self.connection_lost(None)  # cancels what runs, frees the buffer, counts the connection out
        Closing(self.table, code, message, wire.frame([0, status, wire.error_body(code, message)])).adopt(transport)

    def stop_accepting(self) -> None:
        """Shutdown, first step: serve no new requests; those in flight still answer."""
        self._accepting = False
        self._update_reading()

    def close(self) -> None:
        """Shutdown, last step: cancel what still runs, flush the replies, close."""
        self._accepting = False
        for task in self.in_flight:
            task.cancel()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class StreamServer:
    """The protocol factory of stream connections (``StreamServer()`` -> a new connection)."""

    def __init__(self, svc: Service, metrics: Metrics, table: ConnectionTable, tokens: TokenTable) -> None:
        self.svc = svc
        self.metrics = metrics
        self.table = table
        self.tokens = tokens
        self.connections: set[StreamConnection] = set()
        # wire.unpack with each of a connection's two limits, shared by every connection (they
        # all run on the loop's thread, one request at a time).
        self.unpack_full = wire.Unpack(svc.config.max_body_bytes + FRAME_OVERHEAD)
        self.unpack_stranger = wire.Unpack(PRE_HELLO_FRAME_LIMIT)

    def __call__(self) -> StreamConnection:
        return StreamConnection(self)

    async def shutdown(self, timeout: float) -> None:
        """Close every connection once its requests in flight have answered.

        Call after ``Service.begin_stop()``, which answers parked long-polls at once (503
        ``shutting_down``). Requests still running after ``timeout`` are cancelled, and
        connections whose replies cannot be flushed by then are aborted.
        """
        clock = self.svc.clock
        deadline = clock.monotonic() + timeout
        connections = list(self.connections)
        for conn in connections:
            conn.stop_accepting()
        tasks = [task for conn in connections for task in conn.in_flight]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for conn in connections:
            conn.close()
        closing = [conn.closed for conn in connections if not conn.closed.done()]
        if closing:
            remaining = max(0.0, deadline - clock.monotonic())
            await asyncio.wait(closing, timeout=max(remaining, 0.1))
        for conn in connections:
            if not conn.closed.done():
                conn.abort()
