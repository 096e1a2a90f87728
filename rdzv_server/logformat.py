"""The server log's two formats: ``text`` for a person at a terminal, ``json`` for a log pipeline.

What it owns: how one log record becomes one line. JSON lines carry ``time`` (ISO 8601, UTC),
``level``, ``logger`` and ``message``, plus the structured fields a log call passes in
``extra={"job": ..., "node": ..., "round": ..., "cause": ...}`` so an operator can filter by
job, node or cause; an exception travels as one ``traceback`` string field, so a record is
always exactly one line (``json.dumps`` escapes the newlines).

What it must not know: where records go (stderr, set up by ``server.run``), the service, HTTP.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

# The structured fields a log call may pass in ``extra``; the vocabulary of DESIGN.md.
STRUCTURED_FIELDS = ("job", "node", "round", "cause")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, tz=timezone.utc)
        line: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in STRUCTURED_FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                line[field] = value
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["traceback"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # default=str: an odd value in ``extra`` must not lose the record.
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter for ``--log-format`` (``text`` or ``json``, as config.LOG_FORMATS).

    Raises ValueError for any other name."""
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    if log_format == "json":
        return JsonLineFormatter()
    raise ValueError(f"unknown log format {log_format!r}: use text or json")
