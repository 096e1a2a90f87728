"""One job's key-value store, with torch ``Store`` semantics on bytes.

What it owns: the keys of one job, split into key spaces: the job-wide space (scope
``None``) and one space per round (scope = round number), so a new round never reads a
stale round's keys and old rounds are dropped whole.

Rules (those of torch's TCPStore, which callers rely on):
- ``add`` keeps integers as decimal ASCII bytes; a missing key counts as 0; a value that
  is not a decimal integer is :class:`NotAnInteger` and changes nothing.
- ``compare_set``: if the key is missing, an empty ``expected`` sets ``desired``; a
  non-empty one leaves the key missing and returns ``expected``. If the key holds
  ``expected`` it becomes ``desired``. The call returns the value stored afterwards
  (or ``expected`` in the missing case).
- A missing key is ``None`` from ``get``: blocking is the server layer's business.
- No value may grow past ``max_value_bytes`` (``append`` included); such a write is
  :class:`ValueTooLarge` and changes nothing.
- Quota: the job holds at most ``max_keys`` keys and ``max_bytes`` bytes of keys plus
  values over all its key spaces; a write that would pass either is :class:`TooManyKeys`
  or :class:`JobStoreFull` and changes nothing. ``keys`` and ``bytes`` are kept exact on
  every change (O(1) per key written), so the check costs nothing to read. Replay runs
  without a quota (``None``): what was logged was accepted once and must apply again.

What it must not know: time, I/O, rendezvous membership.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .error import JobStoreFull, NotAnInteger, TooManyKeys, ValueTooLarge

# TCPStore counters are int64; so are ours, so a result never outgrows the wire.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

class KeyValueStore:
    """The keys of one job."""

    def __init__(self, max_value_bytes: int, max_keys: int | None = None, max_bytes: int | None = None) -> None:
        self.max_value_bytes = max_value_bytes
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.keys = 0  # over every key space
        self.bytes = 0  # len(key) + len(value) over every key space
        self._spaces: dict[int | None, dict[bytes, bytes]] = {}

    # -- reads -------------------------------------------------------------------------

    def get(self, scope: int | None, key: bytes) -> bytes | None:
        space = self._spaces.get(scope)
        return None if space is None else space.get(key)

    def multi_get(self, scope: int | None, keys: Sequence[bytes]) -> list[bytes] | None:
        """All values, or None while any key is missing."""
        space = self._spaces.get(scope, {})
        values = []
        for key in keys:
            value = space.get(key)
            if value is None:
                return None
            values.append(value)
        return values

    def check(self, scope: int | None, keys: Iterable[bytes]) -> bool:
        space = self._spaces.get(scope, {})
        return all(key in space for key in keys)

    def num_keys(self, scope: int | None) -> int:
        return len(self._spaces.get(scope, {}))

    def list_keys(self, scope: int | None, prefix: bytes) -> list[bytes]:
        return sorted(k for k in self._spaces.get(scope, {}) if k.startswith(prefix))

    def total_keys(self) -> int:
        return self.keys

    # -- writes ------------------------------------------------------------------------

    def _space(self, scope: int | None) -> dict[bytes, bytes]:
        space = self._spaces.get(scope)
        if space is None:
            space = self._spaces[scope] = {}
        return space

    def _fits(self, key: bytes, value: bytes) -> None:
        if len(value) > self.max_value_bytes:
            raise ValueTooLarge(
                f"value for key {key[:64]!r} would be {len(value)} bytes; the limit is {self.max_value_bytes} "
                "(raise it with --max-value-bytes)"
            )

    def _quota(self, new_keys: int, new_bytes: int) -> None:
        """Raise unless ``new_keys`` more keys and ``new_bytes`` more bytes fit the job's quota."""
        if self.max_keys is not None and new_keys > 0 and self.keys + new_keys > self.max_keys:
            raise TooManyKeys(
                f"the job holds {self.keys} keys and this write adds {new_keys}; the limit is {self.max_keys} "
                "keys per job (delete keys you no longer need, or raise --max-keys-per-job)"
            )
        if self.max_bytes is not None and new_bytes > 0 and self.bytes + new_bytes > self.max_bytes:
            raise JobStoreFull(
                f"the job holds {self.bytes} bytes of keys and values and this write adds {new_bytes}; the limit "
                f"is {self.max_bytes} bytes per job (delete keys you no longer need, or raise --max-job-bytes)"
            )

    def _put(self, scope: int | None, key: bytes, value: bytes) -> None:
        """Store one checked value, keeping ``keys`` and ``bytes`` exact."""
        space = self._space(scope)
        old = space.get(key)
        if old is None:
            self.keys += 1
            self.bytes += len(key) + len(value)
        else:
            self.bytes += len(value) - len(old)
        space[key] = value

    def _change(self, scope: int | None, key: bytes, value: bytes) -> None:
        """Check the value's size and the quota, then store it."""
        self._replace(scope, key, self.get(scope, key), value)

    def _replace(self, scope: int | None, key: bytes, old: bytes | None, value: bytes) -> None:
        """:meth:`_change` of a key whose value the caller has just read (``old``; None: missing)."""
        self._fits(key, value)
        self._quota(old is None, len(value) + (len(key) if old is None else -len(old)))
        self._put(scope, key, value)

    def set(self, scope: int | None, key: bytes, value: bytes) -> None:
        self._change(scope, key, value)

    def put_decided(self, scope: int | None, key: bytes, value: bytes) -> None:
        """A write the server decides on its own, inside a command that has changed other state
        already (the release of torch's exit barrier, rule 9 of core/rendezvous.py): never
        refused, as a refusal could not undo the rest. The quota bounds what clients write;
        this is one short key per formed round at most."""
        self._put(scope, key, value)

    def multi_set(self, scope: int | None, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        latest = dict(zip(keys, values))  # a key named twice keeps its last value, as dict updates do
        new_keys = new_bytes = 0
        for key, value in latest.items():
            self._fits(key, value)
            old = self.get(scope, key)
            new_keys += old is None
            new_bytes += len(value) + (len(key) if old is None else -len(old))
        self._quota(new_keys, new_bytes)
        for key, value in latest.items():
            self._put(scope, key, value)

    def add(self, scope: int | None, key: bytes, amount: int) -> int:
        old = self.get(scope, key)
        current = b"0" if old is None else old
        try:
            number = int(current.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise NotAnInteger(f"add on key {key[:64]!r}: its value {current[:32]!r} is not an integer") from None
        number += amount
        if not INT64_MIN <= number <= INT64_MAX:
            raise NotAnInteger(f"add on key {key[:64]!r}: the result {number} does not fit a signed 64-bit integer")
        self._replace(scope, key, old, str(number).encode("ascii"))
        return number

    def compare_set(self, scope: int | None, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self.get(scope, key)
        if current is None and expected:
            return expected
        if current is None or current == expected:
            self._replace(scope, key, current, desired)
            return desired
        return current

    def append(self, scope: int | None, key: bytes, value: bytes) -> None:
        existing = self.get(scope, key)
        combined = value if existing is None else existing + value
        self._change(scope, key, combined)

    def delete_key(self, scope: int | None, key: bytes) -> bool:
        space = self._spaces.get(scope)
        if space is None or key not in space:
            return False
        self.keys -= 1
        self.bytes -= len(key) + len(space.pop(key))
        return True

    def drop_rounds_before(self, round_: int) -> None:
        """Forget every round key space numbered below ``round_`` (the job space stays)."""
        for scope in [s for s in self._spaces if s is not None and s < round_]:
            space = self._spaces.pop(scope)
            self.keys -= len(space)
            self.bytes -= sum(len(k) + len(v) for k, v in space.items())

    # -- snapshot ----------------------------------------------------------------------

    def to_snapshot(self) -> list[list[object]]:
        return [[scope, list(space.items())] for scope, space in self._spaces.items()]

    @classmethod
    def from_snapshot(cls, data: list[list[object]], max_value_bytes: int) -> KeyValueStore:
        store = cls(max_value_bytes)
        for scope, items in data:
            assert scope is None or isinstance(scope, int)
            assert isinstance(items, list)
            space = store._spaces[scope] = {bytes(k): bytes(v) for k, v in items}
            store.keys += len(space)
            store.bytes += sum(len(k) + len(v) for k, v in space.items())
        return store
