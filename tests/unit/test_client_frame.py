"""The one blocking frame read loop (rdzv_client.frame: FrameDecoder.receive, receive_one),
driven in memory by a scripted ``recv``: how many reads a frame takes, what is left behind,
and what a truncated, oversized or over-long stream raises."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_client import frame, wire

REPLY = [7, 200, {"value": 3}]
NEXT = [8, 200, {"value": 4}]


class Script:
    """A stream's ``recv`` that hands out ``chunks`` in turn (each at most ``n`` bytes, the
    rest of a chunk kept for the next read), then ``b""``; it records the sizes asked for."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = [c for c in chunks if c]
        self.asked: list[int] = []

    def recv(self, n: int) -> bytes:
        self.asked.append(n)
        if not self.chunks:
            return b""
        chunk = self.chunks.pop(0)
        if len(chunk) > n:
            self.chunks.insert(0, chunk[n:])
            chunk = chunk[:n]
        return chunk


def message(payload: bytes) -> Any:
    return wire.unpack(payload, 1 << 20)


def test_a_reply_that_arrives_whole_is_taken_from_one_read() -> None:
    stream = Script(wire.frame(REPLY))
    assert message(frame.receive_one(stream.recv, 1 << 20)) == REPLY
    assert stream.asked == [frame.READ_SIZE]


@pytest.mark.parametrize("cuts", [(2,), (4,), (9,), (2, 7), (1, 2, 3, 4, 5)])
def test_a_reply_in_pieces_is_read_to_its_end_and_no_further(cuts: tuple[int, ...]) -> None:
    data = wire.frame(REPLY)
    bounds = [0, *cuts, len(data)]
    stream = Script(*(data[a:b] for a, b in zip(bounds, bounds[1:])), wire.frame(NEXT))
    assert message(frame.receive_one(stream.recv, 1 << 20)) == REPLY
    assert stream.chunks == [wire.frame(NEXT)]  # the next frame is still on the stream


def test_bytes_behind_a_frame_nothing_may_follow_are_refused() -> None:
    with pytest.raises(frame.TrailingBytes):
        frame.receive_one(Script(wire.frame(REPLY) + b"\x00").recv, 1 << 20)


def test_a_stream_that_ends_before_its_frame_is_whole_raises_eof() -> None:
    data = wire.frame(REPLY)
    for stream in (Script(), Script(data[:3]), Script(data[:-1])):
        with pytest.raises(EOFError):
            frame.receive_one(stream.recv, 1 << 20)


def test_a_frame_over_the_limit_is_refused_from_its_header() -> None:
    data = wire.frame(REPLY)
    with pytest.raises(frame.FrameTooLarge):
        frame.receive_one(Script(data).recv, len(data) - frame.HEADER_LEN - 1)
    decoder = frame.FrameDecoder(len(data) - frame.HEADER_LEN - 1)
    stream = Script(data[:frame.HEADER_LEN], data[frame.HEADER_LEN:])
    with pytest.raises(frame.FrameTooLarge):
        decoder.receive(stream.recv)
    assert stream.chunks == [data[frame.HEADER_LEN:]]  # no byte of the body was read


def test_a_decoder_hands_out_buffered_frames_before_it_reads_again() -> None:
    stream = Script(wire.frame(REPLY) + wire.frame(NEXT) + wire.frame(REPLY)[:5], wire.frame(REPLY)[5:])
    decoder = frame.FrameDecoder(1 << 20)
    assert [message(decoder.receive(stream.recv)) for _ in range(3)] == [REPLY, NEXT, REPLY]
    assert len(stream.asked) == 2  # the second frame came from the first read's buffer
    assert decoder.buffered == 0
    with pytest.raises(EOFError):
        decoder.receive(stream.recv)


def test_a_large_frame_is_read_in_pieces_of_at_most_max_read() -> None:
    big = [1, 200, {"v": b"x" * (3 * frame.MAX_READ)}]
    stream = Script(wire.frame(big))
    decoder = frame.FrameDecoder(1 << 24)
    assert message_big(decoder.receive(stream.recv)) == big
    assert max(stream.asked) <= frame.MAX_READ


def message_big(payload: bytes) -> Any:
    return wire.unpack(payload, 1 << 24)
