"""Tokens: the server's table and default file (rdzv_server.api.auth), and the order in which
clients look for theirs (rdzv_client.credential)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rdzv_client.credential import CredentialError, find_token
from rdzv_client.wire import default_token_file
from rdzv_server.api.auth import (
    OPEN,
    Access,
    Grant,
    TokenError,
    TokenTable,
    bearer_token,
    ensure_token_file,
    load_tokens,
)


def test_the_server_creates_a_private_random_token_file_once(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "rdzv-server" / "token"
    token, created = ensure_token_file(path)
    assert created and len(token) >= 43  # 32 random bytes, URL-safe base64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again, created_again = ensure_token_file(path)
    assert (again, created_again) == (token, False)
    other, _ = ensure_token_file(tmp_path / "other")
    assert other != token


def test_a_bad_token_file_is_refused_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("short\n")
    with pytest.raises(TokenError, match=str(path)):
        ensure_token_file(path)


def test_the_table_grants_the_write_and_the_read_token_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "read").write_text("read-only-token-0123456789\n")
    table = load_tokens(tmp_path / "write", tmp_path / "read")
    write = (tmp_path / "write").read_text().strip()
    assert table.grant(write) == Grant(Access.WRITE)
    assert table.grant("read-only-token-0123456789") == Grant(Access.READ)
    for wrong in (None, "", write[:-1], write + "x", "read-only-token-012345678"):
        assert table.grant(wrong) is None


def test_auth_off_grants_everything() -> None:
    assert TokenTable(None).grant(None) is OPEN and not TokenTable(None).enabled


def test_a_read_grant_covers_no_write_and_a_prefix_only_its_jobs() -> None:
    assert Grant(Access.READ).allows(writes=False, rdzv_id="any")
    assert not Grant(Access.READ).allows(writes=True, rdzv_id="any")
    team = Grant(Access.WRITE, job_prefix="team-a/")
    assert team.allows(writes=True, rdzv_id="team-a/job1")
    assert not team.allows(writes=False, rdzv_id="team-b/job1")


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None), (None, None), ("", None)],
)
def test_bearer_token_reads_only_the_bearer_scheme(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


# -- clients ---------------------------------------------------------------------------------


def write(path: Path, token: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token + "\n")
    return path


def test_clients_look_for_the_token_in_the_documented_order(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    assert find_token(env=env) is None
    write(default_token_file(env), "from-default-file")
    assert find_token(env=env) == "from-default-file"
    env["RDZV_TOKEN_FILE"] = str(write(tmp_path / "env-file", "from-env-file"))
    assert find_token(env=env) == "from-env-file"
    env["RDZV_TOKEN"] = "from-env"
    assert find_token(env=env) == "from-env"
    assert find_token(token_file=write(tmp_path / "conf", "from-conf-file"), env=env) == "from-conf-file"
    assert find_token("explicit", token_file=tmp_path / "conf", env=env) == "explicit"


def test_the_default_file_follows_xdg_config_home(tmp_path: Path) -> None:
    assert default_token_file({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "rdzv-server" / "token"
    assert default_token_file({"XDG_CONFIG_HOME": "relative"}) == Path.home() / ".config" / "rdzv-server" / "token"


def test_a_named_token_file_that_cannot_be_read_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CredentialError, match="missing"):
        find_token(token_file=tmp_path / "missing", env={})
    with pytest.raises(CredentialError, match="empty"):
        find_token(token_file=write(tmp_path / "empty", ""), env={})
