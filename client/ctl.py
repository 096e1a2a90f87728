"""``rdzvctl``: look at and poke a running rdzv-server from a terminal.

What it owns: the command line (argparse), the human-readable tables of jobs and
membership (pure functions of the server's documents, so tests can feed them dicts),
and the exit codes: 0 success, 1 the server said no, 2 usage, 3 cannot connect.

What it must not know: HTTP, msgpack, retries (the sync :class:`Client` does all that),
torch.

Usage::

    rdzvctl [--endpoint HOST:PORT[,HOST:PORT...]] [--json] [--token-file PATH]
            [--tls] [--ca-file PATH] [--cert-file PATH --key-file PATH] jobs
    rdzvctl show JOB | close JOB
    rdzvctl cluster
    rdzvctl events JOB [--since SEQ] [--follow]
    rdzvctl watch JOB [--interval SECONDS] [--frames N]
    rdzvctl kv get JOB KEY [--wait SECONDS] | kv set JOB KEY VALUE | kv list JOB [PREFIX]
    (kv commands take --round N to use one round's key space)
    rdzvctl cordon HOST [--reason R] [--for DURATION] | uncordon HOST | cordons
    rdzvctl policy set PATTERN KEY=VALUE... | policy show [PATTERN] [--job JOB]
    rdzvctl policy unset PATTERN [KEY...]

The token is found as every client finds it (``--token-file``, ``RDZV_TOKEN``,
``RDZV_TOKEN_FILE``, the default file); the TLS flags default to ``RDZV_TLS``,
``RDZV_CA_FILE``, ``RDZV_CERT_FILE`` and ``RDZV_KEY_FILE``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from . import wire
from .client import Client
from .error import BadRequestError, NotFoundError, RdzvConnectionError, RdzvError, RdzvTimeoutError

DEFAULT_ENDPOINT = f"127.0.0.1:{wire.DEFAULT_PORT}"  # the server's default bind, on this host
ENDPOINT_ENV = "RDZV_ENDPOINT"
TLS_ENV = "RDZV_TLS"  # 1/true/yes: TLS even for HOST:PORT endpoints
CA_FILE_ENV = "RDZV_CA_FILE"
CERT_FILE_ENV = "RDZV_CERT_FILE"
KEY_FILE_ENV = "RDZV_KEY_FILE"
# An operator at a terminal wants an answer in seconds, not an agent's 30 s of patience.
DEFAULT_CTL_RETRY_BUDGET = 3.0

EXIT_OK = 0
EXIT_SERVER_ERROR = 1
EXIT_USAGE = 2
EXIT_CANNOT_CONNECT = 3


# --------------------------------------------------------------------------- formatting


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``; ``[]`` -> ``"-"``."""
    if not ranks:
        return "-"
    spans: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    spans.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(spans)


def _age(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.1f}s"
    return "-"


def _yes_no(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces; no trailing blanks."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [list(headers), *rows]]


def _node_lines(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = [
        [
            _cell(n.get("node_id")),
            _cell(n.get("addr")),
            _cell(n.get("nproc_per_node")),
            _yes_no(n.get("alive")),
            _age(n.get("last_heartbeat_age_s")),
        ]
        for n in nodes
    ]
    return format_table(["NODE_ID", "ADDR", "NPROC", "ALIVE", "HEARTBEAT"], rows)


def format_membership(doc: Mapping[str, Any]) -> str:
    """The membership document of one job: a header line, the round's node table, then the
    joining, waiting and standby nodes when there are any."""
    header = (
        f"job {doc.get('rdzv_id')}  state {doc.get('state')}  round {doc.get('round')}  "
        f"nodes {doc.get('num_nodes')} ({doc.get('min_nodes')}..{doc.get('max_nodes')})  "
        f"world_size {doc.get('world_size')}"
    )
    lines = [header]
    if doc.get("max_restarts") is not None or doc.get("restarts"):  # the job-wide restart budget
        budget = doc.get("max_restarts")
        lines.append(f"restarts {doc.get('restarts', 0)} of {budget if budget is not None else 'unlimited'}")
    if doc.get("max_fast_failures"):  # the crash-loop rule, when the job asked for it
        lines.append(f"fast failures in a row {doc.get('fast_failures', 0)} of {doc['max_fast_failures']} "
                     f"(min_round_seconds {doc.get('min_round_seconds')})")
    if doc.get("goodput") is not None:  # with progress reports (rdzv_client.progress)
        last = next((r.get("step") for r in reversed(doc.get("progress") or []) if r.get("step") is not None), None)
        lines.append(f"goodput {100 * doc['goodput']:.1f} %  last step {_cell(last)}")
    if doc.get("pending_reason"):  # only while a round is open: what it still waits for
        lines.append(f"pending: {doc['pending_reason']}")
    lines.append("")
    nodes: Sequence[Mapping[str, Any]] = doc.get("nodes") or []
    if nodes:
        rows = [
            [
                _cell(n.get("node_rank")),
                _cell(n.get("node_id")),
                _cell(n.get("addr")),
                _cell(n.get("nproc_per_node")),
                format_ranks(n.get("global_ranks") or []),
                _yes_no(n.get("alive")),
                _age(n.get("last_heartbeat_age_s")),
            ]
            for n in nodes
        ]
        headers = ["NODE_RANK", "NODE_ID", "ADDR", "NPROC", "RANKS", "ALIVE", "HEARTBEAT"]
        if any(n.get("topology") for n in nodes):  # where each node sits, when the nodes say
            headers.append("TOPOLOGY")
            rows = [[*row, _cell(n.get("topology") or None)] for row, n in zip(rows, nodes, strict=True)]
        lines += format_table(headers, rows)
    else:
        lines.append("no nodes in the current round")
    for section in ("joining", "waiting", "standby"):  # joining: in the open round, not yet formed
        others: Sequence[Mapping[str, Any]] = doc.get(section) or []
        if others:
            lines += ["", f"{section} ({len(others)}):"]
            lines += ["  " + line for line in _node_lines(others)]
    settings = format_settings(doc)
    if settings:
        lines += ["", *settings]
    return "\n".join(lines)


def format_jobs(jobs: Sequence[Mapping[str, Any]]) -> str:
    """The job list as a table: rdzv_id, state, round, nodes, world_size."""
    if not jobs:
        return "no jobs"
    rows = [
        [
            _cell(j.get("rdzv_id")),
            _cell(j.get("state")),
            _cell(j.get("round")),
            _cell(j.get("num_nodes")),
            _cell(j.get("world_size")),
        ]
        for j in jobs
    ]
    return "\n".join(format_table(["RDZV_ID", "STATE", "ROUND", "NODES", "WORLD_SIZE"], rows))


def format_cordons(cordons: Sequence[Mapping[str, Any]], server_now: float) -> str:
    """The cordons as a table: host, since, until, reason, by whom (operator or automatic)."""
    if not cordons:
        return "no cordons"
    offset = time.time() - server_now  # the server sends its own clock: show wall-clock times

    def at(value: object) -> str:
        return _local_time(value + offset) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    rows = [
        [
            _cell(c.get("host")),
            at(c.get("since")),
            at(c.get("until")) if c.get("until") is not None else "uncordoned",
            _cell(c.get("reason") or None),
            "automatic" if c.get("by") == "flapping" else _cell(c.get("by")),
        ]
        for c in cordons
    ]
    return "\n".join(format_table(["HOST", "SINCE", "UNTIL", "REASON", "BY"], rows))


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` as seconds (> 0); argparse's type for ``--for``."""
    raw = text.strip().lower()
    unit = _UNITS.get(raw[-1:], None)
    number = raw[:-1] if unit is not None else raw
    try:
        seconds = float(number) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 30m, 2h, 1d)") from None
    if not 0 < seconds <= wire.MAX_CORDON_S or seconds != seconds:
        raise argparse.ArgumentTypeError(f"a duration must be > 0 and at most a year, got {text!r}")
    return seconds


def parse_policy_settings(words: Sequence[str]) -> dict[str, object]:
    """``["min_nodes=2", "last_call_timeout=30"]`` -> ``{"min_nodes": 2, "last_call_timeout": 30.0}``:
    the words of ``rdzvctl policy set``, typed and checked as the server will
    (:func:`rdzv_client.wire.policy_settings`), so that nothing wrong is sent.

    Raises ValueError naming the word, the key or the value that is wrong: no ``=``, a key
    the server does not know (the message lists the keys), a key given twice, a value the key
    cannot take."""
    raw: dict[str, str] = {}
    for word in words:
        key, eq, text = word.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"{word!r} is not KEY=VALUE (e.g. min_nodes=2)")
        if key not in wire.POLICY_KEYS:
            raise ValueError(f"{key!r} is not a policy key; the keys are {', '.join(wire.POLICY_KEYS)}")
        if key in raw:
            raise ValueError(f"{key} is given twice")
        raw[key] = text
    try:
        return wire.policy_settings(raw)
    except wire.WireError as exc:
        raise ValueError(str(exc)) from None


def setting_text(value: object) -> str:
    """A setting's value as one would type it: ``30`` for 30.0, ``1`` / ``0`` for a flag,
    ``none`` for no value (a job with no restart budget)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _settings_words(settings: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={setting_text(value)}" for key, value in sorted(settings.items())) or "(no keys)"


def _by(value: object) -> str:
    return _cell(value or None)


def _changed(policy: Mapping[str, Any], wall_now: float | None) -> str:
    """When a policy last changed, as a local wall-clock time: its ``age_s`` (the server's
    count) back from ``wall_now`` (this host's clock; default: the time now); "-" from a
    server that does not say."""
    age = policy.get("age_s")
    if not isinstance(age, (int, float)) or isinstance(age, bool):
        return "-"
    return _local_time((time.time() if wall_now is None else wall_now) - age)


def format_policies(policies: Sequence[Mapping[str, Any]], wall_now: float | None = None) -> str:
    """``rdzvctl policy show``: one row per policy (the server's order: most specific first),
    its keys as ``key=value`` words, when (``age_s`` back from ``wall_now``) and by whom it
    last changed."""
    if not policies:
        return "no policies (rdzvctl policy set PATTERN KEY=VALUE... makes one)"
    rows = [
        [_cell(p.get("pattern")), _settings_words(p.get("settings") or {}), _changed(p, wall_now),
         _by(p.get("changed_by"))]
        for p in policies
    ]  # fmt: skip
    return "\n".join(format_table(["PATTERN", "SETTINGS", "CHANGED", "BY"], rows))


def format_policy(policy: Mapping[str, Any], wall_now: float | None = None) -> str:
    """``rdzvctl policy show PATTERN``: a header line, then one row per key."""
    settings: Mapping[str, Any] = policy.get("settings") or {}
    lines = [f"policy {policy.get('pattern')}  changed {_changed(policy, wall_now)} by {_by(policy.get('changed_by'))}"]
    rows = [[key, setting_text(value)] for key, value in sorted(settings.items())]
    lines += format_table(["KEY", "VALUE"], rows) if rows else ["(no keys)"]
    return "\n".join(lines)


def format_effective_policy(doc: Mapping[str, Any]) -> str:
    """``rdzvctl policy show --job JOB``: the keys a policy sets for the job, each with the
    pattern it comes from (the others are the nodes' own, or the defaults)."""
    settings: Mapping[str, Any] = doc.get("settings") or {}
    sources: Mapping[str, Any] = doc.get("sources") or {}
    if not settings:
        return f"no policy covers job {doc.get('job')}: its settings are its nodes' own (or the defaults)"
    lines = [f"job {doc.get('job')}  policy version {_cell(doc.get('version'))}"]
    rows = [[key, setting_text(value), _cell(sources.get(key))] for key, value in sorted(settings.items())]
    return "\n".join(lines + format_table(["KEY", "VALUE", "SOURCE"], rows))


def format_settings(doc: Mapping[str, Any]) -> list[str]:
    """The job's effective settings, each with its source (``policy PATTERN``, ``node`` or
    ``default``), from the document's ``settings_source``; nothing from a server without it.
    Keys a policy sets that the document holds no value for (a node-side key such as
    ``health_check``) are listed with their source and no value."""
    sources: Mapping[str, Any] = doc.get("settings_source") or {}
    if not sources:
        return []
    keys = [k for k in wire.POLICY_KEYS if k in sources or (k in doc and k in wire.POLICY_JOB_KEYS)]
    keys += sorted(k for k in sources if k not in wire.POLICY_KEYS)  # keys of a newer server
    rows = [[key, setting_text(doc[key]) if key in doc else "-", _cell(sources.get(key))] for key in keys]
    return ["settings:", *("  " + line for line in format_table(["KEY", "VALUE", "SOURCE"], rows))]


def format_duration(seconds: object) -> str:
    """A span for people, in its two largest units: ``45s``, ``12m05s``, ``3h02m``, ``2d04h``."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def _since(value: object, now: float) -> str:
    """How long ago Unix time ``value`` was ("-" when it is not a time)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return format_duration(now - value)


def _local_time(value: object) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))


def _urls(value: object) -> str:
    if isinstance(value, list) and value:
        return ",".join(str(v) for v in value)
    return "-"


def format_cluster(doc: Mapping[str, Any], now: float) -> str:
    """``rdzvctl cluster``: the mode and the replica that answered, the leader and since when,
    the replica table, then etcd's members when the cluster is replicated. ``now`` is this
    host's Unix time: the ages assume its clock roughly agrees with the servers'."""
    lines = [f"mode {_cell(doc.get('mode'))}, answered by {_cell(doc.get('this'))}"]
    leader = doc.get("leader")
    if isinstance(leader, Mapping):
        lines.append(
            f"leader {_cell(leader.get('id'))} at {_cell(leader.get('url'))}, since "
            f"{_local_time(leader.get('since'))} ({_since(leader.get('since'), now)})"
        )
    elif doc.get("mode") == "replicated":
        lines.append("no leader: an election is under way (requests wait for it)")
    else:
        lines.append("not replicated: this server serves every request itself")
    lines.append("")
    replicas: Sequence[Mapping[str, Any]] = doc.get("replicas") or []
    rows = [
        [
            _cell(r.get("id")),
            _cell(r.get("url")),
            _cell(r.get("role")),
            _since(r.get("since"), now),
            _cell(r.get("applied_index")),
        ]
        for r in replicas
    ]
    lines += format_table(["ID", "URL", "ROLE", "IN ROLE FOR", "APPLIED"], rows) if rows else ["no replicas listed"]
    etcd = doc.get("etcd")
    if isinstance(etcd, Mapping):
        lines += ["", f"etcd at {_urls(etcd.get('endpoints'))}, prefix {_cell(etcd.get('prefix'))}"]
        members: Sequence[Mapping[str, Any]] = etcd.get("members") or []
        member_rows = [
            [_cell(m.get("id")), _cell(m.get("name") or None), _urls(m.get("client_urls")), _urls(m.get("peer_urls"))]
            for m in members
        ]
        if member_rows:
            lines += format_table(["MEMBER_ID", "NAME", "CLIENT_URLS", "PEER_URLS"], member_rows)
        else:
            lines.append("no etcd members listed")
    return "\n".join(lines)


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="backslashreplace")


# --------------------------------------------------------------------------- commands


def build_parser() -> argparse.ArgumentParser:
    """rdzvctl's command line (its subcommands and options)."""
    parser = argparse.ArgumentParser(prog="rdzvctl", description="Inspect and drive a running rdzv-server.")
    parser.add_argument(
        "--endpoint",
        default=os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT,
        help=f"HOST[:PORT] of the server, or a comma-separated list of its replicas "
        f"(default: ${ENDPOINT_ENV}, else {DEFAULT_ENDPOINT})",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead of tables")
    security = parser.add_argument_group("token and TLS")
    security.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="file holding the server's token (default: $RDZV_TOKEN, $RDZV_TOKEN_FILE, else the default token file)",
    )
    security.add_argument(
        "--tls",
        action="store_true",
        default=os.environ.get(TLS_ENV, "").strip().lower() in ("1", "true", "yes"),
        help=f"use TLS even for a HOST:PORT endpoint (https:// endpoints always do; default: ${TLS_ENV})",
    )
    security.add_argument(
        "--ca-file",
        default=os.environ.get(CA_FILE_ENV) or None,
        metavar="PATH",
        help=f"CA bundle to trust for the server's certificate (default: ${CA_FILE_ENV}, else the system's)",
    )
    security.add_argument(
        "--cert-file",
        default=os.environ.get(CERT_FILE_ENV) or None,
        metavar="PATH",
        help=f"client certificate (PEM) for a server with --tls-client-ca (default: ${CERT_FILE_ENV})",
    )
    security.add_argument(
        "--key-file",
        default=os.environ.get(KEY_FILE_ENV) or None,
        metavar="PATH",
        help=f"the client certificate's key (PEM; default: ${KEY_FILE_ENV}, else in --cert-file)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("jobs", help="list every job")
    sub.add_parser("cluster", help="show the replicas, which one leads, and etcd's members")
    show = sub.add_parser("show", help="show a job's membership")
    show.add_argument("job")
    events = sub.add_parser("events", help="print a job's timeline: who joined, died and why, rounds formed")
    events.add_argument("job")
    events.add_argument("--since", type=int, default=0, metavar="SEQ", help="only events after this one")
    events.add_argument(
        "--follow", action="store_true", help="keep printing new events as they happen, until the job is gone"
    )
    watch = sub.add_parser(
        "watch", help="a live view of a job: its membership and last events, redrawn on every change"
    )
    watch.add_argument("job")
    watch.add_argument(
        "--interval", type=_positive, default=WATCH_INTERVAL, metavar="SECONDS",
        help=f"redraw at least this often, for the heartbeat ages (default {WATCH_INTERVAL:g}; at most "
        f"{FOLLOW_WAIT:g}, and the server's --max-hold may make it sooner)",
    )
    watch.add_argument("--frames", type=_positive_int, default=None, metavar="N", help="stop after N redraws")
    close = sub.add_parser("close", help="close a job (later joins fail)")
    close.add_argument("job")
    cordon = sub.add_parser("cordon", help="refuse a host's nodes in every job (a node's host name or address)")
    cordon.add_argument("host")
    cordon.add_argument("--reason", default="", help="why: shown to the refused agents and in `rdzvctl cordons`")
    cordon.add_argument(
        "--for", dest="duration", type=parse_duration, default=None, metavar="DURATION",
        help="lift it by itself after this long (90s, 30m, 2h, 1d; default: until `rdzvctl uncordon`)",
    )
    uncordon = sub.add_parser("uncordon", help="admit a cordoned host's nodes again")
    uncordon.add_argument("host")
    sub.add_parser("cordons", help="list the cordoned hosts: since, until, reason, by whom")
    policy = sub.add_parser("policy", help="the jobs' settings, kept on the server: set, show, unset")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True, metavar="POLICY_COMMAND")
    keys = ", ".join(wire.POLICY_KEYS)
    policy_set = policy_sub.add_parser(
        "set", help="set keys of the policy of PATTERN (made if new); a running job takes them at once",
        description=f"Set KEY=VALUE in the policy of PATTERN (a job id, or a glob such as 'llm-*': quote it). "
        f"The keys: {keys}. A job id beats any glob; of globs, the most specific wins.",
    )
    policy_set.add_argument("pattern", metavar="PATTERN")
    policy_set.add_argument("settings", nargs="+", metavar="KEY=VALUE")
    policy_show = policy_sub.add_parser("show", help="list the policies, or show one (PATTERN) or a job's (--job)")
    policy_show.add_argument("pattern", nargs="?", default=None, metavar="PATTERN")
    policy_show.add_argument("--job", default=None, help="the keys policies set for this job, and from which pattern")
    policy_unset = policy_sub.add_parser(
        "unset", help="remove keys from the policy of PATTERN (no KEY: the whole policy)"
    )
    policy_unset.add_argument("pattern", metavar="PATTERN")
    policy_unset.add_argument("keys", nargs="*", metavar="KEY")
    kv = sub.add_parser("kv", help="read and write a job's keys")
    kv_sub = kv.add_subparsers(dest="kv_command", required=True, metavar="KV_COMMAND")
    kv_get = kv_sub.add_parser("get", help="print a key's value")
    kv_get.add_argument("job")
    kv_get.add_argument("key")
    kv_get.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="wait this long for the key")
    kv_set = kv_sub.add_parser("set", help="set a key")
    kv_set.add_argument("job")
    kv_set.add_argument("key")
    kv_set.add_argument("value")
    kv_list = kv_sub.add_parser("list", help="list keys (optionally by prefix)")
    kv_list.add_argument("job")
    kv_list.add_argument("prefix", nargs="?", default="")
    for p in (kv_get, kv_set, kv_list):
        p.add_argument("--round", type=int, default=None, help="use the key space of this round")
    return parser


# A follow's long-poll: well inside the client's request timeout and the server's --max-hold.
FOLLOW_WAIT = 25.0
# watch redraws this often with nothing new, so heartbeat ages stay current.
WATCH_INTERVAL = 2.0
WATCH_EVENTS = 10  # the last events a watch frame shows: what just happened, on one screen
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen (ANSI)
EVENT_HEADERS = ("SEQ", "TIME", "ROUND", "EVENT", "CAUSE", "NODE", "ADDR", "DETAIL")
_EVENT_FIELDS = frozenset({"seq", "time", "kind", "cause", "round", "node_id", "addr"})


def format_events(events: Sequence[Mapping[str, Any]], server_now: float, *, headers: bool = True) -> str:
    """Events as a table; times are local wall-clock times (the server sends its own clock)."""
    rows = []
    for e in events:
        when = time.time() - (server_now - float(e.get("time", server_now)))
        detail = event_detail(e)
        rows.append(
            [str(e.get("seq")), time.strftime("%H:%M:%S", time.localtime(when)), str(e.get("round")),
             _cell(e.get("kind")), _cell(e.get("cause")), _cell(e.get("node_id")), _cell(e.get("addr")), detail]
        )
    lines = format_table(EVENT_HEADERS, rows)
    return "\n".join(lines if headers else lines[1:])


def event_detail(event: Mapping[str, Any]) -> str:
    """An event's own fields as ``key=value`` words; a ``workers_failed`` event's failures as
    sentences (``rank 1 (local 1) exit code 1: RuntimeError: ...``), its summary only when it
    lists none (``workers failed (no detail)``); a ``policy_changed`` event's changes as
    ``key=old->new (source)`` and what it ``held`` as ``held KEY: why;``."""
    words = []
    failures = event.get("failures")
    changes = event.get("changes")
    for key, value in event.items():
        if key in _EVENT_FIELDS or key == "failures" or (key == "summary" and failures):
            continue
        if key == "changes" and isinstance(changes, Mapping):  # policy_changed: each key, old -> new
            words += [policy_change_text(k, c) for k, c in changes.items() if isinstance(c, Mapping)]
            continue
        if key == "held" and isinstance(value, Mapping):  # a node count a policy could not move: why
            words += [f"held {k}: {why};" for k, why in value.items()]
            continue
        words.append(f"{key}={value}")
    if isinstance(failures, list):
        words += [failure_text(f) + ";" for f in failures if isinstance(f, Mapping)]
    return " ".join(words).rstrip(";")


def policy_change_text(key: str, change: Mapping[str, Any]) -> str:
    """One key of a ``policy_changed`` event: ``max_restarts=1->2 (policy pol-1)``."""
    text = f"{key}={setting_text(change.get('old'))}->{setting_text(change.get('new'))}"
    return f"{text} ({change['source']})" if change.get("source") else text


def failure_text(failure: Mapping[str, Any]) -> str:
    """One failed worker of a ``workers_failed`` event, as the report words it."""
    code = failure.get("exit_code")
    how = failure.get("signal") or f"exit code {code}"
    line = f"rank {failure.get('global_rank')} (local {failure.get('local_rank')}) {how}"
    message = failure.get("message")
    return f"{line}: {message}" if message and message != how else line


def _print_events(client: Client, job: str, since: int, follow: bool, as_json: bool, out: TextIO) -> None:
    page = client.events(job, since=since)
    first = True
    while True:
        if as_json:
            for event in page["events"]:
                _emit_json(event, out)
        elif page["events"] or first:
            if first and page["first_seq"] > since + 1:
                out.write(f"(events {since + 1}..{page['first_seq'] - 1} are no longer kept)\n")
            out.write(format_events(page["events"], page["now"], headers=first) + "\n")
            first = False
        out.flush()
        if not follow:
            return
        try:
            page = client.events(job, since=page["next_seq"] - 1, wait=FOLLOW_WAIT)
        except NotFoundError:
            out.write(f"job {job} is gone (collected after its --job-ttl)\n")
            return


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value <= FOLLOW_WAIT:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {FOLLOW_WAIT:g}, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def format_watch(doc: Mapping[str, Any], events: Sequence[Mapping[str, Any]], server_now: float) -> str:
    """One frame of ``rdzvctl watch``: the membership, then the job's last events."""
    lines = [format_membership(doc), "", f"last events ({len(events)}):" if events else "no events kept"]
    if events:
        lines.append(format_events(events, server_now))
    return "\n".join(lines)


def _watch(client: Client, job: str, interval: float, frames: int | None, as_json: bool, out: TextIO) -> None:
    """Redraw the job's frame whenever its events long-poll answers (a change) or ``interval``
    passes; until ``frames`` are drawn, the job is gone, or Ctrl-C. On a terminal each frame
    replaces the last; piped, frames follow each other, a blank line between.

    Raises NotFoundError when the job is unknown from the start."""
    recent: deque[Mapping[str, Any]] = deque(maxlen=WATCH_EVENTS)
    drawn = 0
    try:
        page = client.events(job, since=0)
        if page["events"] and page["events"][-1]["seq"] < page["next_seq"] - 1:  # a long timeline: its tail
            page = client.events(job, since=max(0, page["next_seq"] - 1 - WATCH_EVENTS))
        recent.extend(page["events"])
        since = page["next_seq"] - 1
        while frames is None or drawn < frames:  # each turn waits on the long-poll (at most interval)
            if drawn:
                page = client.events(job, since=since, wait=interval)
                recent.extend(page["events"])
                if page["events"]:  # after a burst longer than a page, the next turns catch up
                    since = page["events"][-1]["seq"]
            doc = client.job(job)
            if as_json:
                _emit_json({"membership": doc, "events": list(recent)}, out)
            else:
                lead = CLEAR_SCREEN if out.isatty() else ("\n" if drawn else "")
                out.write(lead + format_watch(doc, list(recent), page["now"]) + "\n")
            out.flush()
            drawn += 1
    except NotFoundError:
        if not drawn:
            raise
        out.write(f"job {job} is gone (collected after its --job-ttl)\n")
    except KeyboardInterrupt:  # the way a person ends a watch: not an error
        out.write("\n")
    out.flush()


def _emit_json(obj: object, out: TextIO) -> None:
    out.write(wire.dump_json(obj).decode() + "\n")


def _execute(args: argparse.Namespace, client: Client, out: TextIO) -> None:
    if args.command == "jobs":
        jobs = client.jobs()
        out.write((wire.dump_json({"jobs": jobs}).decode() if args.json else format_jobs(jobs)) + "\n")
    elif args.command == "show":
        doc = client.job(args.job)
        out.write((wire.dump_json(doc).decode() if args.json else format_membership(doc)) + "\n")
    elif args.command == "cluster":
        doc = client.cluster()
        out.write((wire.dump_json(doc).decode() if args.json else format_cluster(doc, time.time())) + "\n")
    elif args.command == "events":
        _print_events(client, args.job, args.since, args.follow, args.json, out)
    elif args.command == "watch":
        _watch(client, args.job, args.interval, args.frames, args.json, out)
    elif args.command == "cordon":
        cordon = client.cordon(args.host, reason=args.reason, duration=args.duration)
        if args.json:
            _emit_json({"cordon": cordon}, out)
        else:
            until = "until uncordoned" if args.duration is None else f"for {format_duration(args.duration)}"
            out.write(f"cordoned {args.host} {until}\n")
    elif args.command == "uncordon":
        lifted = client.uncordon(args.host)
        if args.json:
            _emit_json({"host": args.host, "uncordoned": lifted}, out)
        else:
            out.write(f"uncordoned {args.host}\n" if lifted else f"{args.host} was not cordoned\n")
    elif args.command == "cordons":
        doc = client.cordons()
        out.write((wire.dump_json(doc).decode() if args.json else format_cordons(doc["cordons"], doc["now"])) + "\n")
    elif args.command == "close":
        client.close_job(args.job, cause="operator")
        if args.json:
            _emit_json({"rdzv_id": args.job, "closed": True}, out)
        else:
            out.write(f"closed job {args.job}\n")
    elif args.command == "policy":
        _policy(args, client, out)
    elif args.kv_command == "get":
        try:
            value = client.get(args.job, args.key, timeout=args.wait, round=args.round)
        except RdzvTimeoutError as exc:
            raise RdzvError(f"key {args.key!r} is not set in job {args.job}") from exc
        if args.json:
            _emit_json({"key": args.key, "value": value}, out)
        else:
            out.write(_text(value) + "\n")
    elif args.kv_command == "set":
        client.set(args.job, args.key, args.value, round=args.round)
        if args.json:
            _emit_json({"key": args.key, "value": args.value}, out)
    else:  # kv list
        keys = client.list_keys(args.job, args.prefix, round=args.round)
        if args.json:
            _emit_json({"keys": keys}, out)
        else:
            out.write("".join(_text(k) + "\n" for k in keys))


def _policy(args: argparse.Namespace, client: Client, out: TextIO) -> None:
    if args.policy_command == "set":
        policy = client.set_policy(args.pattern, args.settings)
        if args.json:
            _emit_json(policy, out)
        else:
            out.write(f"policy {policy.get('pattern', args.pattern)}: {_settings_words(policy.get('settings') or {})}\n")
    elif args.policy_command == "unset":
        done = client.unset_policy(args.pattern, args.keys)
        if args.json:
            _emit_json(done, out)
        elif not args.keys:
            out.write(f"removed policy {args.pattern}\n")
        else:
            removed = done.get("removed") or []
            out.write(f"removed {', '.join(removed) if removed else 'nothing'} from policy {args.pattern}\n")
    elif args.job is not None:
        doc = client.effective_policy(args.job)
        out.write((wire.dump_json(doc).decode() if args.json else format_effective_policy(doc)) + "\n")
    elif args.pattern is not None:
        one = client.policy(args.pattern)
        out.write((wire.dump_json(one).decode() if args.json else format_policy(one)) + "\n")
    else:
        policies = client.policies()
        out.write((wire.dump_json({"policies": policies}).decode() if args.json else format_policies(policies)) + "\n")


def _hint(exc: RdzvError, endpoint: str, command: str) -> str:
    if isinstance(exc, RdzvConnectionError) and "TLS handshake failed" in exc.message:
        return "rdzvctl's TLS options are --tls, --ca-file, --cert-file and --key-file (see `rdzvctl --help`)"
    if isinstance(exc, RdzvConnectionError) and exc.code is wire.ErrorCode.NOT_LEADER:
        return (
            "replicas answered but none led: `rdzvctl cluster` shows who leads, and every replica's "
            "--advertise-url must be one of the --endpoint list"
        )
    if isinstance(exc, RdzvConnectionError):
        return (
            f"is the server running at {endpoint}? start it with `rdzv-server`, "
            f"or point rdzvctl at it with --endpoint HOST:PORT or ${ENDPOINT_ENV}"
        )
    if isinstance(exc, NotFoundError) and command == "cluster":
        return "this rdzv-server predates `rdzvctl cluster` (no /v1/cluster): it runs alone, not replicated"
    if command == "policy":
        return _policy_hint(exc)
    if isinstance(exc, NotFoundError):
        return "`rdzvctl jobs` lists the jobs this server knows"
    if isinstance(exc, BadRequestError):
        return "check the job id and key (see `rdzvctl --help`)"
    return ""


def _policy_hint(exc: RdzvError) -> str:
    if exc.code is wire.ErrorCode.FORBIDDEN:
        return "this token may only read: policies are set with the operator's token (--token-file PATH)"
    if isinstance(exc, NotFoundError) and exc.code is wire.ErrorCode.NOT_FOUND:
        return "this rdzv-server predates job policies (no /v1/policies); upgrade it to set them"
    if isinstance(exc, NotFoundError):
        return "`rdzvctl policy show` lists the policies; `rdzvctl policy set PATTERN KEY=VALUE` makes one"
    if isinstance(exc, BadRequestError):
        return f"the keys are {', '.join(wire.POLICY_KEYS)} (see `rdzvctl policy set --help`)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit code (0 ok, 1 server error, 2 usage, 3 cannot connect)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if getattr(args, "policy_command", None) == "set":
        try:
            args.settings = parse_policy_settings(args.settings)
        except ValueError as exc:
            parser.error(f"policy set: {exc}")
    # Retry notices are for agents' logs; a terminal user gets the one-line error below. Put
    # back on return: main() called in a process that logs (a test, a tool) must leave its
    # logging as it found it (a leaked ERROR hid later retry warnings from those who wait on them).
    logger = logging.getLogger("rdzv_client")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return _run(parser, args)
    finally:
        logger.setLevel(level)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        client = Client(
            args.endpoint,
            retry_budget=DEFAULT_CTL_RETRY_BUDGET,
            token_file=args.token_file,
            tls=args.tls,
            ca_file=args.ca_file,
            cert_file=args.cert_file,
            key_file=args.key_file,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        with client:
            _execute(args, client, sys.stdout)
    except RdzvError as exc:
        code = f" ({exc.code.value})" if exc.code is not None else ""
        print(f"rdzvctl: error: {exc.message}{code}", file=sys.stderr)
        hint = _hint(exc, args.endpoint, args.command)
        if hint:
            print(f"rdzvctl: hint: {hint}", file=sys.stderr)
        return EXIT_CANNOT_CONNECT if isinstance(exc, RdzvConnectionError) else EXIT_SERVER_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
