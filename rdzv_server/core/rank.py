"""Rank assignment: who gets which node_rank and which global ranks in a new round.

Rules:
- Nodes of the previous round that come back keep their relative order and take the
  lowest node ranks, so a re-rendezvous moves as few ranks as possible.
- Then nodes that were waiting or newly joined, by arrival; then standby nodes, by arrival.
- At most ``max_nodes`` are admitted; the rest stay standby.
- Global ranks are prefix sums of nproc_per_node in node_rank order: node k owns
  ``[start_k, start_k + nproc_k)``, contiguous, disjoint, covering ``0..world_size-1``.

Pure functions over plain values; no clock, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Tier(enum.IntEnum):
    """Admission priority of a candidate for a round (lower first)."""

    PREVIOUS = 0  # in the previous round's membership
    NEW = 1  # waiting or newly joined
    STANDBY = 2  # arrived when the round was already full


@dataclass(frozen=True)
class Candidate:
    node_id: str
    tier: Tier
    order: int  # previous node_rank for PREVIOUS, else the arrival number
    nproc_per_node: int


@dataclass(frozen=True)
class Placement:
    node_id: str
    node_rank: int
    global_rank_start: int
    nproc_per_node: int


def admission_order(candidates: Sequence[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.tier, c.order))


def place(candidates: Sequence[Candidate], max_nodes: int) -> tuple[list[Placement], list[Candidate]]:
    """Admit up to ``max_nodes`` candidates in priority order; return (placements, overflow)."""
    ordered = admission_order(candidates)
    members, overflow = ordered[:max_nodes], ordered[max_nodes:]
    placements = []
    start = 0
    for node_rank, c in enumerate(members):
        placements.append(Placement(c.node_id, node_rank, start, c.nproc_per_node))
        start += c.nproc_per_node
    return placements, overflow
