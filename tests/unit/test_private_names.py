"""A module's ``_private`` names are used only in that module (STYLE.md): what another module
needs is shared under a public name. Read from the source of every module we ship or bench
with (``rdzv_server``, ``rdzv_client``, ``bench``), so a new cross-file reach fails here, by
file and line."""

from __future__ import annotations

import ast
from pathlib import Path

from unit.test_core_imports import import_target

ROOT = Path(__file__).resolve().parents[2]
#: Package name -> its source folder (``rdzv_client``'s is ``client/``, pyproject's package-dir).
PACKAGES = {"rdzv_server": ROOT / "rdzv_server", "rdzv_client": ROOT / "client", "bench": ROOT / "bench"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_name(package: str, folder: Path, path: Path) -> str:
    parts = (package, *path.relative_to(folder).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(package, folder, path): path
        for package, folder in PACKAGES.items()
        for path in sorted(folder.rglob("*.py"))
    }


def reaches(name: str, source: str, where: str, known: set[str], *, package: bool = False) -> list[str]:
    """Where module ``name`` (``source``, shown as ``where``; ``package``: an ``__init__``) takes
    another module's private name: ``from m import _x``, ``import m._x``, or ``m._x`` on a
    module it imported (``known``: every module's name)."""
    package_name = name if package else name.rpartition(".")[0]
    tree = ast.parse(source, where)
    found = []
    imported: dict[str, str] = {}  # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = import_target(node, package_name)
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    imported[alias.asname or alias.name] = f"{target}.{alias.name}"
                if private(alias.name) and target != name:
                    found.append(f"{where}:{node.lineno}: from {target} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(private(part) for part in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                if alias.name in known:
                    imported[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
            and private(node.attr)
        ):
            found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    every = modules()
    found = [
        line
        for name, path in every.items()
        for line in reaches(
            name, path.read_text(), str(path.relative_to(ROOT)), set(every), package=path.name == "__init__.py"
        )
    ]
    assert found == []


def self_privates(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The private attributes a file defines on ``self`` (assigned, annotated or ``def``) and those it reads."""
    defined, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and private(node.name):
            defined.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and private(node.target.id):
            defined.add(node.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if private(node.attr):
                (defined if isinstance(node.ctx, ast.Store) else used).add(node.attr)
    return defined, used


def test_no_subclass_uses_a_private_name_its_base_defines_in_another_file() -> None:
    """A hook a subclass in another file calls or implements is part of the base's interface,
    so it has a public name (``TrackedConnection.track``, not ``_track``)."""
    every = modules()
    files = {path: self_privates(ast.parse(path.read_text(), str(path))) for path in every.values()}
    found = [
        f"{path.relative_to(ROOT)} uses {sorted(used & other[0])} of {other_path.relative_to(ROOT)}"
        for path, (defined, used) in files.items()
        for other_path, other in files.items()
        if other_path != path and (used - defined) & other[0]
    ]
    assert found == []


def test_the_checks_see_a_reach() -> None:
    """The checks above pass on the tree; these sources show they would see a reach."""
    source = "from .connection import _held\nfrom . import connection\nconnection._held(None)\n"
    found = reaches("rdzv_server.api.stream", source, "stream.py", set(modules()))
    assert found == [
        "stream.py:1: from rdzv_server.api.connection import _held",
        "stream.py:3: connection._held",
    ]
    base = self_privates(ast.parse("class Base:\n    def _track(self) -> None:\n        self._table = 1\n"))
    sub = self_privates(ast.parse("class Sub(Base):\n    def made(self) -> None:\n        self._track()\n"))
    assert (sub[1] - sub[0]) & base[0] == {"_track"}
