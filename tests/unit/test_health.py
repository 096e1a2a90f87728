"""The node's health checks (client/health.py): a command's verdict and last output line, its
timeout, the built-in GPU count read from device files (no CUDA), and the topology path."""

from __future__ import annotations

from pathlib import Path

from rdzv_client import health


def test_a_check_passes_on_exit_0_and_sees_the_job_in_its_environment() -> None:
    result = health.run_check('echo "$RDZV_JOB_ID/$RDZV_NODE_ID"', 10, {"RDZV_JOB_ID": "j", "RDZV_NODE_ID": "n"})
    assert result == health.CheckResult(True, "j/n")


def test_a_failing_check_reports_its_last_non_empty_line_from_stdout_or_stderr() -> None:
    result = health.run_check("echo first; echo 'GPU 2: ECC' >&2; echo; exit 4", 10, {})
    assert result == health.CheckResult(False, "GPU 2: ECC")
    assert health.run_check("exit 7", 10, {}) == health.CheckResult(False, "exit status 7")


def test_a_check_past_its_timeout_is_killed_with_its_children() -> None:
    result = health.run_check("echo starting; sleep 30 & wait", 0.5, {})
    assert not result.ok and result.detail == "timed out after 0.5 s; last output: starting"


def test_gpus_are_counted_from_device_files_narrowed_by_cuda_visible_devices(tmp_path: Path) -> None:
    assert health.visible_gpus({}, tmp_path) is None  # a CPU node
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert health.visible_gpus({}, tmp_path) == 4
    assert health.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}, tmp_path) == 2
    assert health.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, tmp_path) == 1  # CUDA stops at -1
    assert health.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,MIG-1"}, tmp_path) == 2
    assert health.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == 0
    assert health.gpu_check(4, {}, tmp_path).ok
    failed = health.gpu_check(8, {"CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path)
    assert not failed.ok and failed.detail == "the node sees 2 GPU(s) but runs nproc_per_node=8 workers"
    assert health.gpu_check(64, {}, tmp_path / "nowhere").ok  # no device directory: a CPU node, skipped


def test_the_topology_path_comes_from_rdzv_topology_or_the_named_variable() -> None:
    env = {"RDZV_TOPOLOGY": " zone1/rack12/switch3 ", "SLURM_TOPOLOGY_ADDR": "s1.s2.node7"}
    assert health.topology_path(None, env) == "zone1/rack12/switch3"
    assert health.topology_path("SLURM_TOPOLOGY_ADDR", env) == "s1.s2.node7"
    assert health.topology_path("UNSET", env) == ""
