"""A node's fitness to join: its health check, and the built-in GPU count check.

What it owns: :func:`run_check` (the ``--rdzv-conf health_check=CMD`` command, run before
each join), :func:`gpu_check` (the node sees at least ``nproc_per_node`` GPUs) and
:func:`visible_gpus` (how many GPUs the node sees, read without initialising CUDA), and
:func:`topology_path` (the node's ``RDZV_TOPOLOGY``).

Rules:
- A check passes on exit status 0; anything else (a non-zero status, a signal, the timeout,
  a command that cannot start) fails it, and the failure's ``detail`` is the command's last
  non-empty output line (stdout and stderr together), or what went wrong: the server records
  it in the job's timeline, and the agent's error names the check and quotes it.
- The command runs through the shell, with the job id, the node id and nproc_per_node in its
  environment (``RDZV_JOB_ID``, ``RDZV_NODE_ID``, ``RDZV_NPROC_PER_NODE``), and is killed at
  its timeout (its whole process group: a hung ``nvidia-smi`` below a shell dies with it).
- GPUs are counted from the device files the NVIDIA driver makes (``/dev/nvidia0`` ...),
  narrowed by ``CUDA_VISIBLE_DEVICES``: no CUDA call, so the agent's process never creates a
  CUDA context that its forked workers would inherit. A node with no NVIDIA device file is a
  CPU node: the check is skipped.

What it must not know: torch, the server (the handler reports a failure).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: torch's own default would be none; a minute covers a real GPU burn-in check's quick mode.
DEFAULT_HEALTH_CHECK_TIMEOUT = 60.0
#: Output kept from a check: its last line is what matters, and a chatty check must not fill memory.
MAX_OUTPUT_BYTES = 64 * 1024
#: The environment variable a node's topology path is read from, unless ``topology_env`` names another.
TOPOLOGY_ENV = "RDZV_TOPOLOGY"

_GPU_DEVICE = re.compile(r"^nvidia(\d+)$")


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str = ""  # the last output line, or why the command failed


def last_line(output: bytes) -> str:
    for line in reversed(output.decode("utf-8", errors="replace").splitlines()):
        if line.strip():
            return line.strip()
    return ""


def run_check(command: str, timeout: float, env: Mapping[str, str]) -> CheckResult:
    """Run ``command`` through the shell with ``env`` added to this process's environment."""
    try:
        proc = subprocess.Popen(
            command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **env}, start_new_session=True,
        )
    except OSError as exc:
        return CheckResult(False, f"could not start: {exc}")
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
        line = last_line(output[-MAX_OUTPUT_BYTES:])
        return CheckResult(False, f"timed out after {timeout:g} s" + (f"; last output: {line}" if line else ""))
    line = last_line(output[-MAX_OUTPUT_BYTES:])
    if proc.returncode == 0:
        return CheckResult(True, line)
    status = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    return CheckResult(False, line or status)


def visible_gpus(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> int | None:
    """GPUs this node's workers would see; None on a CPU node (no NVIDIA device file at all).

    ``CUDA_VISIBLE_DEVICES`` narrows the devices as CUDA does: its entries up to the first
    invalid one (``-1`` hides every GPU), each naming an index below the device count or a
    ``GPU-``/``MIG-`` UUID (counted as present)."""
    env = os.environ if env is None else env
    try:
        present = sorted(int(m.group(1)) for p in dev.iterdir() if (m := _GPU_DEVICE.match(p.name)))
    except OSError:
        return None
    if not present:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(present)
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            count += 1
        elif entry.isdigit() and int(entry) < len(present):
            count += 1
        else:
            break  # CUDA stops at the first invalid entry
    return count


def gpu_check(nproc_per_node: int, env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> CheckResult:
    """The built-in check: at least ``nproc_per_node`` GPUs are visible (passes on a CPU node)."""
    seen = visible_gpus(env, dev)
    if seen is None or seen >= nproc_per_node:
        return CheckResult(True)
    return CheckResult(False, f"the node sees {seen} GPU(s) but runs nproc_per_node={nproc_per_node} workers")


def topology_path(env_name: str | None, env: Mapping[str, str] | None = None) -> str:
    """The node's topology path from ``env_name`` (default :data:`TOPOLOGY_ENV`); "" if unset."""
    env = os.environ if env is None else env
    return env.get(env_name or TOPOLOGY_ENV, "").strip()
