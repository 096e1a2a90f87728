"""Every ``python -m bench.…`` command the docs quote names a module that exists.

The lab moved under ``bench/lab/`` (issue 26); a command spelled the old way in README.md,
bench/README.md or docs/ would send a reader to a module that is not there.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"python -m (bench(?:\.[a-z_]+)*)")


def _quoted_modules() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for module in COMMAND.findall(doc.read_text(encoding="utf-8")):
            found.setdefault(module, []).append(doc.relative_to(ROOT).as_posix())
    return found


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return (path / "__main__.py").is_file() if path.is_dir() else path.with_suffix(".py").is_file()


def test_every_bench_command_in_the_docs_names_a_module_that_exists() -> None:
    quoted = _quoted_modules()
    assert {"bench", "bench.lab.ceiling", "bench.lab.versus", "bench.lab.snapshot", "bench.lab.etcd_faults"} <= set(quoted)
    missing = {module: docs for module, docs in quoted.items() if not _exists(module)}
    assert not missing, f"commands for modules that do not exist: {missing}"
