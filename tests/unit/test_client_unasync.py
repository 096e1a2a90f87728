"""The blocking client is generated from the asyncio one (client/_unasync.py), and stays so.

The client policy is written once, as AsyncClient's coroutines; ``sync_client.py`` is that
code with the awaits taken out. These tests check that the file on disk is what the generator
writes now, that it holds no coroutine, and that the two clients offer the same methods.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from rdzv_client import _unasync
from rdzv_client.async_client import AsyncClient
from rdzv_client.sync_client import Client

CLIENT_DIR = Path(_unasync.__file__).resolve().parent


def test_the_generated_sync_client_is_up_to_date() -> None:
    source = _unasync.SOURCE.read_text(encoding="utf-8")
    assert _unasync.TARGET.read_text(encoding="utf-8") == _unasync.generate(source), (
        "client/sync_client.py is stale: run `python -m rdzv_client._unasync`"
    )


def test_the_check_command_passes_on_the_tree() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rdzv_client._unasync", "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_a_source_the_table_does_not_fit_is_refused() -> None:
    source = _unasync.SOURCE.read_text(encoding="utf-8")
    with pytest.raises(_unasync.UnasyncError, match="expected this text once"):
        _unasync.generate(source.replace("import asyncio\n", "import asyncio as aio\n"))


def test_code_the_rewrite_cannot_unasync_is_refused() -> None:
    source = _unasync.SOURCE.read_text(encoding="utf-8")
    marker = "    # ----------------------------------------------------------------- store\n"
    assert source.count(marker) == 1
    leftover = "    async def _each(self) -> None:\n        async for _ in self._stream():\n            pass\n\n"
    with pytest.raises(_unasync.UnasyncError, match="left asyncio"):
        _unasync.generate(source.replace(marker, leftover + marker))


def test_no_coroutine_is_stepped_by_hand_in_the_client_package() -> None:
    """No ``.send(None)`` / ``.throw(...)`` on a coroutine anywhere in client/: the standard
    machinery (an event loop, or plain calls) runs every function."""
    stepped = []
    for path in sorted(CLIENT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("send", "throw"):
                if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is None:
                    stepped.append(f"{path.name}:{node.lineno}")
    assert not stepped


def test_the_sync_client_has_no_coroutines() -> None:
    for name, member in inspect.getmembers(Client, inspect.isfunction):
        assert not inspect.iscoroutinefunction(member), name
    tree = ast.parse(_unasync.TARGET.read_text(encoding="utf-8"))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith))]


def _public(cls: type) -> dict[str, inspect.Signature | None]:
    out: dict[str, inspect.Signature | None] = {}
    for name, member in vars(cls).items():
        if name.startswith("_") and name not in ("__init__",):
            continue
        out[name] = None if isinstance(member, property) else inspect.signature(member)
    return out


def test_both_clients_offer_the_same_methods_with_the_same_parameters() -> None:
    renamed = {"aclose": "close"}
    sync, asyn = _public(Client), {renamed.get(k, k): v for k, v in _public(AsyncClient).items()}
    assert sorted(sync) == sorted(asyn)
    for name, signature in sync.items():
        other = asyn[name]
        assert (signature is None) == (other is None), name
        if signature is not None and other is not None:
            assert list(signature.parameters) == list(other.parameters), name
            own_io = {"sleep", "transport_type"}  # each client's own: time.sleep / asyncio.sleep, its transport
            defaults = [p.default for p in signature.parameters.values() if p.name not in own_io]
            assert defaults == [p.default for p in other.parameters.values() if p.name not in own_io], name
