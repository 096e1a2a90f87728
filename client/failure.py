"""What failed in a node's workers, as a bounded report that can travel to the server.

What it owns: building the report (its records, :class:`WorkerFailure` and
:class:`FailureReport` with their wire map, are declared once in :mod:`rdzv_client.record`,
which the server reads too, and re-exported here): :func:`build_report` (the report from the agent's failures: global rank -> torch's
``ProcessFailure``, duck-typed), and :class:`RendezvousEntries` (why the agent calls
``next_rendezvous()`` again, from what the handler itself answered), which lets a restart
whose failures cannot be found still be reported, as :data:`NO_DETAIL`.

Rules:
- At most :data:`MAX_REPORTED_WORKERS` workers per report, the earliest failure first (torch
  calls it the root cause); ``failed_workers`` counts them all. torch's times are whole
  seconds, so within one second a worker that exited on its own comes before one ended by a
  signal (when one worker fails, the agent stops the others with SIGTERM: their echo), then
  the lower global rank.
- A worker's message is the first non-blank line of the message its ``@record`` error file
  holds (``{"message": {"message": "RuntimeError: ...", "extraInfo": {...}}}``, or a plain
  string), else its exit signature (``exit code 3``, ``SIGKILL``); at most
  :data:`MAX_MESSAGE_CHARS` characters. Nothing else of the error file is read: its
  ``extraInfo`` carries the traceback (``py_callstack``), which can quote anything. No
  environment variable is read. URL credentials, ``token=...``-shaped values and the
  secrets the caller names are masked in the line that is kept.
- Building a report never raises: an entry torch would not make (a rank, exit code or time
  that is not a number) is counted but not listed, and a report with nothing listed says
  :data:`NO_DETAIL`. A restart is never reported as nothing.
- Times on the wire are ages (seconds before the report was sent), never timestamps: the
  server is the only clock, and turns an age into its own time.

What it must not know: torch (importing this module never imports it; the torch side is
:mod:`rdzv_client.torchrun`, the torch boundary), the wire encoding, the server.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Mapping

from .record import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from .record import MAX_REPORTED_WORKERS as MAX_REPORTED_WORKERS
from .record import NO_DETAIL as NO_DETAIL
from .record import FailureReport as FailureReport
from .record import WorkerFailure as WorkerFailure
from .record import exit_signature as exit_signature
from .record import is_int, is_number
from .record import signal_name as signal_name

# torch's error file says "<NONE>" where no message was recorded (its _EMPTY_ERROR_DATA).
_NO_MESSAGE = "<NONE>"
_ELLIPSIS = "…"

_URL_USERINFO = re.compile(r"(?<=://)[^/\s@]+@")
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b([\w.-]*(?:token|passw(?:or)?d|secret|api[_-]?key|credential|authorization)[\w.-]*)"
    r"(\s*[=:]\s*)(?:(?:bearer|basic)\s+)?(\"[^\"]*\"|'[^']*'|\S+)"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)\S+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MASK = "***"


def build_report(failures: object, secrets: Collection[str] = ()) -> FailureReport:
    """The report of the agent's failures: a map of global rank -> an object shaped like
    torch's ``ProcessFailure`` (``local_rank``, ``exitcode``, ``timestamp``,
    ``error_file_data``). ``secrets`` are strings masked wherever a message quotes them (the
    client's token). Never raises; see the module's rules."""
    if not isinstance(failures, Mapping):
        return FailureReport.no_detail()
    found = []
    for rank, failure in list(failures.items()):
        try:
            worker = worker_failure(rank, failure, secrets)
        except Exception:  # an object torch would not make: counted, not listed
            worker = None
        if worker is not None:
            found.append(worker)
    found.sort(key=lambda w: (w.failed_at, w.exit_code < 0, w.global_rank))
    return FailureReport(tuple(found[:MAX_REPORTED_WORKERS]), len(failures))


def worker_failure(global_rank: object, failure: object, secrets: Collection[str] = ()) -> WorkerFailure | None:
    """One worker's failure from torch's ``ProcessFailure`` (duck-typed), or None when a rank,
    the exit code or the time is not a number."""
    local_rank = getattr(failure, "local_rank", None)
    exit_code = getattr(failure, "exitcode", None)
    failed_at = getattr(failure, "timestamp", None)
    if not (is_int(global_rank) and is_int(local_rank) and is_int(exit_code) and is_number(failed_at)):
        return None
    text = error_message(failure)
    line = first_line(text, secrets) if text is not None else ""
    return WorkerFailure(global_rank, local_rank, exit_code, float(failed_at), line or exit_signature(exit_code))


def error_message(failure: object) -> str | None:
    """The message of a worker's ``@record`` error file, as torch read it into
    ``ProcessFailure.error_file_data``: its ``message`` is a map whose own ``message`` is
    ``"RuntimeError: ..."`` (torch's ``ErrorHandler.record_exception``), or a plain string
    (an error file written elsewhere); None without one. ``extraInfo`` is never read."""
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, Mapping) else None
    if isinstance(message, Mapping):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip() or message.strip() == _NO_MESSAGE:
        return None
    return message


def first_line(text: str, secrets: Collection[str] = ()) -> str:
    """The first non-blank line of ``text``, without control characters, credentials masked,
    at most :data:`MAX_MESSAGE_CHARS` characters (cut with an ellipsis)."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = _CONTROL.sub(" ", line)
    for secret in secrets:
        if len(secret) >= 4:  # shorter strings would mask ordinary words
            line = line.replace(secret, _MASK)
    line = _URL_USERINFO.sub(_MASK + "@", line)
    line = _SECRET_ASSIGNMENT.sub(lambda m: m.group(1) + m.group(2) + _MASK, line)
    line = _BEARER.sub(lambda m: m.group(1) + _MASK, line)
    if len(line) > MAX_MESSAGE_CHARS:
        line = line[: MAX_MESSAGE_CHARS - len(_ELLIPSIS)] + _ELLIPSIS
    return line


class RendezvousCause(str, enum.Enum):
    """Why the agent entered ``next_rendezvous()``."""

    FIRST = "first"  # its first round
    MEMBERSHIP = "membership"  # the handler answered num_nodes_waiting() > 0
    WORKERS_FAILED = "workers_failed"


class RendezvousEntries:
    """Why the agent calls ``next_rendezvous()`` again, from the handler's own answers.

    torch's agent re-enters it for two reasons only (``_invoke_run``, 2.4 to 2.15): its
    workers failed with restarts left, or they were healthy and ``num_nodes_waiting()``
    answered more than 0. So an entry after the first with no positive answer since the last
    one is a failure, even where the failure itself cannot be found. Not thread-safe: the
    agent calls both methods from its one monitoring thread.
    """

    def __init__(self) -> None:
        self._entries = 0
        self._waiting_answered = False

    def answered_waiting(self, num_nodes_waiting: int) -> None:
        """Note what ``num_nodes_waiting()`` answered the agent."""
        if num_nodes_waiting > 0:
            self._waiting_answered = True

    def entered(self) -> RendezvousCause:
        """Note an entry into ``next_rendezvous()``; says why the agent came."""
        if self._entries == 0:
            cause = RendezvousCause.FIRST
        elif self._waiting_answered:
            cause = RendezvousCause.MEMBERSHIP
        else:
            cause = RendezvousCause.WORKERS_FAILED
        self._entries += 1
        self._waiting_answered = False
        return cause


def report_for(cause: RendezvousCause, found: FailureReport | None) -> FailureReport | None:
    """What to report for an entry: what was found in the agent, else :meth:`no_detail` when
    the entry can only follow a failure, else None (nothing failed)."""
    if found is not None:
        return found
    return FailureReport.no_detail() if cause is RendezvousCause.WORKERS_FAILED else None

