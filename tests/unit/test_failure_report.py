"""The failure report: its bounds and formats (fake failures shaped like torch's
``ProcessFailure``), its wire map, why the agent re-enters a rendezvous, and, against the
installed torch, each thing the finder relies on in torch's agent (one test each, named in
docs/torch-compat.md, "What the failure report relies on").

The real ``torchrun`` checks are tests/e2e/test_job_fate.py (a re-join's report) and
tests/e2e/test_mixed_finish.py (the report of the close in torch's ``launch_agent``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rdzv_client.failure import (
    MAX_MESSAGE_CHARS,
    MAX_REPORTED_WORKERS,
    NO_DETAIL,
    FailureReport,
    RendezvousCause,
    RendezvousEntries,
    WorkerFailure,
    build_report,
    first_line,
    report_for,
)

CUDA_ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"
CALLSTACK = 'Traceback (most recent call last):\n  File "train.py", line 9\nRDZV_TOKEN=hunter2-secret'


@dataclass
class FakeFailure:
    """Shaped like torch's ProcessFailure after it read (or missed) the worker's error file."""

    local_rank: int
    exitcode: int
    timestamp: int = 1_700_000_000
    error_file_data: Any = field(default_factory=lambda: {"message": "<NONE>"})
    pid: int = 4242


def recorded(message: str, timestamp: int = 1_700_000_000) -> dict[str, Any]:
    """The error file torch's ``@record`` writes for an exception (ErrorHandler.record_exception)."""
    return {"message": {"message": message, "extraInfo": {"py_callstack": CALLSTACK, "timestamp": str(timestamp)}}}


# --- bounds and formats -------------------------------------------------------------------


def test_a_recorded_exception_gives_ranks_exit_code_time_and_the_messages_first_line() -> None:
    report = build_report({1: FakeFailure(1, 1, 1_700_000_005, recorded(CUDA_ERROR + "\nCUDA kernel errors ..."))})

    assert report == FailureReport((WorkerFailure(1, 1, 1, 1_700_000_005.0, CUDA_ERROR),), 1)
    assert report.summary() == f"rank 1 (local 1) exit code 1: {CUDA_ERROR}"


def test_the_traceback_and_the_rest_of_the_error_file_never_reach_the_report() -> None:
    data = recorded(CUDA_ERROR)
    data["message"]["extraInfo"]["env"] = {"RDZV_TOKEN": "hunter2-secret"}

    wire = json.dumps(build_report({0: FakeFailure(0, 1, error_file_data=data)}).to_wire(now=1_700_000_010))

    assert CUDA_ERROR in wire
    assert "Traceback" not in wire and "hunter2" not in wire and "train.py" not in wire


def test_a_worker_killed_by_a_signal_is_reported_by_the_signals_name() -> None:
    report = build_report({3: FakeFailure(3, -9)})

    assert report.failures[0].message == "SIGKILL"
    assert report.failures[0].signal == "SIGKILL"
    assert report.summary() == "rank 3 (local 3) SIGKILL"


def test_without_an_error_file_the_message_is_the_exit_signature() -> None:
    report = build_report({5: FakeFailure(1, 3)})

    assert report.failures[0].message == "exit code 3"
    assert report.failures[0].signal == ""


def test_an_error_file_with_a_plain_string_message_is_read_too() -> None:
    data = {"message": "ChildFailedError: trainer FAILED\nmore", "timestamp": "1700000000"}

    assert build_report({0: FakeFailure(0, 1, error_file_data=data)}).failures[0].message == (
        "ChildFailedError: trainer FAILED"
    )


def test_a_report_names_at_most_eight_workers_earliest_first_and_counts_them_all() -> None:
    failures = {rank: FakeFailure(rank % 4, 1, timestamp=1_700_000_100 - rank) for rank in range(12)}

    report = build_report(failures)

    assert report.failed_workers == 12
    assert len(report.failures) == MAX_REPORTED_WORKERS == 8
    assert [f.global_rank for f in report.failures] == [11, 10, 9, 8, 7, 6, 5, 4]
    assert report.summary().endswith("; 11 more failed")


def test_within_one_second_a_worker_that_exited_comes_before_one_ended_by_a_signal_then_by_rank() -> None:
    failures = {2: FakeFailure(0, -15), 9: FakeFailure(1, 1), 7: FakeFailure(3, 1), 1: FakeFailure(1, 1, 1_699_999_999)}

    report = build_report(failures)

    assert [f.global_rank for f in report.failures] == [1, 7, 9, 2]


def test_a_message_is_cut_to_512_characters() -> None:
    report = build_report({0: FakeFailure(0, 1, error_file_data=recorded("ValueError: " + "x" * 2000))})

    message = report.failures[0].message
    assert len(message) == MAX_MESSAGE_CHARS == 512
    assert message.startswith("ValueError: xxx") and message.endswith("…")


def test_the_first_non_blank_line_is_kept_without_control_characters() -> None:
    assert first_line("\n  \n  KeyError: 'a\x1b[31m'\r\nnext") == "KeyError: 'a [31m'"


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ("OSError: postgres://alice:pa55@db:5432/x refused", "OSError: postgres://***@db:5432/x refused"),
        ("ValueError: bad HF_TOKEN=hf_abcdef123 given", "ValueError: bad HF_TOKEN=*** given"),
        ("RuntimeError: password: 'p w' rejected", "RuntimeError: password: *** rejected"),
        ("HTTPError: Authorization: Bearer abc.def", "HTTPError: Authorization: ***"),
        ("HTTPError: sent bearer abc.def", "HTTPError: sent bearer ***"),
        ("RuntimeError: CUDA out of memory", "RuntimeError: CUDA out of memory"),
    ],
)
def test_credentials_in_the_kept_line_are_masked(line: str, kept: str) -> None:
    assert first_line(line) == kept


def test_the_secrets_the_caller_names_are_masked_wherever_they_appear() -> None:
    failure = FakeFailure(0, 1, error_file_data=recorded("OSError: s3cr3t-t0ken rejected"))

    report = build_report({0: failure}, secrets=["s3cr3t-t0ken"])

    assert report.failures[0].message == "OSError: *** rejected"


@pytest.mark.parametrize(
    "odd",
    [
        FakeFailure(0, 1, timestamp=None),  # type: ignore[arg-type]
        FakeFailure("0", 1),  # type: ignore[arg-type]
        FakeFailure(0, True),
        FakeFailure(0, 1, timestamp=float("nan")),  # type: ignore[arg-type]
        object(),
    ],
)
def test_an_entry_torch_would_not_make_is_counted_but_not_listed(odd: object) -> None:
    report = build_report({0: odd, 1: FakeFailure(1, 1)})

    assert report.failed_workers == 2
    assert [f.global_rank for f in report.failures] == [1]


@pytest.mark.parametrize(
    "data", [None, "text", {"message": None}, {"message": {"extraInfo": {}}}, {"message": "  "}, {}]
)
def test_error_file_data_of_any_other_shape_gives_the_exit_signature(data: object) -> None:
    assert build_report({0: FakeFailure(0, 2, error_file_data=data)}).failures[0].message == "exit code 2"


@pytest.mark.parametrize("failures", [None, {}, {"rank": object()}, [FakeFailure(0, 1)]])
def test_nothing_usable_reports_workers_failed_no_detail(failures: object) -> None:
    report = build_report(failures)

    assert not report.detail
    assert report.summary() == NO_DETAIL == "workers failed (no detail)"


# --- the wire map -------------------------------------------------------------------------


def test_the_wire_map_carries_ages_and_round_trips_onto_the_receivers_clock() -> None:
    report = build_report({1: FakeFailure(1, -9, 1_000), 0: FakeFailure(0, 1, 1_004, recorded(CUDA_ERROR, 1_004))}, ())

    wire = report.to_wire(now=1_010.0)

    assert wire == {
        "failed_workers": 2,
        "failures": [
            {"global_rank": 1, "local_rank": 1, "exit_code": -9, "age_s": 10.0, "message": "SIGKILL"},
            {"global_rank": 0, "local_rank": 0, "exit_code": 1, "age_s": 6.0, "message": CUDA_ERROR},
        ],
    }
    assert all(type(v) in (int, float, str) for f in wire["failures"] for v in f.values())
    assert FailureReport.from_wire(wire, now=500.0) == FailureReport(
        (WorkerFailure(1, 1, -9, 490.0, "SIGKILL"), WorkerFailure(0, 0, 1, 494.0, CUDA_ERROR)), 2
    )


def test_a_failure_time_ahead_of_the_senders_clock_is_sent_as_age_zero() -> None:
    assert build_report({0: FakeFailure(0, 1, 2_000)}).to_wire(now=1_999.5)["failures"][0]["age_s"] == 0.0


def entry(**changes: object) -> dict[str, object]:
    return {"global_rank": 1, "local_rank": 1, "exit_code": 1, "age_s": 1.0, "message": "m"} | changes


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"failed_workers": 1},
        {"failed_workers": 1, "failures": [], "extra": 1},
        {"failed_workers": -1, "failures": []},
        {"failed_workers": 9, "failures": [entry()] * 9},
        {"failed_workers": 1, "failures": [entry(), entry(global_rank=2)]},
        {"failed_workers": 1, "failures": [entry(message="x" * 513)]},
        {"failed_workers": 1, "failures": [entry(age_s=-1.0)]},
        {"failed_workers": 1, "failures": [entry(age_s=float("inf"))]},
        {"failed_workers": 1, "failures": [entry(exit_code="1")]},
        {"failed_workers": 1, "failures": [entry(global_rank=True)]},
        {"failed_workers": 1, "failures": [entry() | {"env": "x"}]},
    ],
)
def test_the_wire_map_is_refused_when_it_breaks_a_bound_or_a_type(body: object) -> None:
    with pytest.raises(ValueError):
        FailureReport.from_wire(body, now=0.0)


# --- why the agent re-enters next_rendezvous() ---------------------------------------------


def test_entries_after_the_first_are_membership_changes_only_after_a_positive_waiting_answer() -> None:
    entries = RendezvousEntries()
    causes = [entries.entered()]
    entries.answered_waiting(0)
    entries.answered_waiting(2)
    causes.append(entries.entered())
    entries.answered_waiting(0)
    causes.append(entries.entered())
    causes.append(entries.entered())

    assert causes == [
        RendezvousCause.FIRST,
        RendezvousCause.MEMBERSHIP,
        RendezvousCause.WORKERS_FAILED,
        RendezvousCause.WORKERS_FAILED,
    ]


def test_a_failure_entry_with_nothing_found_reports_no_detail_and_others_report_nothing() -> None:
    found = build_report({0: FakeFailure(0, 1)})

    assert report_for(RendezvousCause.WORKERS_FAILED, None) == FailureReport.no_detail()
    assert report_for(RendezvousCause.MEMBERSHIP, None) is None
    assert report_for(RendezvousCause.FIRST, None) is None
    assert report_for(RendezvousCause.MEMBERSHIP, found) is found


def test_the_failure_module_does_not_import_torch() -> None:
    code = "import sys, rdzv_client.failure; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)

    assert result.stdout.strip() == "False"


# --- what the finder relies on in torch's agent (the installed torch) ---------------------


def recorded_by_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: Exception) -> Any:
    """A ProcessFailure read from the error file torch's own ErrorHandler writes for ``exc``
    (what ``@record`` does in a worker), as the agent makes it for a worker that exited 1."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise exc
    except Exception as raised:
        ErrorHandler().record_exception(raised)
    return ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(path))


def test_torch_error_handler_writes_message_and_extra_info_as_the_report_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's ``ErrorHandler.record_exception`` layout, ``{"message": {"message": ...,
    "extraInfo": {"py_callstack", "timestamp"}}}``, read into ``ProcessFailure.error_file_data``."""
    exc = RuntimeError(CUDA_ERROR.removeprefix("RuntimeError: ") + "\nmore")
    failure = recorded_by_torch(tmp_path, monkeypatch, exc)

    data = failure.error_file_data
    assert isinstance(data.get("message"), dict) and "py_callstack" in data["message"].get("extraInfo", {}), (
        f"torch's ErrorHandler.record_exception changed its error file layout: {sorted(data)}"
    )
    report = build_report({1: failure})
    assert report.failures[0].message == CUDA_ERROR
    assert report.failures[0].failed_at == failure.timestamp


def test_torch_marks_a_failure_without_an_error_file_with_its_no_message_sentinel() -> None:
    """torch's ``_EMPTY_ERROR_DATA`` (``{"message": "<NONE>"}``) where the worker left no error
    file: the report gives the exit signature, not the sentinel or torch's made-up text."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=4242, exitcode=3, error_file="/nonexistent/error.json")

    assert failure.error_file_data.get("message") == "<NONE>", (
        f"torch's _EMPTY_ERROR_DATA changed: {failure.error_file_data}"
    )
    assert build_report({0: failure}).failures[0].message == "exit code 3"


def test_torch_agent_run_loop_holds_its_run_result_while_it_calls_next_rendezvous_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's ``SimpleElasticAgent._invoke_run`` keeps the failed ``RunResult`` (its local
    ``run_result``) on the stack through ``_restart_workers`` -> ``next_rendezvous()``: a real
    agent loop, driven in this process, whose handler calls the finder."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerSpec, WorkerState
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    from rdzv_client.torchrun import find_failure_report

    failure = recorded_by_torch(tmp_path, monkeypatch, RuntimeError(CUDA_ERROR.removeprefix("RuntimeError: ")))
    monitored = [
        RunResult(state=WorkerState.HEALTHY),  # a healthy tick: the handler is asked num_nodes_waiting()
        RunResult(state=WorkerState.FAILED, failures={1: failure}),
        RunResult(state=WorkerState.SUCCEEDED, return_values={0: None, 1: None}),
    ]

    class ProbeHandler(RendezvousHandler):
        def __init__(self) -> None:
            self.store = dist.HashStore()
            self.found: list[FailureReport | None] = []

        def get_backend(self) -> str:
            return "probe"

        def next_rendezvous(self) -> RendezvousInfo:
            self.found.append(find_failure_report())
            return RendezvousInfo(self.store, 0, 1, RendezvousStoreInfo("127.0.0.1", 0))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return "probe"

        def shutdown(self) -> bool:
            return True

    class ScriptedAgent(SimpleElasticAgent):
        """torch's own run loop; the workers are the scripted results above."""

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            return {w.local_rank: w.local_rank for w in worker_group.workers}

        def _stop_workers(self, *args: Any, **kwargs: Any) -> None:
            pass

        def _monitor_workers(self, worker_group: Any) -> RunResult:
            return monitored.pop(0)

        def _shutdown(self, *args: Any, **kwargs: Any) -> None:
            pass

    handler = ProbeHandler()
    spec = WorkerSpec(
        role="trainer", local_world_size=2, rdzv_handler=handler, entrypoint="train.py",
        max_restarts=1, monitor_interval=0.001,
    )  # fmt: skip

    assert ScriptedAgent(spec, exit_barrier_timeout=5).run().state == WorkerState.SUCCEEDED
    assert len(handler.found) == 2 and handler.found[0] is None
    assert handler.found[1] is not None and handler.found[1].failures == (
        WorkerFailure(1, 1, 1, float(failure.timestamp), CUDA_ERROR),
    ), "torch's SimpleElasticAgent._invoke_run no longer holds its RunResult (run_result) during next_rendezvous()"
