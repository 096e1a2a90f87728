"""``rdzvctl``: look at and poke a running rdzv-server from a terminal.

What it owns: the command line (argparse), the human-readable tables of jobs and
membership (pure functions of the server's documents, so tests can feed them dicts),
and the exit codes: 0 success, 1 the server said no, 2 usage, 3 cannot connect.

What it must not know: HTTP, msgpack, retries (the sync :class:`Client` does all that),
torch.

Usage::

    rdzvctl [--endpoint HOST:PORT] [--json] jobs
    rdzvctl show JOB | close JOB
    rdzvctl kv get JOB KEY [--wait SECONDS] | kv set JOB KEY VALUE | kv list JOB [PREFIX]
    (kv commands take --round N to use one round's key space)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from . import wire
from .client import Client
from .error import BadRequestError, NotFoundError, RdzvConnectionError, RdzvError, RdzvTimeoutError

DEFAULT_ENDPOINT = f"127.0.0.1:{wire.DEFAULT_PORT}"  # the server's default bind, on this host
ENDPOINT_ENV = "RDZV_ENDPOINT"
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
    lines = [header, ""]
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
        lines += format_table(["NODE_RANK", "NODE_ID", "ADDR", "NPROC", "RANKS", "ALIVE", "HEARTBEAT"], rows)
    else:
        lines.append("no nodes in the current round")
    for section in ("joining", "waiting", "standby"):  # joining: in the open round, not yet formed
        others: Sequence[Mapping[str, Any]] = doc.get(section) or []
        if others:
            lines += ["", f"{section} ({len(others)}):"]
            lines += ["  " + line for line in _node_lines(others)]
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


def _text(value: bytes) -> str:
    return value.decode("utf-8", errors="backslashreplace")


# --------------------------------------------------------------------------- commands


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdzvctl", description="Inspect and drive a running rdzv-server.")
    parser.add_argument(
        "--endpoint",
        default=os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT,
        help=f"HOST[:PORT] of the server (default: ${ENDPOINT_ENV}, else {DEFAULT_ENDPOINT})",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead of tables")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("jobs", help="list every job")
    show = sub.add_parser("show", help="show a job's membership")
    show.add_argument("job")
    close = sub.add_parser("close", help="close a job (later joins fail)")
    close.add_argument("job")
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


def _emit_json(obj: object, out: TextIO) -> None:
    out.write(wire.dump_json(obj).decode() + "\n")


def _execute(args: argparse.Namespace, client: Client, out: TextIO) -> None:
    if args.command == "jobs":
        jobs = client.jobs()
        out.write((wire.dump_json({"jobs": jobs}).decode() if args.json else format_jobs(jobs)) + "\n")
    elif args.command == "show":
        doc = client.job(args.job)
        out.write((wire.dump_json(doc).decode() if args.json else format_membership(doc)) + "\n")
    elif args.command == "close":
        client.close_job(args.job)
        if args.json:
            _emit_json({"rdzv_id": args.job, "closed": True}, out)
        else:
            out.write(f"closed job {args.job}\n")
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


def _hint(exc: RdzvError, endpoint: str) -> str:
    if isinstance(exc, RdzvConnectionError):
        return (
            f"is the server running at {endpoint}? start it with `rdzv-server`, "
            f"or point rdzvctl at it with --endpoint HOST:PORT or ${ENDPOINT_ENV}"
        )
    if isinstance(exc, NotFoundError):
        return "`rdzvctl jobs` lists the jobs this server knows"
    if isinstance(exc, BadRequestError):
        return "check the job id and key (see `rdzvctl --help`)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit code (0 ok, 1 server error, 2 usage, 3 cannot connect)."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    # Retry notices are for agents' logs; a terminal user gets the one-line error below.
    logging.getLogger("rdzv_client").setLevel(logging.ERROR)
    try:
        client = Client(args.endpoint, retry_budget=DEFAULT_CTL_RETRY_BUDGET)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        with client:
            _execute(args, client, sys.stdout)
    except RdzvError as exc:
        code = f" ({exc.code.value})" if exc.code is not None else ""
        print(f"rdzvctl: error: {exc.message}{code}", file=sys.stderr)
        hint = _hint(exc, args.endpoint)
        if hint:
            print(f"rdzvctl: hint: {hint}", file=sys.stderr)
        return EXIT_CANNOT_CONNECT if isinstance(exc, RdzvConnectionError) else EXIT_SERVER_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
