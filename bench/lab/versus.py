"""``python -m bench.lab.versus REV [REV ...]``: the server's CPU per ``add``, this tree against
other revisions, with one and the same client (~2 minutes for two revisions).

What it owns: one comparison, for issue 15's target on the server's CPU per ``add`` as a
ratio to an older revision's. ``python -m bench`` measures each tree through its own client,
so a revision whose client writes a frame in pieces, or waits differently, moves the
server's figure too; here every server is driven by the same bare client, a blocking socket
loop in this process that greets the server (preface, hello with its token), creates a job,
then sends ``[tag, "add", job, {key, amount, round, rid}]`` frames one at a time, each with
a fresh request id as the client sends it (so the server keeps its exactly-once session),
and reads each reply. The server's CPU is every thread's schedstat (ns) over :data:`ADDS`
adds, the least of :data:`REPEATS` such stretches per start; the servers are started in turn
(this tree, then each revision, then ``bench.lab.ceiling``'s bare uvloop echo server, which
answers every frame with a fixed one: the floor of the event loop and the kernel), :data:`ROUNDS`
times, and the table gives the medians.

Each revision is checked out (``git worktree``) and installed with its own dependencies
into a virtual environment of its own under ``--work`` (default: a folder in the temporary
directory, kept for the next run; pip's cache makes the first install quick). This tree's
server runs from the interpreter running this module.

What it must not know: the rest of the bench; the client's policy and transports (the frames
are written here, as the stream protocol has had them since before issue 15, and read by
:mod:`rdzv_client.frame`'s reader, the one in the tree).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from .ceiling import cpu_s, echo_server, free_port, in_process, replies

ADDS = 8000
ECHO = "echo (the floor)"
REPEATS = 3
ROUNDS = 3
JOB = "versus"
#: Where the revisions' checkouts and virtual environments are kept (reused by the next run).
WORK = Path(tempfile.gettempdir()) / "rdzv-bench-versus"
_PREFACE = b"\x00RDZV1\r\n"
_ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/lab/versus.py


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body




def _connect(port: int, proc: subprocess.Popen[bytes]) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {port} did not start") from None
            time.sleep(0.05)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def server_cpu_per_add(python: str) -> float:
    """Start ``python -m rdzv_server --memory``, drive it as the module says; µs of its CPU per add."""
    home = tempfile.mkdtemp(prefix="rdzv-versus-")
    port = free_port()
    proc = subprocess.Popen(
        [python, "-m", "rdzv_server", "--memory", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "XDG_CONFIG_HOME": home}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=home,  # (from this tree's folder, ``-m`` would import this tree's server whatever the python)
    )
    try:
        with _connect(port, proc) as sock:
            reply = replies(sock)
            token = (Path(home) / "rdzv-server" / "token").read_text().strip()
            sock.sendall(_PREFACE + _frame([1, "hello", "", {"token": token}]))
            if msgpack.unpackb(reply())[1] != 200:
                raise RuntimeError("the server refused the hello")
            sock.sendall(_frame([2, "create", JOB, {"min_nodes": 1, "max_nodes": 1}]))
            msgpack.unpackb(reply())
            seq = 0

            def adds(n: int) -> None:
                nonlocal seq
                for _ in range(n):
                    seq += 1
                    rid = ["versus0123456789", seq, seq]  # one at a time: every earlier one answered
                    sock.sendall(_frame([seq + 2, "add", JOB, {"key": b"k", "amount": 1, "round": None, "rid": rid}]))
                    answer = msgpack.unpackb(reply())
                    if answer[1] != 200:
                        raise RuntimeError(f"the server answered an add with {answer!r:.200}")

            adds(ADDS // 4)  # warm
            stretches = []
            for _ in range(REPEATS):
                before = cpu_s(proc.pid)
                adds(ADDS)
                stretches.append((cpu_s(proc.pid) - before) / ADDS * 1e6)
            return min(stretches)
    finally:
        proc.kill()
        proc.wait()


def revision_tree(rev: str, work: Path) -> tuple[str, Path]:
    """The python of a virtual environment with revision ``rev`` installed, and the revision's
    checkout (both made once, under ``work``). Where this checkout has no git history (a copy
    of the working tree on another host), ``rev`` must be a short commit whose tree and
    environment were made there by hand, as ``tree-REV`` and ``venv-REV`` under ``work``."""
    found = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--short", rev], capture_output=True, text=True)
    commit = found.stdout.strip()
    if found.returncode != 0:
        tree, python = work / f"tree-{rev}", work / f"venv-{rev}" / "bin" / "python"
        if python.exists() and tree.is_dir():
            return str(python), tree
        raise SystemExit(f"git cannot resolve {rev!r} here ({found.stderr.strip()}), and {tree} with {python} was not made by hand")
    tree, venv = work / f"tree-{commit}", work / f"venv-{commit}"
    python = venv / "bin" / "python"
    if python.exists():
        return str(python), tree
    print(f"installing {rev} ({commit}) into {venv} ...", file=sys.stderr, flush=True)
    if not tree.exists():
        subprocess.run(["git", "-C", str(_ROOT), "worktree", "add", "--detach", "-f", str(tree), commit], check=True,
                       stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", str(tree)], check=True)
    return str(python), tree


def echo_cpu_per_request() -> float:
    """The floor: µs of CPU per request of a bare uvloop server that answers every frame with
    a fixed one (``bench.lab.ceiling``'s), driven by the same loop and the same ``add`` frames."""
    proc, port, pid = in_process(echo_server)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reply = replies(sock)
            stretches = []
            for _ in range(REPEATS):
                before = cpu_s(pid)
                for seq in range(1, ADDS + 1):
                    rid = ["versus0123456789", seq, seq]
                    sock.sendall(_frame([seq + 2, "add", JOB, {"key": b"k", "amount": 1, "round": None, "rid": rid}]))
                    reply()
                stretches.append((cpu_s(pid) - before) / ADDS * 1e6)
            return min(stretches)
    finally:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.versus", description=__doc__.split("\n\n")[0])
    parser.add_argument("revs", nargs="+", metavar="REV", help="git revisions to compare this tree with")
    parser.add_argument("--work", type=Path, default=WORK,
                        help="where the revisions' trees and virtual environments are kept")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    pythons = {"this tree": sys.executable, **{rev: revision_tree(rev, args.work)[0] for rev in args.revs}}
    figures: dict[str, list[float]] = {name: [] for name in pythons}
    figures[ECHO] = []
    for round_ in range(1, ROUNDS + 1):
        for name, python in pythons.items():
            figures[name].append(server_cpu_per_add(python))
        figures[ECHO].append(echo_cpu_per_request())
        print(f"round {round_}: " + ", ".join(f"{n} {v[-1]:.1f} µs" for n, v in figures.items()),
              file=sys.stderr, flush=True)
    print(f"server CPU per add (--memory, one bare client, {ADDS} adds x {REPEATS}, {ROUNDS} rounds)")
    print_medians(figures, "this tree")
    return 0


def print_medians(figures: dict[str, list[float]], base: str) -> None:
    """Each server's median µs, its range, and the ratio of ``base``'s median to it."""
    reference = statistics.median(figures[base])
    width = max(len(name) for name in figures)
    print(f"{'server':<{width}}  median µs  range µs      {base} / it")
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"{name:<{width}}  {median:>9.1f}  {min(values):>5.1f}-{max(values):<6.1f}  {reference / median:>11.2f}")


if __name__ == "__main__":
    sys.exit(main())
