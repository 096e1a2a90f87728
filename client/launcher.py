"""``rdzv-torchrun``: torchrun with the ``rdzv-server`` backend, on every supported torch.

What it owns: the console script's entry function. torch reads the ``torchrun.handlers``
entry points (where this package declares the backend) from 2.6 on; torch 2.4 and 2.5 never
do, and their ``torchrun --rdzv-backend=rdzv-server`` fails with "not registered". This script
registers the backend in torch's registry (unless torch already did, from the entry point)
and then runs torchrun's own ``main`` in the same process with the same arguments, so
``rdzv-torchrun ARGS`` behaves as ``torchrun ARGS`` does, exit codes and error files
included. ``python -m rdzv_client.launcher ARGS`` is the same.

What it must not know: torch. Importing it imports nothing of torch (STYLE.md rule 7); the
registration and the launch live in :mod:`rdzv_client.torchrun`, imported when it runs.
"""

from __future__ import annotations


def main() -> None:
    """Run torchrun with ``sys.argv[1:]``, the ``rdzv-server`` backend registered."""
    from .torchrun import run_torchrun

    run_torchrun()


if __name__ == "__main__":
    main()
