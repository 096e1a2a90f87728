"""The job policy as a torchrun node takes it (README "Job policy"): which settings come from
the server's policies instead of the node's own ``--nnodes`` / ``--rdzv-conf``, and when the
node asks.

What it owns:
- :class:`NodePolicy`: when a node fetches the policy. Before its first join it does
  (``effective_policy``) unless the server's hello said its policy table was never written
  (``Client.announced_policy_version`` is 0: no policy covers any job, so there is nothing to
  fetch; thousands of nodes starting at once each fetched over an HTTP connection of its own);
  before a later join only when the ``policy_version`` the server last reported (a join's
  answer) differs from the version it took, so a re-formation of a job whose policy did not
  change costs no request at all. Each time the keys it takes
  change, one line (a warning: it is what the agent's log shows) names them and their
  patterns.

Rules it keeps:
- A policy wins over the node. The server applies the job-side keys whatever the node
  proposes (the node proposes its own ``--nnodes`` / ``--rdzv-conf``, which stay the job's own:
  what it falls back to when the policy is unset). The node-side keys (``health_check``,
  ``health_check_timeout``, ``gpu_check``) are the node's to run: :meth:`NodeConf.with_policy
  <rdzv_client.conf.NodeConf.with_policy>` lays them over its own, and they apply at its next
  join. A policy's ``heartbeat_ttl`` is the job's TTL: the node beats within it (a third of
  it) from its next round on (:attr:`NodePolicy.heartbeat_ttl`).
- A server without policies (404 ``not_found`` from ``/v1/policy``) is asked once: the node
  runs on its own settings. Any other failure to fetch leaves the node on the settings it
  last took (the join that follows reports a server that is really gone) and it asks again
  before its next join.

What it must not know: torch, the transports (it calls the :class:`Client` it is given).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from . import wire
from .client import Client
from .conf import NodeConf
from .error import NotFoundError, RdzvError

log = logging.getLogger("rdzv_client")


def policy_keys(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The keys an effective-policy document (``effective_policy``'s answer) sets from a
    policy: those whose source is ``policy PATTERN`` (every key of ``settings`` when the
    document names no sources)."""
    settings: Mapping[str, Any] = doc.get("settings") or {}
    sources: Mapping[str, Any] = doc.get("sources") or {}
    if not sources:
        return dict(settings)
    return {k: v for k, v in settings.items() if str(sources.get(k, "")).startswith("policy")}


def describe(doc: Mapping[str, Any]) -> str:
    """``min_nodes=2, max_nodes=2 from policy pol-*; gpu_check=0 from policy pol-a``: the keys
    a policy set, by the pattern they came from."""
    sources: Mapping[str, Any] = doc.get("sources") or {}
    by_source: dict[str, list[str]] = {}
    for key, value in policy_keys(doc).items():
        shown = ("1" if value else "0") if isinstance(value, bool) else (f"{value:g}" if isinstance(value, float) else value)
        by_source.setdefault(str(sources.get(key) or "policy"), []).append(f"{key}={shown}")
    return "; ".join(f"{', '.join(words)} from {source}" for source, words in by_source.items())


class NodePolicy:
    """The policy of job ``own.run_id`` as node ``own.node_id`` took it.

    :meth:`before_join` returns the settings for the next join; :meth:`seen` records the
    ``policy_version`` an answer of the server carried. ``conf`` is the current one."""

    def __init__(self, own: NodeConf) -> None:
        self.own = own  # the node's own settings: every policy is laid over these
        self.conf = own
        #: The job's heartbeat TTL as far as the node knows: the policy's, else its own.
        self.heartbeat_ttl = own.settings.heartbeat_ttl
        self._keys: dict[str, Any] = {}  # the keys taken from a policy
        self._taken: int | None = None  # the version taken (None: none yet)
        self._latest: int | None = None  # the latest version the server reported
        self._unsupported = False  # the server has no policies: never ask again

    def seen(self, version: int | None) -> None:
        """The server reported policy ``version`` (a join's or a watch's answer; None: it did
        not say). Versions only grow: an older report (a watch answered before the join's)
        changes nothing."""
        if version is not None and (self._latest is None or version > self._latest):
            self._latest = version

    @property
    def due(self) -> bool:
        """Whether the next join must fetch the policy first."""
        return not self._unsupported and (self._taken is None or self._latest != self._taken)

    def before_join(self, client: Client) -> NodeConf:
        """The node's settings for its next join: fetched and merged when :attr:`due`, else
        the ones it took last. Logs one line when a fetch changed which keys a policy sets.
        Never raises: a failed fetch is logged and the last settings stay."""
        if not self.due:
            return self.conf
        own = self.own
        if self._taken is None and self._latest is None and client.announced_policy_version() == 0:
            # No policy was ever set on this server: its own settings apply, as a fetch would
            # say. A policy set from now on is reported by the answers (seen), and fetched then.
            self._taken = self._latest = 0
            log.info("Node %s: no policy covers job %s; its own --nnodes / --rdzv-conf apply.", own.node_id, own.run_id)
            return self.conf
        try:
            doc = client.effective_policy(own.run_id)
        except NotFoundError as exc:
            if exc.code is wire.ErrorCode.NOT_FOUND:  # no /v1/policy: a server older than policies
                self._unsupported = True
                log.info("Node %s: the server of job %s keeps no job policies; the node's own settings apply.",
                         own.node_id, own.run_id)
                return self.conf
            log.warning("Node %s could not read the policy of job %s (%s); it keeps the settings it has.",
                        own.node_id, own.run_id, exc)
            return self.conf
        except RdzvError as exc:
            log.warning("Node %s could not read the policy of job %s (%s); it keeps the settings it has.",
                        own.node_id, own.run_id, exc)
            return self.conf
        first = self._taken is None
        version = doc.get("version")
        self._taken = self._latest = int(version) if isinstance(version, int) else 0
        keys = policy_keys(doc)
        merged = own.with_policy(keys)
        ttl = keys.get("heartbeat_ttl")
        self.heartbeat_ttl = float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else own.settings.heartbeat_ttl
        words = describe(doc)
        changed, self._keys = keys != self._keys, keys
        if words and (first or changed):
            # A warning, not info: the agent's log shows the plug-in's warnings (torch sets up
            # its own loggers only), and a node that does not do what its command line says
            # must say why where its operator looks.
            log.warning("Node %s of job %s takes settings %s (over its own --nnodes / --rdzv-conf).",
                        own.node_id, own.run_id, words)
        elif first:
            log.info("Node %s: no policy covers job %s; its own --nnodes / --rdzv-conf apply.", own.node_id, own.run_id)
        self.conf = merged
        return merged
