"""What a run leaves behind: the table on stdout, ``results.json`` and the PNG plots.

What it owns: rendering rows (bench.result) for people and for machines. It measures
nothing and judges nothing (bench.target does).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .result import Row

#: Table columns: header and width.
COLUMNS = (("measurement", 10), ("backend", 22), ("metric", 30), ("N", 7), ("value", 16), ("target", 30), ("result", 6))


def fmt_value(row: Row) -> str:
    if row.value is None:
        return row.status
    v = row.value
    if row.unit in ("ops/s", "beats/s"):
        return f"{v:,.0f} {row.unit}"
    if row.unit == "µs":
        return f"{v:,.0f} µs" if v >= 100 else f"{v:.1f} µs"
    if row.unit == "s":
        return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"
    return f"{v:,.1f} {row.unit}"


def table(rows: list[Row]) -> str:
    """A fixed-width table, one row per figure, with PASS/MISS where a target applies."""
    lines = ["  ".join(name.ljust(width) for name, width in COLUMNS)]
    lines.append("  ".join("-" * width for _, width in COLUMNS))
    for r in rows:
        result = "" if r.passed is None else ("PASS" if r.passed else "MISS")
        cells = (r.measurement, r.backend, r.metric, "" if r.n is None else str(r.n), fmt_value(r), r.target, result)
        lines.append("  ".join(str(c)[:w].ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip())
        if r.status not in ("ok",) and r.detail:
            lines.append(" " * 12 + f"({r.detail[:160]})")
    missed = [r for r in rows if r.passed is False]
    judged = [r for r in rows if r.passed is not None]
    lines.append("")
    lines.append(f"targets: {len(judged) - len(missed)} PASS, {len(missed)} MISS")
    return "\n".join(lines)


def write_json(path: Path, rows: list[Row], raw: dict[str, Any], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "rows": [asdict(r) for r in rows], "raw": raw}
    path.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")


def plots(out_dir: Path, rows: list[Row], raw: dict[str, Any]) -> list[Path]:
    """Draw every plot the rows allow; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, draw in (
        ("formation.png", _formation),
        ("store_latency.png", _store_latency),
        ("store_throughput.png", _store_throughput),
        ("rerdzv.png", _rerdzv),
        ("server.png", _server),
    ):
        path = out_dir / name
        if draw(path, rows, raw):
            written.append(path)
    return written


def _series(rows: list[Row], measurement: str, metric: str) -> dict[str, list[tuple[int, Row]]]:
    out: dict[str, list[tuple[int, Row]]] = defaultdict(list)
    for r in rows:
        if r.measurement == measurement and r.metric == metric and r.n is not None:
            out[r.backend].append((r.n, r))
    return out


def _formation(path: Path, rows: list[Row], raw: dict[str, Any]) -> bool:
    import matplotlib.pyplot as plt

    series = _series(rows, "formation", "formation time")
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    failed: list[tuple[int, str]] = []
    for backend, points in series.items():
        ok = [(n, r.value) for n, r in points if r.value is not None]
        line = ax.plot(*zip(*ok), marker="o", label=backend)[0] if ok else None
        color = line.get_color() if line is not None else "red"
        failed += [(n, color) for n, r in points if r.status in ("timeout", "error")]
    top = ax.get_ylim()[1]
    for n, color in failed:  # at the top edge, in the backend's colour
        ax.scatter([n], [top], marker="x", s=80, color=color, clip_on=False)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("time until every node holds its RendezvousInfo (s)")
    ax.set_title("Formation time (x at the top: timed out or failed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _store_latency(path: Path, rows: list[Row], raw: dict[str, Any]) -> bool:
    import matplotlib.pyplot as plt

    ops = ["set", "get", "add", "compare_set", "multi_get"]
    backends = list(dict.fromkeys(r.backend for r in rows if r.measurement == "store"))
    if not backends:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        p50 = [_value(rows, backend, f"{op} p50", 1) for op in ops]
        p99 = [_value(rows, backend, f"{op} p99", 1) for op in ops]
        xs = [k + i * width for k in range(len(ops))]
        ax.bar(xs, [v or 0 for v in p50], width, label=backend)
        ax.scatter(xs, [v or math.nan for v in p99], marker="_", color="black", s=80)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ops))], ops)
    ax.set_yscale("log")
    ax.set_ylabel("latency (µs): bar p50, dash p99")
    ax.set_title("Store operation latency, one client")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _store_throughput(path: Path, rows: list[Row], raw: dict[str, Any]) -> bool:
    import matplotlib.pyplot as plt

    series = _series(rows, "store", "throughput")
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for backend, points in series.items():
        ok = [(n, r.value) for n, r in points if r.value is not None]
        if ok:
            ax.plot(*zip(*ok), marker="o", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("ops/s (set/get mix)")
    ax.set_title("Store throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _rerdzv(path: Path, rows: list[Row], raw: dict[str, Any]) -> bool:
    import matplotlib.pyplot as plt

    metrics = list(dict.fromkeys(r.metric for r in rows if r.measurement == "rerdzv"))
    if not metrics:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    for metric in metrics:
        for backend, points in _series(rows, "rerdzv", metric).items():
            ok = [(n, r.value) for n, r in points if r.value is not None]
            if ok:
                ax.plot(*zip(*ok), marker="o", label=f"{backend}: {metric}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("seconds after the failure (replacement: after its join)")
    ax.set_title("Re-rendezvous after a node failure")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _server(path: Path, rows: list[Row], raw: dict[str, Any]) -> bool:
    import matplotlib.pyplot as plt

    data = raw.get("server", {}).get("heartbeats")
    if not data or not data.get("samples"):
        return False
    t, cpu, rss = zip(*data["samples"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(t, cpu, marker=".", color="tab:red", label="CPU (% of one core)")
    ax.set_xlabel("seconds into the sample window")
    ax.set_ylabel("CPU %", color="tab:red")
    ax2 = ax.twinx()
    ax2.plot(t, rss, marker=".", color="tab:blue", label="RSS (MB)")
    ax2.set_ylabel("RSS (MB)", color="tab:blue")
    ax.set_title(
        f"rdzv-server holding {data['jobs']}x{data['nodes']} nodes, {data['beats_per_s']:.0f} beats/s "
        f"(asked {data['asked_per_s']:.0f})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _value(rows: list[Row], backend: str, metric: str, n: int) -> float | None:
    row = next((r for r in rows if r.backend == backend and r.metric == metric and r.n == n), None)
    return None if row is None else row.value
