"""The documents of the job pages: the membership of ``GET /v1/jobs/{rdzv_id}`` and the lines
of ``GET /v1/jobs`` (DESIGN.md), built from core's plain data (:class:`JobView`,
:class:`JobSummary`), which the service's queries return.

What it owns: the presentation (which node goes in which list, what each field is called and
how it is rounded). What it must not know: how the rendezvous rules decide, I/O, the wire
encoding (``api/codec.py`` encodes the documents as JSON or msgpack).
"""

from __future__ import annotations

from typing import Any

from ..core.rendezvous import JobSummary, JobView, Liveness, NodeView, Role


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
        "pending_reason": view.pending_reason,
        "last_call_timeout": settings.last_call_timeout,
        "join_timeout": settings.join_timeout,
        "heartbeat_ttl": settings.heartbeat_ttl,
        "restarts": view.restarts,  # the job-wide restart budget (README "Fleet control")
        "max_restarts": settings.max_restarts,
        "closed_cause": view.closed_cause or None,
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
