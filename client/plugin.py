"""The ``torchrun.handlers`` entry point of the backend ``rdzv-server``.

Torch-free on purpose: torch loads every ``torchrun.handlers`` entry point while it imports
``torch.distributed.elastic.rendezvous``. If the entry point lived in the torch module, a
program that imports that module first (to use ``RdzvStore``) would make torch call back
into a half-initialised module, and the backend would silently not be registered.
"""

from __future__ import annotations

from typing import Any


def register() -> Any:
    """Torch calls this with no arguments and registers the creator it returns."""

    def create(params: Any) -> Any:
        from .torchrun import create_handler

        return create_handler(params)

    return create
