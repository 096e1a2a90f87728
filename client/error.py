"""The client's error tree, and the one table that maps wire error codes onto it.

What it owns: every exception class the client raises on purpose, and
:func:`error_from_body`, the single place where a server's ``{"error", "message"}``
answer becomes one of them.

What it must not know: HTTP libraries, retries, torch. The mapping onto torch's
rendezvous errors belongs to the client's torch module; this module only says *why* a
call failed.

The tree::

    RdzvError                       every error below; .code (wire code or None), .message
    ├── RdzvConnectionError         no endpoint answered within the retry budget
    ├── RdzvTimeoutError            a blocking call's own deadline passed (also a TimeoutError)
    │   └── JoinTimeoutError        the job's join_timeout passed before a round formed (408)
    ├── JobClosedError              the job was closed (410)
    │   └── JobClosedInLineError    ... while this node was standby or waiting: exit gracefully (410)
    ├── BadRequestError             the request is invalid; fix the call, do not retry (4xx)
    ├── UnauthorizedError           the server wants credentials this client did not send (401)
    ├── NotFoundError               no such job, node or route (404)
    ├── ConflictError               the request contradicts stored state (409)
    ├── HostCordonedError           this node's host is cordoned; the message names the cordon (403)
    ├── LimitError                  a server limit refused the request; nothing changed (429, 413; 503 log_queue_full)
    └── ServerError                 the server failed, or answered something malformed (5xx)
        └── NotLeaderError          a follower replica answered; .leader is the leader's URL (503)
"""

from __future__ import annotations

from collections.abc import Mapping

from .record import ErrorCode


class RdzvError(Exception):
    """Base of every error the client raises on purpose.

    ``code`` is the server's wire error code when the server sent one, else ``None``
    (the failure happened on this side: a timeout, an unreachable server).
    """

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        if self.code is None:
            return self.message
        return f"{self.message} ({self.code.value})"


class RdzvConnectionError(RdzvError):
    """No endpoint could be reached (or stayed not ready) within the client's retry budget."""


class RdzvTimeoutError(RdzvError, TimeoutError):
    """A blocking call (get, multi_get, wait, join) ran out of its own ``timeout``."""


class JoinTimeoutError(RdzvTimeoutError):
    """The job's ``join_timeout`` passed before a round with this node formed."""


class JobClosedError(RdzvError):
    """The job is closed: no new rounds form and joins fail."""


class JobClosedInLineError(JobClosedError):
    """The job closed while this node was still in line (standby or waiting) for a round.

    The node was no part of the run that ended: nothing failed, and a launcher should let
    it exit gracefully (the torchrun handler raises torch's ``RendezvousGracefulExitError``).
    """


class BadRequestError(RdzvError):
    """The request itself is invalid (an id, a key, a size, a media type); retrying cannot help."""


class UnauthorizedError(RdzvError):
    """The server requires credentials this client did not present (401 ``unauthorized``),
    or the token presented does not allow this request (403 ``forbidden``: a read-only token)."""


class NotFoundError(RdzvError):
    """The job, the node or the route does not exist."""


class ConflictError(RdzvError):
    """The request contradicts stored state: other job settings, a non-integer counter."""


class HostCordonedError(RdzvError):
    """This node's host is cordoned (``rdzvctl cordon``, or quarantined by the server for
    flapping): no job admits it until it is uncordoned. The message names the cordon and its
    reason. Retrying cannot help."""


class LimitError(RdzvError):
    """A server limit (connections, buffered bytes, jobs, keys, sessions, the log's queue) refused the request.

    Nothing changed on the server. Connection, buffer and log-queue limits are transient (the
    client retries them within its budget); the others need the operator to raise the limit or the
    caller to store less.
    """


class ClientClosedError(RdzvError):
    """The client was closed while this call was in flight (or before it)."""


class ServerError(RdzvError):
    """The server failed (5xx) or answered something this client cannot read."""


class NotLeaderError(ServerError):
    """A follower replica of a replicated cluster answered: only the leader serves operations.

    ``leader`` is the leader's URL as the follower knows it (``None`` during an election).
    The client retries at the leader with the same request id, so the write applies once.
    """

    def __init__(self, message: str, *, code: ErrorCode | None = None, leader: str | None = None) -> None:
        super().__init__(message, code=code)
        self.leader = leader


# One row per wire code. A test checks that every ErrorCode has a row.
ERROR_CLASSES: dict[ErrorCode, type[RdzvError]] = {
    ErrorCode.BAD_REQUEST: BadRequestError,
    ErrorCode.INVALID_ID: BadRequestError,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: BadRequestError,
    ErrorCode.BODY_TOO_LARGE: BadRequestError,
    ErrorCode.VALUE_TOO_LARGE: BadRequestError,
    ErrorCode.METHOD_NOT_ALLOWED: BadRequestError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.JOB_NOT_FOUND: NotFoundError,
    ErrorCode.NODE_NOT_FOUND: NotFoundError,
    ErrorCode.SETTINGS_CONFLICT: ConflictError,
    ErrorCode.NOT_AN_INTEGER: ConflictError,
    ErrorCode.JOB_CLOSED: JobClosedError,
    ErrorCode.JOB_CLOSED_IN_LINE: JobClosedInLineError,
    ErrorCode.JOIN_TIMEOUT: JoinTimeoutError,
    ErrorCode.UNAUTHORIZED: UnauthorizedError,
    ErrorCode.FORBIDDEN: UnauthorizedError,
    ErrorCode.NOT_READY: ServerError,
    ErrorCode.SHUTTING_DOWN: ServerError,
    ErrorCode.NOT_LEADER: NotLeaderError,
    ErrorCode.INTERNAL: ServerError,
    ErrorCode.HEADERS_TOO_LARGE: BadRequestError,
    ErrorCode.EXPECTATION_FAILED: BadRequestError,
    ErrorCode.REQUEST_TIMEOUT: BadRequestError,
    ErrorCode.HOST_NOT_ALLOWED: BadRequestError,
    ErrorCode.TOO_MANY_CONNECTIONS: LimitError,
    ErrorCode.BUFFERS_FULL: LimitError,
    ErrorCode.TOO_MANY_JOBS: LimitError,
    ErrorCode.TOO_MANY_KEYS: LimitError,
    ErrorCode.JOB_STORE_FULL: LimitError,
    ErrorCode.TOO_MANY_SESSIONS: LimitError,
    ErrorCode.SESSION_FULL: LimitError,
    ErrorCode.RECORD_TOO_LARGE: BadRequestError,
    ErrorCode.LOG_QUEUE_FULL: LimitError,
    ErrorCode.LOG_FAILED: ServerError,
    ErrorCode.HOST_CORDONED: HostCordonedError,
    ErrorCode.BAD_POLICY: BadRequestError,
    ErrorCode.NO_SUCH_POLICY: NotFoundError,
}


def _class_for_status(status: int) -> type[RdzvError]:
    # Only for codes this client does not know (a newer server, or a proxy in between).
    if status in (401, 403):
        return UnauthorizedError
    if status == 404:
        return NotFoundError
    if status == 409:
        return ConflictError
    if status == 410:
        return JobClosedError
    if status == 429:
        return LimitError
    if 400 <= status < 500:
        return BadRequestError
    if status >= 500:
        return ServerError
    return RdzvError


def error_from_body(status: int, body: object) -> RdzvError:
    """The error a non-2xx answer stands for; never raises.

    ``body`` is the decoded error body, ideally ``{"error": CODE, "message": TEXT}``;
    anything else (a proxy's HTML page, garbage) still yields an error chosen by status.
    """
    raw_code: object = None
    message: object = None
    if isinstance(body, Mapping):
        raw_code = body.get("error")
        message = body.get("message")
    try:
        code: ErrorCode | None = ErrorCode(raw_code) if isinstance(raw_code, str) else None
    except ValueError:
        code = None
    if not isinstance(message, str) or not message:
        message = f"the server answered HTTP {status}"
    if code is None and isinstance(raw_code, str):
        message = f"{message} (unknown error code {raw_code!r})"
    cls = ERROR_CLASSES[code] if code is not None else _class_for_status(status)
    if cls is NotLeaderError:
        leader = body.get("leader") if isinstance(body, Mapping) else None
        return NotLeaderError(message, code=code, leader=leader if isinstance(leader, str) and leader else None)
    return cls(message, code=code)
