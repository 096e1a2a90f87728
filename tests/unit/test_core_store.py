"""KeyValueStore keeps torch ``Store`` semantics on bytes, per key space (job or round)."""

from __future__ import annotations

import copy

import pytest

from rdzv_server.core.error import NotAnInteger, ValueTooLarge
from rdzv_server.core.store import KeyValueStore

LIMIT = 16
JOB = None  # the job-wide key space


@pytest.fixture
def kv() -> KeyValueStore:
    return KeyValueStore(max_value_bytes=LIMIT)


def frozen(kv: KeyValueStore) -> list[list[object]]:
    return copy.deepcopy(kv.to_snapshot())


# -- set / get ---------------------------------------------------------------------------


def test_get_of_a_missing_key_is_none(kv: KeyValueStore) -> None:
    assert kv.get(JOB, b"k") is None
    assert kv.get(3, b"k") is None


def test_set_then_get_returns_the_value(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"v")
    assert kv.get(JOB, b"k") == b"v"


def test_set_overwrites(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"one")
    kv.set(JOB, b"k", b"two")
    assert kv.get(JOB, b"k") == b"two"


def test_set_accepts_the_empty_value_and_arbitrary_bytes(kv: KeyValueStore) -> None:
    kv.set(JOB, b"empty", b"")
    kv.set(JOB, b"\x00\xff", b"\x00\x01\xfe")
    assert kv.get(JOB, b"empty") == b""
    assert kv.get(JOB, b"\x00\xff") == b"\x00\x01\xfe"


# -- add -----------------------------------------------------------------------------------


def test_add_on_a_missing_key_counts_from_zero(kv: KeyValueStore) -> None:
    assert kv.add(JOB, b"n", 5) == 5
    assert kv.get(JOB, b"n") == b"5"


def test_add_keeps_the_integer_as_decimal_ascii_bytes(kv: KeyValueStore) -> None:
    kv.add(JOB, b"n", 7)
    assert kv.add(JOB, b"n", 35) == 42
    assert kv.get(JOB, b"n") == b"42"


def test_add_with_zero_reads_the_counter(kv: KeyValueStore) -> None:
    kv.add(JOB, b"n", 3)
    assert kv.add(JOB, b"n", 0) == 3
    assert kv.add(JOB, b"missing", 0) == 0
    assert kv.get(JOB, b"missing") == b"0"


def test_add_accepts_negative_amounts_and_goes_below_zero(kv: KeyValueStore) -> None:
    kv.add(JOB, b"n", 2)
    assert kv.add(JOB, b"n", -5) == -3
    assert kv.get(JOB, b"n") == b"-3"
    assert kv.add(JOB, b"n", 3) == 0


def test_add_continues_from_a_decimal_value_written_by_set(kv: KeyValueStore) -> None:
    kv.set(JOB, b"n", b"10")
    assert kv.add(JOB, b"n", 1) == 11
    kv.set(JOB, b"m", b"-4")
    assert kv.add(JOB, b"m", 1) == -3


@pytest.mark.parametrize("value", [b"abc", b"", b"1.5", b"\xff\xfe", b"12abc"])
def test_add_on_a_non_integer_value_is_not_an_integer_and_changes_nothing(kv: KeyValueStore, value: bytes) -> None:
    kv.set(JOB, b"k", value)
    kv.set(JOB, b"other", b"x")
    before = frozen(kv)
    with pytest.raises(NotAnInteger) as info:
        kv.add(JOB, b"k", 1)
    assert info.value.code == "not_an_integer"
    assert kv.get(JOB, b"k") == value
    assert kv.to_snapshot() == before


# -- compare_set -------------------------------------------------------------------------------


def test_compare_set_on_a_missing_key_with_empty_expected_sets_desired(kv: KeyValueStore) -> None:
    assert kv.compare_set(JOB, b"k", b"", b"new") == b"new"
    assert kv.get(JOB, b"k") == b"new"


def test_compare_set_on_a_missing_key_with_nonempty_expected_returns_expected_and_leaves_it_missing(
    kv: KeyValueStore,
) -> None:
    assert kv.compare_set(JOB, b"k", b"old", b"new") == b"old"
    assert kv.get(JOB, b"k") is None
    assert kv.check(JOB, [b"k"]) is False
    assert kv.num_keys(JOB) == 0


def test_compare_set_swaps_when_the_current_value_matches(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"old")
    assert kv.compare_set(JOB, b"k", b"old", b"new") == b"new"
    assert kv.get(JOB, b"k") == b"new"


def test_compare_set_on_mismatch_returns_the_current_value_and_changes_nothing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"current")
    before = frozen(kv)
    assert kv.compare_set(JOB, b"k", b"other", b"new") == b"current"
    assert kv.get(JOB, b"k") == b"current"
    assert kv.to_snapshot() == before


def test_compare_set_with_empty_expected_does_not_match_an_existing_value(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"v")
    assert kv.compare_set(JOB, b"k", b"", b"new") == b"v"
    assert kv.get(JOB, b"k") == b"v"


def test_compare_set_matches_an_existing_empty_value(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"")
    assert kv.compare_set(JOB, b"k", b"", b"new") == b"new"
    assert kv.get(JOB, b"k") == b"new"


# -- append ----------------------------------------------------------------------------------


def test_append_creates_a_missing_key(kv: KeyValueStore) -> None:
    kv.append(JOB, b"k", b"abc")
    assert kv.get(JOB, b"k") == b"abc"


def test_append_concatenates(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"ab")
    kv.append(JOB, b"k", b"cd")
    kv.append(JOB, b"k", b"")
    kv.append(JOB, b"k", b"e")
    assert kv.get(JOB, b"k") == b"abcde"


# -- multi_get / multi_set / check ------------------------------------------------------------


def test_multi_get_returns_values_in_the_order_asked(kv: KeyValueStore) -> None:
    kv.set(JOB, b"a", b"1")
    kv.set(JOB, b"b", b"2")
    assert kv.multi_get(JOB, [b"b", b"a", b"b"]) == [b"2", b"1", b"2"]


def test_multi_get_is_none_while_any_key_is_missing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"a", b"1")
    assert kv.multi_get(JOB, [b"a", b"b"]) is None
    assert kv.multi_get(7, [b"a"]) is None
    kv.set(JOB, b"b", b"2")
    assert kv.multi_get(JOB, [b"a", b"b"]) == [b"1", b"2"]


def test_multi_get_of_no_keys_is_an_empty_list(kv: KeyValueStore) -> None:
    assert kv.multi_get(JOB, []) == []


def test_multi_set_sets_every_pair(kv: KeyValueStore) -> None:
    kv.set(JOB, b"a", b"old")
    kv.multi_set(JOB, [b"a", b"b", b"c"], [b"1", b"2", b"3"])
    assert kv.multi_get(JOB, [b"a", b"b", b"c"]) == [b"1", b"2", b"3"]


def test_check_is_true_only_when_every_key_exists(kv: KeyValueStore) -> None:
    assert kv.check(JOB, []) is True
    kv.set(JOB, b"a", b"1")
    assert kv.check(JOB, [b"a"]) is True
    assert kv.check(JOB, [b"a", b"b"]) is False
    kv.set(JOB, b"b", b"")
    assert kv.check(JOB, [b"a", b"b"]) is True


# -- delete / num_keys / list_keys --------------------------------------------------------------


def test_delete_key_removes_it_and_says_whether_it_existed(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"v")
    assert kv.delete_key(JOB, b"k") is True
    assert kv.get(JOB, b"k") is None
    assert kv.delete_key(JOB, b"k") is False
    assert kv.delete_key(9, b"k") is False


def test_num_keys_counts_the_keys_of_one_space(kv: KeyValueStore) -> None:
    assert kv.num_keys(JOB) == 0
    kv.set(JOB, b"a", b"1")
    kv.add(JOB, b"b", 1)
    kv.append(JOB, b"c", b"x")
    kv.set(1, b"a", b"1")
    assert kv.num_keys(JOB) == 3
    assert kv.num_keys(1) == 1
    kv.delete_key(JOB, b"a")
    assert kv.num_keys(JOB) == 2


def test_list_keys_returns_the_keys_with_the_prefix_sorted(kv: KeyValueStore) -> None:
    for key in [b"w/3", b"w/1", b"x/1", b"w/2", b"w"]:
        kv.set(JOB, key, b"")
    assert kv.list_keys(JOB, b"w/") == [b"w/1", b"w/2", b"w/3"]
    assert kv.list_keys(JOB, b"w") == [b"w", b"w/1", b"w/2", b"w/3"]
    assert kv.list_keys(JOB, b"") == [b"w", b"w/1", b"w/2", b"w/3", b"x/1"]
    assert kv.list_keys(JOB, b"zzz") == []
    assert kv.list_keys(4, b"") == []


# -- key spaces ------------------------------------------------------------------------------------


def test_key_spaces_are_isolated(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"job")
    kv.set(1, b"k", b"round1")
    kv.set(2, b"k", b"round2")
    assert kv.get(JOB, b"k") == b"job"
    assert kv.get(1, b"k") == b"round1"
    assert kv.get(2, b"k") == b"round2"
    kv.add(1, b"n", 5)
    assert kv.get(2, b"n") is None
    assert kv.get(JOB, b"n") is None
    kv.delete_key(2, b"k")
    assert kv.get(1, b"k") == b"round1"
    assert kv.list_keys(1, b"") == [b"k", b"n"]
    assert kv.list_keys(2, b"") == []
    assert kv.check(JOB, [b"n"]) is False
    assert kv.total_keys() == 3


def test_round_zero_is_a_key_space_distinct_from_the_job_space(kv: KeyValueStore) -> None:
    kv.set(0, b"k", b"round0")
    assert kv.get(JOB, b"k") is None
    kv.set(JOB, b"k", b"job")
    assert kv.get(0, b"k") == b"round0"


def test_drop_rounds_before_forgets_older_rounds_and_keeps_the_job_space(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"job")
    for round_ in range(4):
        kv.set(round_, b"k", str(round_).encode())
    kv.drop_rounds_before(2)
    assert kv.get(JOB, b"k") == b"job"
    assert kv.get(0, b"k") is None
    assert kv.get(1, b"k") is None
    assert kv.get(2, b"k") == b"2"
    assert kv.get(3, b"k") == b"3"
    assert kv.total_keys() == 3


# -- the value size limit ---------------------------------------------------------------------------


def test_set_up_to_the_limit_is_accepted(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"x" * LIMIT)
    assert kv.get(JOB, b"k") == b"x" * LIMIT


def test_set_past_the_limit_is_value_too_large_and_changes_nothing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"old")
    before = frozen(kv)
    with pytest.raises(ValueTooLarge) as info:
        kv.set(JOB, b"k", b"x" * (LIMIT + 1))
    assert info.value.code == "value_too_large"
    assert info.value.status == 413
    assert kv.get(JOB, b"k") == b"old"
    assert kv.to_snapshot() == before


def test_append_may_not_grow_a_value_past_the_limit(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"x" * (LIMIT - 2))
    kv.append(JOB, b"k", b"yy")
    before = frozen(kv)
    with pytest.raises(ValueTooLarge):
        kv.append(JOB, b"k", b"z")
    assert kv.get(JOB, b"k") == b"x" * (LIMIT - 2) + b"yy"
    assert kv.to_snapshot() == before


def test_append_creating_a_key_past_the_limit_changes_nothing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"other", b"v")
    before = frozen(kv)
    with pytest.raises(ValueTooLarge):
        kv.append(5, b"k", b"x" * (LIMIT + 1))
    assert kv.get(5, b"k") is None
    assert kv.to_snapshot() == before


def test_compare_set_past_the_limit_is_value_too_large_and_changes_nothing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"old")
    before = frozen(kv)
    with pytest.raises(ValueTooLarge):
        kv.compare_set(JOB, b"k", b"old", b"x" * (LIMIT + 1))
    assert kv.get(JOB, b"k") == b"old"
    assert kv.to_snapshot() == before


def test_compare_set_creating_a_key_past_the_limit_changes_nothing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"other", b"v")
    before = frozen(kv)
    with pytest.raises(ValueTooLarge):
        kv.compare_set(5, b"k", b"", b"x" * (LIMIT + 1))
    assert kv.get(5, b"k") is None
    assert kv.to_snapshot() == before


def test_compare_set_mismatch_does_not_check_the_size_of_desired(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"current")
    assert kv.compare_set(JOB, b"k", b"other", b"x" * (LIMIT + 1)) == b"current"
    assert kv.compare_set(JOB, b"missing", b"other", b"x" * (LIMIT + 1)) == b"other"


def test_multi_set_with_one_value_past_the_limit_sets_nothing(kv: KeyValueStore) -> None:
    kv.set(JOB, b"a", b"old")
    before = frozen(kv)
    with pytest.raises(ValueTooLarge):
        kv.multi_set(JOB, [b"a", b"b", b"c"], [b"1", b"2", b"x" * (LIMIT + 1)])
    assert kv.get(JOB, b"a") == b"old"
    assert kv.get(JOB, b"b") is None
    assert kv.to_snapshot() == before


def test_multi_set_into_a_new_space_past_the_limit_changes_nothing(kv: KeyValueStore) -> None:
    before = frozen(kv)
    with pytest.raises(ValueTooLarge):
        kv.multi_set(3, [b"a"], [b"x" * (LIMIT + 1)])
    assert kv.to_snapshot() == before


# -- snapshot ------------------------------------------------------------------------------------------


def test_snapshot_round_trip_keeps_every_space_and_value(kv: KeyValueStore) -> None:
    kv.set(JOB, b"k", b"job")
    kv.add(JOB, b"n", 41)
    kv.set(0, b"k", b"\x00round0")
    kv.multi_set(7, [b"a", b"b"], [b"1", b""])
    snapshot = kv.to_snapshot()
    restored = KeyValueStore.from_snapshot(copy.deepcopy(snapshot), LIMIT)
    assert restored.to_snapshot() == snapshot
    assert restored.get(JOB, b"k") == b"job"
    assert restored.add(JOB, b"n", 1) == 42
    assert restored.get(0, b"k") == b"\x00round0"
    assert restored.multi_get(7, [b"a", b"b"]) == [b"1", b""]
    assert restored.list_keys(7, b"") == [b"a", b"b"]
    assert restored.max_value_bytes == LIMIT


def test_snapshot_round_trip_accepts_lists_for_pairs(kv: KeyValueStore) -> None:
    """A snapshot that went through msgpack comes back with lists where tuples were."""
    kv.set(JOB, b"k", b"v")
    kv.set(2, b"r", b"w")
    as_lists = [[scope, [list(pair) for pair in items]] for scope, items in kv.to_snapshot()]  # type: ignore[attr-defined]
    restored = KeyValueStore.from_snapshot(as_lists, LIMIT)
    assert restored.to_snapshot() == kv.to_snapshot()


def test_restored_store_enforces_its_new_limit() -> None:
    kv = KeyValueStore.from_snapshot([[None, [(b"k", b"v")]]], max_value_bytes=2)
    with pytest.raises(ValueTooLarge):
        kv.set(None, b"k", b"xyz")
