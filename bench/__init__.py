"""rdzv-server's benchmark suite: ``python -m bench`` (see bench/README.md).

What it owns: driving every rendezvous backend (``rdzv-server``, torch's ``c10d`` and
``etcd-v2``) through torch's public registry exactly as torchrun does, measuring
formation, store operations, re-rendezvous after a node failure, the server's own
cost and its replicated mode over etcd, and reporting them against the project's targets
(table, JSON, PNG plots).

What it must not know: the server's or the client's internals. It talks to rdzv-server
only through its command line, its HTTP API (via ``rdzv_client``) and the torchrun
handler that torch's registry returns; every address it uses is on 127.0.0.1. One
exception, on purpose: ``bench.ha`` times the server's own etcd client and file log, to
show what one log write costs in each mode.

The one-issue diagnostics (``ceiling``, ``versus``, ``snapshot``, ``etcd_faults``) are the
lab's, :mod:`bench.lab`: each runs on its own, and nothing here imports them.
"""
