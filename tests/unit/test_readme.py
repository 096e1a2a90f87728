"""README's two opening commands are what a newcomer types; CI must run the second one as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert block is not None, "README must open with a bash block of two commands"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_the_install_and_the_test_command() -> None:
    install, test = _readme_commands()
    assert install.startswith("pip install .") and "rdzv-server" in install
    assert "python -m pytest" in test and "-c constraints-test.txt" in test


def test_ci_runs_the_readme_test_command_in_a_fresh_venv() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    _, test = _readme_commands()
    assert test in ci
    venv_at = ci.index("-m venv")
    assert "--system-site-packages" not in ci
    assert venv_at < ci.index(test), "the venv must exist before the test command runs"
    assert "activate" in ci[venv_at : ci.index(test)]


def test_the_test_commands_worker_flags_come_from_a_plugin_the_test_extra_installs() -> None:
    """``-n``/``--dist`` are pytest-xdist's: an empty venv gets it from ``.[test]``, or pytest
    stops with "unrecognized arguments" before running a test."""
    _, test = _readme_commands()
    extra = re.search(r"^test = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.DOTALL | re.MULTILINE)
    assert extra is not None, "pyproject has a test extra"
    if " -n " in f"{test} " or "--dist" in test:
        assert re.search(r'^\s*"pytest-xdist\b', extra.group(1), re.MULTILINE), extra.group(1)


def _high_availability_lines() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## High availability", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the High availability section shows its command lines"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def test_the_high_availability_command_lines_parse_and_agree() -> None:
    import shlex

    from rdzv_client.client import parse_endpoints
    from rdzv_client.ctl import build_parser as ctl_parser
    from rdzv_server.cli import parse

    server, torchrun, rdzvctl = _high_availability_lines()
    argv = shlex.split(server)
    assert argv[0] == "rdzv-server"
    config = parse(argv[1:])
    assert config.etcd == ("http://e1:2379", "http://e2:2379", "http://e3:2379") and config.advertise_url
    endpoint = next(a.split("=", 1)[1] for a in shlex.split(torchrun) if a.startswith("--rdzv-endpoint="))
    listed = {(e.host, e.port) for e in parse_endpoints(endpoint)}
    advertised = parse_endpoints(config.advertise_url)[0]
    assert (advertised.host, advertised.port) in listed, "a follower names the leader by an endpoint the agents have"
    args = ctl_parser().parse_args(shlex.split(rdzvctl)[1:])
    assert args.command == "cluster" and parse_endpoints(args.endpoint) == parse_endpoints(endpoint)


def test_pyproject_and_readme_agree_on_the_torch_floor_and_readme_shows_it_passed() -> None:
    """The floor is one number: every torch requirement in pyproject, README's "torch versions"
    sentence, and the compat table's floor row (bench/torch-compat.sh ran on it)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    floors = set(re.findall(r'"torch>=([0-9.]+)"', pyproject))
    assert len(floors) == 1, f"pyproject states several torch floors: {floors}"
    floor = floors.pop()
    section = (ROOT / "README.md").read_text().split("## torch versions", 1)[1].split("\n## ", 1)[0]
    assert f"**torch {floor} or later**" in section
    row = re.search(rf"^\| {re.escape(floor)}\.\d+ \(the floor\) \| (.*)$", section, re.MULTILINE)
    assert row is not None, f"README's compat table has no row for the floor, torch {floor}"
    assert "failed" not in row.group(1) and "rdzv-torchrun` ok" in row.group(1), row.group(0)
    assert "bench/torch-compat.sh" in section
