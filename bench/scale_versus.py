"""``python -m bench --only scale --sizes N --versus REV``: the scale measurements of this tree
and of an older revision in one run, alternated, with the ratios (issue 29).

What it owns: one comparison of :mod:`bench.scale` between trees. Each tree is measured by
its OWN ``bench.scale``, run by its own interpreter from its own checkout, so each brings its
own server and its own simulated agents (an older tree's agents speak its protocol, as its
plug-in did): a child process per measurement runs that tree's ``bench.__main__.make_plan``
and ``bench.scale.measure`` for one size and prints the run as JSON. The trees take turns
(this tree, REV, then REV, this tree, ... ``--versus-rounds`` times each: :func:`turns`), so a
change in the machine's load falls on both; the table gives each figure's median per tree and the ratio
this tree / REV.

The revision's checkout and virtual environment are :func:`bench.lab.versus.revision_tree`'s
(made once under its ``--work`` folder, kept for the next run); psutil is added to that
environment when missing (``bench.scale`` reads the server's descriptors and CPU with it).

Both trees' simulated agents run with the same cyclic-GC thresholds (:data:`AGENT_SITE`, a
``sitecustomize`` on the children's path that sets them in each agent worker process): with
Python's defaults an older tree's agents spent about half their CPU walking their heap, CPU
taken from the server they measure when the host is small, and a ratio of the trees should
compare their servers and protocols, not which tree's load generator tuned its GC.

What it must not know: how ``bench.scale`` measures (only the names of the figures in its
run record, which have not changed since issue 17: a figure a revision lacks prints ``-``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .agents import AGENT_GC_THRESHOLDS
from .lab.versus import WORK, revision_tree
from .result import Plan, load_average

log = logging.getLogger("bench")

THIS = "this tree"
#: What the child prints before its run record (the last line of its stdout).
MARK = "bench-scale-versus: "
#: The child: a tree's own bench, one size. Written against bench's oldest scale interface
#: (``make_plan(build_parser().parse_args(...))``, ``scale.measure(plan)``).
CHILD = """
import json, logging, signal, sys
from bench.__main__ import build_parser, make_plan
from bench import scale
def stop(signum, frame):
    raise SystemExit(128 + signum)  # unwind: bench.scale's finally stops the server and the agents
signal.signal(signal.SIGTERM, stop)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
plan = make_plan(build_parser().parse_args(sys.argv[1:]))
plan.log_dir.mkdir(parents=True, exist_ok=True)
rows, raw = scale.measure(plan)
run = (raw.get("sizes") or [{}])[0]
failed = [f"{r.metric}: {r.status} ({r.detail})" for r in rows if r.status != "ok"]
print("MARK" + json.dumps({"run": run, "failed": failed}, default=str))
""".replace("MARK", MARK)

#: The ``sitecustomize`` both trees' children get: their agent worker processes (started by
#: multiprocessing's spawn) use the GC thresholds of this tree's agents (bench.agents).
AGENT_SITE = """
import gc, sys
if "--multiprocessing-fork" in sys.argv:
    gc.set_threshold(*THRESHOLDS)
"""
#: Runs of a child that end with no record before the run counts as failed.
CHILD_ATTEMPTS = 2
#: How long a stopped child may take to stop its server and agents.
STOP_GRACE = 60.0
#: The table: (label, unit, how to read it from a run record; None where the run lacks it).
FIGURES: list[tuple[str, str, Any]] = [
    ("formation", "s", lambda r: r.get("formation_s")),
    ("re-formation (kill)", "s", lambda r: r.get("reform_s")),
    # Only of a re-formation that completed with the right ranks (a failed one keeps its CPU).
    ("re-formation: server CPU", "s", lambda r: r.get("reform_server_cpu_s") if r.get("reform_s") else None),
    ("re-formation: requests", "", lambda r: sum(r["reform_requests"].values()) if r.get("reform_s") else None),
    # The simulated agents share the server's cores here: their CPU is part of the time above.
    ("re-formation: agents CPU", "s", lambda r: r.get("reform_agents_cpu_s") if r.get("reform_s") else None),
    ("heartbeat CPU", "% core", lambda r: r.get("heartbeat_cpu")),
    ("beats answered", "/s", lambda r: r.get("beats_per_s")),
    # A beat's share of the server's CPU while the agents heartbeat (watches re-sent included).
    ("per-beat server CPU", "µs", lambda r: r["heartbeat_cpu"] * 1e4 / r["beats_per_s"] if r.get("beats_per_s") else None),
    ("server fds per node", "fds", lambda r: r["server_fds"] / r["nodes"] if r.get("server_fds") else None),
    ("server RSS", "MB", lambda r: r.get("server_rss_mb")),
    # Nodes dropped by the TTL (alive, polling too late): 0 on a host with CPU to spare; a run
    # with thousands measured the host's overload, not the tree.
    ("TTL expiries", "nodes", lambda r: r.get("expired_by_ttl")),
]


def turns(names: list[str], round_: int) -> list[str]:
    """The order the trees run in round ``round_`` (1-based): as given in odd rounds, reversed in
    even ones (ABBA...): the first run on a machine just started is the slowest (a cold page
    cache; on the 16-core hosts lent it was this tree's, always first, 0.3-1.2 s slower than
    its other runs' formation), and it must not always fall on the same tree."""
    return names if round_ % 2 else names[::-1]


def measure(plan: Plan, rev: str, rounds: int, work: Path = WORK) -> str:
    """Measure every size of ``plan`` on this tree and on ``rev``, ``rounds`` times each,
    alternated; return the table. The run records go to ``plan.out_dir / "versus.json"``."""
    work.mkdir(parents=True, exist_ok=True)
    python, tree = revision_tree(rev, work)
    _ensure_psutil(python)
    trees = {THIS: (sys.executable, Path(__file__).resolve().parents[1]), rev: (python, tree)}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    failures: list[str] = []
    for n in plan.scale_sizes:
        runs[n] = {name: [] for name in trees}
        for round_ in range(1, rounds + 1):
            for name in turns(list(trees), round_):
                interpreter, root = trees[name]
                log.info("scale versus: %s, %d nodes, round %d/%d (load %.1f)", name, n, round_, rounds, load_average())
                run, failed = _child(plan, interpreter, root, n, plan.out_dir / "versus" / f"{_slug(name)}-{n}-{round_}")
                runs[n][name].append(run)
                failures += [f"{name}, {n} nodes, round {round_}: {f}" for f in failed]
    (plan.out_dir / "versus.json").write_text(json.dumps({str(n): r for n, r in runs.items()}, indent=1, default=str))
    return table(runs, rev, failures)


def table(runs: dict[int, dict[str, list[dict[str, Any]]]], rev: str, failures: list[str]) -> str:
    lines = []
    for n, by_tree in runs.items():
        count = max(len(v) for v in by_tree.values())
        loads = [r[k] for v in by_tree.values() for r in v for k in ("load_before", "load_after") if k in r]
        load = f"load average {min(loads):.1f}-{max(loads):.1f}" if loads else "load average unknown"
        lines.append(f"scale, {n} nodes: this tree against {rev}, medians of {count} run(s) each, alternated; {load}")
        lines.append(f"{'figure':<26} {'unit':<7} {THIS:>11} {rev:>11} {'ratio':>7}")
        for label, unit, read in FIGURES:
            mine, theirs = (_median([read(r) for r in by_tree[name]]) for name in (THIS, rev))
            ratio = f"{mine / theirs:.2f}" if mine is not None and theirs else "-"
            lines.append(f"{label:<26} {unit:<7} {_show(mine):>11} {_show(theirs):>11} {ratio:>7}")
        for name, values in by_tree.items():
            each = ", ".join(f"{r['reform_s']:.2f} s {r.get('reform_requests')}" for r in values if r.get("reform_s"))
            lines.append(f"  {name}: re-formation per run: {each or '-'}")
    lines += [f"FAILED {f}" for f in failures]
    return "\n".join(lines)


def _child(plan: Plan, python: str, root: Path, n: int, out: Path) -> tuple[dict[str, Any], list[str]]:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--only", "scale", "--sizes", str(n), "--scale-seconds", f"{plan.scale_seconds:g}",
            "--timeout", f"{plan.timeout:g}", "--out", str(out)]  # fmt: skip
    # The tree's own packages: its checkout first on the path (cwd), no path of ours inherited
    # but the agents' sitecustomize (AGENT_SITE), the same for every tree.
    site = out.parent / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(AGENT_SITE.replace("THRESHOLDS", repr(AGENT_GC_THRESHOLDS)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    for attempt in range(1, CHILD_ATTEMPTS + 1):
        # A child that ends with no record failed before measuring anything (on a loaded host,
        # mostly: an older tree's agents give up opening 16,384 connections): once more.
        with open(out / f"child-{attempt}.log", "w") as err:
            child = subprocess.Popen([python, "-c", CHILD, *argv], cwd=root, env=env, stdout=subprocess.PIPE,
                                     stderr=err, text=True)
            try:
                stdout, _ = child.communicate()
            except BaseException:  # stopped (SIGTERM, ^C): the child stops its server and agents first
                child.terminate()
                child.wait(STOP_GRACE)
                raise
        record = [line for line in stdout.splitlines() if line.startswith(MARK)]
        if record:
            break
        log.info("scale versus: the child exited %d with no record (%s)", child.returncode, out / f"child-{attempt}.log")
    else:
        return {"nodes": n}, [f"the child exited {child.returncode} with no record (see {out}/child-*.log)"]
    got = json.loads(record[-1].removeprefix(MARK))
    return got["run"], got["failed"]


def _ensure_psutil(python: str) -> None:
    if subprocess.run([python, "-c", "import psutil"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "psutil>=5.9"], check=True)


def _median(values: list[Any]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


def _show(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)
