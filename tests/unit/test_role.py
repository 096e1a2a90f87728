"""Replication behind a seam: the service decides through a role object, and a replica's role
changes follow one table (rdzv_server/role.py)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from rdzv_server.core.error import LogFailed, NotReady
from rdzv_server.role import TRANSITIONS, IllegalRoleChange, Role, RoleName, Single, transition

LEGAL = [
    (RoleName.CANDIDATE, RoleName.CANDIDATE),
    (RoleName.CANDIDATE, RoleName.FOLLOWER),
    (RoleName.FOLLOWER, RoleName.LEADER),
    (RoleName.FOLLOWER, RoleName.CANDIDATE),
    (RoleName.LEADER, RoleName.CANDIDATE),
]
ILLEGAL = [pair for pair in itertools.product(RoleName, repeat=2) if pair not in LEGAL]


def test_importing_the_service_loads_neither_the_replication_nor_the_etcd_client() -> None:
    code = (
        "import sys, rdzv_server.service\n"
        "loaded = [m for m in ('rdzv_server.replication', 'rdzv_server.storage.etcd_client') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=lambda r: r.value)
def test_a_replica_moves_along_the_table(old: RoleName, new: RoleName) -> None:
    assert transition(old, new) is new


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=lambda r: r.value)
def test_any_other_role_change_raises_illegal_role_change(old: RoleName, new: RoleName) -> None:
    with pytest.raises(IllegalRoleChange, match=f"a {old.value} cannot become a {new.value}"):
        transition(old, new)


def test_the_table_is_the_one_the_tests_spell_out() -> None:
    assert {(old, new) for old, nexts in TRANSITIONS.items() for new in nexts} == set(LEGAL)
    assert set(TRANSITIONS) == set(RoleName)


def test_the_one_server_serves_alone_and_its_log_failing_is_fatal() -> None:
    single: Role = Single(lambda: 7)
    assert single.role is RoleName.SINGLE and not single.replicated
    assert single.lease_valid() and single.leader_url() is None and single.applied() == 7
    assert isinstance(single.unavailable(), NotReady)
    assert isinstance(single.commit_failed(), LogFailed)
    assert single.step_down("the disk failed") is False
