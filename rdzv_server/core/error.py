"""The server's error tree: each class carries its stable wire code, and with it its HTTP status.

Core raises these; the API renders them as ``{"error": code, "message": text}`` with
``status``. The codes are :class:`rdzv_client.record.ErrorCode`'s, and each class's status is
that code's one entry in :data:`rdzv_client.record.HTTP_STATUS` (the record module is pure
data, the one module outside core that core imports). Anything that is not a
:class:`RdzvError` is a bug and becomes a 500 ``internal`` whose traceback stays in the log.
"""

from __future__ import annotations

from rdzv_client.record import HTTP_STATUS, ErrorCode


class RdzvError(Exception):
    """Base of every error a client can cause or observe."""

    code: str = ErrorCode.INTERNAL.value
    status: int = HTTP_STATUS[ErrorCode.INTERNAL]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls.status = HTTP_STATUS[ErrorCode(cls.code)]  # a code's status is declared once, in its table

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(RdzvError):
    code = ErrorCode.BAD_REQUEST.value


class ValueTooLarge(RdzvError):
    code = ErrorCode.VALUE_TOO_LARGE.value


class JobNotFound(RdzvError):
    code = ErrorCode.JOB_NOT_FOUND.value


class NodeNotFound(RdzvError):
    code = ErrorCode.NODE_NOT_FOUND.value


class NoSuchPolicy(RdzvError):
    """No policy has the pattern an unset or a read names."""

    code = ErrorCode.NO_SUCH_POLICY.value


class SettingsConflict(RdzvError):
    code = ErrorCode.SETTINGS_CONFLICT.value


class NotAnInteger(RdzvError):
    code = ErrorCode.NOT_AN_INTEGER.value


class JobClosed(RdzvError):
    code = ErrorCode.JOB_CLOSED.value


class JobClosedInLine(JobClosed):
    """The job closed while the node was standby or waiting for a round: it was no part of the
    run that ended, and its agent should exit gracefully (torch's RendezvousGracefulExitError)."""

    code = ErrorCode.JOB_CLOSED_IN_LINE.value


class HostCordoned(RdzvError):
    """The joining node's host is cordoned: the message names the cordon and its reason."""

    code = ErrorCode.HOST_CORDONED.value


class JoinTimeout(RdzvError):
    code = ErrorCode.JOIN_TIMEOUT.value


# Limits (README "Limits"): each refuses the request and changes nothing.


class TooManyJobs(RdzvError):
    code = ErrorCode.TOO_MANY_JOBS.value


class TooManyKeys(RdzvError):
    code = ErrorCode.TOO_MANY_KEYS.value


class JobStoreFull(RdzvError):
    code = ErrorCode.JOB_STORE_FULL.value


class TooManySessions(RdzvError):
    code = ErrorCode.TOO_MANY_SESSIONS.value


class SessionFull(RdzvError):
    code = ErrorCode.SESSION_FULL.value


class RecordTooLarge(RdzvError):
    """The write's log record is larger than the log takes (raised by the service before it
    applies the command, so nothing changed)."""

    code = ErrorCode.RECORD_TOO_LARGE.value


class LogQueueFull(RdzvError):
    """The log's queue of records waiting to be written is at its bound (raised by the
    service before it applies the command): busy, retry shortly."""

    code = ErrorCode.LOG_QUEUE_FULL.value


class LogFailed(RdzvError):
    """The server's own log failed a write: it acknowledges nothing more and stops (raised
    by the service; a replica answers ``not_leader`` instead, and another replica leads)."""

    code = ErrorCode.LOG_FAILED.value


class Forbidden(RdzvError):
    """The caller's token does not cover this request (a read-only token, another job)."""

    code = ErrorCode.FORBIDDEN.value


class NotReady(RdzvError):
    """The server is still recovering its log (raised by the service, not by core)."""

    code = ErrorCode.NOT_READY.value


class NotLeader(RdzvError):
    """This replica follows; only the leader serves operations (raised by the service).

    ``leader`` is the leader's advertised URL, ``None`` while no replica leads.
    """

    code = ErrorCode.NOT_LEADER.value

    def __init__(self, message: str, leader: str | None) -> None:
        super().__init__(message)
        self.leader = leader


class ShuttingDown(RdzvError):
    """The server is draining for shutdown; clients retry after the restart."""

    code = ErrorCode.SHUTTING_DOWN.value


class IllegalTransition(Exception):
    """A state machine was asked for a transition its table does not allow: a server bug."""


class IllegalNodeTransition(IllegalTransition):
    """A node was asked for a role change that the node table (``rendezvous._NODE_TRANSITIONS``)
    does not allow: a server bug, never a client's fault."""
