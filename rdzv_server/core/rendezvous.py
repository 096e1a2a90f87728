"""The rendezvous state machine of one job: membership, rounds, ranks, liveness.

Everything that affects transitions lives here. The job is in one of three states
(:class:`JobState`); every change is an :class:`Event` looked up in ``_TRANSITIONS``;
a pair missing from the table raises :class:`IllegalTransition` (a server bug, never a
client's fault). Time is always an argument (``now``, seconds on the server's clock).

An event's handler does only what the event itself does (add, re-join or remove a node,
close the job, form the round whose last call passed). What follows from the resulting
*state* is :meth:`Job.settle`, which the one dispatcher (``_dispatch``) runs after every
event, so no handler can forget it: its rules (``_SETTLE_RULES``: complete the round,
arm or clear the last call, open the next round for the nodes in line, stop the clocks
of a formed round's spares) re-run until none changes anything (a fixed point, as in
h11's ``_state.py``; bounded by ``MAX_SETTLE_PASSES``), then the job's idleness is noted.
A multi-node expiry settles after each departure, as each departure is its own event.

A node's role changes only through ``_set``, which checks ``_NODE_TRANSITIONS`` (the
allowed (role, liveness) pairs before and after) and raises
:class:`IllegalNodeTransition` on any other change.

Roles of a node (:class:`Role`):
- CANDIDATE: joined the round that is forming (state OPEN).
- WAITING: arrived after the round formed, fits in the next one (counts in num_nodes_waiting).
- STANDBY: arrived when ``max_nodes`` were already in; admitted when a slot frees (torch's
  redundancy list: a spare).
- MEMBER: in the last formed round's membership (``members``, node_rank order). A member
  is ALIVE, DEAD (heartbeat TTL or dropped connection) or LEFT (graceful shutdown).

Rules:
1. The first join (or an explicit create) fixes the settings. A later join with other
   settings is :class:`SettingsConflict`, unless the job is idle (no node alive or
   pending), in which case the new settings are adopted (a fresh run under the same id).
2. A round completes (OPEN -> COMPLETE):
   a. at once when ``max_nodes`` candidates have joined;
   b. at once when every alive member of the previous round has re-joined and
      candidates + standby reach ``max_nodes``;
   c. when candidates + standby reach ``min_nodes`` and ``last_call_timeout`` has then
      passed (the deadline is set when the count first reaches ``min_nodes`` and cleared
      when it drops below).
   Admission order: returning members by their old node_rank, then waiting and new
   nodes by arrival, then standby by arrival; the first ``max_nodes`` are the round, the
   rest stay standby. Node ranks: survivors keep theirs, the others fill the vacancies by
   topology path, then natural host order (see ``rank.place``).
3. A join while COMPLETE: from a member (its workers restarted) opens the next round;
   from another node it is WAITING if alive members + waiting < ``max_nodes``, else
   STANDBY. If no member is alive any more, any join opens the next round.
4. ``num_nodes_waiting`` for an agent in round r: while round r is the formed round,
   waiting nodes plus dead members (so survivors restart at once instead of waiting for a
   collective to time out); once a later round is open or formed, at least 1.
   Standby nodes do not count: a full round keeps running.
5. Departures: a pending node that leaves, dies (heartbeat TTL, or a dropped connection)
   or passes ``join_timeout`` is removed; a member that dies or leaves is marked so; if
   no member is alive and nodes are in line, the next round opens for them.
   ``join_timeout`` bounds a node's wait for a round to *form*. It runs for candidates
   and waiting nodes from their join (a member's from its re-join), and for a standby
   node only while a round forms (OPEN), from the moment that round opened: a spare
   that waited for hours still gets the whole timeout to be placed, and one that cannot
   be placed does not wait forever. A standby node of a formed (or closed) round is a
   spare of a running job: no join_timeout at all (torch exempts its redundancy list
   alike); it stays until it is placed, leaves, dies by the TTL, or the job closes.
6. CLOSED: joins fail with :class:`JobClosed` while any node of the job is alive or
   pending (their agents must stop). Once every node has departed, the next join starts
   a fresh run under the same id (new settings allowed, next round number, and the
   caller clears the keys: ``runs`` counts these restarts). torchrun closes a job when an
   agent finishes, so this is what lets a user run the same command again.
   A standby or waiting node still in line when the job closes was waiting for a round
   that will never come and was no part of the run: it gets :class:`JobClosedInLine`
   (its agent exits gracefully, as torch's redundancy list does); a candidate (a
   participant of the round that was forming) and a member get :class:`JobClosed`.

7. The job-wide restart budget (``max_restarts``; none: unlimited). A failure is a live
   member's death while its round runs (COMPLETE), or a live member re-joining its formed
   round while nothing else asks for a restart (no waiting node, no dead member: its
   workers failed). The first failure of a formed round counts one restart
   (``restart_counted``); later ones of the same round re-form nothing more and count
   nothing. Scale-up and spares filling in are not failures. A failure when ``restarts``
   already equals the budget closes the job with cause ``restart_budget_exhausted``; every
   node then gets :class:`JobClosed` naming it. A fresh run of a closed job starts with the
   whole budget again.
8. The crash-loop rule (``core/progress.py``; ``min_round_seconds``, ``max_fast_failures``),
   beside rule 7 and independent of its budget: a round that ends by a failure (rule 7's
   re-join, not a death) is judged; a fast failure is a ``fast_failure`` event, and
   ``max_fast_failures`` of them in a row close the job with cause ``restart_storm``; every
   node then gets :class:`JobClosed` naming it. A re-join carries the highest step its node's
   workers reported in the round it leaves (``step``); a round without progress is fast
   however long it ran. A fresh run starts counting again.
9. A mixed finish (torch's exit barrier; :mod:`.finish`). A member's ``add`` on the
   barrier's count in the last formed round's key space (``EXIT_BARRIER_COUNT_KEY``) says
   how many of that round's nodes finished (``exit_barrier``). While some but not all have,
   a member of the round that re-joins, dies or leaves means the barrier can never
   complete and no round can form again (a finished node never re-joins): in the same
   apply the server releases the barrier (the machine sets ``EXIT_BARRIER_LAST_MEMBER_KEY``,
   as torch's last member would, so the finished agents exit 0), records
   ``exit_barrier_released``, and closes the job (unless it is closed already) with cause
   ``workers_failed_after_finish`` (a member re-joined) or ``member_departed_after_finish`` (it
   died or left); the re-joined node's poll gets :class:`JobClosed` naming it. Whichever
   half comes second acts: the loss, or the count (an ``add`` after the loss releases at
   once). Such a failure counts no restart (rule 7) and is no crash loop (rule 8): the job
   ends. A job that rule 7 or 8 closed for a member's failure releases a barrier reached
   after that close at once too (the failing node was refused: it never finishes). When
   every node finishes, torch's own last ``add`` sets the key and nothing of this acts.

10. Why a round gave way (``opened_by``, on the next ``round_formed``). While a round runs
   (COMPLETE), the first of these names the next round's cause and its node: a member's
   workers failed (``workers_failed``: its re-join carried a failure report, or rule 7's
   re-join), a live member died (``member_died``), a node arrived to wait for the next
   round (``scale_up``); a member's graceful leave (``member_left``) names it only until
   one of the others happens (a finished node leaving ends nothing by itself). A spare
   that takes a dead member's place is named by the death (and shows as
   ``standby_promoted``). The first round, and a fresh run's, has no such cause.
11. Every failure report a member brings (with its re-join, or with its agent's final
   close) is one ``workers_failed`` event of the round its workers ran in (the last
   formed round), made in the same apply as the re-join and before anything it causes
   (``restart_counted``, the next ``round_formed``). A re-join that rule 7 calls a failure
   without a report (a client that does not send one) is a ``workers_failed`` with no
   detail. The report's times are ages on the wire; they are placed on the server clock
   (``now - age``) when applied, so a replay makes the same event.

12. Failures that follow a host. When the next round forms, the failures of the round that
   gave way (rule 11, first failure per node) are judged: the node whose workers failed first
   is ``blamed`` (its address, when it failed, how many seconds it led the next node's failure (None: no
   other node failed), its first line) unless the round had fewer than two nodes, a failure
   has no time (no detail), two nodes failed at the same time, or its first line is the
   script's: another node of the round failed with it too, or this run blamed another host
   for it before (a node whose agent restarts for a peer's re-join before it notices its own
   workers' failure reports nothing, so one round of a script's bug can look host-local; the
   next such round, on another host, shows it is not). Such lines are remembered per run
   (``script_lines``, at most ``MAX_SCRIPT_LINES``) and never blamed again in it. Whether that counts against the host is core's
   decision with the server's flags (``--quarantine-failure-lead``, ``--quarantine-failures``:
   ``decision.failure_quarantine``), so the flags never change what a replay rebuilds.

13. Job policy (:mod:`.policy`). ``settings`` are the job's effective settings: its own
   (``own``: its first join's or create's, rule 1) with each key an operator's policy sets
   for it (``policy``: the winning keys, ``sources``: their patterns) in their place. Rule 1
   compares a joining node's settings with the job's own on the keys no policy sets: nodes
   that disagree on a key a policy covers both join, and the job runs with the policy's value.
   A change of the policies that moves a job's effective settings (:meth:`Job.apply_policy`)
   is a ``policy_changed`` event naming each key's old and new value and source (and the node
   counts held, see :func:`.policy.resolve`), then :meth:`Job.settle`, so it acts at once
   where the state says: a lowered ``min_nodes`` arms the last call of a round waiting for
   nodes (with ``last_call_timeout`` 0 it forms now); an armed last call runs for a changed
   ``last_call_timeout`` from when it was armed; ``join_timeout`` and ``heartbeat_ttl`` are read
   at each check (every node's deadline moves with them); a lowered ``max_nodes`` forms a
   round whose candidates reach it (the candidates beyond it stay as spares) and otherwise
   bounds the next round; a raised one admits spares at the next re-formation (a formed round
   runs on); ``max_restarts`` is read at the next failure (rule 7) and the crash-loop keys
   when the next round ends (rule 8).

Invariants (checked by the property tests): in a formed round node ranks are exactly
0..n-1 and global ranks are disjoint, contiguous per node and cover 0..world_size-1;
members that survive into the next round keep their node rank where it still exists (``rank.place``); num_nodes_waiting
is never negative; every node is in exactly one role; ``join_clock`` holds exactly the
pending nodes whose join_timeout runs (candidates, waiting nodes, and standby nodes while
the job is OPEN) in ascending ``joined_at``, and ``untimed`` every other standby node.

Heartbeat times (``heartbeats``) are soft state: never logged, reset to ``now`` for every
node on restore so that each gets one full TTL of grace after a server restart.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdzv_client.record import POLICY_JOB_KEYS, POLICY_NODE_KEYS, Assignment, FailureReport, JobSettings

from .error import (
    IllegalNodeTransition,
    IllegalTransition,
    JobClosed,
    JobClosedInLine,
    JoinTimeout,
    NodeNotFound,
    SettingsConflict,
)
from .event import Cause, Kind, Timeline
from .progress import ProgressView, RoundLog
from .finish import MIXED_FINISH_CAUSES, ExitBarrier
from .policy import NODE_COUNTS, Winning, resolve
from .rank import Candidate, Tier, place


class JobState(str, enum.Enum):
    OPEN = "open"
    COMPLETE = "complete"
    CLOSED = "closed"


class Role(str, enum.Enum):
    CANDIDATE = "candidate"
    WAITING = "waiting"
    STANDBY = "standby"
    MEMBER = "member"


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    LEFT = "left"


class Event(enum.Enum):
    JOIN = "join"
    DEPART = "depart"
    LAST_CALL = "last_call"
    CLOSE = "close"
    EXIT_BARRIER = "exit_barrier"  # a member reached torch's exit barrier (rule 9)


class Departure(str, enum.Enum):
    """Why a node went away; decides how the survivors react."""

    LEFT = "left"  # graceful: survivors keep running
    DEAD = "dead"  # heartbeat TTL passed or connection dropped: survivors restart
    JOIN_TIMEOUT = "join_timeout"  # waited longer than join_timeout for a round


#: What a joining node brings to its next round: addr, nproc_per_node, master_port, host, topology.
Offer = tuple[str, int, int, str, str]  # ... and the node's host name and topology path (fleet control)


@dataclass
class Node:
    node_id: str
    addr: str
    nproc_per_node: int
    arrival: int  # job-wide join counter: orders new nodes
    # Server clock when the node's join_timeout started: its join (a member's re-join); for a
    # standby node, the opening of the round it waits in (rule 5). Stale while it runs untimed.
    joined_at: float
    role: Role
    liveness: Liveness = Liveness.ALIVE
    node_rank: int | None = None  # in the last formed round; kept while the next one forms
    global_rank_start: int | None = None
    # What a re-joining member brings to the next round; the last round keeps the old values.
    next_addr: str | None = None
    next_nproc: int | None = None
    # The port the node offers for its workers' store should it become node rank 0 (0: none).
    master_port: int = 0
    next_port: int | None = None
    host: str = ""  # the node's host name when it is not addr (cordons match either)
    topology: str = ""  # its topology path (RDZV_TOPOLOGY): node ranks follow it

    @property
    def pending(self) -> bool:
        return self.role in (Role.CANDIDATE, Role.WAITING, Role.STANDBY)


#: A node's place in its job: its role and, for a member, whether it is still alive.
NodeStatus = tuple[Role, Liveness]

@dataclass(frozen=True)
class NodeView:
    """One node of a :class:`JobView`, as it stood when the view was taken."""

    node_id: str
    addr: str
    role: Role
    liveness: Liveness
    node_rank: int | None  # of the last formed round: kept by a member that re-joined
    nproc_per_node: int
    global_rank_start: int | None
    last_heartbeat: float | None  # server clock; None once it departed
    topology: str = ""  # its topology path ("" when it reported none)


@dataclass(frozen=True)
class Pending:
    """Why an OPEN round has not formed yet, as the numbers that say it (the API words them).

    Below ``min_nodes`` only ``in_line`` counts; at or above it, the round waits for
    ``members_expected`` live members of the last round to re-join and/or for the last
    call, which ends ``last_call_left`` seconds after ``now`` (None: not armed)."""

    in_line: int  # candidates and standby nodes: those the round may form from
    min_nodes: int
    max_nodes: int
    members_expected: int  # live members of the last formed round that have not re-joined
    last_call_left: float | None  # seconds until the last call ends (>= 0), None when not armed

    @property
    def below_min_nodes(self) -> bool:
        return self.in_line < self.min_nodes


@dataclass(frozen=True)
class JobView:
    """A job at one instant (``now``), as plain data: what the queries hand out."""

    rdzv_id: str
    state: JobState
    round: int
    settings: JobSettings
    num_nodes: int  # of the last formed round; 0 while a round forms
    world_size: int  # likewise
    members: tuple[NodeView, ...]  # the last formed round's nodes still known, node_rank order
    nodes: tuple[NodeView, ...]  # every node of the job, in arrival order
    num_nodes_waiting: int  # rule 4, for an agent of the current round
    pending: Pending | None  # why the round is still open (None unless OPEN)
    now: float
    restarts: int = 0  # failures counted against the restart budget (rule 7)
    closed_cause: str = ""  # why the job closed ("" while it is not)
    progress: ProgressView | None = None  # rounds, steps and goodput (rule 8)
    # Rule 13: where each effective setting comes from ("policy PATTERN", "node", "default"),
    # and the node-side keys a policy sets for the job (the plug-in runs them).
    settings_source: dict[str, str] = field(default_factory=dict)
    node_settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobSummary:
    """A job in one line of the job list, as plain data."""

    rdzv_id: str
    state: JobState
    round: int
    num_nodes: int
    world_size: int
    settings: JobSettings
    pending: int  # nodes in line: candidates, waiting and standby


# Remember why at most this many departed nodes went away (a node that polls after its
# departure gets the reason); older reasons are dropped first.
MAX_DEPARTURE_REASONS = 10_000


@dataclass
class Job:
    rdzv_id: str
    settings: JobSettings
    state: JobState = JobState.OPEN
    round: int = 0
    nodes: dict[str, Node] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)  # last formed round, node_rank order
    last_call_deadline: float | None = None
    arrivals: int = 0
    idle_since: float | None = None
    closed_at: float | None = None
    departed: OrderedDict[str, str] = field(default_factory=OrderedDict)
    world: int = 0  # world_size of the last formed round
    uniform_nproc: bool = False  # its nodes all run the same number of workers
    departures: int = 0  # count of departures, so callers can tell one happened
    runs: int = 0  # fresh runs started in a closed job (rule 6)
    opened_at: float = 0.0  # when the current round opened: its formation time is measured from here
    timeline: Timeline = field(default_factory=Timeline)  # what happened, and why (core/event.py)
    # The job-wide restart budget (rule 7): failures counted, the formed round whose failure
    # was counted last (one per round), and why the job closed ("" while open).
    restarts: int = 0
    restart_round: int = -1
    closed_cause: str = ""
    # The crash-loop rule and the job's progress (rule 8): each formed round's times and steps.
    progress: RoundLog = field(default_factory=RoundLog)
    # torch's exit barrier of the last formed round that nodes reached (rule 9; None: none yet),
    # and a count of the barriers rule 9 released, so the machine can tell one happened (it sets
    # the barrier's key in the round's store).
    exit_barrier: ExitBarrier | None = None
    exit_barrier_releases: int = 0
    # Rule 10: why the formed round gives way (cause, node_id), for the next round_formed; None
    # while nothing made it (and once that round formed).
    opened_by: tuple[str, str] | None = None
    # Rule 12: the first failure of each node of the formed round (failed_at, None: no detail;
    # first line), and the host blamed for the last round that gave way (address, when, lead, line).
    round_failures: dict[str, tuple[float | None, str]] = field(default_factory=dict)
    blamed: tuple[str, float, float | None, str] | None = None
    # ... and, in this run, the host each first line was blamed on, and the lines that are the script's.
    blamed_lines: dict[str, str] = field(default_factory=dict)
    script_lines: set[str] = field(default_factory=set)
    # Derived indexes, rebuilt on restore, so that no join costs O(nodes):
    counts: Counter[tuple[Role, Liveness]] = field(default_factory=Counter)
    # Pending nodes whose join_timeout runs, in joined_at order (join_timed_out is O(timed out)):
    join_clock: OrderedDict[str, float] = field(default_factory=OrderedDict)
    untimed: dict[str, None] = field(default_factory=dict)  # standby nodes with no join_timeout (rule 5)
    # Soft state (not logged, not snapshotted):
    heartbeats: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # Rule 13: the settings the job's nodes gave it (its first join's or create's; ``settings``
    # are the effective ones), the policies' winning keys last applied, and each job key's
    # pattern where a policy gives the effective value.
    own: JobSettings = field(init=False)
    policy: Winning = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.own = self.settings

    # -- the transition table ----------------------------------------------------------

    def _dispatch(self, event: Event, now: float, *args: Any) -> Any:
        """Apply one event: its handler from ``_TRANSITIONS``, then :meth:`settle`.

        Raises :class:`IllegalTransition` (before changing anything) for a pair missing from
        the table."""
        handler = _TRANSITIONS.get((self.state, event))
        if handler is None:
            raise IllegalTransition(f"job {self.rdzv_id}: no transition for {event.name} in state {self.state.name}")
        result = handler(self, now, *args)
        self.settle(now)
        return result

    def join(
        self, node_id: str, addr: str, nproc_per_node: int, settings: JobSettings, now: float, master_port: int = 0,
        host: str = "", topology: str = "", step: int | None = None, failure: FailureReport | None = None,
    ) -> int:
        """A node asks for a place in the next round. Returns the round it is in line for.

        ``master_port`` is the port the node's workers would serve their store on should it
        become node rank 0: the assignment hands node rank 0's addr and port to every node,
        so no node has to publish them through the store after the round forms. ``host`` and
        ``topology`` are the node's host name and topology path (rank placement, cordons).
        ``step``: the highest step its workers reported in the round it leaves (rule 8).
        ``failure``: what failed in the node's workers, its times on the server clock (rule 11)."""
        if not (self.state is JobState.CLOSED and not self.idle()):
            self.adopt_settings(settings, f"node {node_id}")  # a closed, live job refuses it anyway
        node = self.nodes.get(node_id)
        if step is not None and self.state is not JobState.CLOSED and node is not None and node.role is Role.MEMBER:
            self.progress.report(step)  # before the join: rule 8 judges the round it ends with it
        offer = (addr, nproc_per_node, master_port, host, topology)
        round_: int = self._dispatch(Event.JOIN, now, node_id, offer, failure)
        return round_

    def depart(self, node_id: str, why: Departure, now: float, cause: Cause | None = None) -> bool:
        """A node leaves, dies or times out. Returns False if that is a no-op.

        A join timeout only removes a node whose join_timeout still runs and has passed at
        ``now``: a timer's decision made stale by a command applied in between (the node got
        its place, or became a spare of a formed round) must not evict it.
        """
        node = self.nodes.get(node_id)
        if node is None or (why is Departure.JOIN_TIMEOUT and not self._join_timed_out(node_id, now)):
            return False
        self._dispatch(Event.DEPART, now, node_id, why, departure_cause(why, cause))
        return True

    def last_call(self, round_: int, now: float) -> bool:
        """The timer saw the last-call deadline of ``round_`` pass. Returns True if it formed."""
        if self.state is not JobState.OPEN or round_ != self.round:
            return False  # stale timer: the round formed or moved on meanwhile
        formed: bool = self._dispatch(Event.LAST_CALL, now)
        return formed

    def close(
        self, now: float, cause: Cause = Cause.CLOSED, node_id: str = "", failure: FailureReport | None = None
    ) -> None:
        """Close the job (a no-op when it is closed). ``failure``: what failed in the workers of
        ``node_id``, whose agent closes it (rule 11), recorded first, even in a closed job."""
        node = self.nodes.get(node_id)
        if failure is not None and node is not None and node.role is Role.MEMBER:
            self._workers_failed(now, node, failure, Cause.AGENT)
        if self.state is JobState.CLOSED:
            return
        self._dispatch(Event.CLOSE, now, cause)

    def reach_exit_barrier(self, round_: int, finished: int, now: float) -> bool:
        """A node's ``add`` on torch's exit-barrier count in round ``round_``'s key space
        returned ``finished`` (rule 9). Returns False if that is no barrier of the last formed
        round (ignored: torch's own behaviour stands)."""
        counted: bool = self._dispatch(Event.EXIT_BARRIER, now, round_, finished)
        return counted

    # -- handlers ------------------------------------------------------------------------

    def _join_open(self, now: float, node_id: str, offer: Offer, failure: FailureReport | None) -> int:
        node = self.nodes.get(node_id)
        if node is None:
            self._add_node(node_id, offer, Role.CANDIDATE, now)
        elif node.role is Role.MEMBER:
            if failure is not None:  # rule 11: the round it failed in gave way already
                self._workers_failed(now, node, failure, Cause.REJOINED)
            # A member of the previous round comes back: it keeps its old node_rank as priority.
            self._rejoin(node, offer, now)
        return self.round

    def _join_complete(self, now: float, node_id: str, offer: Offer, failure: FailureReport | None) -> int:
        node = self.nodes.get(node_id)
        if node is not None and node.pending:
            return self.round + 1  # already in line (a retried join)
        # Rule 7: a live member re-joins its formed round and nothing made it restart (no
        # node waiting, no member dead): its workers failed.
        failed = node is not None and node.liveness is Liveness.ALIVE and not self.num_nodes_waiting(self.round)
        if node is not None and (failure is not None or failed):
            self._workers_failed(now, node, failure or FailureReport.no_detail(), Cause.REJOINED)  # rule 11
        if failed:
            if not self._spend_restart(now, Cause.WORKERS_FAILED, node_id):
                return self.round + 1  # the budget is spent: the job closed (its poll says so)
            if not self._judge_round(now, node_id):
                return self.round + 1  # a crash loop: the job closed (rule 8)
        if node is not None or not self._alive_members():
            # Rule 3: opened before the node is added, so that its join is in the new round.
            self._open_next_round(now)
            return self._join_open(now, node_id, offer, None)
        full = self._alive_members() + self._count(Role.WAITING) >= self.settings.max_nodes
        self._add_node(node_id, offer, Role.STANDBY if full else Role.WAITING, now)
        if not full:
            self._round_ends(Cause.SCALE_UP, node_id)  # rule 10: the running nodes restart for it
        return self.round + 1

    def _join_closed(self, now: float, node_id: str, offer: Offer, failure: FailureReport | None) -> int:
        if not self.idle():
            node = self.nodes.get(node_id)
            if node is not None and node.role in (Role.STANDBY, Role.WAITING):
                raise self._closed_in_line(node_id)  # its join retried: same answer as its poll
            raise JobClosed(
                f"job {self.rdzv_id} is closed{self._closed_why()}; node {node_id} cannot join while nodes of the "
                "closed run remain (wait for them to exit, or use a new --rdzv-id)"
            )
        for old in list(self.nodes):
            self._forget(old)
        self.members, self.world, self.uniform_nproc, self.closed_at = [], 0, False, None
        self.restarts, self.restart_round, self.closed_cause = 0, -1, ""  # a fresh run has its whole budget
        self.progress = RoundLog()  # ... and counts its own fast failures (rule 8)
        self.opened_by, self.round_failures = None, {}  # rule 10: a fresh run's first round has no cause
        self.blamed_lines, self.script_lines = {}, set()  # rule 12: a fresh run, a fresh script
        self.runs += 1
        self._open_next_round(now)
        return self._join_open(now, node_id, offer, None)

    def _depart(self, now: float, node_id: str, why: Departure, cause: Cause) -> None:
        node = self.nodes[node_id]
        self.timeline.add(now, Kind.NODE_DEPARTED, cause, self.round, node_id, node.addr, role=node.role.value)
        self.heartbeats.pop(node_id, None)
        self._remember_departure(node_id, why)
        if node.node_rank is not None:  # in self.members: keep it there, marked
            alive_member = node.role is Role.MEMBER and node.liveness is Liveness.ALIVE
            self._set(node, Role.MEMBER, Liveness.LEFT if why is Departure.LEFT else Liveness.DEAD)
            if alive_member:  # rule 10
                self._round_ends(Cause.MEMBER_LEFT if why is Departure.LEFT else Cause.MEMBER_DIED, node_id)
            if alive_member and why is Departure.DEAD and self.state is JobState.COMPLETE:
                self._spend_restart(now, Cause.MEMBER_DIED, node_id)  # rule 7: the survivors restart for it
        else:
            self._forget(node_id)

    def _last_call(self, now: float) -> bool:
        deadline = self.last_call_deadline
        if deadline is None or now < deadline:
            return False
        self._form_round(now, Cause.LAST_CALL)
        return True

    def _close(self, now: float, cause: Cause, **detail: Any) -> None:
        self.timeline.add(now, Kind.JOB_CLOSED, cause, self.round, **detail)
        self.progress.ended(now)
        self.state = JobState.CLOSED
        self.closed_at = now
        self.closed_cause = cause.value

    def _workers_failed(self, now: float, node: Node, failure: FailureReport, cause: Cause) -> None:
        """Rule 11: ``node``'s workers failed in the last formed round, as its report says."""
        round_ = self.round if self.state is not JobState.OPEN else self.round - 1
        failures = [
            {"global_rank": f.global_rank, "local_rank": f.local_rank, "exit_code": f.exit_code, "signal": f.signal,
             "failed_at": f.failed_at, "message": f.message}
            for f in failure.failures
        ]  # fmt: skip
        self.timeline.add(
            now, Kind.WORKERS_FAILED, cause, round_, node.node_id, node.addr, node_rank=node.node_rank,
            failed_workers=max(failure.failed_workers, len(failures)), failures=failures, summary=failure.summary(),
        )  # fmt: skip
        self._round_ends(Cause.WORKERS_FAILED, node.node_id)
        first = failure.failures[0] if failure.failures else None
        self.round_failures.setdefault(  # rule 12: its first failure of the round
            node.node_id, (None, failure.summary()) if first is None else (first.failed_at, first.message)
        )

    def _blame(self) -> tuple[str, float, float | None, str] | None:
        """Rule 12: the host whose node failed first in the round that gave way, if any."""
        members = self.members
        timed = {n: (t, m) for n, (t, m) in self.round_failures.items() if t is not None}
        if len(members) < 2 or not timed or len(timed) < len(self.round_failures):
            return None
        order = sorted((t, n) for n, (t, _) in timed.items())
        (first_at, first_id), others = order[0], order[1:]
        message = timed[first_id][1]
        node = self.nodes.get(first_id)
        if message in self.script_lines or node is None:
            return None
        shared = any(m == message for n, (_, m) in timed.items() if n != first_id)
        if shared or self.blamed_lines.get(message, node.addr) != node.addr:
            if len(self.script_lines) < MAX_SCRIPT_LINES:
                self.script_lines.add(message)  # two nodes, one error: the script
            return None
        lead = others[0][0] - first_at if others else None
        if lead is not None and lead <= 0:
            return None
        if len(self.blamed_lines) < MAX_SCRIPT_LINES:
            self.blamed_lines.setdefault(message, node.addr)
        return node.addr, first_at, lead, message

    def _round_ends(self, cause: Cause, node_id: str) -> None:
        """Rule 10: note why the formed round gives way, unless something before did (a
        member's leave is noted until something else happens)."""
        if self.state is not JobState.COMPLETE:
            return
        if self.opened_by is None or self.opened_by[0] == Cause.MEMBER_LEFT.value:
            self.opened_by = (cause.value, node_id)

    def _spend_restart(self, now: float, cause: Cause, node_id: str) -> bool:
        """Rule 7: count the formed round's first failure against the job's restart budget.

        Returns False when the budget was already spent: the job is then closed with cause
        ``restart_budget_exhausted`` (from within a COMPLETE handler; settle keeps it closed).
        A failure while nodes of the round wait in torch's exit barrier counts nothing: rule
        9 ends the job in this very apply."""
        if self._finishing():
            return True
        if self.restart_round == self.round:
            return True  # this round's failure is counted already: one re-formation, one restart
        self.restart_round = self.round
        budget = self.settings.max_restarts
        if budget is not None and self.restarts >= budget:
            self._close(now, Cause.RESTART_BUDGET_EXHAUSTED, node_id=node_id, restarts=self.restarts,
                        max_restarts=budget, failure=cause.value)
            return False
        self.restarts += 1
        if budget is not None:  # a job without a budget counts quietly (its document shows the count)
            self.timeline.add(now, Kind.RESTART_COUNTED, cause, self.round, node_id, self.nodes[node_id].addr,
                              restarts=self.restarts, max_restarts=budget)
        return True

    def _judge_round(self, now: float, node_id: str) -> bool:
        """Rule 8: judge the formed round that ended by ``node_id``'s failure.

        Returns False when it was the ``max_fast_failures``-th fast failure in a row: the job
        is then closed with cause ``restart_storm`` (from within a COMPLETE handler)."""
        if self._finishing():
            return True  # nodes of the round finished: no crash loop, rule 9 ends the job in this apply
        verdict = self.progress.judge(now, self.settings)
        if verdict is None or verdict.cause is None:
            return True
        s = self.settings
        formed = self.progress.rounds[self.round]
        steps = {"step": formed.step, "best_step": formed.base} if self.progress.best is not None else {}
        self.timeline.add(now, Kind.FAST_FAILURE, verdict.cause, self.round, node_id, self.nodes[node_id].addr,
                          fast_failures=verdict.fast_failures, max_fast_failures=s.max_fast_failures,
                          round_s=round(now - formed.formed_at, 3), min_round_seconds=s.min_round_seconds,
                          **steps)  # the steps only where progress is reported
        if not verdict.storm:
            return True
        self._close(now, Cause.RESTART_STORM, node_id=node_id, fast_failures=verdict.fast_failures,
                    min_round_seconds=s.min_round_seconds, max_fast_failures=s.max_fast_failures)
        return False
    # -- rule 9: a mixed finish (torch's exit barrier) ----------------------------------------

    def _exit_barrier_reached(self, now: float, round_: int, finished: int) -> bool:
        """Event.EXIT_BARRIER, in any state: note how many nodes of the last formed round
        reached its exit barrier. Whether that ends anything is :meth:`_mixed_finish`'s (settle)."""
        if round_ != self._last_formed_round():
            return False
        barrier = self.exit_barrier
        if barrier is None or barrier.round != round_:
            barrier = self.exit_barrier = ExitBarrier(round_, len(self.members))
        barrier.finished = max(barrier.finished, finished)
        return True

    def _last_formed_round(self) -> int | None:
        """The round ``members`` belong to (None: none formed in this run).

        While a round forms it is the one before; otherwise the job's round, which a closed job
        may not have formed (it closed while the round was open), but then no node was ever
        handed that round, so no node's barrier names it."""
        if not self.members:
            return None
        return self.round - 1 if self.state is JobState.OPEN else self.round

    def _finishing(self) -> bool:
        """Nodes of the running round wait in its exit barrier for the others (O(1))."""
        barrier = self.exit_barrier
        return (
            barrier is not None and barrier.waits and barrier.round == self.round and self.state is JobState.COMPLETE
        )

    def _mixed_finish(self, now: float) -> bool:
        """Rule 9: nodes of the last formed round wait in its exit barrier, and a member of that
        round that has not reached it re-joined, died or left: the barrier can never complete.
        Release it (the machine sets its key), record why, and close the job if it is open.

        O(1) unless it acts (then O(members), once per job)."""
        barrier = self.exit_barrier
        if barrier is None or not barrier.waits or barrier.round != self._last_formed_round():
            return False  # (a barrier of an earlier run or round is no one's any more)
        failed = self._failure_that_closed()
        if failed is None and self.state is not JobState.OPEN and self._alive_members() == barrier.num_nodes:
            return False  # no next round opened and every member is alive in this one: all may finish yet
        lost = self._lost_member() or (self.nodes.get(failed) if failed else None)
        rejoined = failed is not None or (lost is not None and lost.role is Role.CANDIDATE)
        cause = Cause.WORKERS_FAILED_AFTER_FINISH if rejoined else Cause.MEMBER_DEPARTED_AFTER_FINISH
        node_id, addr = (lost.node_id, lost.addr) if lost is not None else (None, None)
        barrier.released, barrier.cause, barrier.lost = True, cause.value, node_id or ""
        self.exit_barrier_releases += 1
        detail = {"finished": barrier.finished, "num_nodes": barrier.num_nodes}
        self.timeline.add(now, Kind.EXIT_BARRIER_RELEASED, cause, barrier.round, node_id, addr, **detail)
        if self.state is not JobState.CLOSED:
            self._close(now, cause, node_id=node_id, addr=addr, **detail)
        return True

    def _failure_that_closed(self) -> str | None:
        """The node whose workers' failure closed the job (rule 7's spent budget, rule 8's crash
        loop), "" when not known; None when the job is not closed by such a failure. That node was
        refused its next round, so it never reaches the round's exit barrier: a barrier reached
        after it (torch's agents do not all see a failure at once) can never complete either."""
        if self.state is not JobState.CLOSED or self.closed_cause not in _FAILURE_CLOSES:
            return None
        closes = [e for e in self.timeline.since(0) if e.kind is Kind.JOB_CLOSED]
        return (closes[-1].node_id or "") if closes else ""

    def _lost_member(self) -> Node | None:
        """The member of the last formed round that left it: one that re-joined (its workers
        failed) before one that died or left, each in node_rank order; None if none is known."""
        members = [n for n in (self.nodes.get(m) for m in self.members) if n is not None]
        back = [n for n in members if n.role is Role.CANDIDATE]
        gone = [n for n in members if n.liveness is not Liveness.ALIVE]
        return next(iter(back or gone), None)

    # -- settle: the rules that follow from the state ---------------------------------------

    def settle(self, now: float) -> None:
        """Re-run ``_SETTLE_RULES`` until none changes anything, then note the job's idleness.

        Each rule looks only at the state (never at the event that led there) and returns
        whether it changed something. A fixed point needs few passes: the last call is armed
        (1), a zero last call forms the round (2), nothing more (3); a departure can also
        open a round first. Raises :class:`IllegalTransition` if the rules have not settled
        after ``MAX_SETTLE_PASSES`` (a bug: two rules undoing each other).
        """
        for _ in range(MAX_SETTLE_PASSES):
            changed = False
            for rule in _SETTLE_RULES:
                changed = rule(self, now) or changed
            if not changed:
                break
        else:
            raise IllegalTransition(f"job {self.rdzv_id}: the rendezvous rules did not settle in {MAX_SETTLE_PASSES} passes")
        if self.idle():
            if self.idle_since is None:
                self.idle_since = now
        else:
            self.idle_since = None

    def _complete_round(self, now: float) -> bool:
        """Rule 2: a round that may form forms (a, b, and c with a zero last call)."""
        if self.state is not JobState.OPEN:
            return False
        joined = self._count(Role.CANDIDATE)
        if joined >= self.settings.max_nodes:
            self._form_round(now, Cause.MAX_NODES)
        elif joined + self._count(Role.STANDBY) >= self.settings.max_nodes and not self._alive_members():
            self._form_round(now, Cause.MEMBERS_BACK)
        elif self.last_call_deadline is not None and self.settings.last_call_timeout == 0:
            self._form_round(now, Cause.LAST_CALL)
        else:
            return False
        return True

    def _last_call_clock(self, now: float) -> bool:
        """Rule 2c: the last call runs while a forming round has ``min_nodes`` in line.

        Armed when the count first reaches ``min_nodes`` (and kept, not re-armed, while it
        stays there), cleared when it drops below, and when no round forms."""
        deadline = self.last_call_deadline
        if self.state is JobState.OPEN and self._count(Role.CANDIDATE) + self._count(Role.STANDBY) >= self.settings.min_nodes:
            if deadline is None:
                self.last_call_deadline = now + self.settings.last_call_timeout
                return True
            return False
        self.last_call_deadline = None
        return deadline is not None

    def _open_for_those_in_line(self, now: float) -> bool:
        """Rule 5: with no member of the formed round alive, the next round opens for the
        nodes in line."""
        if self.state is not JobState.COMPLETE or self._alive_members() or not self._in_line():
            return False
        self._open_next_round(now)
        return True

    def _spare_clocks(self, now: float) -> bool:
        """Rule 5: a standby node's join_timeout runs only while a round forms; once the round
        formed (or the job closed) the spares it did not place have no clock.

        (Their clocks start when a round opens: ``_open_next_round`` starts them before the
        event that opened it adds its own node, which keeps ``join_clock`` in arrival order.)"""
        if self.state is JobState.OPEN or self._count(Role.STANDBY) == len(self.untimed):
            return False
        for node_id in list(self.join_clock):
            node = self.nodes[node_id]
            if node.role is Role.STANDBY:
                self._stop_clock(node)
        return True

    # -- helpers ---------------------------------------------------------------------------

    def adopt_settings(self, settings: JobSettings, who: str) -> None:
        """Rule 1: the same settings pass; other settings are adopted only while the job is idle.

        Raises :class:`SettingsConflict` (and changes nothing) otherwise.
        """
        if settings == self.own:
            return
        if self.idle():
            self.own = settings
            self.settings, self.sources, _ = resolve(settings, self.policy, settings, {})  # a fresh run: rule 13
            return
        differ = [k for k in POLICY_JOB_KEYS if getattr(settings, k) != getattr(self.own, k)]
        if all(k in self.policy for k in differ):
            return  # rule 13: a key a policy sets is not the nodes' to agree on
        covered = f" (keys a policy sets are not compared: {', '.join(sorted(self.policy))})" if self.policy else ""
        raise SettingsConflict(
            f"{who} asks job {self.rdzv_id} for {_describe(settings)}, but the job's nodes gave it "
            f"{_describe(self.own)}{covered}: give every node the same --nnodes and --rdzv-conf, set the key by "
            "`rdzvctl policy set`, or use a new rdzv_id"
        )

    def apply_policy(self, winning: Winning, now: float, pattern: str, by: str) -> bool:
        """Rule 13: the policies that win for this job are now ``winning`` (a change of
        ``pattern``'s policy, by ``by``). Returns whether the job's effective settings moved
        (then a ``policy_changed`` event says which keys, from what to what); what follows
        from the new settings follows at once (:meth:`settle`)."""
        old, old_policy = self.settings, self.policy
        resolved = resolve(self.own, winning, old, self.sources)
        self.settings, self.sources, self.policy = resolved.settings, resolved.sources, winning
        changes: dict[str, dict[str, Any]] = {}
        sources = self.settings_source()
        for key in POLICY_JOB_KEYS:
            before, after = getattr(old, key), getattr(self.settings, key)
            if before != after:
                changes[key] = {"old": before, "new": after, "source": sources[key]}
        for key in POLICY_NODE_KEYS:  # None: the node's own (its --rdzv-conf)
            before, after = old_policy.get(key, (None, ""))[0], winning.get(key, (None, ""))[0]
            if before != after:
                changes[key] = {"old": before, "new": after, "source": sources.get(key, "node")}
        if not changes and not resolved.held:
            return False
        detail: dict[str, Any] = {"pattern": pattern, "by": by, "changes": changes}
        if resolved.held:
            detail["held"] = resolved.held
        self.timeline.add(now, Kind.POLICY_CHANGED, Cause.OPERATOR, self.round, **detail)
        if self.last_call_deadline is not None:  # an armed last call runs for the new timeout from when it was armed
            self.last_call_deadline += self.settings.last_call_timeout - old.last_call_timeout
        self.settle(now)
        return True

    def settings_source(self) -> dict[str, str]:
        """Rule 13: where each effective setting comes from: ``policy PATTERN``, ``node`` (the
        job's own: its node counts always, any other key its nodes set to other than the
        default), or ``default``; and each node-side key a policy sets."""
        out = {}
        for key in POLICY_JOB_KEYS:
            pattern = self.sources.get(key)
            if pattern is not None:
                out[key] = f"policy {pattern}"
            elif key in NODE_COUNTS or getattr(self.own, key) != getattr(_DEFAULT, key):
                out[key] = "node"
            else:
                out[key] = "default"
        for key in POLICY_NODE_KEYS:
            if key in self.policy:
                out[key] = f"policy {self.policy[key][1]}"
        return out

    def _add_node(self, node_id: str, offer: Offer, role: Role, now: float) -> None:
        self.arrivals += 1
        addr, nproc, port, host, topology = offer
        node = self.nodes[node_id] = Node(
            node_id, addr, nproc, self.arrivals, now, role, master_port=port, host=host, topology=topology
        )
        self.timeline.add(now, Kind.NODE_JOINED, Cause(role.value), self.round, node_id, addr, nproc_per_node=nproc)
        self.counts[(role, node.liveness)] += 1
        if role is Role.STANDBY and self.state is not JobState.OPEN:
            self.untimed[node_id] = None  # a spare of the formed round (rule 5)
        else:
            self.join_clock[node_id] = now
        self.departed.pop(node_id, None)
        self.heartbeats[node_id] = now
        self.heartbeats.move_to_end(node_id)

    def _set(self, node: Node, role: Role, liveness: Liveness = Liveness.ALIVE) -> None:
        """The one place a node changes role: keeps ``counts``, ``join_clock`` and ``untimed`` exact.

        Raises :class:`IllegalNodeTransition` (changing nothing) for a change that
        ``_NODE_TRANSITIONS`` does not list.

        A node that comes into line (a member's re-join) starts its clock at ``joined_at``,
        set to ``now`` by the caller; a node that leaves the line stops it. Between pending
        roles the clock is kept: a waiting node that becomes a candidate keeps its deadline,
        and standby nodes become timed when a round opens (:meth:`_start_clock`) and untimed
        once it formed or the job closed (:meth:`_spare_clocks`).
        """
        old, new = (node.role, node.liveness), (role, liveness)
        if new not in _NODE_TRANSITIONS[old]:
            raise IllegalNodeTransition(
                f"job {self.rdzv_id}: node {node.node_id} cannot go from {old[0].value}/{old[1].value} "
                f"to {role.value}/{liveness.value}"
            )
        was_pending = node.pending
        self.counts[old] -= 1
        node.role, node.liveness = role, liveness
        self.counts[(role, liveness)] += 1
        if was_pending and not node.pending:
            self.join_clock.pop(node.node_id, None)
            self.untimed.pop(node.node_id, None)
        elif node.pending and not was_pending:
            self.join_clock[node.node_id] = node.joined_at

    def _start_clock(self, node: Node, now: float) -> None:
        """An untimed standby node's join_timeout starts at ``now`` (a round opened for it)."""
        del self.untimed[node.node_id]
        node.joined_at = now  # >= every joined_at in join_clock: appending keeps its order
        self.join_clock[node.node_id] = now

    def _stop_clock(self, node: Node) -> None:
        """A standby node becomes a spare of a formed (or closed) round: no join_timeout."""
        self.join_clock.pop(node.node_id, None)
        self.untimed[node.node_id] = None

    def _forget(self, node_id: str) -> None:
        node = self.nodes.pop(node_id)
        self.counts[(node.role, node.liveness)] -= 1
        self.join_clock.pop(node_id, None)
        self.untimed.pop(node_id, None)
        self.heartbeats.pop(node_id, None)

    def _rejoin(self, node: Node, offer: Offer, now: float) -> None:
        (node.next_addr, node.next_nproc, node.next_port, node.host, node.topology), node.joined_at = offer, now
        self.timeline.add(now, Kind.NODE_JOINED, Cause.REJOINED, self.round, node.node_id, offer[0], nproc_per_node=offer[1])
        self._set(node, Role.CANDIDATE)
        self.departed.pop(node.node_id, None)
        self.heartbeats[node.node_id] = now
        self.heartbeats.move_to_end(node.node_id)

    def _open_next_round(self, now: float) -> None:
        if self.state is JobState.COMPLETE:
            self.progress.ended(now)  # the formed round gave way
        self.state = JobState.OPEN
        self.round += 1
        self.opened_at = now
        for node_id in list(self.join_clock):
            node = self.nodes[node_id]
            if node.role is Role.WAITING:
                self._set(node, Role.CANDIDATE)
        for node_id in list(self.untimed):  # rule 5: the spares' join_timeout runs while a round forms
            self._start_clock(self.nodes[node_id], now)

    def _form_round(self, now: float, reason: Cause) -> None:
        self.blamed, self.round_failures = self._blame(), {}  # rule 12, before the members change
        previous = set(self.members)
        candidates = []
        for node in self.nodes.values():
            if node.role is Role.CANDIDATE and node.next_nproc is not None:
                assert node.next_addr is not None and node.next_port is not None
                node.addr, node.nproc_per_node, node.master_port = node.next_addr, node.next_nproc, node.next_port
                node.next_addr = node.next_nproc = node.next_port = None
            # Natural host order is by the address every node reports (the plug-in's default is its
            # host's FQDN): one kind of name for every node, the one the job document shows.
            host, topology = node.addr, node.topology
            if node.role is Role.CANDIDATE:
                if node.node_id in previous and node.node_rank is not None:
                    tier, order = Tier.PREVIOUS, node.node_rank
                else:
                    tier, order = Tier.NEW, node.arrival
            elif node.role is Role.STANDBY:
                tier, order = Tier.STANDBY, node.arrival
            else:
                continue
            candidates.append(Candidate(node.node_id, tier, order, node.nproc_per_node, host, topology, node.arrival))
        placements, overflow = place(candidates, self.settings.max_nodes)
        for member_id in self.members:  # in node-rank order: the timeline reads the same on every replay
            member = self.nodes.get(member_id)
            if member is None or member.role is not Role.MEMBER:
                continue  # back for this round
            if member.liveness is Liveness.ALIVE:  # its death (if any) was not noticed before the round formed
                self.timeline.add(
                    now, Kind.NODE_DEPARTED, Cause.NOT_REJOINED, self.round, member_id, member.addr, role=member.role.value
                )
                self._remember_departure(member_id, Departure.DEAD)
            self._forget(member_id)  # not back for this round
        for c in overflow:  # standby nodes, and candidates beyond a max_nodes lowered meanwhile (rule 13)
            node = self.nodes[c.node_id]
            self._set(node, Role.STANDBY)  # stays a spare: settle stops its clock (rule 5)
            node.node_rank = node.global_rank_start = None
        self.members = []
        for p in placements:
            node = self.nodes[p.node_id]
            if node.role is Role.STANDBY:
                self.timeline.add(now, Kind.STANDBY_PROMOTED, reason, self.round, node.node_id, node.addr)
            self._set(node, Role.MEMBER)
            node.node_rank, node.global_rank_start = p.node_rank, p.global_rank_start
            self.members.append(p.node_id)
        self.world = sum(p.nproc_per_node for p in placements)
        self.uniform_nproc = len({p.nproc_per_node for p in placements}) == 1
        self.state = JobState.COMPLETE
        self.progress.formed(self.round, now)
        opened_by = {}
        if self.opened_by is not None:
            opened_by = {"opened_by": self.opened_by[0], "opened_by_node": self.opened_by[1]}
        self.opened_by = None  # rule 10: this round's own end is still to come
        self.timeline.add(
            now, Kind.ROUND_FORMED, reason, self.round, num_nodes=len(self.members), world_size=self.world,
            formation_s=round(now - self.opened_at, 6), standby=self._count(Role.STANDBY), **opened_by,
        )

    def _remember_departure(self, node_id: str, why: Departure) -> None:
        self.departures += 1
        self.departed[node_id] = why.value
        self.departed.move_to_end(node_id)
        while len(self.departed) > MAX_DEPARTURE_REASONS:
            self.departed.popitem(last=False)

    def _count(self, role: Role) -> int:
        """Nodes in a pending ``role`` (they are always ALIVE)."""
        return self.counts[(role, Liveness.ALIVE)]

    def _alive_members(self) -> int:
        """Members of the last formed round that are alive and have not re-joined."""
        return self.counts[(Role.MEMBER, Liveness.ALIVE)]

    def _in_line(self) -> bool:
        """Whether any node is pending (candidate, waiting or standby)."""
        return bool(self.join_clock or self.untimed)

    def idle(self) -> bool:
        return not self._in_line() and self._alive_members() == 0

    # -- queries ---------------------------------------------------------------------------

    def num_nodes_waiting(self, round_: int) -> int:
        """Rule 4, for an agent whose formed round is ``round_``."""
        if self.state is JobState.CLOSED:
            return 0
        if self.state is JobState.COMPLETE and self.round == round_:
            return self._count(Role.WAITING) + self.counts[(Role.MEMBER, Liveness.DEAD)]
        return max(1, self._count(Role.CANDIDATE) + self._count(Role.WAITING))

    def assignment(self, node_id: str, min_round: int) -> Assignment | None:
        """The node's place once it is a live member of a formed round >= ``min_round``.

        None while it is still in line. Raises :class:`JobClosedInLine` (the job closed while
        the node was standby or waiting, rule 6), :class:`JobClosed`, :class:`JoinTimeout` (it
        waited too long and was removed) or :class:`NodeNotFound`.
        """
        if self.state is JobState.CLOSED:
            node = self.nodes.get(node_id)
            if node is not None and node.role in (Role.STANDBY, Role.WAITING):
                raise self._closed_in_line(node_id)
            raise JobClosed(f"job {self.rdzv_id} is closed{self._closed_why()}")
        node = self.nodes.get(node_id)
        if node is None or (node.role is Role.MEMBER and node.liveness is not Liveness.ALIVE):
            reason = self.departed.get(node_id)
            if reason == Departure.JOIN_TIMEOUT.value:
                raise JoinTimeout(
                    f"node {node_id} waited longer than join_timeout={self.settings.join_timeout}s for a round "
                    f"of job {self.rdzv_id} to form (min_nodes={self.settings.min_nodes})"
                )
            raise NodeNotFound(f"node {node_id} is not in job {self.rdzv_id} ({reason or 'never joined'}); join again")
        if node.pending or self.state is not JobState.COMPLETE or self.round < min_round:
            return None
        assert node.node_rank is not None and node.global_rank_start is not None
        master = self.nodes[self.members[0]]
        return Assignment(
            round=self.round,
            node_rank=node.node_rank,
            num_nodes=len(self.members),
            world_size=self.world_size(),
            nproc_per_node=node.nproc_per_node,
            global_rank_start=node.global_rank_start,
            master_addr=master.addr,
            master_port=master.master_port,
            uniform_nproc=self.uniform_nproc,
        )

    def _closed_why(self) -> str:
        """Why the job closed, for a refused node's error (empty for an ordinary close)."""
        if self.closed_cause == Cause.RESTART_STORM.value:
            s = self.settings
            return (
                f" (restart_storm: {self.progress.fast_failures} rounds in a row ended by a failure within "
                f"min_round_seconds={s.min_round_seconds:g} of forming or without progress, max_fast_failures="
                f"{s.max_fast_failures}; the server stopped the crash loop: fix the workers' failure, then run again)"
            )
        if self.closed_cause in MIXED_FINISH_CAUSES and self.exit_barrier is not None:
            return self.exit_barrier.why()
        if self.closed_cause != Cause.RESTART_BUDGET_EXHAUSTED.value:
            return ""
        return (
            f" (restart_budget_exhausted: its workers failed again after {self.restarts} restart(s), "
            f"max_restarts={self.settings.max_restarts}; the server stopped the job)"
        )

    def _closed_in_line(self, node_id: str) -> JobClosedInLine:
        return JobClosedInLine(
            f"job {self.rdzv_id} closed while node {node_id} was in line (standby or waiting) for a round; "
            "the run it waited to join has ended, so the node should exit gracefully"
        )

    def pending(self, now: float) -> Pending | None:
        """Why the round is still open, as data (None unless OPEN)."""
        if self.state is not JobState.OPEN:
            return None
        s = self.settings
        deadline = self.last_call_deadline
        return Pending(
            in_line=self._count(Role.CANDIDATE) + self._count(Role.STANDBY),
            min_nodes=s.min_nodes,
            max_nodes=s.max_nodes,
            members_expected=self._alive_members(),
            last_call_left=None if deadline is None else max(0.0, deadline - now),
        )

    def world_size(self) -> int:
        """Of the last formed round (also once closed); 0 while a round forms."""
        return 0 if self.state is JobState.OPEN else self.world

    def num_nodes(self) -> int:
        return 0 if self.state is JobState.OPEN else len(self.members)

    def heartbeat(self, node_id: str, now: float) -> None:
        """Soft-state beat; ignored for unknown, dead or departed nodes."""
        if node_id in self.heartbeats:
            self.heartbeats[node_id] = now
            self.heartbeats.move_to_end(node_id)

    def expired(self, now: float) -> list[str]:
        """Nodes whose last beat is older than the TTL (oldest first; O(expired))."""
        ttl = self.settings.heartbeat_ttl
        out = []
        for node_id, beat in self.heartbeats.items():
            if beat + ttl > now:
                break
            out.append(node_id)
        return out

    def join_timed_out(self, now: float) -> list[str]:
        """Pending nodes whose join_timeout (rule 5) has passed at ``now``, oldest first
        (O(timed out): spares of a formed round are not in ``join_clock`` at all)."""
        limit = now - self.settings.join_timeout
        out = []
        for node_id, joined_at in self.join_clock.items():
            if joined_at > limit:
                break
            out.append(node_id)
        return out

    def _join_timed_out(self, node_id: str, now: float) -> bool:
        since = self.join_clock.get(node_id)
        return since is not None and since <= now - self.settings.join_timeout

    def next_deadline(self) -> float | None:
        """The earliest time at which the timer may have something to do for this job."""
        times = []
        if self.last_call_deadline is not None:
            times.append(self.last_call_deadline)
        if self.heartbeats:
            times.append(next(iter(self.heartbeats.values())) + self.settings.heartbeat_ttl)
        if self.join_clock:
            times.append(next(iter(self.join_clock.values())) + self.settings.join_timeout)
        return min(times) if times else None

    def reset_heartbeats(self, now: float) -> None:
        """After a restart: every live node gets one full TTL of grace."""
        self.heartbeats = OrderedDict(
            (n.node_id, now) for n in self.nodes.values() if n.pending or (n.role is Role.MEMBER and n.liveness is Liveness.ALIVE)
        )

    def view(self, now: float) -> JobView:
        """The job at ``now`` as plain data (the API builds its membership document from it)."""

        def node_view(node: Node) -> NodeView:
            return NodeView(
                node.node_id, node.addr, node.role, node.liveness, node.node_rank, node.nproc_per_node,
                node.global_rank_start, self.heartbeats.get(node.node_id), node.topology,
            )

        return JobView(
            rdzv_id=self.rdzv_id,
            state=self.state,
            round=self.round,
            settings=self.settings,
            num_nodes=self.num_nodes(),
            world_size=self.world_size(),
            members=tuple(node_view(self.nodes[m]) for m in self.members if m in self.nodes),
            nodes=tuple(node_view(n) for n in sorted(self.nodes.values(), key=lambda n: n.arrival)),
            num_nodes_waiting=self.num_nodes_waiting(self.round),
            pending=self.pending(now),
            now=now,
            restarts=self.restarts,
            closed_cause=self.closed_cause,
            progress=self.progress.view(now if self.closed_at is None else min(now, self.closed_at)),
            settings_source=self.settings_source(),
            node_settings={k: self.policy[k][0] for k in POLICY_NODE_KEYS if k in self.policy},
        )

    def summary(self) -> JobSummary:
        """The job in a line of the job list, as plain data."""
        pending = self._count(Role.CANDIDATE) + self._count(Role.WAITING) + self._count(Role.STANDBY)
        return JobSummary(self.rdzv_id, self.state, self.round, self.num_nodes(), self.world_size(), self.settings, pending)

    # -- snapshot ----------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        s = self.settings
        return {
            "rdzv_id": self.rdzv_id,
            "settings": _settings_row(s),
            "state": self.state.value,
            "round": self.round,
            "nodes": [
                [n.node_id, n.addr, n.nproc_per_node, n.arrival, n.joined_at, n.role.value, n.liveness.value,
                 n.node_rank, n.global_rank_start, n.next_addr, n.next_nproc, n.master_port, n.next_port, n.host,
                 n.topology]
                for n in self.nodes.values()
            ],
            "members": list(self.members),
            "last_call_deadline": self.last_call_deadline,
            "arrivals": self.arrivals,
            "version": 0,  # read by releases before this one (they restore it, and nothing reads it)
            "idle_since": self.idle_since,
            "closed_at": self.closed_at,
            "departed": list(self.departed.items()),
            "runs": self.runs,
            "world": self.world,
            "uniform_nproc": self.uniform_nproc,
            "opened_at": self.opened_at,
            "restarts": self.restarts,
            "restart_round": self.restart_round,
            "closed_cause": self.closed_cause,
            "opened_by": None if self.opened_by is None else list(self.opened_by),
            "round_failures": [[n, t, m] for n, (t, m) in self.round_failures.items()],
            "blamed": None if self.blamed is None else list(self.blamed),
            "blamed_lines": list(self.blamed_lines.items()),
            "script_lines": sorted(self.script_lines),
            "timeline": self.timeline.to_snapshot(),
            "progress": self.progress.to_snapshot(),
            "exit_barrier": None if self.exit_barrier is None else self.exit_barrier.to_snapshot(),
            "own": None if self.own == s else _settings_row(self.own),
            "policy": [[k, v, pattern] for k, (v, pattern) in self.policy.items()],
            "sources": list(self.sources.items()),
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> Job:
        job = cls(data["rdzv_id"], JobSettings(*data["settings"]))
        job.state = JobState(data["state"])
        job.round = data["round"]
        for nid, addr, nproc, arrival, joined_at, role, liveness, rank, start, *rest in data["nodes"]:
            job.nodes[nid] = Node(nid, addr, nproc, arrival, joined_at, Role(role), Liveness(liveness), rank, start, *rest)
        job.members = list(data["members"])
        job.last_call_deadline = data["last_call_deadline"]
        job.arrivals = data["arrivals"]
        job.idle_since = data["idle_since"]
        job.closed_at = data["closed_at"]
        job.departed = OrderedDict((k, v) for k, v in data["departed"])
        job.runs = data["runs"]
        job.world = data["world"]
        # (Snapshots before it: unknown, so False, the worker-rank exchange as before.)
        job.uniform_nproc = data.get("uniform_nproc", False)
        job.opened_at = data.get("opened_at", 0.0)
        job.restarts = data.get("restarts", 0)
        job.restart_round = data.get("restart_round", -1)
        job.closed_cause = data.get("closed_cause", "")
        opened_by = data.get("opened_by")
        job.opened_by = None if opened_by is None else (opened_by[0], opened_by[1])
        job.round_failures = {n: (t, m) for n, t, m in data.get("round_failures", ())}
        blamed = data.get("blamed")
        job.blamed = None if blamed is None else (blamed[0], blamed[1], blamed[2], blamed[3])
        job.blamed_lines = {line: host for line, host in data.get("blamed_lines", ())}
        job.script_lines = set(data.get("script_lines", ()))
        if "timeline" in data:
            job.timeline = Timeline.from_snapshot(data["timeline"])
        if "progress" in data:  # (snapshots before rule 8: no round judged yet)
            job.progress = RoundLog.from_snapshot(data["progress"])
        job.exit_barrier = ExitBarrier.from_snapshot(data.get("exit_barrier"))
        own = data.get("own")  # (snapshots before rule 13: the job's own are its settings)
        job.own = job.settings if own is None else JobSettings(*own)
        job.policy = {k: (v, pattern) for k, v, pattern in data.get("policy", ())}
        job.sources = dict(data.get("sources", ()))
        for node in sorted(job.nodes.values(), key=lambda n: (n.joined_at, n.arrival)):
            job.counts[(node.role, node.liveness)] += 1
            if node.role is Role.STANDBY and job.state is not JobState.OPEN:
                job.untimed[node.node_id] = None
            elif node.pending:
                job.join_clock[node.node_id] = node.joined_at
        return job


_DEPARTURE_CAUSES = {
    Departure.LEFT: Cause.LEFT,
    Departure.DEAD: Cause.HEARTBEAT_EXPIRED,  # the timer's own verdict; a dropped watch names its cause
    Departure.JOIN_TIMEOUT: Cause.JOIN_TIMEOUT,
}


def departure_cause(why: Departure, cause: Cause | None = None) -> Cause:
    """The event cause of a departure: the one its command names, else the one ``why`` implies."""
    return cause or _DEPARTURE_CAUSES[why]


def _settings_row(s: JobSettings) -> list[Any]:
    """A job's settings as its snapshot keeps them (positional: ``JobSettings(*row)``)."""
    return [s.min_nodes, s.max_nodes, s.last_call_timeout, s.join_timeout, s.heartbeat_ttl, s.max_restarts,
            s.min_round_seconds, s.max_fast_failures]


def _describe(s: JobSettings) -> str:
    return (
        f"min_nodes={s.min_nodes} max_nodes={s.max_nodes} last_call_timeout={s.last_call_timeout} "
        f"join_timeout={s.join_timeout} heartbeat_ttl={s.heartbeat_ttl}"
        + ("" if s.max_restarts is None else f" max_restarts={s.max_restarts}")
        + ("" if (s.min_round_seconds, s.max_fast_failures) == (_DEFAULT.min_round_seconds, _DEFAULT.max_fast_failures)
           else f" min_round_seconds={s.min_round_seconds:g} max_fast_failures={s.max_fast_failures}")
    )


_DEFAULT = JobSettings()


_ALIVE = Liveness.ALIVE

#: Every change of a node's (role, liveness) that ``Job._set`` may make: before -> allowed after.
#: A node enters in line (``_add_node``: candidate, waiting or standby) and leaves through
#: ``_forget``; neither is a change of role.
_NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    # placed in the round; or, a re-joined member that departs goes back to the last round, marked
    # ... or, beyond a max_nodes a policy lowered while the round formed (rule 13), a spare
    (Role.CANDIDATE, _ALIVE): frozenset({
        (Role.MEMBER, _ALIVE), (Role.MEMBER, Liveness.DEAD), (Role.MEMBER, Liveness.LEFT), (Role.STANDBY, _ALIVE),
    }),
    (Role.WAITING, _ALIVE): frozenset({(Role.CANDIDATE, _ALIVE)}),  # the next round opened
    (Role.STANDBY, _ALIVE): frozenset({(Role.MEMBER, _ALIVE), (Role.STANDBY, _ALIVE)}),  # promoted, or stays a spare
    # a member re-joins (alive or not: a restarted agent), dies or leaves (again: a retried leave)
    **{
        (Role.MEMBER, liveness): frozenset({(Role.CANDIDATE, _ALIVE), (Role.MEMBER, Liveness.DEAD), (Role.MEMBER, Liveness.LEFT)})
        for liveness in Liveness
    },
}

#: Rule 12: the first lines a run remembers (blamed, or the script's): a job's few errors, bounded.
MAX_SCRIPT_LINES = 64

#: How many passes :meth:`Job.settle` may take; three suffice (see its docstring).
MAX_SETTLE_PASSES = 8

#: The rules :meth:`Job.settle` re-runs, in this order within a pass.
#: Closes that a member's failure caused: that member never reaches its round's exit barrier.
_FAILURE_CLOSES = frozenset({Cause.RESTART_BUDGET_EXHAUSTED.value, Cause.RESTART_STORM.value})

_SETTLE_RULES: tuple[Callable[[Job, float], bool], ...] = (
    Job._mixed_finish,  # first: a round that cannot finish ends the job before another round forms
    Job._complete_round,
    Job._last_call_clock,
    Job._open_for_those_in_line,
    Job._spare_clocks,
)

_TRANSITIONS: dict[tuple[JobState, Event], Callable[..., Any]] = {
    (JobState.OPEN, Event.JOIN): Job._join_open,
    (JobState.COMPLETE, Event.JOIN): Job._join_complete,
    (JobState.CLOSED, Event.JOIN): Job._join_closed,
    (JobState.OPEN, Event.DEPART): Job._depart,
    (JobState.COMPLETE, Event.DEPART): Job._depart,
    (JobState.CLOSED, Event.DEPART): Job._depart,
    (JobState.OPEN, Event.LAST_CALL): Job._last_call,
    (JobState.OPEN, Event.CLOSE): Job._close,
    (JobState.COMPLETE, Event.CLOSE): Job._close,
    **{(state, Event.EXIT_BARRIER): Job._exit_barrier_reached for state in JobState},
}
