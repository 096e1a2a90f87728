"""Leader election among replicas, on etcd: one lease-bound key per candidate, oldest leads.

What it owns: campaigning under a prefix, keeping the candidate's lease alive, knowing
whether this replica leads, naming the current leader (for followers and redirects), and
the :class:`LeaderKey` that fences every write the leader makes.

What it must not know: the log, records, HTTP.

How it works (the recipe of etcd's own ``concurrency.Election``):
- A candidate grants a lease of ``ttl_s`` seconds and creates ``<prefix>/election/<lease
  id in hex>`` attached to it, holding its name. etcd gives every key a cluster-wide
  increasing create revision; the live key with the smallest one is the leader.
- A candidate that is not the oldest watches the key just older than its own and checks
  again when that key goes away (its holder resigned, or its lease expired), so a takeover
  happens within the old lease's TTL of the old leader's last keepalive. A watch that breaks
  (its etcd member died or went silent) is opened again, on another member, and the check
  repeated: losing an etcd member does not end a campaign.
- The keepalive loop renews the lease every third of the TTL, and at once again (the client
  moving from member to member) when a renewal fails. etcd's answers decide whether the
  lease is alive: when etcd says it is gone, this replica stops calling itself leader
  (:attr:`Election.lost` is set) and never leads again under that campaign. When etcd does
  not answer, the lease may still be alive (a new etcd leader extends every lease by its
  election), so the loop keeps asking for :data:`LEASE_LOSS_GRACE_S` past the estimate
  below before it gives the lease up. Meanwhile :meth:`Election.lease_valid` is false (the
  replica serves nothing), and true again as soon as a renewal is confirmed.

Invariants:
- Leading is decided by etcd, not by this process's belief. :attr:`Election.is_leader` is
  advisory (a paused process may still believe it leads); what keeps a stale leader from
  writing is the fence: every write is a txn compared on the :class:`LeaderKey`'s create
  revision, and a key whose lease expired no longer exists (create revision 0), so the
  compare fails. A later campaign creates a new key with a new revision, so an old fence
  never matches again.
- Every wait is bounded: :meth:`Election.campaign` takes a timeout, the keepalive loop
  runs until resign or loss, and each etcd call has the client's request timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from .etcd_client import (
    GRPC_NOT_FOUND,
    Compare,
    EtcdClient,
    EtcdError,
    EtcdRequestError,
    EtcdUnavailableError,
    EtcdWatchCompactedError,
    Get,
    KeyValue,
    Put,
    prefix_end,
)

logger = logging.getLogger(__name__)

# A dead leader is replaced within about this long; a GC pause or a slow etcd shorter than
# it does not cost a replica its leadership.
DEFAULT_LEASE_TTL_S = 5
# How long past the lease estimate (see Election.valid_until) keepalives go on, unanswered,
# before the lease is given up: etcd's own election takes one to two election timeouts (1 s
# by default) and its new leader extends every lease, so a renewal confirmed within this
# keeps the leadership; a lease etcd did expire is refused at the first answer anyway.
LEASE_LOSS_GRACE_S = 3.0
# A candidate's watch that breaks is opened again this many times in a row (each open tries
# every member), this far apart, before the campaign fails (as the log's tail does).
WATCH_REOPENS = 20
WATCH_REOPEN_PAUSE_S = 0.5
# After a renewal that failed, the next one goes after this short pause (the client has
# already spent its request deadline trying every member, unless etcd refused outright).
KEEPALIVE_RETRY_PAUSE_S = 0.1


@dataclass(frozen=True)
class LeaderKey:
    """The leader's election key and its create revision: what every leader write compares on."""

    key: bytes
    create_revision: int
    name: str

    def fence(self) -> Compare:
        """The txn condition "this key is still the one this leader created"."""
        return Compare(self.key, "CREATE", self.create_revision)


class ElectionLostError(EtcdError):
    """The campaign ended without leadership: its lease expired or it was resigned meanwhile."""


class Election:
    """One replica's campaign under ``prefix``; see the module docstring.

    ``name`` is what followers learn about the leader (its advertised URL, say).
    """

    def __init__(self, client: EtcdClient, prefix: str, name: str, *, ttl_s: int = DEFAULT_LEASE_TTL_S) -> None:
        if ttl_s < 1:
            raise ValueError(f"The election lease TTL must be at least 1 s, not {ttl_s}.")
        self._client = client
        self._dir = prefix.rstrip("/").encode() + b"/election/"
        self.name = name
        self.ttl_s = ttl_s
        self.lease_id = 0
        self.leader_key: LeaderKey | None = None  # set once this campaign leads
        self._own: KeyValue | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()
        # Until when (the loop's monotonic clock) etcd cannot have expired the lease: the
        # send time of the last renewal etcd confirmed, plus the TTL it answered. etcd counts
        # the TTL from when it received the renewal, so this errs early. A process that was
        # paused (SIGSTOP, a long GC) sees it passed the moment it runs again.
        self.valid_until = 0.0

    @property
    def is_leader(self) -> bool:
        """Whether this campaign won and has not lost its lease since (advisory: see the docstring)."""
        return self.leader_key is not None and not self.lost.is_set()

    def lease_valid(self) -> bool:
        """Whether the lease is surely still alive in etcd now (see :attr:`valid_until`).

        A leader answers reads from memory only while this holds: after a pause longer than
        the TTL another replica may lead and have taken writes this one never saw.
        """
        return not self.lost.is_set() and asyncio.get_running_loop().time() < self.valid_until

    async def register(self) -> None:
        """Become a candidate (grant the lease, create the key) without waiting to lead; idempotent."""
        if self._own is None:
            await self._register()

    async def leader(self) -> LeaderKey | None:
        """The current leader, as etcd sees it now; ``None`` when nobody campaigns."""
        result = await self._client.range(self._dir, prefix_end(self._dir), limit=1, sort_by_create=True)
        if not result.kvs:
            return None
        kv = result.kvs[0]
        return LeaderKey(kv.key, kv.create_revision, kv.value.decode(errors="replace"))

    async def campaign(self, timeout_s: float | None = None) -> LeaderKey:
        """Wait until this replica leads; return its fence.

        Raises ``TimeoutError`` after ``timeout_s`` (then still a candidate: call
        :meth:`resign` to withdraw), :class:`ElectionLostError` if the lease is lost while
        waiting, and :class:`~.etcd_client.EtcdError` when etcd cannot be reached.
        """
        await self.register()
        waiting = asyncio.ensure_future(self._wait_until_oldest())
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            done, _ = await asyncio.wait({waiting, lost}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
        if waiting in done:
            self.leader_key = waiting.result()
            logger.info("Replica %s leads under %s (lease %x).", self.name, self._dir.decode(), self.lease_id)
            return self.leader_key
        if self.lost.is_set():
            raise ElectionLostError(f"Replica {self.name} lost its election lease while campaigning.")
        raise TimeoutError(f"Replica {self.name} did not become leader within {timeout_s} s.")

    async def _register(self) -> None:
        sent = asyncio.get_running_loop().time()
        lease = await self._client.lease_grant(self.ttl_s)
        self.valid_until = sent + (lease.ttl or self.ttl_s)
        self.lease_id = lease.id
        key = self._dir + f"{lease.id:x}".encode()
        result = await self._client.txn(
            [Compare(key, "CREATE", 0)], [Put(key, self.name.encode(), lease.id), Get(key)], [Get(key)]
        )
        self._own = result.ranges[0][0]
        self._keepalive = asyncio.get_running_loop().create_task(
            self._keep_alive(), name=f"rdzv-election-keepalive {self.name}"
        )

    async def _wait_until_oldest(self) -> LeaderKey:
        assert self._own is not None
        own = self._own
        broken = 0  # watches broken in a row, without a range read in between
        # Bounded by the caller's timeout (or the lease's loss); each pass waits for one
        # older candidate to go, there are finitely many older ones, and a broken watch is
        # reopened at most WATCH_REOPENS times in a row.
        while True:
            older = await self._client.range(self._dir, prefix_end(self._dir), sort_by_create=True)
            ahead = [kv for kv in older.kvs if kv.create_revision < own.create_revision]
            if not any(kv.key == own.key for kv in older.kvs):
                raise ElectionLostError(f"Replica {self.name}'s election key is gone (its lease expired).")
            if not ahead:
                return LeaderKey(own.key, own.create_revision, self.name)
            try:
                await self._wait_deleted(ahead[-1].key, older.revision + 1)
                broken = 0
            except (EtcdUnavailableError, EtcdWatchCompactedError) as exc:
                # Its member died or went silent (or the history moved on): the range above,
                # read again, says whether the key ahead is gone meanwhile.
                broken += 1
                if broken > WATCH_REOPENS:
                    raise
                logger.warning("Replica %s's election watch broke (%s); watching again.", self.name, exc)
                await asyncio.sleep(WATCH_REOPEN_PAUSE_S)

    async def _wait_deleted(self, key: bytes, start_revision: int) -> None:
        async for batch in self._client.watch(key, start_revision=start_revision):
            if any(event.kind == "DELETE" for event in batch.events):
                return

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        pause = self.ttl_s / 3
        try:
            while True:  # until etcd says the lease is gone, or it stayed silent past the grace
                await asyncio.sleep(pause)
                try:
                    renewal = await self._client.lease_keepalive(self.lease_id)
                except EtcdRequestError as exc:
                    if exc.code == GRPC_NOT_FOUND:
                        logger.warning("etcd says the election lease of replica %s is gone: %s", self.name, exc)
                        break
                    renewal = None
                    failure: EtcdError = exc
                except EtcdError as exc:
                    renewal = None
                    failure = exc
                if renewal is None:
                    if loop.time() > self.valid_until + LEASE_LOSS_GRACE_S:
                        logger.warning(
                            "Replica %s could not renew its election lease for %.1f s past its estimate: %s",
                            self.name, LEASE_LOSS_GRACE_S, failure,
                        )  # fmt: skip
                        break
                    logger.warning("Replica %s could not renew its election lease yet: %s", self.name, failure)
                    pause = KEEPALIVE_RETRY_PAUSE_S
                    continue
                if renewal.ttl <= 0:
                    logger.warning("etcd says the election lease of replica %s has expired.", self.name)
                    break
                self.valid_until = max(self.valid_until, renewal.sent + renewal.ttl)
                pause = self.ttl_s / 3
            logger.warning(
                "Replica %s lost its election lease %x; it no longer leads.", self.name, self.lease_id
            )
        finally:
            self.valid_until = 0.0
            self.lost.set()

    async def resign(self) -> None:
        """Stop campaigning or leading: revoke the lease, which deletes this candidate's key.

        Idempotent. A leader that resigns must stop writing first; its fence fails anyway.
        """
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        self.lost.set()
        if self.lease_id:
            lease_id, self.lease_id = self.lease_id, 0
            await self._client.lease_revoke(lease_id)

    def stop_keepalive(self) -> None:
        """Stop renewing the lease without revoking it (what a paused or partitioned leader looks like).

        For tests and for a replica that must step down without reaching etcd: the lease
        then expires within its TTL, and another candidate takes over.
        """
        if self._keepalive is not None:
            self._keepalive.cancel()
