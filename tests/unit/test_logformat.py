"""The server log's formats: a JSON line per record with the structured fields a call passes,
an exception as one string field; text stays what a person reads."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest

from rdzv_server import logformat
from rdzv_server.config import LOG_FORMATS, ConfigError, ServerConfig


def record(msg: str, *args: object, extra: dict[str, object] | None = None, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("the disk is gone")
        except RuntimeError:
            exc_info = sys.exc_info()
    made = logging.getLogger("rdzv_server.service").makeRecord(
        "rdzv_server.service", logging.WARNING, __file__, 1, msg, args, exc_info, extra=extra
    )
    made.created = 1_700_000_000.25  # a fixed instant: 2023-11-14T22:13:20.250Z
    return made


def test_a_json_line_has_time_level_logger_and_the_formatted_message() -> None:
    line = logformat.formatter("json").format(record("Job %s collected after its TTL.", "j1"))
    assert json.loads(line) == {
        "time": "2023-11-14T22:13:20.250Z",
        "level": "WARNING",
        "logger": "rdzv_server.service",
        "message": "Job j1 collected after its TTL.",
    }


def test_the_structured_fields_a_call_passes_are_top_level_fields() -> None:
    extra = {"job": "j1", "node": "n-7", "round": 3, "cause": "connection_closed", "unrelated": "x"}
    doc = json.loads(logformat.formatter("json").format(record("Node n-7 died.", extra=extra)))
    assert (doc["job"], doc["node"], doc["round"], doc["cause"]) == ("j1", "n-7", 3, "connection_closed")
    assert "unrelated" not in doc  # only the documented fields: a pipeline's schema stays fixed


def test_an_exception_is_one_traceback_field_and_the_record_stays_one_line() -> None:
    line = logformat.formatter("json").format(record("Writing a snapshot failed.", exc=True))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["message"] == "Writing a snapshot failed."
    assert doc["traceback"].startswith("Traceback (most recent call last):")
    assert doc["traceback"].rstrip().endswith("RuntimeError: the disk is gone")


def test_a_value_json_cannot_encode_does_not_lose_the_record() -> None:
    doc = json.loads(logformat.formatter("json").format(record("odd %s", object(), extra={"node": b"\xff"})))
    assert doc["message"].startswith("odd <object object") and doc["node"] == "b'\\xff'"


def test_text_is_the_default_and_keeps_its_one_line_layout() -> None:
    assert ServerConfig().log_format == "text"
    line = logformat.formatter("text").format(record("Job %s collected.", "j1", extra={"job": "j1"}))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING rdzv_server.service: Job j1 collected\.", line)


def test_an_unknown_format_is_refused_by_the_config_and_the_formatter() -> None:
    assert LOG_FORMATS == ("text", "json")
    with pytest.raises(ConfigError, match="--log-format must be one of text, json"):
        ServerConfig(log_format="xml")
    with pytest.raises(ValueError):
        logformat.formatter("xml")


def test_the_flag_and_its_environment_variable_pick_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    from rdzv_server import cli

    monkeypatch.delenv("RDZV_LOG_FORMAT", raising=False)
    assert cli.parse(["--memory"]).log_format == "text"
    assert cli.parse(["--memory", "--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("RDZV_LOG_FORMAT", "json")
    assert cli.parse(["--memory"]).log_format == "json"
    assert cli.parse(["--memory", "--log-format", "text"]).log_format == "text"
