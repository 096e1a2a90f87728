"""The wire format shared by the server and the client: the one module both import.

What it owns:
- the operation table: every operation the client can ask for, its HTTP route and the
  typed request and response records it carries;
- the stream protocol: the same operations as length-prefixed msgpack frames on a plain
  TCP connection to the same port (see "stream protocol" below);
- (re-exported from :mod:`rdzv_client.record`, the pure-data records core uses too) the
  error codes (stable strings) with their HTTP statuses, the job settings with their
  defaults, and the assignment;
- msgpack framing (``use_bin_type=True``, explicit size limits) and strict validation of
  decoded bodies into frozen dataclasses.

What it must not know: torch, aiohttp, the server's state machines. It imports only the
standard library and msgpack. Nothing is ever pickled.

Rules:
- Keys and values are ``bytes`` on the wire. Identifiers (``rdzv_id``, ``node_id``) are
  short ASCII strings matching :data:`ID_PATTERN`. Text fields are valid Unicode: a lone
  surrogate (which JSON's ``"\\ud800"`` decodes to, and msgpack cannot encode) is refused.
- Durations are seconds as floats (``>= 0``); the server is the only clock, so no
  timestamp ever crosses the wire.
- A write may carry ``rid = [client_id, seq, floor]``: the server applies a given
  (client_id, seq) at most once and answers a retry with the recorded result. ``floor``
  (optional) is the client's lowest seq still awaiting an answer: the server forgets the
  client's results below it and refuses a seq below it as a stale duplicate.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import pathlib
import struct
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union

import msgpack

from .record import HTTP_STATUS as HTTP_STATUS
from .record import Assignment as Assignment
from .record import ErrorCode as ErrorCode
from .record import JobSettings as JobSettings
from .record import WireError as WireError
from .record import CLOSE_CAUSES as CLOSE_CAUSES
from .record import ID_PATTERN as ID_PATTERN
from .record import MAX_ADDR_CHARS as MAX_ADDR_CHARS
from .record import MAX_KEY_BYTES as MAX_KEY_BYTES
from .record import MAX_KEYS_PER_REQUEST as MAX_KEYS_PER_REQUEST
from .record import Command as Command
from .record import Request as Request
from .record import Rid as Rid
from .record import check_id as check_id
from .record import SetRequest as SetRequest
from .record import AddRequest as AddRequest
from .record import CompareSetRequest as CompareSetRequest
from .record import AppendRequest as AppendRequest
from .record import MultiSetRequest as MultiSetRequest
from .record import DeleteKeyRequest as DeleteKeyRequest
from .record import CreateJobRequest as CreateJobRequest
from .record import JoinRequest as JoinRequest
from .record import LeaveRequest as LeaveRequest
from .record import CloseRequest as CloseRequest
from .record import RefuseRequest as RefuseRequest
from .record import CordonRequest as CordonRequest
from .record import UncordonRequest as UncordonRequest
from .record import CORDON_BY as CORDON_BY
from .record import REFUSE_CAUSES as REFUSE_CAUSES
from .record import MAX_REASON_CHARS as MAX_REASON_CHARS
from .record import MAX_CORDON_S as MAX_CORDON_S
from .record import SetPolicyRequest as SetPolicyRequest
from .record import UnsetPolicyRequest as UnsetPolicyRequest
from .record import POLICY_KEYS as POLICY_KEYS
from .record import POLICY_JOB_KEYS as POLICY_JOB_KEYS
from .record import POLICY_NODE_KEYS as POLICY_NODE_KEYS
from .record import bad_policy as bad_policy
from .record import pattern_ok as pattern_ok
from .record import policy_settings as policy_settings
from .record import policy_value as policy_value
from .record import FailureReport as FailureReport
from .record import FailureWire as FailureWire
from .record import WorkerFailure as WorkerFailure
from .record import NO_DETAIL as NO_DETAIL
from .record import signal_name as signal_name
from .record import (
    INLINE_KEY,
    REQUIRED_KEY,
    WIRE_KEY,
    failure_wire,
    key_ok,
    keys_ok,
    nonnegative,
    optional,
    spelled,
    step_ok,
)

CONTENT_TYPE_MSGPACK = "application/msgpack"
CONTENT_TYPE_JSON = "application/json"

# 29400 is torchrun's default rendezvous port, so `--rdzv-endpoint=HOST` alone works.
DEFAULT_PORT = 29400
# The longest a long-poll is held: the server answers by then (proxies and dead peers never
# pin a request forever), and a client asks for no longer (a possibly dead connection is
# noticed no later than this).
DEFAULT_MAX_HOLD = 30.0

MAX_CLIENT_ID_CHARS = 64
# Integers sent for float fields (JSON has one number type) must convert to a finite float.
MAX_FLOAT_INT = 2**1023


# --------------------------------------------------------------------------- credentials

#: Where clients and server look for the bearer token (see rdzv_client.credential).
TOKEN_ENV = "RDZV_TOKEN"
TOKEN_FILE_ENV = "RDZV_TOKEN_FILE"


def default_token_file(env: typing.Mapping[str, str] | None = None) -> pathlib.Path:
    """``$XDG_CONFIG_HOME/rdzv-server/token``, or ``~/.config/rdzv-server/token``: the file the
    server creates on its first start and every client on the same host reads.

    A relative ``XDG_CONFIG_HOME`` is ignored, as the XDG base directory spec requires.
    """
    env = os.environ if env is None else env
    config_home = env.get("XDG_CONFIG_HOME", "")
    base = pathlib.Path(config_home) if config_home and os.path.isabs(config_home) else pathlib.Path.home() / ".config"
    return base / "rdzv-server" / "token"


# --------------------------------------------------------------------------- framing


def pack(obj: Any) -> bytes:
    """Encode a plain object (dicts, lists, str, bytes, numbers, None) as msgpack."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    packed: bytes = packer.pack(obj)  # (a Packer resets itself after a failed pack)
    return packed


# Each thread's Packer: msgpack.packb builds one, with its buffer, per call, which costs about
# as much as encoding a request (the blocking client packs one per call, from many threads).
_packers = threading.local()


# Replies may list many keys (list_keys, multi_get); requests are bounded by MAX_KEYS_PER_REQUEST.
MAX_REPLY_ITEMS = 10_000_000


def unpack(data: bytes, max_bytes: int, *, max_items: int = MAX_KEYS_PER_REQUEST * 2) -> Any:
    """Decode one msgpack object; raise :class:`WireError` on garbage, trailing bytes or size.

    ``max_items`` bounds every array; the server keeps the request default, the client
    decodes replies with :data:`MAX_REPLY_ITEMS`.
    """
    if len(data) > max_bytes:
        raise WireError(f"body of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=max_items,
            max_map_len=64,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"body is not valid msgpack: {exc}") from exc


#: The largest body an :class:`Unpack` takes through its unpacker (larger ones: :func:`unpack`),
#: so that its buffer stays this small: store requests and replies are far smaller.
UNPACKER_BYTES = 64 * 1024


class Unpack:
    """:func:`unpack` with its limits fixed once: ``Unpack(max_bytes, max_items)(data)`` returns
    the same object and raises the same :class:`WireError` as ``unpack(data, max_bytes,
    max_items=max_items)``, at a fraction of the cost: msgpack parses ``unpackb``'s keyword
    limits on every call, which costs several times the decoding of a small frame, where a
    ``msgpack.Unpacker`` holds them. Anything but one whole object with nothing after it
    (truncated, trailing bytes, over a limit, not msgpack) is handed to :func:`unpack` itself,
    so each failure reads the same, and the unpacker is replaced; so is a body over
    :data:`UNPACKER_BYTES`, which would grow the unpacker's buffer for good. Not thread-safe:
    one per thread (or per event loop)."""

    __slots__ = ("_fed", "_max_bytes", "_max_items", "_unpacker")

    def __init__(self, max_bytes: int, max_items: int = MAX_KEYS_PER_REQUEST * 2) -> None:
        self._max_bytes = max_bytes
        self._max_items = max_items
        self._unpacker = self._new()
        self._fed = 0  # bytes fed to this unpacker: what it must have consumed after each object

    def _new(self) -> msgpack.Unpacker:
        limit = self._max_bytes
        return msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_buffer_size=max(1, min(limit, UNPACKER_BYTES)),
            max_bin_len=limit,
            max_str_len=limit,
            max_array_len=self._max_items,
            max_map_len=64,
            max_ext_len=0,
        )

    def __call__(self, data: bytes | memoryview) -> Any:
        if len(data) > UNPACKER_BYTES:
            return unpack(data, self._max_bytes, max_items=self._max_items)  # type: ignore[arg-type]  # (a buffer)
        if len(data) > self._max_bytes:
            raise WireError(f"body of {len(data)} bytes exceeds the limit of {self._max_bytes}")
        unpacker = self._unpacker
        try:
            unpacker.feed(data)
            self._fed += len(data)
            obj = unpacker.unpack()
            whole = unpacker.tell() == self._fed
        except Exception:  # noqa: BLE001 (the reference below raises what unpack raises)
            whole = False
        if whole:
            return obj
        self._unpacker, self._fed = self._new(), 0
        return unpack(data, self._max_bytes, max_items=self._max_items)  # type: ignore[arg-type]  # (a buffer)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        # JSON is for people: show bytes as text; undecodable bytes are escaped, not lost silently.
        return bytes(obj).decode("utf-8", errors="backslashreplace")
    if isinstance(obj, enum.Enum):
        return obj.value
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def dump_json(obj: Any) -> bytes:
    return json.dumps(obj, default=_json_default, separators=(",", ":")).encode()


def load_json(data: bytes, max_bytes: int) -> Any:
    if len(data) > max_bytes:
        raise WireError(f"body of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError(f"body is not valid JSON: {str(exc)[:200]}") from exc


# --------------------------------------------------------------------------- validation

T = TypeVar("T")


def _text_ok(name: str, value: str) -> None:
    # JSON's "\ud800" decodes to a lone surrogate, which msgpack (the log, the replies) cannot encode.
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise WireError(f"field {name!r} is not valid Unicode text: {exc}") from exc


def _as_bytes(name: str, value: object) -> bytes:
    # JSON callers (curl) send text; the client sends bin.
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise WireError(f"field {name!r} is not valid Unicode text: {exc}") from exc
    raise WireError(f"field {name!r} must be bytes or a string, not {type(value).__name__}")


Convert = Callable[[str, object], Any]


def _as_any(name: str, value: object) -> Any:  # only `rid`, checked by _convert_rid before
    return value


def _as_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise WireError(f"field {name!r} must be a string, not {type(value).__name__}")
    _text_ok(name, value)
    return value


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"field {name!r} must be a boolean, not {type(value).__name__}")
    return value


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"field {name!r} must be an integer, not {type(value).__name__}")
    if not -(2**63) <= value < 2**63:
        raise WireError(f"field {name!r} must fit a signed 64-bit integer")
    return value


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"field {name!r} must be a number, not {type(value).__name__}")
    if isinstance(value, int) and not -MAX_FLOAT_INT <= value <= MAX_FLOAT_INT:
        raise WireError(f"field {name!r} is too large for a number of seconds")  # float() would overflow
    if not math.isfinite(value):
        raise WireError(f"field {name!r} must be a finite number")
    return float(value)


_SCALARS: dict[Any, Convert] = {Any: _as_any, bytes: _as_bytes, str: _as_str, bool: _as_bool, int: _as_int, float: _as_float}


def _converter(hint: Any) -> Convert:
    """The checking conversion of a field of type ``hint``: built once per field, when its
    record is first decoded, so a request pays no type introspection."""
    scalar = _SCALARS.get(hint)
    if scalar is not None:
        return scalar
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        (inner,) = [a for a in args if a is not type(None)]
        convert = _converter(inner)
        if type(None) not in args:
            return convert

        def optional(name: str, value: object) -> Any:
            return None if value is None else convert(name, value)

        return optional
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(hint)
        item = _converter(inner)

        def items(name: str, value: object) -> tuple[Any, ...]:
            if not isinstance(value, (list, tuple)):
                raise WireError(f"field {name!r} must be a list, not {type(value).__name__}")
            if len(value) > MAX_KEYS_PER_REQUEST:
                raise WireError(f"field {name!r} names more than {MAX_KEYS_PER_REQUEST} items")
            if item is _as_any:
                return tuple(value)
            return tuple([item(f"{name}[{i}]", v) for i, v in enumerate(value)])

        return items
    raise TypeError(f"unsupported field type {hint!r}")  # a bug in this module, not bad input


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: Any
    convert: Convert
    required: bool


class _NoValue:
    """The as-is type of a field whose every value goes through its converter (no value has this type)."""


def _as_is(hint: Any) -> type:
    """The one type whose values the converter of a field of type ``hint`` returns unchanged,
    tested as ``type(v) is``: the decoder takes such a value without the call (a key's bytes,
    the None of an optional field such as a store request's round)."""
    if hint is bytes or hint is bool:
        return hint
    if typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint):
        return type(None)
    return _NoValue


@dataclasses.dataclass(frozen=True)
class _Schema:
    """A record's wire map, derived once from its declaration: every field in order (the
    fields of an inline record, such as a join's :class:`JobSettings`, spelled in its place),
    and the inline records to regroup them into."""

    fields: dict[str, _Field]
    inline: tuple[tuple[str, type[Any], tuple[str, ...]], ...]
    validates: bool
    names: frozenset[str]
    #: ``fields`` as the decoder reads them: (name, as-is type, convert, required) each.
    steps: tuple[tuple[str, type, Convert, bool], ...]


_schemas: dict[type[Any], _Schema] = {}


def _schema(cls: type[Any]) -> _Schema:
    schema = _schemas.get(cls)
    if schema is None:
        schema = _schemas[cls] = _build_schema(cls)
    return schema


def _build_schema(cls: type[Any]) -> _Schema:
    hints = typing.get_type_hints(cls)
    fields: dict[str, _Field] = {}
    inline: list[tuple[str, type[Any], tuple[str, ...]]] = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get(WIRE_KEY, True):
            continue  # supplied by the caller (a command's rdzv_id: the route or frame names it)
        if f.metadata.get(INLINE_KEY):
            record: type[Any] = hints[f.name]
            inner = _schema(record).fields
            required = f.metadata.get(REQUIRED_KEY, ())
            fields.update({n: dataclasses.replace(g, required=g.required or n in required) for n, g in inner.items()})
            inline.append((f.name, record, tuple(inner)))
            continue
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        convert = _FIELD_CONVERTERS.get(f.name) or _converter(hints[f.name])
        fields[f.name] = _Field(f.name, hints[f.name], convert, not has_default)
    return _Schema(
        fields,
        tuple(inline),
        callable(getattr(cls, "validate", None)),
        frozenset(fields),
        tuple((name, _as_is(f.hint), f.convert, f.required) for name, f in fields.items()),
    )


def wire_fields(cls: type[Any]) -> dict[str, Any]:
    """The fields of record ``cls``'s wire map with their types, in order."""
    return {name: f.hint for name, f in _schema(cls).fields.items()}


def from_mapping(cls: type[T], body: object, **given: Any) -> T:
    """Build the request dataclass ``cls`` from a decoded body, checking every field;
    ``given``: the fields the wire map does not carry (a command's ``rdzv_id``).

    Raises :class:`WireError` on a non-mapping body, an unknown or missing field, a wrong
    type, a negative duration, an oversize key or an illegal id.
    """
    return _decode(cls, body, given)


_MISSING = object()


def _decode(cls: type[T], body: object, given: dict[str, Any]) -> T:
    """The one decoder: the schema's fields in order, each through its converter unless its
    value already has the field's as-is type (:func:`_as_is`; most of a store request: its
    key, its round). One loop read from the schema, not code generated from it, so there is
    one definition of what a body may hold and of each error's text; it costs about what the
    generated decoders it replaced did (docs/architecture.md, "How a body is checked")."""
    schema = _schema(cls)
    if not isinstance(body, dict):
        raise WireError(f"body must be a map, not {type(body).__name__}")
    if not body.keys() <= schema.names:
        unknown = set(body) - schema.names
        raise WireError(f"unknown field(s) {sorted(map(str, unknown))} for {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for name, as_is, convert, required in schema.steps:
        value = body.get(name, _MISSING)
        if value is _MISSING:
            if required:
                raise WireError(f"missing field {name!r} for {cls.__name__}")
        elif type(value) is as_is:
            kwargs[name] = value
        else:
            kwargs[name] = convert(name, value)
    for name, record, names in schema.inline:
        kwargs[name] = record(**{n: kwargs.pop(n) for n in names if n in kwargs})
    obj = cls(**kwargs, **given)
    if schema.validates:
        obj.validate()  # type: ignore[attr-defined]
    return obj


def to_mapping(obj: Any) -> dict[str, Any]:
    """The plain dict of a request or response dataclass, ready for :func:`pack`: the record
    spelled for the wire (:func:`rdzv_client.record.spelled`: an inline record's fields in its
    place, a field added later left out at its default), a tuple as a list, a record as its map."""
    out = spelled(obj, WIRE_KEY)
    cls = type(obj)
    not_plain = _not_plain.get(cls)
    if not_plain is None:
        not_plain = _not_plain[cls] = _fields_not_plain(cls)
    for name in not_plain:
        if name in out:
            out[name] = _plain(out[name])
    return out


#: Per record class, the wire fields :func:`to_mapping` passes through :func:`_plain`.
_not_plain: dict[type[Any], tuple[str, ...]] = {}


def _fields_not_plain(cls: type[Any]) -> tuple[str, ...]:
    """The wire fields of ``cls`` (an inline record's in its place) that may hold a tuple or a record."""
    hints = typing.get_type_hints(cls)
    names: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get(WIRE_KEY, True):
            continue
        if f.metadata.get(INLINE_KEY):
            names += _fields_not_plain(hints[f.name])
        elif not _scalar(hints[f.name]):
            names.append(f.name)
    return tuple(names)


def _plain(v: Any) -> Any:
    """A field's value as :func:`pack` takes it: a tuple as a list, a record as its mapping."""
    if v is None:  # (most often: a request with no rid)
        return v
    if isinstance(v, tuple):
        return [to_mapping(x) if dataclasses.is_dataclass(x) else x for x in v]
    if dataclasses.is_dataclass(v):
        return to_mapping(v)
    return v


# A field of these types is packed as it is (no tuple, no record to convert).
_PACKED_AS_IS = frozenset({bytes, str, int, float, bool, type(None)})


def _scalar(hint: Any) -> bool:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return all(_scalar(a) for a in typing.get_args(hint))
    return hint in _PACKED_AS_IS


# --------------------------------------------------------------------------- requests
#
# The write requests (set, add, ..., join, leave, close) are declared in rdzv_client.record:
# they are also the server's core commands and log records. The reads are declared here.


def _rid_check(rid: tuple[Any, ...] | None) -> None:
    if rid is None:
        return
    shape = "rid must be [client_id: str, seq: int] or [client_id, seq, floor: int]"
    if len(rid) not in (2, 3) or not isinstance(rid[0], str):
        raise WireError(shape)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in rid[1:]):
        raise WireError(shape)
    if not 0 < len(rid[0]) <= MAX_CLIENT_ID_CHARS or not 0 <= rid[1] < 2**63:
        raise WireError(f"rid client_id must be 1..{MAX_CLIENT_ID_CHARS} chars and 0 <= seq < 2**63")
    _text_ok("rid", rid[0])
    if len(rid) == 3 and not 0 <= rid[2] <= rid[1]:
        raise WireError("rid floor must be 0 <= floor <= seq")


def _convert_rid(value: object) -> tuple[Any, ...] | None:
    """A request id as the request keeps it (a tuple), or :class:`WireError`."""
    if type(value) is list and len(value) == 3:  # what every client sends: taken at first sight when plainly well formed
        client_id, seq, floor = value
        if (
            type(client_id) is str and type(seq) is int and type(floor) is int
            and 0 < len(client_id) <= MAX_CLIENT_ID_CHARS and client_id.isascii() and 0 <= floor <= seq < 2**63
        ):  # fmt: skip
            return (client_id, seq, floor)
    return _checked_rid(value)


def _checked_rid(value: object) -> tuple[Any, ...] | None:
    """The definition of a well-formed request id, checked rule by rule."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise WireError("rid must be [client_id, seq] or [client_id, seq, floor]")
    rid = tuple(value)
    _rid_check(rid)
    return rid


# Fields whose check is more than their type: every write's request id (`rid`) has one shape.
# A failure report (a join's or a close's `failure`) is a small map of its own: rdzv_client.record checks it.
_FIELD_CONVERTERS: dict[str, Convert] = {
    "rid": lambda _name, value: _convert_rid(value),
    "failure": lambda _name, value: failure_wire(value),
}


@dataclasses.dataclass(frozen=True)
class GetRequest(Request):
    """Blocking get: the server holds the request up to ``timeout`` (capped) for the key."""

    op: ClassVar[str] = "get"
    key: bytes
    timeout: float = 0.0
    round: int | None = None

    def validate(self) -> None:
        key_ok("key", self.key)
        nonnegative("timeout", self.timeout)


@dataclasses.dataclass(frozen=True)
class MultiGetRequest(Request):
    """Blocking like get: answers when every key exists."""

    op: ClassVar[str] = "multi_get"
    keys: tuple[bytes, ...]
    timeout: float = 0.0
    round: int | None = None

    def validate(self) -> None:
        keys_ok(self.keys)
        nonnegative("timeout", self.timeout)


@dataclasses.dataclass(frozen=True)
class CheckRequest(Request):
    op: ClassVar[str] = "check"
    keys: tuple[bytes, ...]
    round: int | None = None

    def validate(self) -> None:
        keys_ok(self.keys)


@dataclasses.dataclass(frozen=True)
class WaitRequest(Request):
    op: ClassVar[str] = "wait"
    keys: tuple[bytes, ...]
    timeout: float = 0.0
    round: int | None = None

    def validate(self) -> None:
        keys_ok(self.keys)
        nonnegative("timeout", self.timeout)


@dataclasses.dataclass(frozen=True)
class NumKeysRequest(Request):
    op: ClassVar[str] = "num_keys"
    round: int | None = None


@dataclasses.dataclass(frozen=True)
class ListKeysRequest(Request):
    op: ClassVar[str] = "list_keys"
    prefix: bytes = b""
    round: int | None = None


@dataclasses.dataclass(frozen=True)
class AwaitRoundRequest(Request):
    """Long-poll until ``node_id`` is a participant of a complete round numbered >= ``round``."""

    op: ClassVar[str] = "await_round"
    node_id: str
    round: int
    hold: float = 0.0

    def validate(self) -> None:
        check_id("node_id", self.node_id)
        nonnegative("hold", self.hold)


@dataclasses.dataclass(frozen=True)
class WatchRequest(Request):
    """Heartbeat, then long-poll until the node's ``num_nodes_waiting`` differs from ``known``.

    Holding this request open is also the fast liveness signal: when the connection drops
    without a following request within the server's grace, the node is considered dead.
    Held open it is not a heartbeat (a hung process keeps its connection): the request beats
    when it arrives and when it is answered. ``hold=0`` is a plain heartbeat that answers at
    once, without parking (the plug-in sends one every third of the TTL and holds its watch
    up to ``max_hold``; a client that sends no other beats holds it a third of the TTL; a
    server before the beats caps every hold at a third of the TTL). Once a later round is open or
    formed, a watcher that already knows a positive count (it is to re-join) is answered at
    the end of its hold or when the job closes, not at every node that joins the later round.
    """

    op: ClassVar[str] = "watch"
    node_id: str
    round: int
    known: int = -1
    hold: float = 0.0
    #: The node's current training step (``rdzv_client.progress``; None: none reported). Soft
    #: state, as the beat itself: the job's steps over time, never logged.
    step: int | None = optional(None)

    def validate(self) -> None:
        check_id("node_id", self.node_id)
        nonnegative("hold", self.hold)
        step_ok(self.step)


@dataclasses.dataclass(frozen=True)
class BeatRequest(Request):
    """The node's heartbeat, and nothing else: one-way on a stream whose server says so.

    Over a stream connection whose server announced ``beat`` in its hello's ``one_way`` (see
    "stream protocol"), an accepted beat gets no reply at all: a beat only has to reach the
    server, and a reply per beat doubled the system calls on both sides. A refused one (a
    follower's ``not_leader``, ``job_not_found``, ``not_ready``) is answered with its tag,
    as any request, so the client learns of it. Over HTTP, and on a stream to a server that
    did not announce it, it is answered ``{}`` (HTTP) or is an unknown operation (older
    servers): clients send a watch of no hold there instead. Soft state, as the watch's beat:
    never logged. ``step``: the node's current training step, as on a watch.
    """

    op: ClassVar[str] = "beat"
    node_id: str
    round: int
    step: int | None = optional(None)

    def validate(self) -> None:
        check_id("node_id", self.node_id)
        step_ok(self.step)


@dataclasses.dataclass(frozen=True)
class PolicyRequest(Request):
    """What the policies set for the job (which need not exist yet): the same document as
    ``GET /v1/policy?job=ID`` (``{"job", "settings", "sources", "version"}``), as an operation, so
    a node reads it on its stream connection instead of opening an HTTP one for it."""

    op: ClassVar[str] = "policy"


REQUESTS: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        SetRequest,
        GetRequest,
        AddRequest,
        CompareSetRequest,
        AppendRequest,
        MultiGetRequest,
        MultiSetRequest,
        CheckRequest,
        WaitRequest,
        DeleteKeyRequest,
        NumKeysRequest,
        ListKeysRequest,
        CreateJobRequest,
        JoinRequest,
        AwaitRoundRequest,
        WatchRequest,
        BeatRequest,
        LeaveRequest,
        CloseRequest,
        RefuseRequest,
        PolicyRequest,
    )
}


def decode_request(op: str, body: object, rdzv_id: str = "") -> Request:
    """Validate a decoded body as the request of operation ``op`` on job ``rdzv_id`` (raises
    :class:`WireError`). A write request is the core command as it is: ``rdzv_id`` is its job."""
    cls = REQUESTS.get(op)
    if cls is None:
        raise WireError(f"unknown operation {op!r}")
    return _decode(cls, body, {"rdzv_id": rdzv_id} if cls.writes else {})


def op_path(rdzv_id: str, op: str) -> str:
    """The route of an operation: ``/v1/jobs/{rdzv_id}/{op}``."""
    return f"/v1/jobs/{rdzv_id}/{op}"


# --------------------------------------------------------------------------- stream protocol
#
# The same operations without HTTP, on the server's one port (the server tells the two
# apart by the first byte: no HTTP request starts with NUL). It exists for speed: a store
# operation over HTTP costs the server ~0.3 ms of CPU, over a stream a small fraction.
#
#   client -> server   STREAM_PREFACE, once, first on the connection
#   then frames, both ways: a 4-byte unsigned big-endian length L, then L bytes of msgpack
#   request  frame: [tag: int, op: str, rdzv_id: str, fields: map]
#   reply    frame: [tag: int, status: int, body: map]
#
# ``fields`` is the HTTP request body of ``op`` and (status, body) is exactly the HTTP
# status and body of the same request, errors included, so a client interprets both the
# same way. ``tag`` is the client's (0 <= tag < 2**63); a client may pipeline requests and
# the replies come in completion order (a long-poll answers late), matched by tag. A frame
# that decodes but is not a valid request is answered with its tag (0 if none can be read)
# and a 400; a frame longer than the server's body limit, or a wrong preface, is answered
# with tag 0 and the connection is closed. So are the server's limits that refuse a whole
# connection: ``too_many_connections``, ``buffers_full`` (429) and ``request_timeout``
# (408, a frame that stalled after its first byte): a tag-0 frame is the answer to every
# request in flight on that connection. Closing the connection cancels its requests in
# flight, as closing an HTTP connection does (a node's dropped long-poll: see fast death).

#
# Authentication: a server with auth on serves no operation on a stream until the client
# sent a hello frame, ``[tag, "hello", "", {"token": TOKEN}]``, answered ``[tag, 200,
# {"access": "write"|"read"}]``; a wrong or missing token (or an operation before the
# hello) is answered with a tag-0 ``401 unauthorized`` frame and the connection closed. A
# client may pipeline its first request right behind the hello. With auth off a hello is
# answered 200 whatever it carries, so a client may always send one.
#
# One-way requests (issue 29): the hello's reply also lists, under ``one_way``, the operations
# this server takes without answering them when they succeed (``ONE_WAY_OPS``: ``beat``). A
# refused one is answered with its tag and the error, as any request; a client has no waiter
# for it and reads it as "send the next one answered". A client gives every one-way request on a
# connection one tag of their own, and a node's beat is the same frame all round long (unless
# its step moved): the server takes a read that is the same bytes as the last beat it took,
# alone in its read, without decoding it again. A server that lists nothing (every
# server before issue 29: its hello reply is ``{"access"}`` alone) takes none: a client sends
# it a watch of no hold instead of a beat. So an old client (which never sends ``beat``) and
# an old server (which never announces it) both still mix with new ones.
#
# A join that also parks the node's next watch (issue 29): the hello's reply lists, under
# ``then_watch``, the operations that may carry the field ``then_watch: [TAG, HOLD]``
# (``THEN_WATCH_OPS``: ``join`` and ``await_round``). TAG is a tag of the client's, different
# from the request's own; HOLD >= 0. When such a request is answered 200 with an
# ``assignment``, the server at once serves the watch ``[TAG, "watch", rdzv_id, {"node_id":
# the request's, "round": the assignment's, "known": 0, "hold": HOLD}]`` as if it had arrived
# (its answer comes under TAG): a survivor of a re-formation so costs the server the watch's
# answer, the join and the assignment, and no request for its next round's watch. Answered
# otherwise (an error; no assignment yet: the client re-polls with await_round, carrying
# ``then_watch`` again), nothing is parked. A malformed ``then_watch`` answers the request 400
# ``bad_request`` naming the field, and nothing is applied. The field belongs to the stream: a
# server's stream layer takes it out before the operation sees it, and over HTTP (or to a
# server that does not list it) it is an unknown field, refused 400. A client sends it only
# to a server whose hello listed it.

#: Sent first by a stream client; the version is the last byte before CRLF.
STREAM_PREFACE = b"\x00RDZV1\r\n"
#: The stream protocol's authentication frame's op (see above).
HELLO_OP = "hello"
#: The hello reply's field listing the operations the server takes one-way (see above).
HELLO_ONE_WAY = "one_way"
#: The operations this server takes one-way on a stream: answered only when refused.
ONE_WAY_OPS = (BeatRequest.op,)
#: The hello reply's field listing the operations that may carry ``then_watch`` (see above).
HELLO_THEN_WATCH = "then_watch"
#: The request field (stream only) that parks the node's next watch when it is answered with
#: an assignment: ``[TAG, HOLD]`` (see above).
THEN_WATCH = "then_watch"
#: The operations that take ``then_watch`` on a stream.
THEN_WATCH_OPS = (JoinRequest.op, AwaitRoundRequest.op)
FRAME_HEADER = struct.Struct(">I")


def one_way_ops(hello_reply: object) -> frozenset[str]:
    """The operations a server's hello reply says it takes one-way (none from a server before
    them, or from a reply that says nothing readable: the client then sends them answered)."""
    ops = hello_reply.get(HELLO_ONE_WAY) if isinstance(hello_reply, dict) else None
    return frozenset(op for op in ops if isinstance(op, str)) if isinstance(ops, list) else frozenset()


#: The hello reply's field saying the server's job-policy version (``PolicyTable.version``): 0
#: while no job policy was ever set on it, so a node starting has no policy to fetch. Only a
#: server that serves says it (not one recovering, not a follower replica).
HELLO_POLICY_VERSION = "policy_version"


def hello_policy_version(hello_reply: object) -> int | None:
    """The policy version a server's hello reply announced; None when it said none (a server
    before it, one not serving) or nothing readable."""
    version = hello_reply.get(HELLO_POLICY_VERSION) if isinstance(hello_reply, dict) else None
    return version if type(version) is int and version >= 0 else None


def hello_terms(hello_reply: object) -> tuple[frozenset[str], bool, dict[str, Any]]:
    """What a client keeps of a server's hello reply: the operations it takes one-way
    (:func:`one_way_ops`), whether a join may carry ``then_watch`` (:func:`takes_then_watch`),
    and the reply itself ({} when it is no map), for the rest (:func:`hello_policy_version`)."""
    return one_way_ops(hello_reply), takes_then_watch(hello_reply), hello_reply if isinstance(hello_reply, dict) else {}


def takes_then_watch(hello_reply: object) -> bool:
    """Whether a server's hello reply lists every operation of ``THEN_WATCH_OPS`` under
    ``then_watch`` (no server before them does: the client then sends none)."""
    ops = hello_reply.get(HELLO_THEN_WATCH) if isinstance(hello_reply, dict) else None
    return isinstance(ops, list) and all(op in ops for op in THEN_WATCH_OPS)


def then_watch_of(value: object, tag: int) -> tuple[int, float]:
    """The ``(TAG, HOLD)`` of a request's ``then_watch`` field, the request's own tag being
    ``tag`` (raises :class:`WireError` naming the field: see "stream protocol")."""
    if type(value) is list and len(value) == 2:
        watch_tag, hold = value
        if type(watch_tag) is int and 0 <= watch_tag < 2**63 and watch_tag != tag:
            if type(hold) in (int, float) and hold >= 0:
                return watch_tag, float(hold)
    raise WireError(
        f"field {THEN_WATCH!r} must be [tag: int 0..2**63-1 other than the request's, hold: number >= 0], got {value!r:.100}"
    )


def frame(obj: Any) -> bytes:
    """``obj`` as one frame: length header plus msgpack."""
    body = pack(obj)
    return FRAME_HEADER.pack(len(body)) + body


# --------------------------------------------------------------------------- responses
#
# Responses are plain maps; these are their fields by operation (the client reads them):
#   set, append, multi_set, leave, close, create -> {}
#   get        -> {"found": bool, "value": bytes | None}   found=False: not yet, re-poll
#   multi_get  -> {"found": bool, "values": [bytes] | None}
#   add        -> {"value": int}
#   compare_set-> {"value": bytes}                         the value now stored
#   check      -> {"result": bool}
#   wait       -> {"found": bool}
#   delete_key -> {"deleted": bool}
#   num_keys   -> {"count": int}
#   list_keys  -> {"keys": [bytes]}
#   join       -> {"round": int, "assignment": ASSIGNMENT | None}
#   await_round-> {"round": int, "assignment": ASSIGNMENT | None}
#                join and await_round fail with job_closed_in_line (a kind of job_closed) when the
#                job closed while the node was standby or waiting: it was no part of the run
#   watch      -> {"round": int, "state": str, "num_nodes_waiting": int, "closed": bool}
#   beat       -> {}  over HTTP; on a stream that announced it, no reply unless refused
#   hello      -> {"access": "write"|"read", "one_way": [op, ...], "then_watch": [op, ...]}
#                (one_way, then_watch: since issue 29)
# ASSIGNMENT = {"round", "node_rank", "num_nodes", "world_size", "nproc_per_node",
#               "global_rank_start", "master_addr", "master_port", "uniform_nproc"}
#              (node rank 0's addr and the master_port it offered when it joined, 0 if none;
#              uniform_nproc: every node of the round runs the same number of workers)
# errors     -> {"error": ErrorCode, "message": str}


def assignment_from_wire(body: object) -> Assignment:
    """The :class:`Assignment` of a join or await_round reply (raises :class:`WireError`).

    Replies are read leniently: a newer server may add fields an older client ignores."""
    if not isinstance(body, dict):
        raise WireError("assignment must be a map")
    names = _schema(Assignment).fields
    return from_mapping(Assignment, {k: v for k, v in body.items() if k in names})


def error_body(code: ErrorCode, message: str, **extra: Any) -> dict[str, Any]:
    """An error answer's body: ``{"error": CODE, "message": TEXT}`` plus code-specific fields
    (``not_leader`` adds ``leader``: the leader's URL, or ``None`` while none is known)."""
    return {"error": code.value, "message": message, **extra}
