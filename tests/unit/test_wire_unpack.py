"""``wire.Unpack`` (limits fixed once, a msgpack Unpacker kept between calls) is ``wire.unpack``:
the same object for every body, the same WireError (message included) for every refused one,
whatever came before it through the same instance (a truncated body, trailing bytes, garbage,
a body over a limit or over the unpacker's own size)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdzv_client import wire

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMIT = 300
VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=40), st.text(max_size=40),
        st.floats(),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=12,
)


def packed(value: Any) -> bytes:
    return wire.pack(value)


BODIES = st.one_of(
    VALUES.map(packed),
    st.binary(max_size=60),
    st.tuples(VALUES.map(packed), st.integers(min_value=0, max_value=50)).map(lambda t: t[0][: t[1]]),  # truncated
    st.tuples(VALUES.map(packed), st.binary(min_size=1, max_size=4)).map(lambda t: t[0] + t[1]),  # trailing bytes
    st.just(wire.pack(["x" * 400])),  # over the limit
    st.just(wire.pack({str(i): i for i in range(70)})),  # a map over max_map_len
)


def outcome(fn: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "ok", fn(body)
    except wire.WireError as exc:
        return "error", str(exc)


@FUZZ
@given(st.lists(BODIES, min_size=1, max_size=8), st.sampled_from([LIMIT, 2**20]), st.sampled_from([4, 20_000]))
def test_unpack_with_fixed_limits_answers_every_body_as_unpack_does(
    bodies: list[bytes], limit: int, items: int
) -> None:
    fixed = wire.Unpack(limit, items)
    for body in bodies:
        want = outcome(lambda b: wire.unpack(b, limit, max_items=items), body)
        got = outcome(fixed, body)
        assert got == want or (want[0] == got[0] == "ok" and repr(got) == repr(want)), body  # (NaN != NaN)
        assert outcome(fixed, memoryview(body)) == got or repr(outcome(fixed, memoryview(body))) == repr(got)


def test_a_body_over_the_unpackers_size_goes_through_unpack_and_the_next_small_one_still_decodes() -> None:
    fixed = wire.Unpack(1 << 20)
    big = wire.pack([b"v" * (wire.UNPACKER_BYTES + 1)])
    assert fixed(big) == wire.unpack(big, 1 << 20)
    assert fixed(wire.pack([1, "add", "j", {}])) == [1, "add", "j", {}]
