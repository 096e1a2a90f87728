"""Scale: one job of thousands of agents against one server (issue 17).

How, per size N: a memory-mode server on 127.0.0.1; N simulated agents (:mod:`bench.agents`,
asyncio, one worker process per core, one pipelined stream connection per agent, each
speaking the plug-in's protocol) in one job with ``min_nodes = N-1``, ``max_nodes = N``,
``last_call_timeout`` 1 s (the re-rendezvous measurement's) and the plug-in's heartbeat
defaults (every 2 s, TTL 10 s: each agent beats every TTL/3, one-way where the server's hello
takes it (a watch of no hold to an older server), while its watch proper is held up to
``max_hold``, 30 s, and re-sent at once). Automatic quarantine is
off: every simulated agent is on 127.0.0.1, so a few deaths would cordon all of them.

- ``formation_s``: from the common start (every agent sends its join) to the last agent
  holding its assignment of the first round that holds all N (on an overloaded host nodes
  can drop out of line and re-join: the later round's time counts). Ranks must be 0..N-1
  once each, every world size N.
- ``server_fds``, ``server_rss_mb``: the server's descriptors and RSS once every agent
  watches (steady state), read by psutil; ``rss_per_node_kb`` is the growth over the idle
  server, per agent.
- ``heartbeat_cpu``: the server's CPU while every agent heartbeats for ``--scale-seconds``
  (default 30), in % of one core; ``watches_per_s`` are the watches answered and
  ``beats_per_s`` the beats taken (a one-way beat counts when sent: the server answers none),
  ``requests_per_s`` both.
- ``reform_s``: one agent is killed (its connection aborted, as the kernel does for a dead
  process); from the kill to the last survivor holding its assignment of the next round.
  It includes the server's disconnect grace (0.5 s) and the round's last call (1 s: N-1
  survivors are ``min_nodes``, not ``max_nodes``). Ranks must be 0..N-2; the round is the
  first after the formation's that holds N-1 agents.

The agents and the server share the machine: the table's detail says the load average and
the agents' own CPU. The last line :func:`summary` gives is the JSON the issue asks for.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .agents import AgentFleet, AgentSpec, raise_open_files, worker_count
from .backend import LAST_CALL_S
from .backend.rdzv_server import start_server
from .process import Timeout, Unavailable
from .result import Plan, Row, load_average

log = logging.getLogger("bench")

#: Steady state: the agents' first watches are parked this long after the last assignment.
SETTLE_S = 3.0
#: Descriptors a process needs besides one per connection (log files, pipes, the loop).
FD_SLACK = 512


def measure(plan: Plan) -> tuple[list[Row], dict[str, object]]:
    rows: list[Row] = []
    runs: list[dict[str, Any]] = []
    for n in plan.scale_sizes:
        got, run = _one(plan, n)
        rows += got
        if run is not None:
            runs.append(run)
    return rows, {"sizes": runs}


def summary(raw: dict[str, Any]) -> dict[str, Any]:
    """``{"scale": [{"nodes", "formation_s", "reform_s", "server_fds", "server_rss_mb", "heartbeat_cpu"}, ...]}``."""
    keys = ("nodes", "formation_s", "reform_s", "server_fds", "server_rss_mb", "heartbeat_cpu")
    return {"scale": [{k: run.get(k) for k in keys} for run in raw.get("sizes", [])]}


def _one(plan: Plan, n: int) -> tuple[list[Row], dict[str, Any] | None]:
    import psutil
    from rdzv_client.credential import find_token

    workers = worker_count()
    fail = lambda metric, unit, status, why: [Row.failed("scale", "rdzv-server", metric, n, unit, status, why)]  # noqa: E731
    if n < 2:
        return fail("formation", "s", "error", "a scale job needs at least 2 agents (one is killed)"), None
    short = raise_open_files(n + FD_SLACK)
    if short:
        return fail("formation", "s", "unavailable", short), None
    try:
        server, endpoint = start_server(f"rdzv-server-scale-{n}", ["--memory"], plan.log_dir)
    except (Unavailable, Timeout) as exc:
        return fail("formation", "s", "error", str(exc)), None
    run: dict[str, Any] = {"nodes": n, "workers": workers, "load_before": load_average()}
    rows: list[Row] = []
    try:
        proc = psutil.Process(server.pid)
        rss_idle = proc.memory_info().rss / 1e6
        fds_idle = proc.num_fds()
        spec = AgentSpec(endpoint, f"scale-{n}", min_nodes=n - 1, max_nodes=n, last_call_timeout=LAST_CALL_S)
        with AgentFleet(spec, n, workers, find_token(None, None)) as fleet:
            t_open = time.monotonic()
            fleet.start(plan.timeout + n / 100)
            run["connect_s"] = time.monotonic() - t_open
            # -- formation
            t0 = fleet.go()
            try:
                formed, last = fleet.wait_formed(-1, n, plan.timeout)
                run["formation_s"] = last - t0
                run["formation_round"] = formed
            except (Timeout, RuntimeError) as exc:
                return fail("formation", "s", "timeout" if isinstance(exc, Timeout) else "error", str(exc)), run
            ranks, sizes = fleet.ranks(formed)
            wrong = _ranks_wrong(ranks, sizes, n)
            if wrong:
                return fail("formation", "s", "error", wrong), run
            # -- steady state: descriptors, memory
            time.sleep(SETTLE_S)
            run["server_fds"] = proc.num_fds()
            rss = proc.memory_info().rss / 1e6
            run["server_rss_mb"] = round(rss, 1)
            run["rss_per_node_kb"] = round((rss - rss_idle) * 1e3 / n, 2)
            run["fds_idle"] = fds_idle
            # -- heartbeats
            log.info(
                "scale %d: formed in %.1f s; sampling the server's CPU for %g s of heartbeats",
                n, run["formation_s"], plan.scale_seconds,
            )  # fmt: skip
            _, _, (watches0, beats0), agents_cpu0 = fleet.stats()
            proc.cpu_percent(None)
            times0 = proc.cpu_times()
            t_beat = time.monotonic()
            samples = []
            while time.monotonic() - t_beat < plan.scale_seconds:
                time.sleep(1.0)
                samples.append(proc.cpu_percent(None))
            beat_s = time.monotonic() - t_beat
            times1 = proc.cpu_times()
            # User (Python, the loop) against system (the kernel's recv/send on its behalf) CPU.
            run["heartbeat_cpu_user"] = round(100 * (times1.user - times0.user) / beat_s, 1)
            run["heartbeat_cpu_system"] = round(100 * (times1.system - times0.system) / beat_s, 1)
            _, _, (watches1, beats1), agents_cpu1 = fleet.stats()
            run["heartbeat_cpu"] = round(sum(samples) / len(samples), 1)
            run["watches_per_s"] = round((watches1 - watches0) / beat_s)
            run["beats_per_s"] = round((beats1 - beats0) / beat_s)
            run["requests_per_s"] = run["watches_per_s"] + run["beats_per_s"]
            run["agents_cpu"] = round(100 * (agents_cpu1 - agents_cpu0) / beat_s, 1)
            run["load_heartbeats"] = load_average()
            # -- re-formation after a kill
            log.info("scale %d: killing one agent", n)
            server_cpu0 = _cpu_seconds(proc)
            _, _, _, agents_cpu0 = fleet.stats()
            served0 = _served(endpoint)
            t_kill = fleet.kill(n // 2)
            try:
                reformed, last = fleet.wait_formed(formed, n - 1, plan.timeout)
                run["reform_s"] = last - t_kill
                run["reform_round"] = reformed
                # Who was busy meanwhile (CPU s, to the last stats call: a little past the end).
                run["reform_server_cpu_s"] = round(_cpu_seconds(proc) - server_cpu0, 2)
                run["reform_agents_cpu_s"] = round(fleet.stats()[3] - agents_cpu0, 2)
                served = _served(endpoint)
                run["reform_requests"] = {
                    op: count - served0.get(op, 0) for op, count in sorted(served.items()) if count > served0.get(op, 0)
                }
            except (Timeout, RuntimeError) as exc:
                rows += fail("re-formation", "s", "timeout" if isinstance(exc, Timeout) else "error", str(exc))
            else:
                ranks, sizes = fleet.ranks(reformed)
                wrong = _ranks_wrong(ranks, sizes, n - 1)
                if wrong:
                    rows += fail("re-formation", "s", "error", wrong)
                    del run["reform_s"]
            run["server_rss_mb_max"] = round(max(rss, proc.memory_info().rss / 1e6), 1)
    finally:
        server.stop()
    # Nodes the server dropped by the heartbeat TTL (alive, but their polls came too late): 0
    # unless the host is overloaded; each one re-joins, and a member's departure re-forms.
    run["expired_by_ttl"] = server.log_path.read_text(errors="replace").count("departed (heartbeat_expired)")
    run["load_after"] = load_average()
    load = f"load {run['load_before']:.1f}->{run['load_after']:.1f}"
    rows.insert(0, Row("scale", "rdzv-server", "formation", n, run["formation_s"], "s",
                       detail=f"{workers} agent processes; connections opened first in {run['connect_s']:.1f} s; "
                              f"{run['expired_by_ttl']} TTL expiries; {load}"))
    if "reform_s" in run:
        rows.append(Row("scale", "rdzv-server", "re-formation (kill)", n, run["reform_s"], "s",
                        detail=f"incl. disconnect grace 0.5 s + last call {LAST_CALL_S:g} s; CPU meanwhile: server "
                               f"{run.get('reform_server_cpu_s')} s, agents {run.get('reform_agents_cpu_s')} s; "
                               f"requests {run.get('reform_requests')}"))
    rows += [
        Row("scale", "rdzv-server", "server fds per node", n, run["server_fds"] / n, "fds",
            detail=f"{run['server_fds']} fds ({run['fds_idle']} idle)"),
        Row("scale", "rdzv-server", "server RSS", n, run["server_rss_mb"], "MB",
            detail=f"{run['rss_per_node_kb']} KB per node over the idle server"),
        Row("scale", "rdzv-server", "heartbeat CPU", n, run["heartbeat_cpu"], "% core",
            detail=f"{run['heartbeat_cpu_user']}% user + {run['heartbeat_cpu_system']}% system; "
                   f"{run['beats_per_s']} beats/s + {run['watches_per_s']} watches/s answered; "
                   f"agents used {run['agents_cpu']}% of a core; "
                   f"load {run['load_heartbeats']:.1f}"),
    ]  # fmt: skip
    return rows, run


def _served(endpoint: str) -> dict[str, int]:
    """Requests the server answered so far, by operation (its ``/metrics``, which need no token)."""
    import urllib.request

    counts: dict[str, int] = {}
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("rdzv_requests_total{"):
                op = line.split('op="', 1)[1].split('"', 1)[0]
                counts[op] = counts.get(op, 0) + int(float(line.rsplit(" ", 1)[1]))
    return counts


def _cpu_seconds(proc: Any) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _ranks_wrong(ranks: list[int], sizes: list[int], n: int) -> str:
    """'' when ``ranks`` are 0..n-1 once each and every world size is n; else what is wrong."""
    if sorted(ranks) != list(range(n)):
        return f"node ranks are not 0..{n - 1} once each ({len(ranks)} ranks, {len(set(ranks))} distinct)"
    if sizes != [n]:
        return f"world sizes {sizes[:5]} != {n}"
    return ""
