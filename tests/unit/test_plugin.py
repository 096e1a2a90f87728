"""The torchrun backend is found through the entry point, whatever is imported first."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = (
    "from torch.distributed.elastic.rendezvous import registry, RendezvousParameters\n"
    "h = registry.get_rendezvous_handler(RendezvousParameters('rdzv-server', '127.0.0.1:1', 'job', 1, 2))\n"
    "assert h.get_backend() == 'rdzv-server', h\n"
    "print('OK', type(h).__name__)\n"
)


@pytest.mark.parametrize("first", ["", "import rdzv_client.torchrun\n", "import rdzv_client\n"])
def test_backend_is_registered_by_the_entry_point(first: str) -> None:
    result = subprocess.run([sys.executable, "-c", first + CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK RdzvServerHandler" in result.stdout
    assert "Exception while registering" not in result.stderr


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, rdzv_client, rdzv_client.plugin; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
