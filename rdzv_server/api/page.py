"""The job page's data: a page of the membership document, and the job's lanes.

What it owns: :func:`document_page` (``GET /v1/jobs/{rdzv_id}?offset=O&limit=L``) and
:func:`lanes` (``GET /v1/jobs/{rdzv_id}/lanes``): the job over time, one lane per node across
rounds, drawn by the job page. Both are pure functions of what the service read: the
membership document, then the timeline's events and the server's ``now`` (two reads: a change
between them shows in the timeline, whose deaths and refusals win; the next read catches up).

Rules:
- Paging: the nodes are in one order, the document's own: ``nodes`` (node_rank order), then
  ``joining``, ``waiting``, ``standby`` (arrival order); lanes add the nodes that only the
  timeline still names (departed or refused), by first appearance. ``offset``/``limit`` cut
  that order; a paged document keeps its four lists (each holding its part of the page) and
  adds ``page`` (``offset``, ``limit``, ``total``) and ``counts``. Without paging parameters
  the document is unchanged.
- A lane's cell is the node's state in one round: ``member``, ``joining`` (a candidate, or
  waiting for the next round), ``standby``, ``left`` (left, or timed out in line), ``failed``
  (its workers failed in that round: a ``workers_failed`` event; the cell's cause is the
  report's summary, the first failure's rank, exit code or signal and message), ``cordoned``,
  ``refused``, ``dead``. When a node was in several states in one round the last one shown is
  the strongest (:data:`STATES`, weakest first): a member that died in round 3 is ``dead``
  there. A cell is ``None`` where the node was not in the job, or where nothing kept says.
- Cells come from replaying the events kept (a job keeps its last 1,024: ``first_seq`` > 1 says
  older ones are gone, so an early round may show fewer nodes than it had), and the current
  round's cells from the membership document, which is authoritative for who is member,
  joining or standby now; the timeline's stronger states (left, cordoned, refused, dead) win.
- Only the newest :data:`MAX_ROUNDS` rounds are drawn; ``summary`` counts each round's cells
  over every lane (not only the page), so a 16,384-node job is drawn as a page of lanes plus
  one bar per round.
- Event kinds this module does not know (added later) are kept as the round's ``notes``; a
  ``node_refused`` or ``node_departed`` whose cause is ``cordoned``, and ``host_cordoned``
  naming a node, make the node's cell ``cordoned``; ``host_uncordoned``, ``job_closed`` and
  the like are notes.

What it must not know: the service, the machine, HTTP; how the page draws any of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.event import Cause, Kind

#: A lane's cell states, weakest first: within one round the strongest wins.
STATES = ("joining", "standby", "member", "left", "failed", "cordoned", "refused", "dead")
_STRENGTH = {state: i for i, state in enumerate(STATES)}
#: Rounds drawn: the newest this many (a job that re-formed more often shows its recent past).
MAX_ROUNDS = 48
#: Lanes or document nodes per page when ``limit`` is not given, and the most one page may hold.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: The document's node lists, in the one order the pages cut.
NODE_LISTS = ("nodes", "joining", "waiting", "standby")

_PENDING_STATUS = {"candidate": "joining", "waiting": "joining", "standby": "standby"}
_MEMBER_STATUS = {"alive": "member"}  # a member's other statuses (dead, left) are lane states
# Every other departure cause is a death; a cordon taking a node out of line is its own state.
_DEPARTED = {Cause.LEFT.value: "left", Cause.JOIN_TIMEOUT.value: "left", Cause.CORDONED.value: "cordoned"}
# Every other refusal cause (settings, health check) is "refused".
_REFUSAL = {Cause.CORDONED.value: "cordoned"}
# Kinds that place nodes in lanes; every other kind is a note on its round.
_NODE_KINDS = frozenset(
    k.value for k in (Kind.NODE_JOINED, Kind.STANDBY_PROMOTED, Kind.NODE_DEPARTED, Kind.JOIN_REFUSED, Kind.NODE_REFUSED)
)


def document_page(document: dict[str, Any], offset: int, limit: int) -> dict[str, Any]:
    """The membership document with its node lists cut to ``[offset, offset + limit)`` of their
    one order, plus ``page`` and ``counts`` (each list's full length)."""
    counts = {name: len(document[name]) for name in NODE_LISTS}
    paged = dict(document)
    start, end = offset, offset + limit
    for name in NODE_LISTS:
        size = counts[name]
        paged[name] = document[name][max(0, start) : max(0, end)]
        start, end = start - size, end - size
    paged["page"] = {"offset": offset, "limit": limit, "total": sum(counts.values())}
    paged["counts"] = counts
    return paged


@dataclass(slots=True)
class _Lane:
    node_id: str
    addr: str | None
    node_rank: int | None = None
    cells: dict[int, tuple[str, str]] = field(default_factory=dict)  # round -> (state, cause)

    def mark(self, round_: int, state: str, cause: str) -> None:
        old = self.cells.get(round_)
        if old is None or _STRENGTH[state] >= _STRENGTH[old[0]]:
            self.cells[round_] = (state, cause)


@dataclass
class _Replay:
    """The events kept, replayed into lanes (see the module docstring)."""

    lanes: dict[str, _Lane] = field(default_factory=dict)  # first appearance order
    current: dict[str, str] = field(default_factory=dict)  # node -> joining | standby | member
    rounds: dict[int, dict[str, Any]] = field(default_factory=dict)

    def lane(self, event: dict[str, Any]) -> _Lane:
        node_id = event["node_id"]
        lane = self.lanes.get(node_id)
        if lane is None:
            lane = self.lanes[node_id] = _Lane(node_id, event.get("addr"))
        elif event.get("addr"):
            lane.addr = event["addr"]
        return lane

    def round_info(self, round_: int) -> dict[str, Any]:
        info = self.rounds.get(round_)
        if info is None:
            info = self.rounds[round_] = {"round": round_, "formed_at": None, "cause": None, "num_nodes": None,
                                          "world_size": None, "formation_s": None, "notes": [],
                                          "opened_by": None, "opened_by_node": None}  # fmt: skip
        return info

    def apply(self, e: dict[str, Any]) -> None:
        kind, cause, round_, node_id = e["kind"], e["cause"], e["round"], e.get("node_id")
        info = self.round_info(round_)
        if kind == Kind.ROUND_FORMED.value:
            info.update(formed_at=e["time"], cause=cause, num_nodes=e.get("num_nodes"), world_size=e.get("world_size"),
                        formation_s=e.get("formation_s"), opened_by=e.get("opened_by"),
                        opened_by_node=e.get("opened_by_node"))  # fmt: skip
            for nid, state in self.current.items():
                if state == "joining":
                    self.current[nid] = state = "member"
                self.lanes[nid].mark(round_, state, cause)
            return
        if kind == Kind.JOB_CREATED.value:
            return  # the start of the story: the first lane says it
        if kind == Kind.WORKERS_FAILED.value and node_id is not None:
            self.lane(e).mark(round_, "failed", str(e.get("summary") or cause))  # the round it failed in
            return
        if node_id is None or (kind not in _NODE_KINDS and kind != Kind.HOST_CORDONED.value):
            note = {"kind": kind, "cause": cause, "time": e["time"]}
            if node_id is not None:
                note["node_id"] = node_id
            info["notes"].append(note)
            return
        lane = self.lane(e)
        if kind == Kind.NODE_JOINED.value:
            state = "standby" if cause == Cause.STANDBY.value else "joining"
            self.current[node_id] = state
        elif kind == Kind.STANDBY_PROMOTED.value:
            state = self.current[node_id] = "member"
        elif kind == Kind.NODE_DEPARTED.value:
            state = _DEPARTED.get(cause, "dead")
            self.current.pop(node_id, None)
        elif kind == Kind.HOST_CORDONED.value:
            state = "cordoned"  # it finishes its round; its next join is refused
        else:  # join_refused, node_refused
            state = _REFUSAL.get(cause, "refused")
            self.current.pop(node_id, None)
        lane.mark(round_, state, cause)


def lanes(
    document: dict[str, Any], events: Iterable[dict[str, Any]], first_seq: int, now: float, offset: int, limit: int
) -> dict[str, Any]:
    """The job's lanes (``GET /v1/jobs/{rdzv_id}/lanes``): ``rounds`` (oldest first, each with its
    formation time, cause and notes), ``summary`` (per round: a count per state, over every
    lane), and the lanes ``[offset, offset + limit)``, each with one cell per round."""
    replay = _Replay()
    for e in events:
        replay.apply(e)
    now_round, open_ = document["round"], document["state"] == "open"
    placed: dict[str, _Lane] = {}  # a re-joined member of an open round is in two lists: one lane
    member_round = now_round - 1 if open_ else now_round
    known = replay.lanes
    for name in NODE_LISTS:
        for n in document[name]:
            node_id, status = n["node_id"], n["status"]
            pending = _PENDING_STATUS.get(status)
            # The document's word on one round: a member's (alive, dead, left) on the formed round's.
            if pending is None:
                round_, state, cause = member_round, _MEMBER_STATUS.get(status, status), ""
            else:
                round_, state, cause = now_round, pending, status
            lane = placed.get(node_id)
            if lane is None and node_id not in known:  # nothing else to say (most nodes of a big job)
                placed[node_id] = _Lane(node_id, n["addr"], n["node_rank"], {round_: (state, cause)})
                continue
            if lane is None:
                lane = placed[node_id] = known.pop(node_id)
            lane.addr = n["addr"]
            if n["node_rank"] is not None:
                lane.node_rank = n["node_rank"]
            if pending is None:
                if state == "member" or not lane.cells:  # a known death is where the timeline put it
                    lane.mark(round_, state, "")
            else:  # the document is authoritative for who is in line now
                old = lane.cells.get(round_)
                if old is None or _STRENGTH[old[0]] <= _STRENGTH["member"]:
                    lane.cells[round_] = (state, cause)
    ordered = [*placed.values(), *replay.lanes.values()]  # known only from the timeline: departed, refused
    newest = max([now_round, *replay.rounds])
    oldest = min([now_round, *replay.rounds, *(r for lane in ordered for r in lane.cells)])
    shown = list(range(max(oldest, newest - MAX_ROUNDS + 1), newest + 1))
    summary: list[dict[str, int]] = [{} for _ in shown]
    first = shown[0]
    for lane in ordered:
        for round_, (state, _) in lane.cells.items():
            if round_ >= first:
                counts = summary[round_ - first]
                counts[state] = counts.get(state, 0) + 1
    page = ordered[offset : offset + limit]
    return {
        "rdzv_id": document["rdzv_id"],
        "state": document["state"],
        "round": now_round,
        "now": now,
        "first_seq": first_seq,  # > 1: older events are gone, early rounds may be partial
        "states": list(STATES),
        "rounds": [replay.round_info(r) for r in shown],
        "summary": summary,
        "page": {"offset": offset, "limit": limit, "total": len(ordered)},
        "lanes": [
            {
                "node_id": lane.node_id,
                "addr": lane.addr,
                "node_rank": lane.node_rank,
                "cells": [lane.cells[r][0] if r in lane.cells else None for r in shown],
                "causes": [lane.cells[r][1] or None if r in lane.cells else None for r in shown],
            }
            for lane in page
        ],
    }
