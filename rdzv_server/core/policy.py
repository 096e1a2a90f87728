"""The job policies: settings an operator keeps on the server for the jobs a pattern matches.

What it owns: :class:`Policy` (one pattern and its settings, when and by whom last changed),
:class:`PolicyTable` (the server-wide table, with its version), the precedence rule
(:meth:`PolicyTable.winning`) and :func:`resolve` (a job's effective settings from its own,
the winning policies' and the ones it had).

Rules:
- A pattern is a job id, or a glob over job ids in fnmatch syntax (``*``, ``?``, ``[...]``,
  compared case-sensitively, as job ids are). A policy's settings are typed and checked
  before they reach here (``rdzv_client.record.policy_settings``): keys of
  ``POLICY_JOB_KEYS`` (the job settings the server applies) and ``POLICY_NODE_KEYS``
  (``health_check``, ``health_check_timeout``, ``gpu_check``: the plug-in runs them).
- Precedence, per key: the policy whose pattern is the job id itself wins; else, among the
  globs that match the job id, the most specific that sets the key: the most literal
  characters (those outside ``*``, ``?`` and a ``[...]`` set), then the longest pattern, then
  the lexically first (:func:`specificity`). So ``llm-*`` can set ``max_restarts`` for every
  LLM job while ``llm-7b-*`` sets its node counts and ``llm-7b-a`` one timeout.
- A key no matching policy sets is the job's own (its first join's or create's), else the
  default; the job document names each key's source (``policy PATTERN``, ``node``,
  ``default``).
- One rule spans keys: ``min_nodes <= max_nodes``. A policy that sets both is checked when it
  is set; where a policy and a job's own values combine to break it (a policy's
  ``min_nodes=6`` over a job started with ``--nnodes=1:4``), :func:`resolve` keeps the job's
  previous value of each node count that the change would move, and says so (``held``): the
  change applies to the job's other keys, and its ``policy_changed`` event names what was held
  and why. Nothing is refused for it: a policy is for many jobs, present and future.
- ``version`` grows by one at every change of the table (a node refetches its job's policy
  only when the version it last saw moved). The table changes only through the apply path
  (``machine.StateMachine``), from the command and its ``now``; it travels in the snapshot.

What it must not know: I/O, the clock, jobs (the machine hands each job its winning policies).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

from rdzv_client.record import POLICY_JOB_KEYS, JobSettings

#: The most policies the server holds: one per team, job family and job, and more.
MAX_POLICIES = 10_000
#: Characters that make a pattern a glob (a job id has none of them).
GLOB_CHARS = frozenset("*?[")
#: The one rule between keys: these two are held together (see the module docstring).
NODE_COUNTS = ("min_nodes", "max_nodes")

#: Per key a policy sets for a job: its value and the pattern of the policy it comes from.
Winning = dict[str, tuple[Any, str]]


@dataclass(frozen=True)
class Policy:
    pattern: str
    settings: dict[str, Any]  # never changed in place: a change makes a new Policy
    changed_at: float  # server clock
    changed_by: str  # "operator"

    def entry(self) -> dict[str, Any]:
        """The policy as the routes answer it (and as a ``set_policy`` result is kept for retries)."""
        return {
            "pattern": self.pattern,
            "settings": dict(self.settings),
            "changed_at": self.changed_at,
            "changed_by": self.changed_by,
        }


def document(rdzv_id: str, winning: Winning, version: int) -> dict[str, Any]:
    """The effective policy of job ``rdzv_id`` as the clients read it (``GET /v1/policy`` and
    the ``policy`` operation): each key some policy sets, its source, and the table's version."""
    return {
        "job": rdzv_id,
        "settings": {k: v for k, (v, _) in winning.items()},
        "sources": {k: f"policy {pattern}" for k, (_, pattern) in winning.items()},
        "version": version,
    }


def is_glob(pattern: str) -> bool:
    return not GLOB_CHARS.isdisjoint(pattern)


def literal_chars(pattern: str) -> int:
    """The characters of ``pattern`` outside its wildcards (``*``, ``?``, a ``[...]`` set; an
    unclosed ``[`` is a literal, as fnmatch reads it)."""
    count, i = 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch in "*?":
            i += 1
            continue
        if ch == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "!":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            end = pattern.find("]", j)
            if end >= 0:
                i = end + 1
                continue
        count += 1
        i += 1
    return count


def specificity(pattern: str) -> tuple[int, int, int, str]:
    """The sort key of precedence, most specific first: the exact job id, then the most literal
    characters, then the longest pattern, then the lexically first."""
    return (1 if is_glob(pattern) else 0, -literal_chars(pattern), -len(pattern), pattern)


def matches(pattern: str, rdzv_id: str) -> bool:
    return fnmatchcase(rdzv_id, pattern) if is_glob(pattern) else pattern == rdzv_id


class Resolved(NamedTuple):
    """A job's effective settings under its winning policies."""

    settings: JobSettings
    sources: dict[str, str]  # each job key a policy gives its value: that policy's pattern
    held: dict[str, str]  # each node count kept at its previous value, and why


def resolve(own: JobSettings, winning: Winning, previous: JobSettings, previous_sources: dict[str, str]) -> Resolved:
    """The job's settings: ``own`` (its nodes') with each job key ``winning`` names replaced.

    Where that breaks ``min_nodes <= max_nodes``, each node count the result would move from
    ``previous`` (the settings the job had; its own for a new job or a fresh run) keeps its
    previous value and source, and is ``held`` (see the module docstring)."""
    overrides = {k: v for k, (v, _) in winning.items() if k in _JOB_KEYS}
    merged = dataclasses.replace(own, **overrides) if overrides else own
    held: dict[str, str] = {}
    if merged.min_nodes > merged.max_nodes:
        moved = [k for k in NODE_COUNTS if getattr(merged, k) != getattr(previous, k)]
        merged = dataclasses.replace(merged, **{k: getattr(previous, k) for k in moved})
        why = (
            f"min_nodes <= max_nodes would not hold ({_counts(winning, own)}): "
            f"the job keeps min_nodes={merged.min_nodes} max_nodes={merged.max_nodes}"
        )
        held = {k: why for k in moved}
    sources = {k: winning[k][1] for k in overrides if k not in held}
    sources.update({k: previous_sources[k] for k in held if k in previous_sources})
    return Resolved(merged, sources, held)


def _counts(winning: Winning, own: JobSettings) -> str:
    words = []
    for key in NODE_COUNTS:
        entry = winning.get(key)
        words.append(f"{key}={getattr(own, key)} (node)" if entry is None else f"{key}={entry[0]} (policy {entry[1]})")
    return ", ".join(words)


_JOB_KEYS = frozenset(POLICY_JOB_KEYS)


class PolicyTable:
    def __init__(self) -> None:
        self.policies: dict[str, Policy] = {}
        self.version = 0

    def __len__(self) -> int:
        return len(self.policies)

    def full(self, pattern: str) -> bool:
        """Whether a new policy for ``pattern`` would exceed :data:`MAX_POLICIES`."""
        return pattern not in self.policies and len(self.policies) >= MAX_POLICIES

    def get(self, pattern: str) -> Policy | None:
        return self.policies.get(pattern)

    def listing(self) -> list[Policy]:
        """Every policy, most specific first (the order precedence reads them in)."""
        return sorted(self.policies.values(), key=lambda p: specificity(p.pattern))

    def set(self, pattern: str, settings: dict[str, Any], now: float, by: str) -> Policy:
        """Merge ``settings`` into ``pattern``'s policy (made if new); returns the policy."""
        old = self.policies.get(pattern)
        merged = dict(old.settings) if old is not None else {}
        merged.update(settings)
        policy = self.policies[pattern] = Policy(pattern, merged, now, by)
        self.version += 1
        return policy

    def unset(self, pattern: str, keys: tuple[str, ...], now: float, by: str) -> list[str]:
        """Remove ``keys`` from ``pattern``'s policy (none: all of them; a policy left with none
        is removed). Returns the keys removed. The caller checks that the policy exists."""
        old = self.policies[pattern]
        removed = [k for k in old.settings if not keys or k in keys]
        left = {k: v for k, v in old.settings.items() if k not in removed}
        if left:
            self.policies[pattern] = Policy(pattern, left, now, by)
        else:
            del self.policies[pattern]
        if removed:
            self.version += 1
        return removed

    def winning(self, rdzv_id: str) -> Winning:
        """Per key some policy sets for job ``rdzv_id``: the winning value and its pattern
        (precedence: see the module docstring). O(policies)."""
        found = [p for p in self.policies.values() if matches(p.pattern, rdzv_id)]
        if not found:
            return {}
        found.sort(key=lambda p: specificity(p.pattern))
        out: Winning = {}
        for policy in found:
            for key, value in policy.settings.items():
                out.setdefault(key, (value, policy.pattern))
        return out

    # -- snapshot -------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "policies": [[p.pattern, p.settings, p.changed_at, p.changed_by] for p in self.policies.values()],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any] | None) -> PolicyTable:
        table = cls()
        if data:  # (snapshots before issue 28 have none)
            table.version = data["version"]
            for pattern, settings, changed_at, changed_by in data["policies"]:
                table.policies[pattern] = Policy(pattern, dict(settings), changed_at, changed_by)
        return table
