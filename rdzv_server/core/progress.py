"""A job's formed rounds as its crash-loop rule and its goodput see them: when each round
formed and ended, the highest training step reported in it, and the fast failures in a row.

Rules (README "A crash loop stops itself"; ``core/rendezvous.py`` rule 8 applies them):

1. A round *ends by a failure* when a live member re-joins its formed round while nothing
   else asked for a new round (no death, no departure, no waiting or standby node): torch's
   restart after its workers failed (rendezvous rule 7). Only such rounds are judged.
2. A judged round is a *fast failure* when it ended within ``min_round_seconds`` of forming
   (``short_round``), or when progress is on (a step was reported in this run) and its
   highest step is not above the job's best step before it formed (``no_progress``), however
   long it ran. A judged round that is neither resets the count.
3. ``max_fast_failures`` fast failures in a row close the job with ``restart_storm``
   (0: the rule is off, nothing is counted).
4. Steps arrive two ways. Logged: a member's re-join carries the highest step its workers
   reported in the round it leaves; rule 2 reads only these, so a replay decides the same.
   Soft: a node's beats carry its current step, for the steps over time a page draws and for
   the running round's goodput (like heartbeats: not logged, not snapshotted, lost on restart).
5. Goodput: the time spent in rounds that made progress (their highest step, logged or soft,
   above the job's best before them) over the wall time since the run's first round formed.
   None while no step was reported.

Bounded: the last ``MAX_ROUNDS_KEPT`` rounds and ``MAX_SAMPLES`` samples are kept; what older
rounds contributed to goodput is kept as two sums.

What it must not know: nodes, roles, the transition table (``rendezvous.py`` calls it), I/O
and clocks (time is an argument).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from rdzv_client.record import Cause, JobSettings

#: Rounds whose record a job keeps: its document lists them all, and is read every few seconds
#: by an open job page (200 rounds are ~16 KB of JSON; the page draws the newest 48 lanes).
MAX_ROUNDS_KEPT = 200
#: Soft step samples a job keeps for its page (one per change of the job's step, ~30 bytes each).
MAX_SAMPLES = 500


@dataclass
class RoundRecord:
    """One formed round: when it formed and ended, the job's best step before it, the highest
    step logged for it (re-joins) and seen for it (beats), and whether it was a fast failure."""

    round: int
    formed_at: float
    base: int | None  # the job's best logged step when the round formed
    ended_at: float | None = None
    step: int | None = None  # logged
    seen: int | None = None  # soft
    fast: str = ""  # the fast failure's cause ("": not one)

    def last_step(self) -> int | None:
        steps = [s for s in (self.step, self.seen) if s is not None]
        return max(steps) if steps else None

    def progressed(self, step: int | None) -> bool:
        """Whether ``step`` (the round's highest) is progress: above the best before it."""
        return step is not None and (self.base is None or step > self.base)


@dataclass(frozen=True)
class Verdict:
    """How rule 2 judged a round that ended by a failure."""

    cause: Cause | None  # SHORT_ROUND or NO_PROGRESS; None: a healthy round
    fast_failures: int  # in a row, this one included
    storm: bool  # rule 3: the job must close with restart_storm


@dataclass(frozen=True)
class ProgressView:
    """A job's rounds and steps at one instant, as plain data (the API builds its document)."""

    rounds: tuple[RoundRecord, ...]  # copies: the job's own records go on changing
    samples: tuple[tuple[float, int, int], ...]  # (server time, round, step), soft
    goodput: float | None
    fast_failures: int


@dataclass
class RoundLog:
    rounds: OrderedDict[int, RoundRecord] = field(default_factory=OrderedDict)
    best: int | None = None  # the highest logged step of this run
    fast_failures: int = 0  # in a row (rule 2)
    started_at: float | None = None  # the run's first round formed (goodput's wall time)
    dropped_good_s: float = 0.0  # goodput of rounds no longer kept
    samples: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # soft

    def formed(self, round_: int, now: float) -> None:
        """Round ``round_`` formed at ``now``."""
        if self.started_at is None:
            self.started_at = now
        self.rounds[round_] = RoundRecord(round_, now, self.best)
        while len(self.rounds) > MAX_ROUNDS_KEPT:
            _, old = self.rounds.popitem(last=False)
            if old.progressed(old.step) and old.ended_at is not None:  # logged steps only: the snapshot replays
                self.dropped_good_s += old.ended_at - old.formed_at

    def ended(self, now: float) -> None:
        """The last formed round gave way (the next round opened, or the job closed)."""
        last = self._last()
        if last is not None and last.ended_at is None:
            last.ended_at = now

    def report(self, step: int) -> None:
        """Rule 4, logged: a member of the last formed round reports its highest step in it."""
        last = self._last()
        if last is not None:
            last.step = step if last.step is None else max(last.step, step)
        self.best = step if self.best is None else max(self.best, step)

    def judge(self, now: float, settings: JobSettings) -> Verdict | None:
        """Rules 2 and 3 for the last formed round, which ended by a failure at ``now``.

        None when the rule is off (``max_fast_failures=0``) or no round formed."""
        last = self._last()
        if settings.max_fast_failures == 0 or last is None:
            return None
        if now - last.formed_at < settings.min_round_seconds:
            cause: Cause | None = Cause.SHORT_ROUND
        elif self.best is not None and not last.progressed(last.step):
            cause = Cause.NO_PROGRESS
        else:
            cause = None
        self.fast_failures = self.fast_failures + 1 if cause is not None else 0
        last.fast = cause.value if cause is not None else ""
        return Verdict(cause, self.fast_failures, self.fast_failures >= settings.max_fast_failures)

    def seen(self, round_: int, step: int, now: float) -> None:
        """Rule 4, soft: a node of round ``round_`` beats with its current ``step``."""
        last = self._last()
        if last is None or last.round != round_ or last.ended_at is not None:
            return
        if last.seen is None or step > last.seen:
            last.seen = step
            self.samples.append((now, round_, step))

    def goodput(self, now: float) -> float | None:
        """Rule 5 at ``now`` (the job's close time once it closed), or None (no step reported)."""
        if self.started_at is None or now <= self.started_at:
            return None
        good, any_step = self.dropped_good_s, self.dropped_good_s > 0
        for r in self.rounds.values():
            step = r.last_step()
            any_step = any_step or step is not None
            if r.progressed(step):
                good += (now if r.ended_at is None else r.ended_at) - r.formed_at
        return min(1.0, good / (now - self.started_at)) if any_step else None

    def view(self, now: float) -> ProgressView:
        """The rounds and steps at ``now`` (the job's close time once it closed)."""
        return ProgressView(
            tuple(dataclasses.replace(r) for r in self.rounds.values()), tuple(self.samples), self.goodput(now),
            self.fast_failures,
        )

    def _last(self) -> RoundRecord | None:
        return next(reversed(self.rounds.values())) if self.rounds else None

    # -- snapshot: the logged part only (``seen`` and ``samples`` are soft) ------------------

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "rounds": [[r.round, r.formed_at, r.base, r.ended_at, r.step, r.fast] for r in self.rounds.values()],
            "best": self.best,
            "fast_failures": self.fast_failures,
            "started_at": self.started_at,
            "dropped_good_s": self.dropped_good_s,
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> RoundLog:
        log = cls(best=data["best"], fast_failures=data["fast_failures"], started_at=data["started_at"],
                  dropped_good_s=data["dropped_good_s"])
        for round_, formed_at, base, ended_at, step, fast in data["rounds"]:
            log.rounds[round_] = RoundRecord(round_, formed_at, base, ended_at, step, None, fast)
        return log
