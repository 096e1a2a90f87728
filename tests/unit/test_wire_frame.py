"""The stream protocol's frame codec in memory (rdzv_client.frame): whole, split, truncated and
oversized input, in both directions with wire.frame."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_client import frame, wire

HELLO = [1, wire.HELLO_OP, "", {"token": "t" * 32}]
ADD = [7, "add", "job", {"key": b"k", "amount": 1, "rid": ["c", 1, 1]}]
REPLY = [7, 200, {"value": 3}]
BIG = [2, 200, {"keys": [b"x" * 100] * 1000}]


def frames_out(chunks: list[bytes], limit: int = 1 << 20) -> list[Any]:
    decoder = frame.FrameDecoder(limit)
    out = []
    for chunk in chunks:
        decoder.feed(chunk)
        while (message := decoder.next_frame()) is not None:
            out.append(message)
    return out


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i : i + n] for i in range(0, len(data), n)]


STREAM = wire.frame(HELLO) + wire.frame(ADD) + wire.frame(REPLY) + wire.frame(BIG)


@pytest.mark.parametrize(
    ("case", "chunks", "expected"),
    [
        ("one frame", [wire.frame(ADD)], [ADD]),
        ("several frames in one read", [STREAM], [HELLO, ADD, REPLY, BIG]),
        ("a byte at a time", split_every(STREAM, 1), [HELLO, ADD, REPLY, BIG]),
        ("reads across frame boundaries", split_every(STREAM, 7), [HELLO, ADD, REPLY, BIG]),
        ("a header split in two", [wire.frame(ADD)[:2], wire.frame(ADD)[2:]], [ADD]),
        ("truncated header", [wire.frame(ADD)[:3]], []),
        ("truncated body", [wire.frame(ADD)[:-1]], []),
        ("a whole frame, then a truncated one", [wire.frame(ADD) + wire.frame(REPLY)[:-2]], [ADD]),
        ("nothing", [], []),
    ],
)
def test_frames_come_out_once_whole(case: str, chunks: list[bytes], expected: list[Any]) -> None:
    assert frames_out(chunks) == expected, case


def test_what_a_frame_carries_round_trips_through_wire_frame() -> None:
    for message in (HELLO, ADD, REPLY, BIG, [0, 400, wire.error_body(wire.ErrorCode.BAD_REQUEST, "no")]):
        assert frames_out([wire.frame(message)]) == [message]


def test_a_frame_at_the_limit_is_taken_and_one_byte_more_is_refused_from_its_header_alone() -> None:
    payload = wire.pack(b"x" * 100)
    at_limit = frame.FrameDecoder(len(payload))
    at_limit.feed(wire.frame(b"x" * 100))
    assert at_limit.next_frame() == b"x" * 100
    over = frame.FrameDecoder(len(payload) - 1)
    over.feed(wire.frame(b"x" * 100)[: frame.HEADER_LEN])  # no byte of the body needed
    with pytest.raises(frame.FrameTooLarge, match=f"frame of {len(payload)} bytes exceeds the limit of {len(payload) - 1}"):
        over.next_payload()


def test_an_oversized_frame_is_a_wire_error_naming_its_length_and_the_limit() -> None:
    with pytest.raises(wire.WireError) as caught:
        frame.frame_end(frame.HEADER.pack(2**32 - 1), 0, 1024)
    assert isinstance(caught.value, frame.FrameTooLarge)
    assert (caught.value.length, caught.value.limit) == (2**32 - 1, 1024)


def test_an_empty_frame_is_a_frame_whose_payload_is_not_msgpack() -> None:
    decoder = frame.FrameDecoder(1024)
    decoder.feed(frame.HEADER.pack(0) + frame.HEADER.pack(0))
    assert decoder.next_payload() == b""
    with pytest.raises(wire.WireError, match="not valid msgpack"):
        decoder.next_frame()
    assert decoder.buffered == 0


def test_garbage_in_a_whole_frame_is_a_wire_error_and_the_next_frame_still_reads() -> None:
    decoder = frame.FrameDecoder(1024)
    decoder.feed(frame.HEADER.pack(2) + b"\xc1\xc1" + wire.frame(ADD))
    with pytest.raises(wire.WireError):
        decoder.next_frame()
    assert decoder.next_frame() == ADD


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (b"", frame.HEADER_LEN),
        (frame.HEADER.pack(10)[:1], frame.HEADER_LEN - 1),
        (frame.HEADER.pack(10), 10),
        (frame.HEADER.pack(10) + b"x" * 4, 6),
        (frame.HEADER.pack(10) + b"x" * 10, 0),
        (frame.HEADER.pack(0), 0),
    ],
)
def test_missing_counts_the_bytes_that_complete_the_header_then_the_frame(held: bytes, expected: int) -> None:
    assert frame.missing(held) == expected
    decoder = frame.FrameDecoder(1 << 20)
    decoder.feed(held)
    assert decoder.missing() == expected


def test_frame_end_scans_a_buffer_the_caller_owns_from_any_position() -> None:
    data = bytearray(b"junk" + wire.frame(ADD) + wire.frame(REPLY)[:5])
    end = frame.frame_end(data, 4, 1 << 20)
    assert end == 4 + len(wire.frame(ADD))
    assert wire.unpack(bytes(data[4 + frame.HEADER_LEN : end]), 1 << 20) == ADD
    assert frame.frame_end(data, end, 1 << 20) is None  # the next one is not whole yet
    assert frame.frame_end(memoryview(bytes(data)), 4, 1 << 20) == end  # any buffer
