"""mypy --strict over both packages (STYLE.md convention 11).

``rdzv_client``'s source lives in ``client/``; an editable install hides that mapping
from mypy, so the test checks a tree of symlinks with the import names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict_passes(tmp_path: Path) -> None:
    (tmp_path / "rdzv_server").symlink_to(ROOT / "rdzv_server")
    (tmp_path / "rdzv_client").symlink_to(ROOT / "client")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / ".mypy_cache"), "-p", "rdzv_server", "-p", "rdzv_client"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
