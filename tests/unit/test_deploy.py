"""Every deploy example passes only flags `rdzv-server` accepts (parsed by the real CLI)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from rdzv_server.cli import parse
from rdzv_server.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _server_args(path: Path) -> list[list[str]]:
    text = path.read_text()
    found: list[list[str]] = []
    if path.name == "Containerfile":
        found.append(json.loads(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1)))  # type: ignore[union-attr]
    elif path.suffix == ".yaml":
        found.append(json.loads(re.search(r"args: (\[.*\])", text).group(1)))  # type: ignore[union-attr]
    else:
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#", 1)[0]) if "rdzv-server " in line else []
            if "rdzv-server" in words:
                found.append(words[words.index("rdzv-server") + 1 :])
            elif words and words[0].startswith("ExecStart=") and words[0].endswith("rdzv-server"):
                found.append(words[1:])
    return found


@pytest.mark.parametrize("name", ["rdzv-server.service", "Containerfile", "kubernetes.yaml", "slurm.sbatch"])
def test_deploy_example_flags_parse(name: str) -> None:
    calls = _server_args(DEPLOY / name)
    assert calls, f"{name} starts no rdzv-server"
    for args in calls:
        args = [a.replace('"', "") for a in args if a != "&"]
        args = [re.sub(r"\$\w+|\$\{\w+\}|\$\(.*\)", "x", a) for a in args]
        config = parse(args)
        assert isinstance(config, ServerConfig)
        assert config.port == 29400 and not config.memory, f"{name} should serve durably on 29400"


def test_slurm_example_uses_the_backend() -> None:
    text = (DEPLOY / "slurm.sbatch").read_text()
    assert "--rdzv-backend=rdzv-server" in text and '--rdzv-endpoint="$MASTER:29400"' in text
