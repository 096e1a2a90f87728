"""rdzv_server: the rendezvous key-value server for torchrun (see DESIGN.md)."""

__version__ = "0.1.0"
