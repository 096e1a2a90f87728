"""The seam between the service and the part it plays: the one server, or one replica of a cluster.

What it owns: the roles a server takes (:class:`RoleName`), the table of legal role changes
(:data:`TRANSITIONS`, checked in one place, :func:`transition`), the interface the service
decides through (:class:`Role`), and :class:`Single`, the role of the one server (no ``--etcd``).
:mod:`.replication` implements :class:`Role` for a replica. The cluster document
(``GET /v1/cluster``) is built here alone (:func:`cluster_document`, :func:`replica_entry`,
:func:`single_view`), for a replica and for the one server alike.

Rules:
- The one server is ``single`` for its whole life. A replica starts a ``candidate`` and moves
  only along :data:`TRANSITIONS`: recovered, it follows; elected and serving, it leads; a term
  that ends (a lost lease, a failed append, shutdown) makes it a candidate again. An illegal
  change raises :class:`IllegalRoleChange` and changes nothing.
- The service decides through a role's methods, never by its name: the name is presentation
  (``/readyz``, ``/v1/cluster``, the metrics, the replica registry).

What it must not know: etcd, HTTP, the state machine, the log.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .core.error import LogFailed, NotReady, RdzvError


class RoleName(enum.Enum):
    """The part a server plays; the values are the wire's strings."""

    SINGLE = "single"  # no --etcd: the one server
    CANDIDATE = "candidate"  # a replica between terms: no state it keeps current
    FOLLOWER = "follower"  # a replica replaying the leader's committed records
    LEADER = "leader"  # the replica that serves


#: Each role's legal next roles. A candidate may stay one (a term that failed before it
#: recovered ends as it began); every other change is a step along a term.
TRANSITIONS: Mapping[RoleName, frozenset[RoleName]] = {
    RoleName.SINGLE: frozenset(),
    RoleName.CANDIDATE: frozenset({RoleName.CANDIDATE, RoleName.FOLLOWER}),
    RoleName.FOLLOWER: frozenset({RoleName.LEADER, RoleName.CANDIDATE}),
    RoleName.LEADER: frozenset({RoleName.CANDIDATE}),
}


class IllegalRoleChange(RuntimeError):
    """A role change :data:`TRANSITIONS` does not allow: a bug in the caller, never a client's doing."""

    def __init__(self, old: RoleName, new: RoleName) -> None:
        allowed = ", ".join(sorted(r.value for r in TRANSITIONS[old])) or "nothing"
        super().__init__(f"a {old.value} cannot become a {new.value} (a {old.value} may become: {allowed})")
        self.old = old
        self.new = new


def transition(old: RoleName, new: RoleName) -> RoleName:
    """``new``, if a server playing ``old`` may take it up. Raises IllegalRoleChange otherwise."""
    if new not in TRANSITIONS[old]:
        raise IllegalRoleChange(old, new)
    return new


def replica_entry(
    replica_id: str, url: str, role: RoleName, since: float, started: float, applied_index: int
) -> dict[str, Any]:
    """One server's entry in the cluster document (a replica also publishes it in etcd's registry):
    ``since`` is when it took up ``role``, ``started`` when its process started (wall-clock seconds)."""
    return {"id": replica_id, "url": url, "role": role.value, "since": since, "started": started,
            "applied_index": applied_index}  # fmt: skip


def cluster_document(
    mode: str, this: dict[str, Any], leader: dict[str, Any] | None, replicas: list[dict[str, Any]],
    etcd: dict[str, Any] | None,
) -> dict[str, Any]:
    """``GET /v1/cluster``: ``mode`` (``single`` or ``replicated``), which replica answers
    (``this``, its entry), the leader (``{"id", "url", "since"}``, None if none is known), every
    replica's entry, and etcd's part (None for the one server)."""
    return {"mode": mode, "this": this["id"], "leader": leader, "replicas": replicas, "etcd": etcd}


def single_view(server_id: str, url: str, started: float, applied_index: int) -> dict[str, Any]:
    """The cluster document of the one server: it alone, leading since it started."""
    me = replica_entry(server_id, url, RoleName.SINGLE, started, started, applied_index)
    return cluster_document("single", me, {"id": me["id"], "url": me["url"], "since": me["since"]}, [me], None)


class Role(Protocol):
    """What the service asks of the part it plays (see the module docstring)."""

    @property
    def role(self) -> RoleName:
        """The part played now."""
        ...

    @property
    def replicated(self) -> bool:
        """Whether this server is one replica of a cluster (``--etcd``)."""
        ...

    async def start(self) -> None:
        """Take up the part; a replica returns once it follows (or leads). Raises SystemExit
        (one line) for a configuration that cannot work."""
        ...

    async def close(self) -> None:
        """Give the part up (a leader resigns, so that another replica takes over at once)."""
        ...

    def lease_valid(self) -> bool:
        """Whether this server may answer from its memory now (a replica: its lease is surely alive)."""
        ...

    def leader_url(self) -> str | None:
        """The URL of the replica that leads (this one's own included); None if none, or single."""
        ...

    def applied(self) -> int:
        """The index of the last record this server applied (a leader: appended)."""
        ...

    def unavailable(self) -> RdzvError:
        """The error an operation is answered with while this server does not serve."""
        ...

    def commit_failed(self) -> RdzvError:
        """The error a write is answered with when the log did not take its record."""
        ...

    def step_down(self, reason: str) -> bool:
        """The log failed: end this term and return True; False where there is no term to end
        (the one server), and the server must stop for good."""
        ...

    async def view(self) -> dict[str, Any] | None:
        """``GET /v1/cluster`` as this replica sees it; None for the one server (the API draws
        that). Raises NotReady when etcd does not answer."""
        ...


class Single:
    """The one server (no ``--etcd``): it serves once recovered, and its log failing is fatal."""

    def __init__(self, log_index: Callable[[], int]) -> None:
        self._log_index = log_index

    @property
    def role(self) -> RoleName:
        return RoleName.SINGLE

    @property
    def replicated(self) -> bool:
        return False

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def lease_valid(self) -> bool:
        return True

    def leader_url(self) -> str | None:
        return None

    def applied(self) -> int:
        return self._log_index()

    def unavailable(self) -> RdzvError:
        return NotReady("the server is still recovering its log; retry shortly")

    def commit_failed(self) -> RdzvError:
        return LogFailed(
            "the server's log failed to write this change (see the server's log: a full or failing disk?), "
            "so it acknowledges nothing more and stops; retry once it is restarted"
        )

    def step_down(self, reason: str) -> bool:
        return False

    async def view(self) -> dict[str, Any] | None:
        return None
