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
