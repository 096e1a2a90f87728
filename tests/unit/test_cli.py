"""`rdzv-server` flags and their RDZV_* environment variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdzv_server.cli import parse
from rdzv_server.config import ConfigError, ServerConfig


def test_defaults_serve_durably_on_torchruns_port() -> None:
    config = parse([])
    assert config.port == 29400
    assert not config.memory and config.fsync == "always"
    assert config.resolved_data_dir() is not None


def test_environment_variables_set_flags_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDZV_PORT", "31000")
    monkeypatch.setenv("RDZV_FSYNC", "batch")
    monkeypatch.setenv("RDZV_MAX_HOLD", "5")
    config = parse(["--port", "32000"])
    assert (config.port, config.fsync, config.max_hold) == (32000, "batch", 5.0)


def test_memory_mode_has_no_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDZV_MEMORY", "1")
    assert parse([]).resolved_data_dir() is None


def test_data_dir_flag(tmp_path: Path) -> None:
    assert parse(["--data-dir", str(tmp_path)]).resolved_data_dir() == tmp_path


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--port", "70000"], "--port"),
        (["--fsync", "sometimes"], "--fsync"),
        (["--max-hold", "0"], "--max-hold"),
        (["--max-value-bytes", "100", "--max-body-bytes", "10"], "--max-body-bytes"),
        (["--memory", "--data-dir", "/tmp/x"], "--data-dir"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_config_validates_on_construction() -> None:
    with pytest.raises(ConfigError, match="--snapshot-every"):
        ServerConfig(snapshot_every=0)


def test_pre_authentication_limits_have_flags_environment_variables_and_sane_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse([])
    assert (config.max_head_bytes, config.auth_timeout) == (32 * 1024, 10.0)
    assert config.pre_auth_bytes() == config.max_buffered_bytes // 8  # token holders keep 7/8
    small = parse(["--max-buffered-bytes", str(64 * 1024 * 1024), "--max-body-bytes", str(32 * 1024 * 1024)])
    assert small.pre_auth_bytes() == 8 * 1024 * 1024  # the share follows the budget
    monkeypatch.setenv("RDZV_MAX_HEAD_BYTES", "4096")
    monkeypatch.setenv("RDZV_MAX_PRE_AUTH_BYTES", "65536")
    monkeypatch.setenv("RDZV_AUTH_TIMEOUT", "3")
    config = parse([])
    assert (config.max_head_bytes, config.pre_auth_bytes(), config.auth_timeout) == (4096, 65536, 3.0)
    assert parse(["--auth-timeout", "5"]).auth_timeout == 5.0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-head-bytes", "100"], "--max-head-bytes"),
        (["--max-pre-auth-bytes", "1000"], "--max-pre-auth-bytes"),  # less than one head
        (["--max-pre-auth-bytes", str(2**40)], "--max-pre-auth-bytes"),  # more than the budget
        (["--auth-timeout", "0"], "--auth-timeout"),
    ],
)
def test_bad_pre_authentication_limits_exit_2_naming_the_flag(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
def test_with_etcd_the_value_and_body_limits_are_capped_to_what_etcd_takes() -> None:
    from rdzv_server.config import ETCD_MAX_BODY_BYTES, ETCD_MAX_VALUE_BYTES
    from rdzv_server.storage.etcd_log import MAX_RECORD_BYTES

    capped = parse(["--etcd", "http://e1:2379", "--max-value-bytes", str(16 << 20), "--max-body-bytes", str(64 << 20)])
    assert (capped.max_value_bytes, capped.max_body_bytes) == (ETCD_MAX_VALUE_BYTES, ETCD_MAX_BODY_BYTES)
    assert ETCD_MAX_VALUE_BYTES < MAX_RECORD_BYTES < ETCD_MAX_BODY_BYTES <= 1536 * 1024  # etcd's default limit
    smaller = parse(["--etcd", "http://e1:2379", "--max-value-bytes", "1000", "--max-body-bytes", "5000"])
    assert (smaller.max_value_bytes, smaller.max_body_bytes) == (1000, 5000)
    alone = parse([])
    assert (alone.max_value_bytes, alone.max_body_bytes) == (16 << 20, 64 << 20)


def test_the_log_queue_bounds_are_flags() -> None:
    config = parse(["--max-log-queue", "7", "--max-log-queue-bytes", "4096"])
    assert (config.max_log_queue, config.max_log_queue_bytes) == (7, 4096)
    with pytest.raises(ConfigError, match="--max-log-queue"):
        ServerConfig(max_log_queue=0)


def test_automatic_quarantine_flags_have_defaults_environment_variables_and_bounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = parse([])
    assert (config.quarantine_after, config.quarantine_window, config.quarantine_for) == (3, 3600.0, 3600.0)
    monkeypatch.setenv("RDZV_QUARANTINE_AFTER", "0")  # off
    assert parse(["--quarantine-for", "600"]).quarantine_after == 0 and parse(["--quarantine-for", "600"]).quarantine_for == 600.0
    for argv, flag in ((["--quarantine-after", "65"], "--quarantine-after"), (["--quarantine-window", "0"], "--quarantine-window"),
                       (["--quarantine-for", "-1"], "--quarantine-for")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert flag in capsys.readouterr().err
