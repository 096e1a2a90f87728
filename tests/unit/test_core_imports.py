"""core/ is the inner ring: no I/O, no clock, no randomness, no outer layer (STYLE.md §1);
its error tree speaks the wire's error codes."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import rdzv_server.core
from rdzv_client import wire
from rdzv_server.core import error

CORE_DIR = Path(rdzv_server.core.__file__).parent
CORE_MODULES = sorted(CORE_DIR.rglob("*.py"))

FORBIDDEN = (
    "asyncio",
    "aiohttp",
    "msgpack",
    "torch",
    "time",
    "datetime",
    "random",
    "socket",
    "os",
    "rdzv_server.api",
    "rdzv_server.storage",
    "rdzv_client",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE_DIR.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[tuple[int, str]]:
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    return imported_names_in(path.read_text(), package, str(path))


def import_target(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names_in(source: str, package: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """Every module an import statement names, relative imports resolved against ``package``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            out.append((node.lineno, target))
            # `from rdzv_server import storage` names the module rdzv_server.storage
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return out


#: The one module outside core that core may import: the records both sides share, pure data
#: (standard library only, which test_the_record_module_core_imports_is_pure_data keeps so).
ALLOWED = ("rdzv_client.record",)


def forbidden(name: str) -> str | None:
    if name in ALLOWED or any(name.startswith(allowed + ".") for allowed in ALLOWED):
        return None
    for root in FORBIDDEN:
        if name == root or name.startswith(root + "."):
            return root
    return None


def test_the_server_imports_only_the_wire_part_of_the_client() -> None:
    """DESIGN.md: the server shares the wire format with the client, never its transport or
    policy; and the server never imports torch. A fresh interpreter, so nothing else loaded them."""
    code = (
        "import sys, rdzv_server.cli, rdzv_server.server\n"
        "loaded = [m for m in ('rdzv_client.client', 'rdzv_client.transport', 'rdzv_client.torchrun', 'torch')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert 'rdzv_client.wire' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_core_has_modules_to_check() -> None:
    names = {p.stem for p in CORE_MODULES}
    assert {"rendezvous", "store", "rank", "machine", "command", "error"} <= names


@pytest.mark.parametrize("path", CORE_MODULES, ids=lambda p: p.name)
def test_core_module_imports_nothing_forbidden(path: Path) -> None:
    bad = [f"{path.name}:{line} imports {name}" for line, name in imported_names(path) if forbidden(name)]
    assert bad == []


def test_the_import_checker_sees_forbidden_imports() -> None:
    """The checker itself: absolute, dotted, aliased, from- and relative imports into an outer ring."""
    source = (
        "import os.path\nfrom time import monotonic\nimport asyncio as aio\n"
        "from .. import storage\nfrom ..api import app\nfrom rdzv_client.wire import ErrorCode\n"
        "from . import store\nfrom .rank import place\nimport collections\n"
        "def f():\n    import random\n"
    )
    names = [name for _, name in imported_names_in(source, "rdzv_server.core")]
    assert "rdzv_server.core.store" in names and "rdzv_server.core.rank" in names
    hits = {forbidden(n) for n in names} - {None}
    assert hits == {"os", "time", "asyncio", "random", "rdzv_server.storage", "rdzv_server.api", "rdzv_client"}
    assert forbidden("rdzv_server.core.store") is None
    assert forbidden("collections") is None
    assert forbidden("timeit") is None  # a name that merely starts like a forbidden one


def test_every_core_module_imports_cleanly() -> None:
    for info in pkgutil.walk_packages(rdzv_server.core.__path__, "rdzv_server.core."):
        importlib.import_module(info.name)


def error_classes() -> list[type[error.RdzvError]]:
    return [
        obj
        for _, obj in inspect.getmembers(error, inspect.isclass)
        if issubclass(obj, error.RdzvError) and obj.__module__ == error.__name__
    ]


def test_the_error_tree_has_its_classes() -> None:
    names = {cls.__name__ for cls in error_classes()}
    assert {
        "RdzvError", "BadRequest", "ValueTooLarge", "JobNotFound", "NodeNotFound", "SettingsConflict",
        "NotAnInteger", "JobClosed", "JoinTimeout",
    } <= names


@pytest.mark.parametrize("cls", error_classes(), ids=lambda cls: cls.__name__)
def test_every_error_code_is_a_wire_error_code_with_its_http_status(cls: type[error.RdzvError]) -> None:
    codes = {code.value for code in wire.ErrorCode}
    assert cls.code in codes
    assert cls.status == wire.HTTP_STATUS[wire.ErrorCode(cls.code)]


def test_error_codes_are_distinct_per_class() -> None:
    leaves = [cls for cls in error_classes() if cls is not error.RdzvError]
    assert len({cls.code for cls in leaves}) == len(leaves)


def test_an_error_carries_its_message() -> None:
    exc = error.JobClosed("job j is closed")
    assert exc.message == "job j is closed" == str(exc)
    assert (exc.code, exc.status) == ("job_closed", 410)


def test_core_and_the_wire_share_one_assignment_and_one_job_settings() -> None:
    # The service sends core's Assignment with dataclasses.asdict and the client reads the
    # wire's: one declaration, so the two cannot drift apart.
    from rdzv_client import record
    from rdzv_server.core import rendezvous

    assert rendezvous.Assignment is wire.Assignment is record.Assignment
    assert rendezvous.JobSettings is wire.JobSettings is record.JobSettings


def test_importing_core_loads_no_outer_ring_even_through_the_record_module() -> None:
    """A fresh interpreter: core, with the one client module it uses, loads no msgpack, no
    asyncio, no wire framing, no transport."""
    code = (
        "import sys, pkgutil, importlib, rdzv_server.core\n"
        "for info in pkgutil.walk_packages(rdzv_server.core.__path__, 'rdzv_server.core.'):\n"
        "    importlib.import_module(info.name)\n"
        "loaded = [m for m in ('msgpack', 'asyncio', 'aiohttp', 'rdzv_client.wire', 'rdzv_client.transport', 'torch')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_record_module_core_imports_is_pure_data() -> None:
    """What core may import from outside itself imports nothing but the standard library, so
    core stays free of msgpack, I/O and clocks through it too."""
    from rdzv_client import record

    path = Path(record.__file__)
    names = [name for _, name in imported_names_in(path.read_text(), "rdzv_client", str(path))]
    outside = [n for n in names if n.split(".")[0] not in sys.stdlib_module_names]
    assert outside == []
    assert not {forbidden(n) for n in names} - {None}
    assert not [n for n in names if n.split(".")[0] in ("time", "datetime", "random", "os", "socket", "asyncio")]
