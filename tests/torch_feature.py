"""What the installed torch can do, found by looking at it rather than at its version number.

The supported floor (pyproject's ``torch>=2.4``) lacks some torch features that newer
releases have. A test that needs one skips where it is missing and says which feature and
what stands in for it; a test of the plug-in itself never skips. Imported by torch-facing
tests only: importing this module imports torch.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.rendezvous import registry

VERSION = torch.__version__

#: torch loads the ``torchrun.handlers`` entry points while it imports its rendezvous package
#: (``registry._register_out_of_tree_handlers``, from torch 2.6). Without it, plain ``torchrun``
#: does not know the backend, and ``rdzv-torchrun`` (rdzv_client.launcher) is the launcher.
READS_ENTRY_POINTS = hasattr(registry, "_register_out_of_tree_handlers")
NO_ENTRY_POINTS = (
    f"torch {VERSION} does not read torchrun.handlers entry points (torch 2.6 and later do): "
    "plain torchrun cannot find the backend there; rdzv-torchrun is the launcher, tested instead"
)

#: torch's ``Store.clone`` (and so ``PrefixStore.clone``); absent on 2.4 and 2.6. RdzvStore has
#: its own ``clone`` either way.
STORE_CLONE = hasattr(dist.Store, "clone")
NO_STORE_CLONE = (
    f"torch {VERSION} has no Store.clone, so its PrefixStore cannot be cloned (a torch feature, "
    "not the plug-in's; RdzvStore.clone is tested directly)"
)

#: The agent's shortcut past its worker-rank exchange through the round's store,
#: ``TORCH_ELASTIC_WORKER_IDENTICAL=1`` (pytorch#136865, late 2024), which the handler turns on
#: for uniform rounds. Without it every round trades worker ranks through the store.
WORKER_RANK_SHORTCUT = "TORCH_ELASTIC_WORKER_IDENTICAL" in inspect.getsource(SimpleElasticAgent._assign_worker_ranks)
NO_WORKER_RANK_SHORTCUT = (
    f"torch {VERSION}'s agent has no TORCH_ELASTIC_WORKER_IDENTICAL shortcut: it trades worker ranks "
    "through the round's store in every round, and waits there for a member that died as the round formed"
)


def torchrun_command() -> list[str]:
    """How a test starts a torchrun agent with this torch, as a user would: plain ``torchrun``
    where torch finds the backend by itself, else ``rdzv-torchrun`` (both as ``python -m``, so
    that the test's own interpreter runs them)."""
    module = "torch.distributed.run" if READS_ENTRY_POINTS else "rdzv_client.launcher"
    return [sys.executable, "-m", module]
