"""Rank assignment: who gets into a new round, and which node_rank and global ranks each gets.

Rules (README "Where each node's ranks land"):
- Admission: nodes of the previous round that come back first (by their old node rank), then
  nodes that were waiting or newly joined, by arrival; then standby nodes, by arrival. At most
  ``max_nodes`` are admitted; the rest stay standby.
- Node ranks, so that the fewest ranks move and neighbours in rank are neighbours in the
  network, for the ``n`` admitted nodes:
  1. a node of the previous round keeps its old node rank if it is below ``n``;
  2. the ranks left over go, lowest first, to the previous round's nodes whose old rank is
     ``n`` or more (a shrink; by old rank), then to the others in placement order: their
     topology path (``zone/rack/switch``, component by component, each in natural order),
     then their host in natural order (``node7`` before ``node66``), then arrival. A node
     with no topology path comes after every node with one.
  So a first round is in topology-then-host order, and a spare that replaces a departed
  node takes the departed node's rank.
- Global ranks are prefix sums of nproc_per_node in node_rank order: node k owns
  ``[start_k, start_k + nproc_k)``, contiguous, disjoint, covering ``0..world_size-1``
  (mixed nproc_per_node included: a node that takes another's rank may own other global ranks).

Pure functions over plain values; no clock, no I/O.
"""

from __future__ import annotations

import enum
import functools
import re
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
    host: str = ""  # the node's address (its host): natural order after the topology path
    topology: str = ""  # its topology path, "" when it reported none
    arrival: int = 0  # the job-wide join counter: the last tie-break


@dataclass(frozen=True)
class Placement:
    node_id: str
    node_rank: int
    global_rank_start: int
    nproc_per_node: int


def admission_order(candidates: Sequence[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.tier, c.order))


_DIGITS = re.compile(r"\d+")
# A digit run becomes NUL, a character saying how many digits it has, then the digits: runs
# sort by value (a shorter number is smaller), before any text at the same place. Components
# of a topology path are joined by two NULs, which sort before anything a component holds.
# Flat strings: sorting 16K nodes compares strings, not nested tuples (about 10x faster).
_COMPONENT = "\x00\x00"


def _number(match: re.Match[str]) -> str:
    digits = match.group().lstrip("0") or "0"
    return "\x00" + chr(0x21 + len(digits)) + digits


@functools.lru_cache(maxsize=1 << 17)  # hosts and path components recur at every formation
def natural_key(text: str) -> str:
    """``text`` as people sort it: runs of digits by their value (``node7`` < ``node66``).
    Text is a printable host name or path component (the wire refuses control characters)."""
    return _DIGITS.sub(_number, text) if any(ch.isdigit() for ch in text) else text


def placement_key(c: Candidate) -> tuple[bool, str, str, int]:
    """Topology path (none last; component by component), then host, then arrival: the order
    new nodes take the free node ranks in."""
    path = _COMPONENT.join(natural_key(part) for part in c.topology.split("/")) if c.topology else ""
    return (not c.topology, path, natural_key(c.host), c.arrival)


def place(candidates: Sequence[Candidate], max_nodes: int) -> tuple[list[Placement], list[Candidate]]:
    """Admit up to ``max_nodes`` candidates in priority order and give each its node rank (see
    the module's rules); return (placements in node-rank order, overflow)."""
    ordered = admission_order(candidates)
    members, overflow = ordered[:max_nodes], ordered[max_nodes:]
    n = len(members)
    kept = {c.node_id: c.order for c in members if c.tier is Tier.PREVIOUS and c.order < n}
    displaced = [c for c in members if c.tier is Tier.PREVIOUS and c.node_id not in kept]  # by old rank
    others = sorted((c for c in members if c.tier is not Tier.PREVIOUS), key=placement_key)
    taken = set(kept.values())
    vacant = [r for r in range(n) if r not in taken]
    by_rank: dict[int, Candidate] = {rank: c for c in members if (rank := kept.get(c.node_id, -1)) >= 0}
    by_rank.update(zip(vacant, [*displaced, *others], strict=True))
    placements = []
    start = 0
    for node_rank in range(n):
        c = by_rank[node_rank]
        placements.append(Placement(c.node_id, node_rank, start, c.nproc_per_node))
        start += c.nproc_per_node
    return placements, overflow
