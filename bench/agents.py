"""Simulated agents on asyncio: thousands per process, each one torchrun agent on the wire.

What it owns: :class:`Agent`, which speaks to rdzv-server exactly as the torchrun plug-in
(``rdzv_client.torchrun.RdzvServerHandler``) does, and :class:`AgentFleet`, which spreads
the agents of one job over worker processes (one per core) and collects what they saw. The
thread-per-node path through torch's registry (:mod:`bench.nodes`) stays for torch-level
checks at small N; this one exists for N in the thousands, where two threads per agent run
out of threads and the load generator, not the server, is what gets measured.

What an agent does, as the plug-in does it:
- one :class:`rdzv_client.AsyncClient` over one pipelined stream connection
  (:class:`bench.transport.AsyncStreamTransport`, the asyncio twin of the plug-in's
  :class:`~rdzv_client.stream.PipelinedSocketTransport`): every request of the agent
  travels on it, so the server holds one descriptor per agent;
- before its first join the job's policy, fetched (``effective_policy``, an HTTP request)
  unless the server's hello announced that no policy was ever set (policy version 0), and
  before a later join only when an answer reported another version (the plug-in's
  ``NodePolicy``);
- ``next_rendezvous()``: stop watching, ``join`` with ``then_watch`` (no deadline of its
  own, as the plug-in): the server parks the agent's watch of the new round as it answers with
  the assignment, so the watch loop's first watch is that one, not a request sent; then watch
  the new round. A survivor of a re-formation so costs the server its watch's answer, its join
  (and await_round re-polls while the round has not formed) and the assignment;
- the watch loop: ``watch(round, known, hold=max_hold)`` back to back (the long-poll for
  ``num_nodes_waiting``, and the fast death signal while parked) until it sees nodes
  waiting (the agent re-joins: no other long-poll of that round), a failed watch retried
  after ``keep_alive_interval``;
- the beat loop: ``beat`` one-way where the server's hello took it (``Client.beat``), else
  ``watch(round, hold=0)`` (answered at once), while the round is watched, whenever nothing beat the agent (a watch sent or answered, the assignment) for
  TTL/3 (x 0.9-1, jittered; the first one of a round at a random point of the first
  interval, so that agents placed in the same second do not beat together): the same frame
  the plug-in sends, handed to the transport directly (not through the client's retry
  policy, whose per-call CPU, times 16,384 agents on the server's two cores, would be
  measured instead of the server);
- the agent's monitor loop: when the watch sees ``num_nodes_waiting > 0`` the agent
  re-joins. torchrun polls every ``--monitor-interval`` (0.1 s); the agent waits a uniform
  part of it instead of polling (16K agents polling ten times a second would measure the
  simulator), which is when a poll would have seen it.

What it leaves out: the master-port reservation (a bound socket per agent: a descriptor of
the agent's own host, not of the server; agents offer a made-up port), the workers.
The connections open before the common start (preface and hello answered): the formation
clock measures the joins, not the kernel's accept backlog (``net.core.somaxconn``).

Worker protocol (a pipe per worker, parent's commands): ``go`` (every agent joins now),
``stats`` (per round: agents placed in it, the last one's ``time.monotonic()``, errors;
plus the watches answered and the worker's CPU seconds), ``ranks ROUND`` (the node ranks and
world sizes seen), ``kill INDEX`` (the agent's connection is aborted and its tasks end: the
server sees what a dead process leaves), ``stop``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import multiprocessing.connection
import os
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from .backend import LAST_CALL_S
from .process import SPAWN, Timeout, end_processes

#: torchrun's default ``--monitor-interval``.
MONITOR_INTERVAL = 0.1
#: The plug-in's defaults (client/torchrun.py): heartbeat every 2 s, dead after 5 missed.
KEEP_ALIVE_INTERVAL = 2.0
KEEP_ALIVE_MAX_ATTEMPT = 5
#: The plug-in's retry budget (torch's close_timeout).
RETRY_BUDGET = 30.0
#: Opening connections before the start: this many at once per worker (the accept backlog).
CONNECT_IN_FLIGHT = 512
#: Tries to open an agent's connection before the start (see Agent.connect).
CONNECT_ATTEMPTS = 3
#: The cyclic GC of a worker process: the server's thresholds (rdzv_server.server.GC_THRESHOLDS).
#: With Python's defaults (700, 10, 10), a worker's thousands of agents, each with its tasks
#: and futures parked for seconds, had their whole heap walked again and again: 45% of a
#: worker's CPU in gc_collect_main during a 16,384-node re-formation (py-spy --native), CPU
#: the server it measures shares on a small host.
AGENT_GC_THRESHOLDS = (50_000, 100, 10)
#: A worker that hears nothing from the parent this long exits (bounded even if orphaned).
WORKER_LIFETIME = 3600.0


@dataclass(frozen=True)
class AgentSpec:
    """The job every agent of a fleet joins, as ``--rdzv-*`` flags would give it."""

    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    last_call_timeout: float = LAST_CALL_S
    join_timeout: float = 600.0
    keep_alive_interval: float = KEEP_ALIVE_INTERVAL
    keep_alive_max_attempt: int = KEEP_ALIVE_MAX_ATTEMPT

    @property
    def heartbeat_ttl(self) -> float:
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass
class RoundSeen:
    """What one worker's agents saw of one round: how many got a place in it, and when the last did."""

    formed: int = 0
    last: float = 0.0  # time.monotonic() of the last agent to get its assignment
    ranks: list[int] = field(default_factory=list)
    world_sizes: set[int] = field(default_factory=set)


class Agent:
    """One torchrun agent on the wire (see the module docstring)."""

    def __init__(self, spec: AgentSpec, node_id: str, token: str | None, port: int) -> None:
        from rdzv_client import AsyncClient, JobSettings

        from .transport import AsyncStreamTransport

        self.spec = spec
        self.settings = JobSettings(
            spec.min_nodes, spec.max_nodes, spec.last_call_timeout, spec.join_timeout, spec.heartbeat_ttl
        )
        self.node_id = node_id
        self.port = port
        self.transport = AsyncStreamTransport(token=token)
        self.client = AsyncClient(spec.endpoint, retry_budget=RETRY_BUDGET, transport=self.transport)
        self.num_waiting = 0
        self.changed = asyncio.Event()
        self.watches = 0
        self.beats = 0
        self.contact = 0.0  # time.monotonic() of the server's last answer that beat this agent
        self._watching: tuple[int, int] | None = None
        self._generation = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.dead = False
        # The job-policy version taken, as the plug-in's NodePolicy keeps it (None: none yet), and
        # the latest one an answer reported; how many policy fetches the agent made.
        self.policy_taken: int | None = None
        self.policy_latest: int | None = None
        self.policy_fetches = 0

    async def connect(self) -> None:
        """Open the connection (preface, hello) ahead of the start. On a host loaded by other
        work a connect can outlast its timeout in the accept backlog (a SYN dropped, resent
        seconds later): it is tried again, up to :data:`CONNECT_ATTEMPTS` times."""
        from rdzv_client.transport import TransportError

        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                await self.transport.connect(self.client.endpoints[0])
                return
            except TransportError:
                if attempt == CONNECT_ATTEMPTS:
                    raise

    async def next_rendezvous(self) -> Any:
        """The plug-in's next_rendezvous: stop watching, take the job's policy when due, join,
        watch the new round."""
        self._watching = None
        s = self.spec
        await self._take_policy()
        a = await self.client.join(
            s.run_id, node_id=self.node_id, addr="127.0.0.1", nproc_per_node=1,
            settings=self.settings,
            master_port=self.port, timeout=math.inf, then_watch=True,
        )  # fmt: skip
        if self.policy_latest is None or a.policy_version > self.policy_latest:
            self.policy_latest = a.policy_version
        self.num_waiting = 0
        self.changed.clear()
        self.contact = time.monotonic()
        self._generation += 1
        self._watching = (a.round, self._generation)
        self.spawn(self._watch_round(self._watching))
        self.spawn(self._beat_round(self._watching))
        return a

    async def _take_policy(self) -> None:
        """As the plug-in's ``NodePolicy.before_join``: before the first join the policy is
        fetched unless the server's hello said no policy was ever set; before a later one only
        when an answer reported a version other than the one taken. (The simulated agents run on
        their own settings whatever it says: only the requests matter here.)"""
        if self.policy_taken is not None and self.policy_latest == self.policy_taken:
            return
        if self.policy_taken is None and self.policy_latest is None and await self.client.announced_policy_version() == 0:
            self.policy_taken = self.policy_latest = 0
            return
        self.policy_fetches += 1
        doc = await self.client.effective_policy(self.spec.run_id)
        version = doc.get("version")
        self.policy_taken = self.policy_latest = version if isinstance(version, int) else 0

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_round(self, current: tuple[int, int]) -> None:
        from rdzv_client import RdzvError

        round_ = current[0]
        known = 0
        while self._watching == current and not self.dead:
            try:
                self.contact = time.monotonic()  # its arrival beats the agent
                seen = await self.client.watch(self.spec.run_id, self.node_id, round=round_, known=known, hold=math.inf)
            except RdzvError:
                if self._watching != current:
                    return
                await asyncio.sleep(self.spec.keep_alive_interval)
                continue
            self.watches += 1
            if self.policy_latest is None or seen.policy_version > self.policy_latest:
                self.policy_latest = seen.policy_version  # NodePolicy.seen, as the plug-in's watch does
            self.contact = time.monotonic()
            if self._watching != current:
                return
            known = seen.num_nodes_waiting
            self.num_waiting = known
            if known > 0:
                self.changed.set()
                return  # the round is over for this agent, as for the plug-in's NodeLoop: it re-joins

    async def _beat_round(self, current: tuple[int, int]) -> None:
        from rdzv_client import RdzvError, wire
        from rdzv_client.policy import BEAT_JITTER
        from rdzv_client.transport import DEFAULT_REQUEST_TIMEOUT, TransportError

        # The frame the plug-in's client sends for a beat (``watch(..., hold=0.0)``), built once
        # per round and sent straight on the agent's connection: 16,384 agents sharing two cores
        # with the server would otherwise spend more CPU on the client's per-call policy than the
        # server spends answering. (A failed beat is not retried before the next one is due.)
        fields = wire.to_mapping(wire.WatchRequest(node_id=self.node_id, round=current[0], hold=0.0))
        one_way = wire.to_mapping(wire.BeatRequest(node_id=self.node_id, round=current[0]))
        endpoint = self.client.endpoints[0]
        interval = self.spec.heartbeat_ttl / 3
        first = True  # the first beat at a random point of the first interval (as the plug-in)
        while True:
            seen = self.contact
            due = seen + interval * random.uniform(0.0 if first else BEAT_JITTER, 1.0)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self._watching != current or self.dead:
                return
            if self.contact != seen and not first:
                continue  # a watch was sent or answered meanwhile
            first = False
            sent = time.monotonic()
            try:
                # As Client.beat: one-way where the server's hello took it, else the watch of no hold.
                if await self.transport.notify(
                    endpoint, self.spec.run_id, "beat", one_way, answered_within=DEFAULT_REQUEST_TIMEOUT
                ):
                    self.beats += 1
                    self.contact = sent
                    continue
                answer = await self.transport.call(endpoint, self.spec.run_id, "watch", fields, DEFAULT_REQUEST_TIMEOUT)
                self.beats += 200 <= answer.status < 300
            except (TransportError, RdzvError, OSError):  # a lost connection, the client closed
                pass
            self.contact = sent

    def kill(self) -> None:
        """What a SIGKILLed agent leaves: its connection closed by the kernel, nothing more."""
        self.dead = True
        self._watching = None
        self.transport.abort()
        for task in list(self._tasks):
            task.cancel()


async def _life(agent: Agent, seen: dict[int, RoundSeen], errors: list[str], rng: random.Random) -> None:
    """Formation, then a re-join whenever the watch sees nodes waiting (torchrun's monitor loop)."""
    while not agent.dead:
        try:
            a = await agent.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 (reported to the parent)
            if not agent.dead:
                errors.append(f"{agent.node_id}: next_rendezvous: {exc!r}")
            return
        now = time.monotonic()
        got = seen.setdefault(a.round, RoundSeen())
        got.formed += 1
        got.last = max(got.last, now)
        got.ranks.append(a.node_rank)
        got.world_sizes.add(a.num_nodes)
        await agent.changed.wait()
        await asyncio.sleep(rng.uniform(0.0, MONITOR_INTERVAL))


def _worker(conn: multiprocessing.connection.Connection, spec: AgentSpec, first: int, count: int, token: str | None) -> None:
    gc.set_threshold(*AGENT_GC_THRESHOLDS)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("rdzv_client").setLevel(logging.CRITICAL)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_serve(conn, spec, first, count, token))
    except Exception as exc:  # noqa: BLE001 (sent to the parent)
        conn.send(("error", repr(exc)))


async def _serve(conn: multiprocessing.connection.Connection, spec: AgentSpec, first: int, count: int, token: str | None) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(first)
    agents = [Agent(spec, f"sim-{i:06d}", token, 20000 + i % 40000) for i in range(first, first + count)]
    slots = asyncio.Semaphore(CONNECT_IN_FLIGHT)

    async def connect(agent: Agent) -> None:
        async with slots:
            await agent.connect()

    await asyncio.gather(*(connect(a) for a in agents))
    conn.send(("ok", count))
    seen: dict[int, RoundSeen] = {}
    errors: list[str] = []
    lives: list[asyncio.Task[None]] = []
    commands: asyncio.Queue[Any] = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: commands.put_nowait(conn.recv()))
    while True:
        try:
            command = await asyncio.wait_for(commands.get(), WORKER_LIFETIME)
        except asyncio.TimeoutError:
            return
        verb, *args = command
        if verb == "go":
            lives = [asyncio.ensure_future(_life(a, seen, errors, rng)) for a in agents]
            conn.send(("ok", time.monotonic()))
        elif verb == "stats":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            phases = {p: (s.formed, s.last) for p, s in seen.items()}
            answered = sum(a.watches for a in agents), sum(a.beats for a in agents)
            conn.send(("ok", (phases, errors[:5], len(errors), answered, usage.ru_utime + usage.ru_stime)))
        elif verb == "ranks":
            got = seen.get(args[0], RoundSeen())
            conn.send(("ok", (got.ranks, sorted(got.world_sizes))))
        elif verb == "kill":
            agents[args[0]].kill()
            conn.send(("ok", time.monotonic()))
        elif verb == "stop":
            loop.remove_reader(conn.fileno())
            for task in lives:
                task.cancel()
            for agent in agents:
                agent.kill()
            conn.send(("ok", None))
            return


class AgentFleet:
    """The ``nodes`` agents of one job over ``processes`` worker processes. A context manager."""

    def __init__(self, spec: AgentSpec, nodes: int, processes: int, token: str | None) -> None:
        self.spec = spec
        self.nodes = nodes
        per = math.ceil(nodes / processes)
        self.shares = [(first, min(per, nodes - first)) for first in range(0, nodes, per)]
        self.token = token
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []

    def __enter__(self) -> AgentFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self, timeout: float) -> None:
        """Spawn the workers; return once every agent's connection is open."""
        for first, count in self.shares:
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(target=_worker, args=(child, self.spec, first, count, self.token), daemon=True)
            proc.start()
            child.close()
            self._pipes.append(parent)
            self._procs.append(proc)
        self._all(None, timeout, "every agent's connection to open")

    def _all(self, command: tuple[Any, ...] | None, timeout: float, what: str) -> list[Any]:
        if command is not None:
            for pipe in self._pipes:
                pipe.send(command)
        deadline = time.monotonic() + timeout
        out = []
        for pipe in self._pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise Timeout(f"{what}: not within {timeout:g} s")
            kind, value = pipe.recv()
            if kind == "error":
                raise RuntimeError(f"an agent worker failed: {value}")
            out.append(value)
        return out

    def go(self) -> float:
        """Every agent joins now; returns the monotonic time just before."""
        t = time.monotonic()
        self._all(("go",), 60.0, "the workers to start their agents")
        return t

    def stats(self) -> tuple[dict[int, tuple[int, float]], list[str], tuple[int, int], float]:
        """Per round (agents placed in it, time of the last), errors, (watches, beats) answered,
        workers' CPU s."""
        phases: dict[int, tuple[int, float]] = {}
        errors: list[str] = []
        watches = beats = 0
        cpu = 0.0
        for got, errs, _, (watched, beat), seconds in self._all(("stats",), 60.0, "the workers' stats"):
            for p, (n, last) in got.items():
                had = phases.get(p, (0, 0.0))
                phases[p] = (had[0] + n, max(had[1], last))
            errors += errs
            watches += watched
            beats += beat
            cpu += seconds
        return phases, errors, (watches, beats), cpu

    def wait_formed(self, after: int, nodes: int, timeout: float) -> tuple[int, float]:
        """Wait until ``nodes`` agents hold an assignment of one round later than ``after``;
        that round and the time its last agent got it. Rounds that formed without everyone
        (nodes dropped and re-joined under load) are passed over: their time counts."""
        deadline = time.monotonic() + timeout
        while True:
            rounds, errors, _, _ = self.stats()
            if errors:
                raise RuntimeError(f"agents failed: {errors[0]}")
            full = sorted(r for r, (formed, _) in rounds.items() if r > after and formed >= nodes)
            if full:
                return full[0], rounds[full[0]][1]
            if time.monotonic() >= deadline:
                best = max((formed for r, (formed, _) in rounds.items() if r > after), default=0)
                raise Timeout(
                    f"{nodes} agents to hold a place in one round after round {after}: at most {best} "
                    f"(rounds {sorted(r for r in rounds if r > after)[-5:]}) within {timeout:g} s"
                )
            time.sleep(0.1)

    def ranks(self, round_: int) -> tuple[list[int], list[int]]:
        ranks: list[int] = []
        sizes: set[int] = set()
        for got, world_sizes in self._all(("ranks", round_), 60.0, "the ranks"):
            ranks += got
            sizes.update(world_sizes)
        return ranks, sorted(sizes)

    def kill(self, node: int) -> float:
        """Kill agent ``node`` (its connection aborted); the monotonic time just before."""
        for index, (first, count) in enumerate(self.shares):
            if first <= node < first + count:
                t = time.monotonic()
                self._pipes[index].send(("kill", node - first))
                self._pipes[index].recv()
                return t
        raise ValueError(f"no agent {node}")

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        end_processes(self._procs, grace=10.0)
        for pipe in self._pipes:
            pipe.close()


def raise_open_files(needed: int) -> str:
    """Lift this process's soft open-files limit to the hard one (children inherit it).

    Returns '' when ``needed`` descriptors fit, else what to raise, exactly.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return ""
    return (
        f"the open-files limit is {soft} (hard {hard}) and this run needs about {needed}: raise the hard limit "
        f"(as root: `ulimit -Hn {needed}` in the shell that runs the bench, `LimitNOFILE={needed}` for a "
        f"systemd unit, or `* hard nofile {needed}` in /etc/security/limits.conf), then run it again"
    )


def worker_count() -> int:
    """One worker process per core, the server's core left to it where there are several."""
    cores = os.cpu_count() or 1
    return max(1, cores - 1) if cores > 2 else cores
