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
