"""The documents the API answers with: the membership of ``GET /v1/jobs/{rdzv_id}`` (with its
``pending_reason`` sentence), the lines of ``GET /v1/jobs``, the events of
``GET /v1/jobs/{rdzv_id}/events`` and the cordons of ``/v1/cordons`` (DESIGN.md), built from
core's plain data (:class:`JobView`, :class:`Pending`, :class:`JobSummary`, :class:`JobEvent`,
:class:`EventPage`, :class:`Cordon`), which the service's queries return.

What it owns: the presentation (which node goes in which list, what each field is called, how
it is rounded, the words of a sentence). What it must not know: how the rendezvous rules
decide, I/O, the wire encoding (``api/codec.py`` encodes the documents as JSON or msgpack).
"""

from __future__ import annotations

from typing import Any

from ..core.cordon import Cordon
from ..core.policy import Policy
from ..core.event import EventPage, JobEvent
from ..core.rendezvous import JobSummary, JobView, Liveness, NodeView, Pending, Role


def job_document(view: JobView) -> dict[str, Any]:
    """The membership document: the formed round's nodes, then those in line by role."""
    settings = view.settings

    def in_role(role: Role) -> list[dict[str, Any]]:
        return [_node_entry(n, view.now) for n in view.nodes if n.role is role]

    return {
        "rdzv_id": view.rdzv_id,
        "state": view.state.value,
        "round": view.round,
        "min_nodes": settings.min_nodes,
        "max_nodes": settings.max_nodes,
        "num_nodes": view.num_nodes,
        "world_size": view.world_size,
        "nodes": [_node_entry(n, view.now) for n in view.members],
        "joining": in_role(Role.CANDIDATE),
        "waiting": in_role(Role.WAITING),
        "standby": in_role(Role.STANDBY),
        "num_nodes_waiting": view.num_nodes_waiting,
        "pending_reason": pending_reason(view.pending),
        "last_call_timeout": settings.last_call_timeout,
        "join_timeout": settings.join_timeout,
        "heartbeat_ttl": settings.heartbeat_ttl,
        "restarts": view.restarts,  # the job-wide restart budget (README "Fleet control")
        "max_restarts": settings.max_restarts,
        "closed_cause": view.closed_cause or None,
        **_progress_fields(view),
        # Job policy (README "Job policy"): the node-side keys a policy sets for the job, and
        # where each effective setting comes from ("policy PATTERN", "node", "default").
        **view.node_settings,
        "settings_source": dict(view.settings_source),
    }


def _progress_fields(view: JobView) -> dict[str, Any]:
    """The crash-loop rule's settings and count, each formed round's last step (and fast
    failure), the steps over time and the goodput (README "A crash loop stops itself")."""
    progress = view.progress
    return {
        "min_round_seconds": view.settings.min_round_seconds,
        "max_fast_failures": view.settings.max_fast_failures,
        "fast_failures": 0 if progress is None else progress.fast_failures,
        "progress": [] if progress is None else [
            {"round": r.round, "formed_at": r.formed_at, "ended_at": r.ended_at, "step": r.last_step(),
             "fast_failure": r.fast}
            for r in progress.rounds
        ],
        "steps": [] if progress is None else [[t, round_, step] for t, round_, step in progress.samples],
        "goodput": None if progress is None or progress.goodput is None else round(progress.goodput, 4),
    }


def _node_entry(node: NodeView, now: float) -> dict[str, Any]:
    """One node: a member shows its node rank and global ranks; a node in line, its role."""
    member = node.role is Role.MEMBER
    start = node.global_rank_start
    beat = node.last_heartbeat
    return {
        "node_id": node.node_id,
        "addr": node.addr,
        "node_rank": node.node_rank if member else None,
        "nproc_per_node": node.nproc_per_node,
        "global_ranks": list(range(start, start + node.nproc_per_node)) if start is not None and member else [],
        "alive": node.liveness is Liveness.ALIVE,
        "status": node.liveness.value if member else node.role.value,
        "last_heartbeat_age_s": None if beat is None else round(max(0.0, now - beat), 3),
        "topology": node.topology or None,
    }


def job_summary(summary: JobSummary) -> dict[str, Any]:
    """One line of the job list."""
    return {
        "rdzv_id": summary.rdzv_id,
        "state": summary.state.value,
        "round": summary.round,
        "num_nodes": summary.num_nodes,
        "world_size": summary.world_size,
        "min_nodes": summary.settings.min_nodes,
        "max_nodes": summary.settings.max_nodes,
        "pending": summary.pending,
    }


def pending_reason(pending: Pending | None) -> str | None:
    """Why the round is still open, in words an operator can act on (None: it is not open)."""
    if pending is None:
        return None
    if pending.below_min_nodes:
        return f"waiting for min_nodes: {pending.in_line} of {pending.min_nodes} joined"
    reasons = []
    expected = pending.members_expected
    if expected:
        reasons.append(f"waiting for {expected} previous member{'s' if expected > 1 else ''} to re-join")
    if pending.last_call_left is not None:
        reasons.append(
            f"last call ends in {pending.last_call_left:.1f} s ({pending.in_line} of up to {pending.max_nodes} joined)"
        )
    return "; ".join(reasons) or None


def policy_entry(policy: Policy, now: float) -> dict[str, Any]:
    """One policy: its pattern, settings, when (server clock, as ``now``) and by whom it last
    changed, and ``age_s``, how long ago that was."""
    return {**policy.entry(), "age_s": round(max(0.0, now - policy.changed_at), 3)}


def event_entry(event: JobEvent) -> dict[str, Any]:
    """One event of a job's timeline: its fields, then its kind's details."""
    return {
        "seq": event.seq,
        "time": event.time,
        "kind": event.kind.value,
        "cause": event.cause.value,
        "round": event.round,
        "node_id": event.node_id,
        "addr": event.addr,
        **event.detail,
    }


def events_document(rdzv_id: str, found: EventPage) -> dict[str, Any]:
    """``GET /v1/jobs/{rdzv_id}/events``: the events found, and where the timeline stands."""
    return {
        "rdzv_id": rdzv_id,
        "first_seq": found.first_seq,  # a reader that asked for less missed the ones before
        "next_seq": found.next_seq,
        "now": found.now,
        "events": [event_entry(e) for e in found.events],
    }


def cordon_entry(cordon: Cordon, now: float) -> dict[str, Any]:
    """One cordon in effect at ``now``: ``left_s`` is the time it still runs (None: until lifted)."""
    return {
        "host": cordon.host,
        "since": cordon.since,
        "until": cordon.until,
        "left_s": None if cordon.until is None else round(max(0.0, cordon.until - now), 3),
        "reason": cordon.reason,
        "by": cordon.by,
    }
