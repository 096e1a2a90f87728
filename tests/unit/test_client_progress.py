"""A worker's progress report (rdzv_client.progress): the file its agent reads, rate-limited,
never raising into the training loop, a no-op outside a job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rdzv_client
from rdzv_client.progress import PROGRESS_DIR_ENV, clear, node_step


def run_worker(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A worker process: ``body`` runs after ``import rdzv_client`` with ``env`` set."""
    code = f"import rdzv_client\n{body}\n"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)


def test_the_agent_reads_the_highest_step_of_its_workers_and_their_last_step_at_exit(tmp_path: Path) -> None:
    for rank, steps in (("0", "range(1, 501)"), ("1", "range(1, 301)")):
        # Hundreds of calls inside one second: the first is written at once, the last at the exit.
        done = run_worker(tmp_path, f"for s in {steps}: rdzv_client.progress(s)",
                          **{PROGRESS_DIR_ENV: str(tmp_path), "LOCAL_RANK": rank})
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]  # one file per worker, no temporary left
    assert node_step(str(tmp_path)) == 500
    clear(str(tmp_path))
    assert node_step(str(tmp_path)) is None and list(tmp_path.iterdir()) == []


def test_outside_a_job_and_with_bad_input_progress_does_nothing_and_never_raises(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != PROGRESS_DIR_ENV}
    done = subprocess.run([sys.executable, "-c", "import rdzv_client; rdzv_client.progress(5); print('ok')"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "ok")
    missing = tmp_path / "gone"
    body = "rdzv_client.progress(1); rdzv_client.progress(-3); rdzv_client.progress('x'); rdzv_client.progress(2.5); print('ok')"
    done = run_worker(tmp_path, body, **{PROGRESS_DIR_ENV: str(missing)})
    assert (done.returncode, done.stdout.strip()) == (0, "ok")  # an unwritable directory is logged, not raised
    assert not missing.exists()


def test_node_step_skips_what_is_not_a_step(tmp_path: Path) -> None:
    (tmp_path / "0").write_text("12")
    (tmp_path / "1").write_text("not a step")
    (tmp_path / ".step-half").write_text("99")  # a write in progress
    assert node_step(str(tmp_path)) == 12
    assert node_step(str(tmp_path / "none")) is None


def test_the_package_attribute_is_the_function() -> None:
    import rdzv_client.progress  # noqa: F401 (the submodule's import must not shadow it)

    assert callable(rdzv_client.progress) and rdzv_client.progress.__module__ == "rdzv_client.progress"


@pytest.mark.parametrize("step", [None, 0, 2**63 - 1])
def test_a_watch_and_a_join_carry_a_step_only_when_there_is_one(step: int | None) -> None:
    from rdzv_client import wire

    watch = wire.to_mapping(wire.WatchRequest(node_id="a", round=1, step=step))
    assert watch.get("step") == step and (("step" in watch) == (step is not None))
