"""Property tests: random joins, leaves, deaths, heartbeats, clock advances (applying what
``due()`` detects), member re-joins and rare closes, with the rendezvous invariants checked
after every applied command, against a small model of the rules that decide roles."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.core.error import JobClosed, JobClosedInLine, JobNotFound, RdzvError
from rdzv_server.core.machine import StateMachine
from rdzv_server.core.rank import Candidate, Tier, place
from rdzv_server.core.rendezvous import Job, JobState, Liveness, Role

RDZV_ID = "job"
POOL = [f"n{i}" for i in range(6)]
JOB_TTL = 80.0
MAX_VALUE_BYTES = 64
SETTINGS = settings(max_examples=200, deadline=None, stateful_step_count=30)


def live(node_role: Role, liveness: Liveness) -> bool:
    return node_role is not Role.MEMBER or liveness is Liveness.ALIVE


def check_job(job: Job, now: float) -> None:
    """Every invariant of rendezvous.py that a full scan of ``job.nodes`` can decide."""
    s = job.settings
    nodes = job.nodes
    # every node is in exactly one role, pending nodes are alive
    scan = Counter((n.role, n.liveness) for n in nodes.values())
    assert all(v >= 0 for v in job.counts.values()), job.counts
    assert +job.counts == scan
    for n in nodes.values():
        assert isinstance(n.role, Role) and isinstance(n.liveness, Liveness)
        if n.pending:
            assert n.liveness is Liveness.ALIVE
    # rule 5: join_timeout runs for every pending node but the standby nodes of a formed or
    # closed round; join_clock holds them in joined_at order (join_timed_out relies on it)
    def untimed(n: Any) -> bool:
        return n.role is Role.STANDBY and job.state is not JobState.OPEN

    assert dict(job.join_clock) == {n.node_id: n.joined_at for n in nodes.values() if n.pending and not untimed(n)}
    assert set(job.untimed) == {n.node_id for n in nodes.values() if untimed(n)}
    since = list(job.join_clock.values())
    assert since == sorted(since)
    assert not set(job.join_timed_out(now)) & set(job.untimed)
    # heartbeats: only for live nodes, oldest first (expired relies on it)
    assert set(job.heartbeats) <= {n.node_id for n in nodes.values() if live(n.role, n.liveness)}
    beats = list(job.heartbeats.values())
    assert beats == sorted(beats)
    # members: ids unique, every MEMBER-role node is listed
    assert len(set(job.members)) == len(job.members)
    assert {n.node_id for n in nodes.values() if n.role is Role.MEMBER} <= set(job.members)
    # idle_since is kept exactly while the job is idle
    assert (job.idle_since is not None) == job.idle()

    waiting = scan[(Role.WAITING, Liveness.ALIVE)]
    candidates = scan[(Role.CANDIDATE, Liveness.ALIVE)]
    standby = scan[(Role.STANDBY, Liveness.ALIVE)]
    alive_members = scan[(Role.MEMBER, Liveness.ALIVE)]
    dead_members = scan[(Role.MEMBER, Liveness.DEAD)]

    for round_ in range(job.round + 1):
        assert job.num_nodes_waiting(round_) >= 0
    if job.state is JobState.COMPLETE:
        members = [nodes[m] for m in job.members]
        assert all(m.role is Role.MEMBER for m in members)
        assert candidates == 0
        assert [m.node_rank for m in members] == list(range(len(members)))
        start = 0
        covered: list[int] = []
        for m in members:
            assert m.global_rank_start == start
            covered += range(start, start + m.nproc_per_node)
            start += m.nproc_per_node
        assert covered == list(range(job.world_size()))
        assert job.world_size() == sum(m.nproc_per_node for m in members)
        assert s.min_nodes <= len(members) <= s.max_nodes
        if alive_members == 0:  # rule 5: with no alive member the next round opens for whoever is in line
            assert waiting + standby == 0
        # rule 4
        assert job.num_nodes_waiting(job.round) == waiting + dead_members
        for round_ in range(job.round):
            assert job.num_nodes_waiting(round_) >= 1
        for m in members:
            if m.liveness is Liveness.ALIVE:
                a = job.assignment(m.node_id, job.round)
                assert a is not None
                assert (a.round, a.node_rank, a.num_nodes) == (job.round, m.node_rank, len(members))
                assert (a.global_rank_start, a.nproc_per_node, a.world_size) == (
                    m.global_rank_start, m.nproc_per_node, job.world_size(),
                )
                assert a.master_addr == members[0].addr
        for n in nodes.values():
            if n.pending:
                assert job.assignment(n.node_id, job.round) is None
    elif job.state is JobState.OPEN:
        assert waiting == 0  # waiting nodes became candidates when the round opened
        assert job.world_size() == 0
        for round_ in range(job.round + 1):
            assert job.num_nodes_waiting(round_) >= 1
        # rule 2: what has not formed yet must not be due to form at once
        assert candidates < s.max_nodes
        assert not (alive_members == 0 and candidates + standby >= s.max_nodes)
        if candidates + standby >= s.min_nodes:
            assert job.last_call_deadline is not None
            assert s.last_call_timeout > 0
        else:
            assert job.last_call_deadline is None
    else:
        assert job.last_call_deadline is None
        assert job.num_nodes_waiting(job.round) == 0
        # rule 6: standby and waiting nodes learn that they were no part of the closed run
        for n in nodes.values():
            try:
                job.assignment(n.node_id, job.round)
            except JobClosed as exc:
                assert isinstance(exc, JobClosedInLine) == (n.role in (Role.STANDBY, Role.WAITING))
            else:
                raise AssertionError("an assignment of a closed job")


def check_restore(sm: StateMachine) -> None:
    data = copy.deepcopy(sm.to_snapshot())
    restored = StateMachine(max_value_bytes=sm.max_value_bytes, job_ttl=sm.job_ttl)
    restored.restore(data)
    assert restored.to_snapshot() == sm.to_snapshot()
    for rdzv_id, entry in sm.jobs.items():
        job, again = entry.job, restored.job(rdzv_id)
        assert +again.counts == +job.counts
        assert dict(again.join_clock) == dict(job.join_clock) and again.untimed == job.untimed
        assert again.world_size() == job.world_size()
        for round_ in range(job.round + 1):
            assert again.num_nodes_waiting(round_) == job.num_nodes_waiting(round_)


class Rendezvous(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sm = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
        self.now = 0.0
        self.log: list[tuple[c.Command, float]] = []
        self.formed: tuple[int, int, list[str]] | None = None  # (run, round, members) last formed
        self.nproc = {n: 1 for n in POOL}
        self.checkpoints: list[tuple[int, dict[str, Any]]] = []  # (log length, snapshot) now and then
        self.settings: dict[str, Any] = {}

    @initialize(
        min_nodes=st.integers(1, 3),
        extra=st.integers(0, 2),
        last_call_timeout=st.sampled_from([0.0, 3.0, 10.0]),
        join_timeout=st.sampled_from([15.0, 60.0]),
        heartbeat_ttl=st.sampled_from([8.0, 25.0]),
    )
    def configure(self, min_nodes: int, extra: int, last_call_timeout: float, join_timeout: float, heartbeat_ttl: float) -> None:
        self.settings = {
            "min_nodes": min_nodes,
            "max_nodes": min_nodes + extra,
            "last_call_timeout": last_call_timeout,
            "join_timeout": join_timeout,
            "heartbeat_ttl": heartbeat_ttl,
        }

    # -- helpers ----------------------------------------------------------------------------

    def job(self) -> Job | None:
        entry = self.sm.jobs.get(RDZV_ID)
        return None if entry is None else entry.job

    def apply(self, command: c.Command) -> dict[str, Any] | RdzvError:
        before = copy.deepcopy(self.sm.to_snapshot())
        try:
            result = self.sm.apply(command, self.now).result
        except RdzvError as exc:
            assert self.sm.to_snapshot() == before  # a failed command changes nothing
            return exc
        self.log.append((command, self.now))
        if len(self.log) % 7 == 0:
            self.checkpoints.append((len(self.log), copy.deepcopy(self.sm.to_snapshot())))
        self.after_apply()
        return result

    def after_apply(self) -> None:
        job = self.job()
        if job is None:
            self.formed = None
            return
        check_job(job, self.now)
        if self.formed is not None and self.formed[0] != job.runs:
            self.formed = None  # a fresh run of a closed job carries no ranks over
        if job.state is JobState.COMPLETE and (self.formed is None or self.formed[1] != job.round):
            if self.formed is not None:
                # rank stability: a survivor of the previous round keeps its node rank when the
                # new round is big enough to hold it (rank.place, rule 1)
                for old_rank, m in enumerate(self.formed[2]):
                    if m in job.members and old_rank < len(job.members):
                        assert job.members[old_rank] == m
            self.formed = (job.runs, job.round, list(job.members))

    def join(self, node_id: str, nproc: int) -> None:
        self.nproc[node_id] = nproc
        job = self.job()
        if job is None:
            result = self.apply(c.Join(RDZV_ID, node_id, f"{node_id}.host", nproc, JobSettings(**self.settings)))
            assert isinstance(result, dict) and result["round"] == 0
            return
        state, round_, runs, idle = job.state, job.round, job.runs, job.idle()
        node = copy.deepcopy(job.nodes.get(node_id))
        scan = Counter((n.role, n.liveness) for n in job.nodes.values())
        result = self.apply(c.Join(RDZV_ID, node_id, f"{node_id}.host", nproc, JobSettings(**self.settings)))
        if state is JobState.CLOSED:
            if not idle:  # rule 6: the closed run still has nodes
                assert isinstance(result, JobClosed)
                in_line = node is not None and node.role in (Role.STANDBY, Role.WAITING)
                assert isinstance(result, JobClosedInLine) == in_line
                return
            # rule 6: every node departed: a fresh run with the next round number
            assert isinstance(result, dict) and result["round"] == round_ + 1
            job = self.job()
            assert job is not None and job.runs == runs + 1
            assert self.sm.kv(RDZV_ID).total_keys() == 0
            return
        assert isinstance(result, dict)
        job = self.job()
        assert job is not None
        if state is JobState.COMPLETE:
            alive_members = scan[(Role.MEMBER, Liveness.ALIVE)]
            if node is not None and node.pending:
                assert result["round"] == round_ + 1
                assert (job.state, job.round) == (state, round_)
            elif node is not None or alive_members == 0:
                # rule 3: a member (or anyone, once no member is alive) opens the next round
                assert job.round == round_ + 1
                assert result["round"] == round_ + 1
            else:
                expected = Role.WAITING if alive_members + scan[(Role.WAITING, Liveness.ALIVE)] < self.settings["max_nodes"] else Role.STANDBY
                assert job.nodes[node_id].role is expected
                assert (job.state, job.round) == (state, round_)
        else:
            assert result["round"] == round_

    # -- rules -------------------------------------------------------------------------------

    @rule(node_id=st.sampled_from(POOL), nproc=st.integers(1, 3))
    def join_any(self, node_id: str, nproc: int) -> None:
        self.join(node_id, nproc)

    @rule(data=st.data(), change_nproc=st.booleans())
    def member_rejoins(self, data: st.DataObject, change_nproc: bool) -> None:
        job = self.job()
        members = [] if job is None else [m for m in job.members if m in job.nodes and job.nodes[m].role is Role.MEMBER]
        if not members:
            return
        node_id = data.draw(st.sampled_from(members))
        nproc = data.draw(st.integers(1, 3)) if change_nproc else self.nproc[node_id]
        self.join(node_id, nproc)

    @rule(node_id=st.sampled_from(POOL))
    def leave(self, node_id: str) -> None:
        known = self.job() is not None
        result = self.apply(c.Leave(RDZV_ID, node_id))
        assert isinstance(result, JobNotFound) == (not known)

    @rule(node_id=st.sampled_from(POOL))
    def die(self, node_id: str) -> None:
        """A dropped connection: the server layer expires the node through the apply path."""
        result = self.apply(c.Expire(RDZV_ID, (node_id,), "dead"))
        assert isinstance(result, dict)

    @rule(node_id=st.sampled_from(POOL))
    def heartbeat(self, node_id: str) -> None:
        if self.job() is not None:
            before = self.sm.to_snapshot()
            self.sm.heartbeat(RDZV_ID, node_id, self.now)
            assert self.sm.to_snapshot() == before

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0, 12.0, 40.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        for _ in range(5):
            due = self.sm.due(RDZV_ID, self.now)
            if not due:
                break
            deadline = self.sm.deadline(RDZV_ID)
            assert deadline is not None and deadline <= self.now
            for command in due:
                job = self.job()
                spared = {}
                if isinstance(command, c.Expire) and command.why == "join_timeout" and job is not None:
                    # rule 5 removes *pending* nodes that pass join_timeout, never a spare of a
                    # formed round; an earlier command of the same batch may have admitted one
                    # into a round (or made it a spare) meanwhile
                    spared = {
                        n: (job.nodes[n].role, job.nodes[n].liveness)
                        for n in command.node_ids
                        if n in job.nodes and (not job.nodes[n].pending or n in job.untimed)
                    }
                result = self.apply(command)
                assert isinstance(result, dict)
                job = self.job()
                for node_id, was in spared.items():
                    assert job is not None and (job.nodes[node_id].role, job.nodes[node_id].liveness) == was
        else:
            raise AssertionError("due() keeps returning commands")
        deadline = self.sm.deadline(RDZV_ID)
        assert deadline is None or deadline > self.now

    @rule(go=st.integers(0, 4))
    def close(self, go: int) -> None:
        if go == 0 and self.job() is not None:
            self.apply(c.Close(RDZV_ID))
            job = self.job()
            assert job is not None and job.state is JobState.CLOSED

    @rule(key=st.sampled_from([b"a", b"b"]), amount=st.integers(-3, 3), in_round=st.booleans())
    def add(self, key: bytes, amount: int, in_round: bool) -> None:
        job = self.job()
        if job is not None:
            self.apply(c.Add(RDZV_ID, key, amount, round=job.round if in_round else None))

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def snapshot_restore_snapshot_is_identity(self) -> None:
        check_restore(self.sm)

    def teardown(self) -> None:
        # replaying every applied command with its `now` rebuilds the same state
        replayed = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
        for command, now in self.log:
            replayed.apply(command, now)
        assert replayed.to_snapshot() == self.sm.to_snapshot()
        # so does what recovery does: a snapshot taken midway, then the rest of the log
        for length, data in self.checkpoints:
            recovered = StateMachine(max_value_bytes=MAX_VALUE_BYTES, job_ttl=JOB_TTL)
            recovered.restore(copy.deepcopy(data))
            for command, now in self.log[length:]:
                recovered.apply(command, now)
            assert recovered.to_snapshot() == self.sm.to_snapshot()


TestRendezvousProperties = Rendezvous.TestCase
TestRendezvousProperties.settings = SETTINGS


# -- rank.place, a pure function --------------------------------------------------------------------


@st.composite
def candidates(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(0, 8))
    tiers = draw(st.lists(st.sampled_from(list(Tier)), min_size=n, max_size=n))
    out = []
    for i, tier in enumerate(tiers):
        out.append(Candidate(f"n{i}", tier, draw(st.integers(0, 20)) * 100 + i, draw(st.integers(1, 4))))
    return draw(st.permutations(out))


@settings(max_examples=200, deadline=None)
@given(cands=candidates(), max_nodes=st.integers(1, 6))
def test_place_admits_by_tier_then_order_with_prefix_sum_global_ranks(cands: list[Candidate], max_nodes: int) -> None:
    placements, overflow = place(cands, max_nodes)
    assert len(placements) == min(len(cands), max_nodes)
    assert {p.node_id for p in placements} | {o.node_id for o in overflow} == {x.node_id for x in cands}
    assert not {p.node_id for p in placements} & {o.node_id for o in overflow}
    assert [p.node_rank for p in placements] == list(range(len(placements)))
    start = 0
    for p in placements:
        assert p.global_rank_start == start
        start += p.nproc_per_node
    by_id = {x.node_id: x for x in cands}
    admitted = [by_id[p.node_id] for p in placements]
    if overflow:
        worst = max((x.tier, x.order) for x in admitted)
        assert all((o.tier, o.order) > worst for o in overflow)
    n = len(placements)
    for p in placements:  # a previous member keeps its old rank when it fits
        x = by_id[p.node_id]
        if x.tier is Tier.PREVIOUS and x.order < n:
            assert p.node_rank == x.order
