"""The torchrun backend is found on every supported torch: through the entry point, whatever is
imported first (torch 2.6 and later), and through ``rdzv-torchrun`` (every torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = (
    "from torch.distributed.elastic.rendezvous import registry, RendezvousParameters\n"
    "h = registry.get_rendezvous_handler(RendezvousParameters('rdzv-server', '127.0.0.1:1', 'job', 1, 2))\n"
    "assert h.get_backend() == 'rdzv-server', h\n"
    "print('OK', type(h).__name__)\n"
)


@pytest.mark.parametrize("first", ["", "import rdzv_client.torchrun\n", "import rdzv_client\n"])
def test_backend_is_registered_by_the_entry_point(first: str) -> None:
    from torch_feature import NO_ENTRY_POINTS, READS_ENTRY_POINTS

    if not READS_ENTRY_POINTS:
        pytest.skip(NO_ENTRY_POINTS)
    result = subprocess.run([sys.executable, "-c", first + CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK RdzvServerHandler" in result.stdout
    assert "Exception while registering" not in result.stderr


def test_register_backend_registers_it_where_torch_did_not_and_keeps_torchs_own() -> None:
    """What ``rdzv-torchrun`` does before torchrun's main, on this torch: afterwards the backend
    is there, registered by this call only where torch read no entry point, and a second
    call changes nothing."""
    from torch_feature import READS_ENTRY_POINTS

    code = (
        "from rdzv_client.torchrun import register_backend\n"
        "first, again = register_backend(), register_backend()\n"
        + CHECK
        + "print('REGISTERED_BY_US', first, again)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK RdzvServerHandler" in result.stdout
    by_us = not READS_ENTRY_POINTS
    assert f"REGISTERED_BY_US {by_us} {by_us}" in result.stdout, result.stdout
    assert "Exception while registering" not in result.stderr


def test_rdzv_torchrun_is_torchrun() -> None:
    """The console script is installed and parses torchrun's own arguments."""
    script = Path(sys.executable).with_name("rdzv-torchrun")
    assert script.exists(), f"rdzv-torchrun is not installed beside {sys.executable}"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--rdzv-backend" in result.stdout and "--nproc-per-node" in result.stdout


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys, rdzv_client, rdzv_client.plugin, rdzv_client.launcher\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
