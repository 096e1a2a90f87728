"""What the server decides on its own, beside a client's request: pure functions that return commands.

What it owns: the decisions the service used to make itself, each a function of the state,
the time and a policy that returns what to apply (as :meth:`.machine.StateMachine.due`
already was for the timer):

- :func:`quarantine`: which hosts automatic quarantine cordons after deaths of their nodes
  (``--quarantine-after K --quarantine-window W --quarantine-for D``, :class:`QuarantinePolicy`),
  and :func:`failure_quarantine`, after failures that were a host's own (``--quarantine-failures
  K --quarantine-failure-lead L``, rule 12 of ``rendezvous.py``);
- :func:`refusal`: what a refused join leaves on its job's timeline (the job itself if the
  refused node was its first; the refusal, once per repeated refusal), and
  :func:`self_refusal`, the same for a node whose health check failed;
- :func:`death_after_drop`: whether a node whose long-poll dropped died, judged from its heartbeats once
  the grace has passed;
- :func:`dying`: the hosts and last heartbeats of the nodes an expiry is about to mark dead,
  read before it is applied (what quarantine counts by, and how long a death took to notice).

Rules:
- Nothing here changes state or reads a clock: ``now`` is an argument, and what comes back is
  applied (and logged) through the one apply path like any other command, so a replay never
  decides again and a change of the flags never makes a replay diverge.
- A decision the state no longer supports answers "nothing to do" (an empty list, None),
  never an error: the service may ask late (a job collected meanwhile).

What it must not know: I/O, asyncio, logging, the service, the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rdzv_client.record import MAX_REASON_CHARS

from . import command as c
from .error import HostCordoned, RdzvError, SettingsConflict
from .event import Cause
from .machine import StateMachine
from .rendezvous import Departure

#: The refusals of a join that its job's timeline records, by the error that refused it.
REFUSAL_CAUSES: tuple[tuple[type[RdzvError], Cause], ...] = (
    (SettingsConflict, Cause.SETTINGS_CONFLICT),
    (HostCordoned, Cause.CORDONED),
)


@dataclass(frozen=True)
class QuarantinePolicy:
    """Automatic quarantine (README "Quarantine"): ``after`` deaths of one host's nodes within
    ``window`` s cordon the host for ``duration`` s; ``after`` 0 turns it off."""

    after: int
    window: float
    duration: float
    # Host-local failures (README "Job fate"): this many within ``window`` cordon the host (0:
    # never), each counted when its node's workers failed at least ``failure_lead`` s before
    # any other node's of the same round, or alone.
    failures: int = 0
    failure_lead: float = 0.0


class Dying(NamedTuple):
    """The nodes an expiry is about to mark dead, as quarantine and the metrics need them."""

    hosts: tuple[str, ...]  # their addresses, each once, in the command's order
    beats: tuple[float, ...]  # their last heartbeats (a silent host died at most this long before)


NOBODY = Dying((), ())


def dying(machine: StateMachine, command: c.Command) -> Dying:
    """The hosts and last heartbeats of the nodes ``command`` (an ``Expire`` of dead nodes) is
    about to remove; :data:`NOBODY` for any other command. Read it *before* applying: the
    expiry forgets the nodes it removes."""
    if not isinstance(command, c.Expire) or command.why != Departure.DEAD.value:
        return NOBODY
    entry = machine.jobs.get(command.rdzv_id)
    if entry is None:
        return NOBODY
    nodes, beats = entry.job.nodes, entry.job.heartbeats
    hosts = tuple(dict.fromkeys(nodes[n].addr for n in command.node_ids if n in nodes))
    return Dying(hosts, tuple(beats[n] for n in command.node_ids if n in beats))


def quarantine(
    machine: StateMachine, rdzv_id: str, hosts: tuple[str, ...], now: float, policy: QuarantinePolicy
) -> list[c.Cordon]:
    """The cordons automatic quarantine applies at ``now``, after deaths of nodes on ``hosts``
    in job ``rdzv_id``: one per host with at least ``policy.after`` deaths within
    ``policy.window`` that is not cordoned already (its cordon names why, ``by="flapping"``)."""
    if policy.after <= 0:
        return []
    cordons = machine.cordons
    out: list[c.Cordon] = []
    for host in hosts:
        deaths = cordons.deaths_within(host, now, policy.window)
        if deaths < policy.after or cordons.active(host, now) is not None:
            continue
        reason = f"{deaths} deaths of its nodes within {policy.window:g} s (--quarantine-after {policy.after})"
        out.append(c.Cordon(rdzv_id, host=host, reason=reason, duration=policy.duration, by=Cause.FLAPPING.value))
    return out


#: How much of each failure's first line a quarantine's reason quotes (a reason is at most 500 characters).
QUOTED_CHARS = 120


def failure_quarantine(machine: StateMachine, rdzv_id: str, now: float, policy: QuarantinePolicy) -> list[c.Cordon]:
    """The cordon automatic quarantine applies at ``now``, after a round of job ``rdzv_id``
    formed: its host blamed for the round before (rule 12 of ``rendezvous.py``), once it has
    ``policy.failures`` failures within ``policy.window`` that led the others by
    ``policy.failure_lead`` s, and is not cordoned already. Its reason quotes the failures'
    first lines (``by="workers_failed"``). Nothing when nobody was blamed."""
    entry = machine.jobs.get(rdzv_id)
    if policy.failures <= 0 or entry is None or entry.job.blamed is None:
        return []
    host = entry.job.blamed[0]
    cordons = machine.cordons
    lines = cordons.failures_within(host, now, policy.window, policy.failure_lead)
    if len(lines) < policy.failures or cordons.active(host, now) is not None:
        return []
    printable = ("".join(ch if ch.isprintable() else " " for ch in line[:QUOTED_CHARS]) for line in reversed(lines))
    quoted = "; ".join(dict.fromkeys(printable))  # newest first, each once: a reason is one printable line
    reason = (
        f"workers failed on it first {len(lines)} times within {policy.window:g} s "
        f"(--quarantine-failures {policy.failures}): {quoted}"
    )
    return [c.Cordon(rdzv_id, host=host, reason=reason[:MAX_REASON_CHARS], duration=policy.duration,
                     by=Cause.WORKERS_FAILED.value)]  # fmt: skip


def refusal(machine: StateMachine, join: c.Join, exc: RdzvError) -> list[c.Command] | None:
    """What to log for ``join`` refused with ``exc``, in order: the job, when the refused node
    was its first (the job exists to say why it is not in it), then the refusal, unless the
    job's timeline says the same already (a node refused again and again is recorded once).
    None when ``exc`` is not a refusal the timeline records (the caller raises it as it is)."""
    cause = next((cause for kind, cause in REFUSAL_CAUSES if isinstance(exc, kind)), None)
    if cause is None:
        return None
    refused = c.Refused(join.rdzv_id, join.node_id, join.addr, cause.value, exc.message)
    out: list[c.Command] = []
    if join.rdzv_id not in machine.jobs:
        out.append(c.Create(join.rdzv_id, join.settings))
    if not machine.already_refused(refused):
        out.append(refused)
    return out


def self_refusal(machine: StateMachine, command: c.Refuse) -> list[c.Command]:
    """What to log for a node that refused itself (its health check failed): ``command``,
    unless its job's timeline says the same refusal already."""
    same = c.Refused(command.rdzv_id, command.node_id, command.addr, command.cause, command.detail)
    return [] if machine.already_refused(same) else [command]


def death_after_drop(
    machine: StateMachine, rdzv_id: str, node_id: str, lost_at: float, now: float, grace: float, polling: bool
) -> c.Expire | None:
    """Whether node ``node_id``, whose long-poll dropped at ``lost_at``, is dead at ``now``:
    the expiry to apply, or None. It is dead once ``grace`` has passed since the drop unless it
    came back: a request after the drop (its heartbeat is newer), or another of its polls
    still open (``polling``); None too when the job or the node is gone already. A heartbeat
    sent while the dropped poll was parked says nothing about whether it outlived the
    connection, so only a newer one counts."""
    if now < lost_at + grace or polling:
        return None
    entry = machine.jobs.get(rdzv_id)
    if entry is None:
        return None
    beat = entry.job.heartbeats.get(node_id)
    if beat is None or beat > lost_at:
        return None
    return c.Expire(rdzv_id, (node_id,), Departure.DEAD.value, Cause.CONNECTION_CLOSED.value)
