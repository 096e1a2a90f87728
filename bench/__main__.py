"""``python -m bench``: run the measurements, print the table, write JSON and plots.

    python -m bench                 # everything (10-25 minutes on 2 cores)
    python -m bench --quick         # every measurement, small (about 3 minutes)
    python -m bench --only formation,store --backends rdzv-server,c10d --sizes 8,64,256
    python -m bench --only ha --quick   # replicas over etcd vs the single server (~1 minute)
    python -m bench --only scale --sizes 4096,16384   # one job of thousands of simulated agents
    python -m bench --only scale --sizes 16384 --versus eb0e1c3   # the same, this tree against eb0e1c3

Measurements (one module each): ``formation`` (bench.formation), ``store``
(bench.store), ``rerdzv`` (bench.rerdzv), ``server`` (bench.server_cost), ``ha``
(bench.ha: replicas over a 3-member etcd against the single server), ``scale`` (bench.scale:
one job of thousands of asyncio agents; only when asked for, with ``--only scale``, and its
last line is then the JSON ``{"scale": [...]}``; with ``--versus REV``, bench.scale_versus: this
tree and REV in turn, each with its own server and agents, one table with the ratios). Results go to
``--out`` (default ``bench/out``): ``results.json``, ``*.png``, ``bench.log`` and
``logs/`` (every service's own log). The exit status is 0 when the run completed, even
with missed targets (the table says which); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import report, target
from .backend import BACKEND_NAMES
from .result import Plan, Row, load_average

log = logging.getLogger("bench")

MEASUREMENTS = ("formation", "store", "rerdzv", "server", "ha", "scale")
#: What runs without --only: scale needs thousands of descriptors and minutes of its own.
DEFAULT_ONLY = ("formation", "store", "rerdzv", "server", "ha")
#: bench.scale's job sizes (issue 17); --sizes overrides them too.
FULL_SCALE_SIZES = (4096, 16384)
QUICK_SCALE_SIZES = (1024,)
#: bench.scale: how long the server's CPU is sampled while every agent heartbeats.
FULL_SCALE_SECONDS = 30.0
QUICK_SCALE_SECONDS = 5.0
#: N=128 is where formation is compared with c10d (the 20x target).
FULL_SIZES = (8, 64, 128, 256, 1024, 4096)
QUICK_SIZES = (8, 64)
FULL_RERDZV_SIZES = (8, 64, 256, 1024)
QUICK_RERDZV_SIZES = (8,)
#: A formation (or one phase of a re-rendezvous) that takes longer is a timeout.
FULL_TIMEOUT = 120.0
QUICK_TIMEOUT = 30.0
#: ha: one writer (latency alone), then 16 and 64 sharing the leader (its group commit).
HA_CLIENTS = (1, 16, 64)
FULL_HA_SIZES = (8, 64)
QUICK_HA_SIZES = (8,)
#: ha: 2 s is the shortest lease the server takes; 5 s is its default.
FULL_HA_TTLS = (2, 5)
QUICK_HA_TTLS = (2,)
FULL_HA_REPEATS = 5
QUICK_HA_REPEATS = 3
FULL_HA_OPS = 1000
QUICK_HA_OPS = 100


def _csv(kind: type, allowed: Sequence[str] | None = None, least: int | None = None):  # type: ignore[no-untyped-def]
    def parse(text: str) -> tuple[object, ...]:
        items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(map(str, bad))}; expected some of {', '.join(allowed)}")
        if least is not None and any(x < least for x in items):
            raise argparse.ArgumentTypeError(f"every value must be at least {least}, got {text}")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def _count(least: int, most: int):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        value = int(text)
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"expected {least}..{most}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="Benchmark rdzv-server against torch's c10d and etcd-v2 rendezvous backends.")
    p.add_argument("--quick", action="store_true", help="a small smoke run of every measurement (~3 min)")
    p.add_argument(
        "--only", type=_csv(str, MEASUREMENTS), default=DEFAULT_ONLY,
        help="measurements: " + ",".join(MEASUREMENTS) + " (default: all but scale)",
    )  # fmt: skip
    p.add_argument("--backends", type=_csv(str, BACKEND_NAMES), default=BACKEND_NAMES, help="backends: " + ",".join(BACKEND_NAMES))
    p.add_argument(
        "--sizes", type=_csv(int), default=None,
        help="formation sizes N (default 8,64,128,256,1024,4096; quick 8,64); scale: agents (default 4096,16384; quick 1024)",
    )  # fmt: skip
    p.add_argument("--scale-seconds", type=float, default=None, help="scale: s of heartbeats sampled (default 30; quick 5)")
    p.add_argument("--versus", metavar="REV", default=None,
                   help="scale only: measure git revision REV too, alternated with this tree, and give the ratios")
    p.add_argument("--versus-rounds", type=_count(1, 20), default=1,
                   help="--versus: runs of each tree per size, alternated; the table gives medians (default 1)")
    p.add_argument("--rerdzv-sizes", type=_csv(int), default=None, help="re-rendezvous sizes (default 8,64,256,1024; quick 8)")
    p.add_argument("--ha-clients", type=_csv(int, least=1), default=None, help="ha: concurrent writers per step (default 1,16,64)")
    p.add_argument("--ha-sizes", type=_csv(int, least=1), default=None, help="ha: formation sizes N (default 8,64; quick 8)")
    p.add_argument("--ha-ttls", type=_csv(int, least=2), default=None, help="ha: replica lease TTLs, s, >= 2 (default 2,5; quick 2)")
    p.add_argument("--ha-repeats", type=_count(1, 100), default=None, help="ha: leader kills per TTL (default 5; quick 3)")
    p.add_argument("--store-ops", type=_count(10, 1_000_000), default=None, help="store: latency samples per operation (default 2000; quick 100)")
    p.add_argument(
        "--ha-etcd-election-ms", type=_count(100, 50_000), default=0,
        help="ha: etcd's --election-timeout in ms, heartbeat a tenth of it (default: etcd's own, 1000)",
    )
    p.add_argument("--timeout", type=float, default=None, help="s per formation / re-rendezvous phase (default 120; quick 30)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="output directory (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="progress on stderr too")
    return p


def make_plan(args: argparse.Namespace) -> Plan:
    quick = bool(args.quick)
    return Plan(
        quick=quick,
        only=tuple(args.only),
        backends=tuple(args.backends),
        formation_sizes=tuple(args.sizes or (QUICK_SIZES if quick else FULL_SIZES)),
        rerdzv_sizes=tuple(args.rerdzv_sizes or (QUICK_RERDZV_SIZES if quick else FULL_RERDZV_SIZES)),
        timeout=args.timeout or (QUICK_TIMEOUT if quick else FULL_TIMEOUT),
        out_dir=args.out,
        store_ops=args.store_ops or (100 if quick else 2000),
        throughput_seconds=0.5 if quick else 3.0,
        throughput_clients=(1, 8, 64),
        server_jobs=10 if quick else 100,
        server_nodes=100 if quick else 1000,
        server_sample_seconds=5.0 if quick else 20.0,
        recovery_keys=100_000 if quick else 1_000_000,
        ha_clients=tuple(args.ha_clients or HA_CLIENTS),
        ha_sizes=tuple(args.ha_sizes or (QUICK_HA_SIZES if quick else FULL_HA_SIZES)),
        ha_ttls=tuple(args.ha_ttls or (QUICK_HA_TTLS if quick else FULL_HA_TTLS)),
        ha_repeats=args.ha_repeats or (QUICK_HA_REPEATS if quick else FULL_HA_REPEATS),
        ha_ops=QUICK_HA_OPS if quick else FULL_HA_OPS,
        ha_etcd_election_ms=args.ha_etcd_election_ms,
        scale_sizes=tuple(args.sizes or (QUICK_SCALE_SIZES if quick else FULL_SCALE_SIZES)),
        scale_seconds=args.scale_seconds or (QUICK_SCALE_SECONDS if quick else FULL_SCALE_SECONDS),
    )


def run(plan: Plan) -> tuple[list[Row], dict[str, object]]:
    """Every measurement the plan asks for, in order; each backend's failure stays its own row."""
    from .backend import make_backends

    rows: list[Row] = []
    raw: dict[str, object] = {}
    for name in MEASUREMENTS:
        if name not in plan.only:
            continue
        started = time.monotonic()
        log.info("== %s (load average %.1f)", name, load_average())
        if name == "formation":
            from . import formation

            got, data = formation.measure(make_backends(list(plan.backends), durable=True), plan)
        elif name == "store":
            from . import store

            got, data = store.measure(make_backends(list(plan.backends), durable=True), plan)
        elif name == "rerdzv":
            from . import rerdzv

            got, data = rerdzv.measure(make_backends(list(plan.backends), durable=False), plan)
        elif name == "server":
            from . import server_cost

            if "rdzv-server" not in plan.backends:
                continue
            got, data = server_cost.measure(plan)
        elif name == "scale":
            from . import scale

            got, data = scale.measure(plan)
        else:
            from . import ha

            if "rdzv-server" not in plan.backends:
                continue
            got, data = ha.measure(plan)
        rows += got
        raw[name] = {**data, "seconds": time.monotonic() - started}
        log.info("== %s done in %.0f s", name, time.monotonic() - started)
    return rows, raw


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # `timeout` sends SIGTERM: unwind through every finally, which stops the services.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.versus is not None and tuple(args.only) != ("scale",):
        parser.error("--versus compares the scale measurement only: add --only scale")
    plan = make_plan(args)
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(plan.out_dir / "bench.log", mode="w")]
    if args.verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", handlers=handlers)
    for noisy in ("rdzv_client", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.versus is not None:
        from . import scale_versus

        print(scale_versus.measure(plan, args.versus, args.versus_rounds))
        return 0
    # Import torch's registry before rdzv_client.torchrun: the registry loads our entry point.
    import torch.distributed.elastic.rendezvous.registry  # noqa: F401

    started = time.monotonic()
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "load_before": load_average(),
        "plan": {k: v for k, v in plan.__dict__.items() if k != "out_dir"},
    }
    rows, raw = run(plan)
    target.judge(rows)
    meta.update(seconds=time.monotonic() - started, load_after=load_average())
    report.write_json(plan.out_dir / "results.json", rows, raw, meta)
    print(report.table(rows))
    try:
        pictures = report.plots(plan.out_dir, rows, raw)
    except ImportError as exc:  # matplotlib comes with bench/setup.sh; the table and JSON do not need it
        pictures = []
        print(f"\nno plots ({exc}; bash bench/setup.sh installs matplotlib)")
    print(f"\nwrote {plan.out_dir / 'results.json'}, " + ", ".join(str(p) for p in pictures))
    print(f"took {meta['seconds']:.0f} s (load average {meta['load_before']:.1f} -> {meta['load_after']:.1f})")
    if "scale" in raw:
        from .scale import summary

        print(json.dumps(summary(raw["scale"])))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
