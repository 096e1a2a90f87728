"""``rdzvctl policy`` as an operator runs it (issue 28): a subprocess against a real server on
loopback, with the operator's token and with a read-only one. The tables' exact layout is in
tests/unit/test_ctl_policy.py; here, what reaches the server and what comes back. Also the
client's side of the plug-in's refetch rule: the policy version a join and a watch carry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess

from rdzv_client import Client, JobSettings
from rdzv_client.error import RdzvTimeoutError


def rdzvctl(server: ServerProcess, *args: str, token_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rdzv_client.ctl", "--endpoint", server.endpoint]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    return subprocess.run(argv + list(args), check=False, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))  # fmt: skip


def rows(text: str) -> list[str]:
    """A table's lines with each run of blanks as one: widths are the unit tests' concern."""
    return [" ".join(line.split()) for line in text.splitlines()]


@pytest.fixture(scope="module")
def read_token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("read-token") / "token"
    path.write_text("read-" + uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, read_token_file: Path) -> Iterator[ServerProcess]:
    """One memory-only server for the module; every test uses patterns of its own."""
    srv = ServerProcess(tmp_path_factory.mktemp("ctl-policy"), durable=False,
                        args=("--read-token-file", str(read_token_file)))  # fmt: skip
    srv.start()
    yield srv
    srv.close()


def test_set_show_and_unset_a_policy_and_a_job_shows_where_each_setting_came_from(server: ServerProcess) -> None:
    done = rdzvctl(server, "policy", "set", "team-*", "min_nodes=2", "max_nodes=4", "last_call_timeout=30",
                   "health_check=/opt/check.sh --quick", "gpu_check=off")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "policy team-*: gpu_check=0 health_check=/opt/check.sh --quick last_call_timeout=30 max_nodes=4 min_nodes=2\n"
    )
    assert rdzvctl(server, "policy", "set", "team-7", "max_nodes=3").returncode == 0

    listed = rdzvctl(server, "policy", "show")
    assert listed.returncode == 0, listed.stderr
    patterns = [line.split()[0] for line in listed.stdout.splitlines()]
    assert patterns[0] == "PATTERN" and {"team-*", "team-7"} <= set(patterns[1:]), listed.stdout
    one = rdzvctl(server, "policy", "show", "team-7")
    assert rows(one.stdout)[1:] == ["KEY VALUE", "max_nodes 3"], one.stdout
    as_json = json.loads(rdzvctl(server, "--json", "policy", "show", "team-*").stdout)
    assert as_json["settings"] == {"min_nodes": 2, "max_nodes": 4, "last_call_timeout": 30.0,
                                   "health_check": "/opt/check.sh --quick", "gpu_check": False}  # fmt: skip

    # A job id beats the glob, key by key.
    effective = rdzvctl(server, "policy", "show", "--job", "team-7")
    assert {"max_nodes 3 policy team-7", "min_nodes 2 policy team-*"} <= set(rows(effective.stdout)), effective.stdout

    # A job that runs under them: `rdzvctl show` lists each setting with its source.
    with Client(server.endpoint) as client, pytest.raises(RdzvTimeoutError):  # in line for min_nodes 2
        client.join("team-7", node_id="n0", addr="10.0.0.1", nproc_per_node=1,
                    settings=JobSettings(min_nodes=1, max_nodes=8, join_timeout=60.0), timeout=0.1)  # fmt: skip
    shown = rows(rdzvctl(server, "show", "team-7").stdout)
    settings = shown[shown.index("settings:") + 2 :]
    assert {"min_nodes 2 policy team-*", "max_nodes 3 policy team-7", "join_timeout 60 node",
            "health_check /opt/check.sh --quick policy team-*"} <= set(settings), shown  # fmt: skip

    removed = rdzvctl(server, "policy", "unset", "team-*", "gpu_check", "health_check")
    assert removed.stdout == "removed health_check, gpu_check from policy team-*\n", removed.stdout
    assert rdzvctl(server, "policy", "unset", "team-7").stdout == "removed policy team-7\n"
    gone = rdzvctl(server, "policy", "show", "team-7")
    assert gone.returncode == 1 and "(no_such_policy)" in gone.stderr, gone.stderr
    assert "`rdzvctl policy show` lists the policies" in gone.stderr


def test_a_read_only_token_reads_policies_and_cannot_set_or_unset_one(
    server: ServerProcess, read_token_file: Path
) -> None:
    assert rdzvctl(server, "policy", "set", "ro-*", "max_restarts=2").returncode == 0
    shown = rdzvctl(server, "policy", "show", "ro-*", token_file=read_token_file)
    assert shown.returncode == 0 and "max_restarts 2" in rows(shown.stdout), shown.stderr
    for args in (("policy", "set", "ro-*", "max_restarts=5"), ("policy", "unset", "ro-*")):
        refused = rdzvctl(server, *args, token_file=read_token_file)
        assert refused.returncode == 1, refused
        assert "(forbidden)" in refused.stderr and "policies are set with the operator's token" in refused.stderr
    assert "max_restarts 2" in rows(rdzvctl(server, "policy", "show", "ro-*").stdout)  # unchanged


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        (("policy", "set", "bad pattern", "min_nodes=2"), 1, "pattern"),
        (("policy", "unset", "nobody-*"), 1, "(no_such_policy)"),
    ],
)
def test_a_pattern_that_cannot_be_or_is_not_a_policy_is_refused_and_changes_nothing(
    server: ServerProcess, args: tuple[str, ...], code: int, said: str
) -> None:
    done = rdzvctl(server, *args)
    assert done.returncode == code, done
    assert said in done.stderr, done.stderr
    assert "x-*" not in rdzvctl(server, "policy", "show").stdout


def test_a_join_and_a_watch_tell_the_node_the_policy_version_and_it_moves_with_each_change(
    server: ServerProcess,
) -> None:
    """What the plug-in reads to know when to ask for its job's policy again (README "Job policy")."""
    with Client(server.endpoint) as client:
        before = client.effective_policy("ver-1")["version"]
        placed = client.join("ver-1", node_id="n0", addr="10.0.0.1", nproc_per_node=1,
                             settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)  # fmt: skip
        assert placed.policy_version == before
        client.set_policy("ver-*", {"health_check": "/opt/check.sh"})
        seen = client.watch("ver-1", "n0", round=placed.round, hold=0.0)
        assert seen.policy_version == before + 1 == client.effective_policy("ver-1")["version"]
