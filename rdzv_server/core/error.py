"""The server's error tree: each class carries its stable wire code and HTTP status.

Core raises these; the API renders them as ``{"error": code, "message": text}`` with
``status``. The codes are the strings of ``rdzv_client.wire.ErrorCode`` (core may not
import the wire module; a test checks the two agree). Anything that is not a
:class:`RdzvError` is a bug and becomes a 500 ``internal`` whose traceback stays in the log.
"""

from __future__ import annotations


class RdzvError(Exception):
    """Base of every error a client can cause or observe."""

    code = "internal"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(RdzvError):
    code = "bad_request"
    status = 400


class ValueTooLarge(RdzvError):
    code = "value_too_large"
    status = 413


class JobNotFound(RdzvError):
    code = "job_not_found"
    status = 404


class NodeNotFound(RdzvError):
    code = "node_not_found"
    status = 404


class SettingsConflict(RdzvError):
    code = "settings_conflict"
    status = 409


class NotAnInteger(RdzvError):
    code = "not_an_integer"
    status = 409


class JobClosed(RdzvError):
    code = "job_closed"
    status = 410


class JobClosedInLine(JobClosed):
    """The job closed while the node was standby or waiting for a round: it was no part of the
    run that ended, and its agent should exit gracefully (torch's RendezvousGracefulExitError)."""

    code = "job_closed_in_line"
    status = 410


class JoinTimeout(RdzvError):
    code = "join_timeout"
    status = 408


# Limits (README "Limits"): each refuses the request and changes nothing.


class TooManyJobs(RdzvError):
    code = "too_many_jobs"
    status = 429


class TooManyKeys(RdzvError):
    code = "too_many_keys"
    status = 429


class JobStoreFull(RdzvError):
    code = "job_store_full"
    status = 413


class TooManySessions(RdzvError):
    code = "too_many_sessions"
    status = 429


class SessionFull(RdzvError):
    code = "session_full"
    status = 429


class RecordTooLarge(RdzvError):
    """The write's log record is larger than the log takes (raised by the service before it
    applies the command, so nothing changed)."""

    code = "record_too_large"
    status = 413


class LogQueueFull(RdzvError):
    """The log's queue of records waiting to be written is at its bound (raised by the
    service before it applies the command): busy, retry shortly."""

    code = "log_queue_full"
    status = 503


class LogFailed(RdzvError):
    """The server's own log failed a write: it acknowledges nothing more and stops (raised
    by the service; a replica answers ``not_leader`` instead, and another replica leads)."""

    code = "log_failed"
    status = 503


class Forbidden(RdzvError):
    """The caller's token does not cover this request (a read-only token, another job)."""

    code = "forbidden"
    status = 403


class NotReady(RdzvError):
    """The server is still recovering its log (raised by the service, not by core)."""

    code = "not_ready"
    status = 503


class NotLeader(RdzvError):
    """This replica follows; only the leader serves operations (raised by the service).

    ``leader`` is the leader's advertised URL, ``None`` while no replica leads.
    """

    code = "not_leader"
    status = 503

    def __init__(self, message: str, leader: str | None) -> None:
        super().__init__(message)
        self.leader = leader


class ShuttingDown(RdzvError):
    """The server is draining for shutdown; clients retry after the restart."""

    code = "shutting_down"
    status = 503


class IllegalTransition(Exception):
    """A state machine was asked for a transition its table does not allow: a server bug."""
