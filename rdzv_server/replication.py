"""One replica of a cluster over etcd (``--etcd``): follow the log, campaign, lead, step down.

What it owns: the replica's etcd client, its terms (one election campaign each), the
follower's tail into the live state machine, the leader's hand-over to the service, the
replica registry in etcd, and the cluster view (``GET /v1/cluster``).

What it must not know: HTTP, what records mean (it hands them to the state machine's
``replay``), how the leader applies commands (:class:`~.service.Service` does).

A term, start to end (:meth:`Replication._term`):

1. Recover: read the snapshot and the records after it at one etcd revision, rebuild a
   fresh machine off the loop, and install it as a follower. Every operation now answers
   503 ``not_leader`` naming the leader (clients go there with the same request id).
   Register as a candidate, read who leads and publish this replica in the registry; only
   then is it a follower (``/readyz``): a ready replica is always in the cluster view.
2. Follow and campaign at once: a watch from that revision replays every record the
   leader commits into the live machine (the state stays hot), while the election waits
   for this replica's key to be the oldest.
3. Lead: once elected, the old leader's key is gone, so its fenced appends fail and the
   log is frozen. Read ``log-head``; the tail catches up to it; stop the tail; open the
   replicated log at that index and hand it to the service, which resets heartbeats (each
   node gets a full TTL of grace: no node is declared dead because the leader changed),
   schedules every deadline and serves.
4. Step down when the lease is lost (etcd says so, or no keepalive was answered for a while
   past the lease estimate: :mod:`.storage.election`), when an append is not committed (the
   fence failed, or etcd failed), or on shutdown: the service stops serving
   at once, its memory (which may hold applied but uncommitted commands) is dropped, and a
   new term starts from step 1.

Invariants:
- Only the leader applies commands through the service; a follower's machine changes only
  by replaying committed records, in index order.
- A leader acknowledges a write only after its txn committed under its fence, and answers
  reads only while its lease is surely alive (:meth:`Election.lease_valid`), so a leader
  paused past its lease answers nothing stale when it resumes.
- Every wait is bounded or cancellable: terms retry after a pause; catch-up has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from .config import ServerConfig
from .core.error import NotLeader, NotReady, RdzvError
from .role import RoleName, cluster_document, replica_entry, transition
from .storage.election import Election, LeaderKey
from .storage.etcd_client import (
    EtcdAuthError,
    EtcdClient,
    EtcdError,
    EtcdTLSError,
    Put,
    etcd_ssl_context,
    prefix_end,
    read_credentials,
)
from .storage.etcd_log import MAX_RECORD_BYTES, EtcdLog, log_head, recover, snapshot_index, tail

if TYPE_CHECKING:
    from .service import Service

log = logging.getLogger("rdzv_server")

# After a failed term (etcd unreachable, a lost lease), wait this long before the next.
TERM_RETRY_PAUSE_S = 1.0
# A new leader's tail must reach the log's head within this long, or the term restarts.
CATCH_UP_TIMEOUT_S = 30.0
# Replicas publish their applied index this often (one small etcd put, only when changed).
PUBLISH_EVERY_S = 5.0
# The leader-name watch reopens after a break this long later.
LEADER_WATCH_PAUSE_S = 0.5
# One append (its etcd txn, retries across members included) may take this fraction of the
# lease TTL before the log fails and the leader steps down: well inside the lease, so a
# single writer stuck on an etcd that does not answer never holds every queued write for
# longer than a take-over would take.
APPEND_TIMEOUT_LEASE_FRACTION = 0.5
# ... but never less than this: etcd's own leader election (its leader member lost) takes
# 1-2.5 s at etcd's default --election-timeout (sometimes two rounds), and an append must
# outlast it with room for a loaded host, or losing one etcd member would cost the
# leadership (bench --only ha: writes paused at most 1.6 s).
MIN_APPEND_TIMEOUT_S = 4.0
# A lease a resign could not revoke is tried again this often, this many times (each try
# itself waits for etcd's answer up to the client's request timeout).
STALE_LEASE_RETRY_S = 0.2
STALE_LEASE_ATTEMPTS = 100


def default_url(config: ServerConfig, port: int) -> str:
    """The URL clients reach this replica at when ``--advertise-url`` is not given."""
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if config.tls_cert is not None else 'http'}://{shown}:{port}"


def etcd_client(config: ServerConfig) -> EtcdClient:
    """The etcd client ``--etcd``, ``--etcd-ca``/``--etcd-cert``/``--etcd-key`` and
    ``--etcd-token-file`` ask for. Raises SystemExit (one line) when a file is unusable."""
    try:
        tls = None
        if config.etcd_ca or config.etcd_cert or any(url.startswith("https://") for url in config.etcd):
            tls = etcd_ssl_context(config.etcd_ca, config.etcd_cert, config.etcd_key)
        user, password = read_credentials(config.etcd_token_file) if config.etcd_token_file else (None, None)
    except ValueError as exc:
        raise SystemExit(f"rdzv-server: error: {exc}") from exc
    return EtcdClient(list(config.etcd), ssl_context=tls, username=user, password=password)


def join(service: Service) -> Replication:
    """This replica's role for ``service``, with an etcd client as ``service.config`` says; the
    service starts it (see :meth:`Replication.start`)."""
    config = service.config
    port = service.bound_port if service.bound_port is not None else config.port
    url = config.advertise_url or default_url(config, port)
    replica_id = config.replica_id or f"{socket.gethostname()}:{port}"
    client = etcd_client(config)
    replication = Replication(service, config, client, url=url, replica_id=replica_id)
    log.info(
        "Replica %s (%s) joins the cluster under %s in etcd at %s.", replica_id, url, config.etcd_prefix,
        ", ".join(config.etcd),
    )
    log.info(
        "With --etcd a value is at most %d bytes, a request body %d bytes and a write's log record %d bytes "
        "(etcd refuses requests over 1.5 MiB): larger --max-value-bytes and --max-body-bytes are capped, and a "
        "write whose record is larger is refused with 413 record_too_large before it is applied.",
        config.max_value_bytes,
        config.max_body_bytes,
        MAX_RECORD_BYTES,
    )
    return replication


class Replication:
    """This replica's part in the cluster, the service's :class:`~.role.Role` with ``--etcd``;
    see the module docstring. ``start`` then ``close``."""

    def __init__(self, service: Service, config: ServerConfig, client: EtcdClient, *, url: str, replica_id: str) -> None:
        self._service = service
        self._config = config
        self.client = client
        self.prefix = config.etcd_prefix.rstrip("/")
        self.url = url
        self.id = replica_id
        self.role = RoleName.CANDIDATE  # changed only by _set_role
        self.role_since = time.time()
        self.started = time.time()
        self.applied_index = 0
        self.leader: dict[str, Any] | None = None  # {"id", "url"} of the leader etcd names
        self.election: Election | None = None
        self._registry = (self.prefix + "/replicas/").encode()
        self._runner: asyncio.Task[None] | None = None
        self._installed = asyncio.Event()  # the first term follows and is published: start() may return
        self._stepped_down = asyncio.Event()
        self._published: dict[str, Any] | None = None
        self._closing = False
        self._revoking: set[asyncio.Task[None]] = set()  # old leases still to revoke (see _revoke_later)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the terms; return once the first recovery installed a machine.

        Raises SystemExit (one line) when etcd refuses this replica's credentials or TLS
        before that: retrying cannot fix a configuration. An etcd that is down is waited for.
        """
        self._runner = asyncio.get_running_loop().create_task(self._run(), name="rdzv-replication")
        installed = asyncio.ensure_future(self._installed.wait())
        await asyncio.wait({installed, self._runner}, return_when=asyncio.FIRST_COMPLETED)
        if not installed.done():
            installed.cancel()
            exc = self._runner.exception()
            raise SystemExit(f"rdzv-server: error: etcd refused this replica: {exc}") from exc

    async def close(self) -> None:
        """Stop leading or following; resign so that another replica takes over at once."""
        self._closing = True
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(BaseException):  # cancelled, or what start() already reported
                await self._runner
        for task in list(self._revoking):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.client.close()

    def step_down(self, reason: str) -> bool:
        """The service saw the log fail (an append not committed): end this term."""
        if self.role is RoleName.LEADER:
            log.warning("Replica %s steps down: %s", self.id, reason)
        self._stepped_down.set()
        return True

    def lease_valid(self) -> bool:
        return self.election is not None and self.election.lease_valid()

    @property
    def replicated(self) -> bool:
        return True

    def leader_url(self) -> str | None:
        leader = self.leader
        return leader["url"] if leader is not None else None

    def unavailable(self) -> RdzvError:
        """``not_leader``, naming the leader to retry at (unless that is this replica itself)."""
        leader = self.leader
        url = leader["url"] if leader is not None and leader["url"] != self.url else None
        where = f"the leader is {url}" if url else "no replica leads right now (an election is under way)"
        return NotLeader(f"replica {self.id} is not the leader; {where}: retry there", url)

    def commit_failed(self) -> RdzvError:
        """A write whose append failed answers ``not_leader``: the client retries at the leader with
        the same request id, and the write applies once (committed or not, the new leader's
        sessions know)."""
        return self.unavailable()

    # -- terms --------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self._term()
            except asyncio.CancelledError:
                raise
            except (EtcdAuthError, EtcdTLSError):
                if not self._installed.is_set():
                    raise  # a configuration that never worked: start() says so and the server exits
                log.exception("Replica %s: etcd refused it; retrying.", self.id)
            except Exception as exc:  # noqa: BLE001 - etcd down, a lost lease, a gap: the next term starts over
                log.warning("Replica %s: term ended (%s); starting over in %.1f s.", self.id, exc, TERM_RETRY_PAUSE_S)
            await asyncio.sleep(TERM_RETRY_PAUSE_S)

    async def _term(self) -> None:
        service = self._service
        self._stepped_down.clear()
        recovered, revision = await recover(self.client, self.prefix)
        machine = await asyncio.to_thread(service.rebuild, recovered)
        self.applied_index = recovered.last_index
        service.follow(machine)
        name = json.dumps({"id": self.id, "url": self.url})
        election = Election(self.client, self.prefix, name, ttl_s=self._config.etcd_lease_ttl)
        self.election = election
        tasks: list[asyncio.Task[Any]] = []
        loop = asyncio.get_running_loop()
        try:
            await election.register()
            current = await election.leader()
            self.leader = _parse_name(current.name) if current is not None else None
            # A follower is ready (/readyz) only once the cluster view lists it and it names the leader.
            await self._become(RoleName.FOLLOWER)
            self._installed.set()
            follower = loop.create_task(self._follow(revision + 1), name="rdzv-follow")
            tasks += [follower, loop.create_task(self._watch_leader(election), name="rdzv-leader-watch")]
            tasks.append(loop.create_task(self._publish_loop(), name="rdzv-publish"))
            fence = await self._campaign(election, follower)
            await self._lead(election, fence, follower)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            was_leading = self.role is RoleName.LEADER
            self._set_role(RoleName.CANDIDATE)
            await service.stop_leading()
            if was_leading:
                log.warning("Replica %s no longer leads.", self.id)
            lease_id = election.lease_id
            try:
                await asyncio.wait_for(election.resign(), self._config.etcd_lease_ttl)
            except Exception:  # noqa: BLE001 - etcd unreachable: revoke it once etcd answers again
                if lease_id:
                    self._revoke_later(lease_id)
            self.election = None

    def _revoke_later(self, lease_id: int) -> None:
        """Keep trying to revoke a lease this replica could not (etcd had no quorum), until etcd
        takes it or the lease is gone. Its election key is older than every key of a later term:
        left to expire, it would hold off every candidate for a whole TTL after etcd is back,
        where a revoke lets the next leader take over as soon as etcd commits again."""

        async def revoke() -> None:
            for _ in range(STALE_LEASE_ATTEMPTS):  # bounded: the lease expires by itself anyway
                try:
                    await self.client.lease_revoke(lease_id)
                    return
                except EtcdError as exc:
                    log.debug("Replica %s could not revoke its old lease %x yet: %s", self.id, lease_id, exc)
                await asyncio.sleep(STALE_LEASE_RETRY_S)

        task = asyncio.get_running_loop().create_task(revoke(), name=f"rdzv-revoke {lease_id:x}")
        self._revoking.add(task)
        task.add_done_callback(self._revoking.discard)

    async def _campaign(self, election: Election, follower: asyncio.Task[None]) -> LeaderKey:
        """Wait until elected; a failing tail (a gap, a compacted history) ends the term."""
        campaign = asyncio.ensure_future(election.campaign())
        try:
            await asyncio.wait({campaign, follower}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not campaign.done():
                campaign.cancel()
                with contextlib.suppress(BaseException):
                    await campaign
        if follower.done():
            follower.result()  # raises what ended it
            raise EtcdError("the log's tail ended")
        return campaign.result()

    async def _lead(self, election: Election, fence: LeaderKey, follower: asyncio.Task[None]) -> None:
        head = await log_head(self.client, self.prefix)
        clock = self._service.clock  # the service's seam: a test's fake clock decides when catching up gives up
        deadline = clock.monotonic() + CATCH_UP_TIMEOUT_S
        while self.applied_index < head:  # bounded by the deadline
            if follower.done():
                follower.result()
                raise EtcdError("the log's tail ended before it reached the head")
            if clock.monotonic() > deadline:
                raise EtcdError(f"the tail did not reach record {head} within {CATCH_UP_TIMEOUT_S} s")
            await asyncio.sleep(0.005)
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        if self.applied_index != head:  # the old leader's fence failed before we read the head
            raise EtcdError(f"the tail applied record {self.applied_index}, past the head {head} read after the election")
        cut = await snapshot_index(self.client, self.prefix)
        replicated = EtcdLog(
            self.client,
            self.prefix,
            fence,
            last_index=head,
            snapshot_index=cut,
            append_timeout_s=max(MIN_APPEND_TIMEOUT_S, self._config.etcd_lease_ttl * APPEND_TIMEOUT_LEASE_FRACTION),
            max_queued_records=self._config.max_log_queue,
            max_queued_bytes=self._config.max_log_queue_bytes,
        )
        self.leader = {"id": self.id, "url": self.url}
        await self._service.lead(replicated, f"replica {self.id} took over as leader")
        await self._become(RoleName.LEADER)  # serving and published: /readyz says so only now
        log.info("Replica %s leads from record %d (%s).", self.id, head, self.url)
        lost = asyncio.ensure_future(election.lost.wait())
        stepped = asyncio.ensure_future(self._stepped_down.wait())
        try:
            # Leading ends when etcd says the lease is gone, or when no keepalive was answered
            # for LEASE_LOSS_GRACE_S past the estimate (election.py sets ``lost`` either way).
            # While the estimate has lapsed the service answers nothing (``lease_valid``), and
            # appends in flight fail within their timeout, so nothing waits on this leader.
            await asyncio.wait({lost, stepped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            stepped.cancel()

    async def _follow(self, start_revision: int) -> None:
        machine = self._service.machine
        async for index, record in tail(
            self.client, self.prefix, after_index=self.applied_index, start_revision=start_revision
        ):
            machine.replay(record)
            self.applied_index = index

    async def _watch_leader(self, election: Election) -> None:
        """Keep :attr:`leader` naming the replica etcd says leads (for redirects)."""
        directory = (self.prefix + "/election/").encode()
        while True:  # cancelled with the term
            try:
                current = await election.leader()
                self.leader = _parse_name(current.name) if current is not None else None
                result = await self.client.range(directory, prefix_end(directory), limit=1)
                async for _ in self.client.watch(directory, prefix_end(directory), start_revision=result.revision + 1):
                    current = await election.leader()
                    self.leader = _parse_name(current.name) if current is not None else None
            except EtcdError as exc:
                log.debug("Replica %s: the leader watch broke (%s); reopening.", self.id, exc)
            await asyncio.sleep(LEADER_WATCH_PAUSE_S)

    # -- registry and the cluster view -----------------------------------------------------

    def _set_role(self, role: RoleName) -> None:
        """The one place this replica's role changes. Raises IllegalRoleChange (role.py's table)."""
        old, self.role = self.role, transition(self.role, role)
        if role is not old:
            self.role_since = time.time()

    async def _become(self, role: RoleName) -> None:
        """Publish this replica's entry with ``role``, then take the role: whoever sees the role
        (``/readyz``, the ready line) finds it in the registry too (``GET /v1/cluster``).
        Raises IllegalRoleChange, as :meth:`_set_role` does, before publishing anything."""
        transition(self.role, role)
        since = time.time()
        await self._publish({**self._entry(), "role": role.value, "since": since})
        self._set_role(role)
        self.role_since = since

    def _entry(self) -> dict[str, Any]:
        return replica_entry(self.id, self.url, self.role, self.role_since, self.started, self.applied_index)

    async def _publish(self, entry: dict[str, Any] | None = None) -> None:
        """Put this replica's registry entry (``entry``, else its current one), attached to its
        election lease (gone with it)."""
        election = self.election
        if election is None or not election.lease_id:
            return
        self._published = entry if entry is not None else self._entry()
        await self.client.txn([], [Put(self._registry + self.id.encode(), json.dumps(self._published).encode(), election.lease_id)])

    async def _publish_loop(self) -> None:
        while True:  # cancelled with the term
            await asyncio.sleep(PUBLISH_EVERY_S)
            if self._entry() != self._published:
                try:
                    await self._publish()
                except EtcdError as exc:
                    log.debug("Replica %s could not publish its state: %s", self.id, exc)

    def applied(self) -> int:
        """The index of the last record this replica applied (leader: appended)."""
        return self._service.log_index() if self.role is RoleName.LEADER else self.applied_index

    async def view(self) -> dict[str, Any]:
        """The cluster as this replica sees it: ``GET /v1/cluster``. Raises NotReady when etcd
        does not answer."""
        try:
            return await self._view()
        except EtcdError as exc:
            message = f"etcd did not answer ({exc}); check that its members run and this replica can reach them"
            raise NotReady(message) from exc

    async def _view(self) -> dict[str, Any]:
        if self.role is RoleName.LEADER:
            self.applied_index = self._service.log_index()
        registry = await self.client.range(self._registry, prefix_end(self._registry))
        replicas = {}
        for kv in registry.kvs:
            with contextlib.suppress(ValueError):
                entry = json.loads(kv.value)
                replicas[entry["id"]] = entry
        this = replicas[self.id] = self._entry()  # this one's own, fresher than what it published
        leader = None
        if self.leader is not None:
            since = replicas.get(self.leader["id"], {}).get("since")
            leader = {**self.leader, "since": since}
        members = await self.client.member_list()
        etcd = {
            "prefix": self.prefix,
            "endpoints": list(self.client.endpoints),
            "members": [
                {"id": f"{m.id:x}", "name": m.name, "client_urls": m.client_urls, "peer_urls": m.peer_urls}
                for m in members
            ],
        }
        return cluster_document("replicated", this, leader, sorted(replicas.values(), key=lambda r: str(r["id"])), etcd)


def _parse_name(name: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(name)
    except ValueError:
        return None
    return {"id": str(parsed.get("id")), "url": str(parsed.get("url"))} if isinstance(parsed, dict) else None

