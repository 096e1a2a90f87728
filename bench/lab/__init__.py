"""The lab: one-issue diagnostics, each run on its own, none part of ``python -m bench``.

What it owns: measurements that answered one question once and are kept to answer it again
(``python -m bench.lab.ceiling``, ``bench.lab.versus``, ``bench.lab.snapshot``,
``bench.lab.etcd_faults``; one line each in bench/README.md). Their figures, by session,
are in docs/bench-log.md.

What it must not know: nothing the product benchmark (``bench``) depends on lives here;
the lab uses the bench's processes, backends and records, never the other way round.
"""
