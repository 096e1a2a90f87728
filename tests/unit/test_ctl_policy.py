"""``rdzvctl policy``'s words (issue 28): KEY=VALUE read into typed settings with messages that
say what to type instead, and the tables people read, as pure functions of the server's
documents. The commands against a real server are in tests/integration/test_rdzvctl_policy.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rdzv_client import ctl


def test_key_value_words_become_typed_settings() -> None:
    words = ["min_nodes=2", "max_nodes=16", "last_call_timeout=30", "join_timeout=600", "heartbeat_ttl=7.5",
             "max_restarts=0", "min_round_seconds=90", "max_fast_failures=3",
             "health_check=nvidia-smi -q | grep -q 'Ecc Mode'", "health_check_timeout=90", "gpu_check=off"]
    assert ctl.parse_policy_settings(words) == {
        "min_nodes": 2, "max_nodes": 16, "last_call_timeout": 30.0, "join_timeout": 600.0, "heartbeat_ttl": 7.5,
        "max_restarts": 0, "min_round_seconds": 90.0, "max_fast_failures": 3,
        "health_check": "nvidia-smi -q | grep -q 'Ecc Mode'", "health_check_timeout": 90.0, "gpu_check": False,
    }  # fmt: skip
    assert ctl.parse_policy_settings(["gpu_check=YES", "last_call_timeout=0"]) == {
        "gpu_check": True, "last_call_timeout": 0.0
    }


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("min_nodes", "'min_nodes' is not KEY=VALUE (e.g. min_nodes=2)"),
        ("=2", "'=2' is not KEY=VALUE"),
        ("min_node=2", "'min_node' is not a policy key; the keys are min_nodes, max_nodes,"),
        ("min_nodes=two", "policy key min_nodes: 'two' is not an integer"),
        ("min_nodes=0", "policy key min_nodes must be 1..1000000, got 0"),
        ("max_restarts=1.5", "policy key max_restarts: '1.5' is not an integer"),
        ("last_call_timeout=soon", "policy key last_call_timeout: 'soon' is not a number"),
        ("join_timeout=-5", "policy key join_timeout must be >= 0"),
        ("join_timeout=nan", "policy key join_timeout takes a number of seconds"),
        ("heartbeat_ttl=0", "policy key heartbeat_ttl must be > 0"),
        ("gpu_check=maybe", "policy key gpu_check takes true or false"),
    ],
)
def test_a_bad_word_is_refused_naming_it_and_what_it_takes(word: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ctl.parse_policy_settings([word])
    assert str(info.value).startswith(message), str(info.value)


def test_node_counts_that_cross_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="need min_nodes <= max_nodes, got 5 > 2"):
        ctl.parse_policy_settings(["min_nodes=5", "max_nodes=2"])


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="min_nodes is given twice"):
        ctl.parse_policy_settings(["min_nodes=2", "min_nodes=3"])


def test_policy_set_with_a_bad_word_is_a_usage_error_that_sends_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # No server listens on port 1: a request would end in exit 3, a usage error is exit 2.
    with pytest.raises(SystemExit) as info:
        ctl.main(["--endpoint", "127.0.0.1:1", "policy", "set", "llm-*", "min_nodes=2", "max_nodez=4"])
    assert info.value.code == ctl.EXIT_USAGE
    assert "policy set: 'max_nodez' is not a policy key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        ctl.main(["policy", "set", "llm-*"])  # no KEY=VALUE at all
    assert info.value.code == ctl.EXIT_USAGE


WALL = time.mktime(time.strptime("2026-11-28 03:00:00", "%Y-%m-%d %H:%M:%S"))  # this host's clock now


def _age(text: str) -> float:
    """The ``age_s`` the server gives a policy changed at local wall-clock ``text``."""
    return WALL - time.mktime(time.strptime(text, "%Y-%m-%d %H:%M:%S"))


POLICIES: list[dict[str, Any]] = [
    {"pattern": "llm-*", "settings": {"min_nodes": 2, "max_restarts": 1, "last_call_timeout": 30.0},
     "age_s": _age("2026-11-28 01:55:02"), "changed_by": "operator"},
    {"pattern": "llm-7", "settings": {"gpu_check": False, "health_check": "/opt/check.sh"},
     "age_s": _age("2026-11-28 02:10:40"), "changed_by": ""},
]  # fmt: skip


def test_policy_show_lists_each_policy_with_its_keys_and_who_changed_it_when() -> None:
    assert ctl.format_policies(POLICIES, WALL).splitlines() == [
        "PATTERN  SETTINGS                                         CHANGED              BY",
        "llm-*    last_call_timeout=30 max_restarts=1 min_nodes=2  2026-11-28 01:55:02  operator",
        "llm-7    gpu_check=0 health_check=/opt/check.sh           2026-11-28 02:10:40  -",
    ]
    assert ctl.format_policies([]) == "no policies (rdzvctl policy set PATTERN KEY=VALUE... makes one)"
    # A server that does not say how old a policy is: when is unknown.
    unsaid = [{k: v for k, v in POLICIES[0].items() if k != "age_s"}]
    assert ctl.format_policies(unsaid).splitlines()[1].split()[-2:] == ["-", "operator"]


def test_policy_show_of_one_pattern_lists_its_keys() -> None:
    assert ctl.format_policy(POLICIES[0], WALL).splitlines() == [
        "policy llm-*  changed 2026-11-28 01:55:02 by operator",
        "KEY                VALUE",
        "last_call_timeout  30",
        "max_restarts       1",
        "min_nodes          2",
    ]


def test_policy_show_of_a_job_names_the_pattern_each_key_comes_from() -> None:
    doc = {"job": "llm-7", "settings": {"min_nodes": 2, "gpu_check": False},
           "sources": {"min_nodes": "policy llm-*", "gpu_check": "policy llm-7"}, "version": 4}  # fmt: skip
    assert ctl.format_effective_policy(doc).splitlines() == [
        "job llm-7  policy version 4",
        "KEY        VALUE  SOURCE",
        "gpu_check  0      policy llm-7",
        "min_nodes  2      policy llm-*",
    ]
    none = {"job": "x", "settings": {}, "sources": {}, "version": 4}
    assert ctl.format_effective_policy(none) == "no policy covers job x: its settings are its nodes' own (or the defaults)"


def test_show_lists_every_effective_setting_with_its_source() -> None:
    doc = {"rdzv_id": "pol-a", "state": "complete", "round": 0, "num_nodes": 2, "world_size": 2, "nodes": [],
           "min_nodes": 2, "max_nodes": 2, "last_call_timeout": 1.0, "join_timeout": 600.0, "heartbeat_ttl": 2.0,
           "max_restarts": 1, "restarts": 0, "min_round_seconds": 60.0, "max_fast_failures": 0,
           "settings_source": {"min_nodes": "policy pol-*", "max_nodes": "policy pol-*", "last_call_timeout": "node",
                               "join_timeout": "default", "heartbeat_ttl": "node", "max_restarts": "policy pol-*",
                               "min_round_seconds": "default", "max_fast_failures": "default",
                               "health_check": "policy pol-a"}}  # fmt: skip
    text = ctl.format_membership(doc).splitlines()
    assert text[text.index("settings:") :] == [
        "settings:",
        "  KEY                VALUE  SOURCE",
        "  min_nodes          2      policy pol-*",
        "  max_nodes          2      policy pol-*",
        "  last_call_timeout  1      node",
        "  join_timeout       600    default",
        "  heartbeat_ttl      2      node",
        "  max_restarts       1      policy pol-*",
        "  min_round_seconds  60     default",
        "  max_fast_failures  0      default",
        "  health_check       -      policy pol-a",
    ]


def test_show_of_a_server_without_settings_sources_prints_no_settings_table() -> None:
    doc = {"rdzv_id": "old", "state": "open", "round": 0, "num_nodes": 0, "world_size": 0, "nodes": [],
           "min_nodes": 1, "max_nodes": 1}  # fmt: skip
    assert "settings:" not in ctl.format_membership(doc)


@pytest.mark.parametrize(("value", "text"), [(None, "none"), (True, "1"), (False, "0"), (30.0, "30"), (0.5, "0.5"), (3, "3")])
def test_a_setting_prints_as_one_would_type_it(value: object, text: str) -> None:
    assert ctl.setting_text(value) == text


def test_a_policy_changed_event_reads_as_each_key_old_to_new_and_its_source() -> None:
    event = {"seq": 10, "time": 7.6, "kind": "policy_changed", "cause": "operator", "round": 1, "node_id": None,
             "addr": None, "pattern": "pol-1", "by": "operator",
             "changes": {"max_restarts": {"old": 1, "new": 2, "source": "policy pol-1"},
                         "health_check": {"old": None, "new": "/opt/check.sh", "source": "policy pol-*"}}}  # fmt: skip
    assert ctl.event_detail(event) == (
        "pattern=pol-1 by=operator max_restarts=1->2 (policy pol-1) health_check=none->/opt/check.sh (policy pol-*)"
    )


def test_a_node_count_a_policy_could_not_move_reads_as_held_and_why() -> None:
    event = {"seq": 3, "time": 1.0, "kind": "policy_changed", "cause": "operator", "round": 0, "node_id": None,
             "addr": None, "pattern": "llm-*", "by": "operator", "changes": {},
             "held": {"min_nodes": "min_nodes=6 would exceed the job's max_nodes=4"}}  # fmt: skip
    assert ctl.event_detail(event) == "pattern=llm-* by=operator held min_nodes: min_nodes=6 would exceed the job's max_nodes=4"
