"""How a round's nodes finish: torch's exit barrier, as the server sees it (a mixed finish).

What it owns: :class:`ExitBarrier`, the state of torch's exit barrier for the last formed
round of a job (how many of the round's nodes have reached it, whether the server released
it, and why), and the words a closed job's error uses for it. The rule that acts on it is
rule 9 of :mod:`rdzv_server.core.rendezvous` (it needs the job's membership); the machine
(:mod:`rdzv_server.core.machine`) feeds it the barrier's count from the round's store and
sets the barrier's key when the rule releases it.

Why the server ends a barrier: torch's agent, once its workers succeeded, adds 1 to the
round's ``num_members`` count and waits (300 s by default) for ``last_member``, which the
node that brings the count to the round's number of nodes sets. A node whose workers failed
never adds: with restarts left it re-joins, with none it ends its run. Its round can then
never complete the barrier, and, since a finished node never re-joins, no later round can
form with everyone: the finished nodes would wait out the 300 s and the failing one would
wait for a round that cannot form. The server sees both halves (the count, and the member
that re-joined, died or left), so it ends the barrier as torch's last member would and
closes the job, naming the cause.

What it must not know: torch (the key names are a protocol constant of
:mod:`rdzv_client.record`), I/O, the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .event import Cause

#: The job close causes of a mixed finish (``Job._closed_why`` words them with the barrier).
MIXED_FINISH_CAUSES = (Cause.WORKERS_FAILED_AFTER_FINISH.value, Cause.MEMBER_DEPARTED_AFTER_FINISH.value)

# How the member that made the round unable to finish went, by its cause, for an error text.
_HOW = {
    Cause.WORKERS_FAILED_AFTER_FINISH.value: "re-joined (its workers failed and its agent restarted them)",
    Cause.MEMBER_DEPARTED_AFTER_FINISH.value: "died or left",
}


@dataclass
class ExitBarrier:
    """torch's exit barrier of formed round ``round`` (``num_nodes`` nodes): ``finished`` of
    them have reached it (the count their ``add`` returned). Once ``released`` the server has
    set its key; ``cause`` and ``lost`` then say why, and which member ("" when none is known)."""

    round: int
    num_nodes: int
    finished: int = 0
    released: bool = False
    cause: str = ""
    lost: str = ""

    @property
    def waits(self) -> bool:
        """Some nodes of the round finished and wait for the others (torch's last add releases
        them when all do; the server when one of the others can no longer come)."""
        return not self.released and 0 < self.finished < self.num_nodes

    def why(self) -> str:
        """The closed job's explanation, for a refused node's error (begins with a space)."""
        who = f"node {self.lost}" if self.lost else "a member"
        return (
            f" ({self.cause}: {who} of round {self.round} {_HOW.get(self.cause, 'went away')} after {self.finished} "
            f"of its {self.num_nodes} nodes had finished and were waiting in torch's exit barrier; a finished node "
            "never re-joins, so no round can form again: the server released the finished nodes and ended the job)"
        )

    def to_snapshot(self) -> list[Any]:
        return [self.round, self.num_nodes, self.finished, self.released, self.cause, self.lost]

    @classmethod
    def from_snapshot(cls, data: list[Any] | None) -> ExitBarrier | None:
        return None if data is None else cls(*data)
