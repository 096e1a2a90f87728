"""``python -m bench --only scale --versus REV``: the table a reader compares trees by.

The measurement itself takes minutes (it is run by hand, bench/README.md); what is checked
here is what the table says given two trees' run records, and that the flag refuses what it
cannot compare."""

from __future__ import annotations

import pytest

from bench import __main__ as bench_main
from bench.scale_versus import table


def _run(reform: float, cpu: float, beats: int, fds: int = 4100) -> dict[str, object]:
    return {"nodes": 4096, "formation_s": 2.0, "reform_s": reform, "reform_server_cpu_s": 1.0,
            "reform_requests": {"join": 4095, "watch": 5000}, "heartbeat_cpu": cpu, "beats_per_s": beats,
            "server_fds": fds, "server_rss_mb": 60.0, "expired_by_ttl": 0, "load_before": 3.0, "load_after": 5.5}  # fmt: skip


def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(label))
    return line[len(label):].split()


def test_the_table_gives_each_trees_median_and_the_ratio_of_this_tree_to_the_revision() -> None:
    runs = {4096: {"this tree": [_run(1.0, 4.0, 1000), _run(3.0, 6.0, 1000), _run(2.0, 5.0, 1000)],
                   "abc1234": [_run(4.0, 10.0, 1000), _run(5.0, 10.0, 1000), _run(6.0, 10.0, 1000)]}}  # fmt: skip
    text = table(runs, "abc1234", [])
    assert "medians of 3 run(s)" in text and "load average 3.0-5.5" in text
    assert _row(text, "re-formation (kill)") == ["s", "2", "5", "0.40"]
    # 5 % of a core over 1,000 beats/s: 50 µs a beat.
    assert _row(text, "per-beat server CPU") == ["µs", "50", "100", "0.50"]
    assert _row(text, "re-formation: requests") == ["9095", "9095", "1.00"]
    assert _row(text, "TTL expiries") == ["nodes", "0", "0", "-"]


def test_a_figure_a_revision_lacks_prints_a_dash_and_a_failed_run_is_named() -> None:
    old = _run(4.0, 10.0, 1000)
    del old["reform_s"]
    text = table({4096: {"this tree": [_run(2.0, 5.0, 1000)], "abc1234": [old]}}, "abc1234",
                 ["abc1234, 4096 nodes, round 1: re-formation: timeout (not within 120 s)"])
    assert _row(text, "re-formation (kill)") == ["s", "2", "-", "-"]
    assert text.splitlines()[-1] == "FAILED abc1234, 4096 nodes, round 1: re-formation: timeout (not within 120 s)"


def test_versus_without_only_scale_is_refused_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_main.main(["--versus", "eb0e1c3", "--out", "/nonexistent/never-made"])
    assert exited.value.code == 2
    assert "--versus compares the scale measurement only" in capsys.readouterr().err


def test_the_trees_take_turns_abba_so_a_cold_first_run_does_not_always_fall_on_one() -> None:
    from bench.scale_versus import turns

    order = [name for round_ in (1, 2, 3, 4) for name in turns(["this tree", "eb0e1c3"], round_)]
    assert order == ["this tree", "eb0e1c3", "eb0e1c3", "this tree", "this tree", "eb0e1c3", "eb0e1c3", "this tree"]
