"""The API's presentation of core's plain data (``api/document.py``): the sentence of a round
that is still open, and the entries of the events and cordons documents. Core hands out the
facts (``Pending``, ``JobEvent``, ``Cordon``); the words and the field names are the API's."""

from __future__ import annotations

from rdzv_server.api.document import cordon_entry, event_entry, events_document, pending_reason
from rdzv_server.core.cordon import Cordon
from rdzv_server.core.event import Cause, EventPage, JobEvent, Kind
from rdzv_server.core.rendezvous import Pending


def test_a_round_not_open_has_no_pending_reason() -> None:
    assert pending_reason(None) is None


def test_below_min_nodes_the_reason_is_the_count_alone() -> None:
    pending = Pending(in_line=1, min_nodes=2, max_nodes=4, members_expected=3, last_call_left=None)
    assert pending_reason(pending) == "waiting for min_nodes: 1 of 2 joined"


def test_previous_members_and_the_last_call_are_both_said_in_that_order() -> None:
    one = Pending(in_line=2, min_nodes=2, max_nodes=4, members_expected=1, last_call_left=None)
    assert pending_reason(one) == "waiting for 1 previous member to re-join"
    both = Pending(in_line=3, min_nodes=2, max_nodes=4, members_expected=2, last_call_left=12.34)
    assert pending_reason(both) == (
        "waiting for 2 previous members to re-join; last call ends in 12.3 s (3 of up to 4 joined)"
    )
    ended = Pending(in_line=3, min_nodes=2, max_nodes=4, members_expected=0, last_call_left=0.0)
    assert pending_reason(ended) == "last call ends in 0.0 s (3 of up to 4 joined)"


def test_an_open_round_with_nothing_to_wait_for_has_no_reason() -> None:
    assert pending_reason(Pending(in_line=2, min_nodes=2, max_nodes=4, members_expected=0, last_call_left=None)) is None


def test_an_event_entry_spells_its_fields_then_its_details() -> None:
    event = JobEvent(7, 1.5, Kind.NODE_DEPARTED, Cause.LEFT, 2, "a", "10.0.0.1", {"role": "member"})
    entry = event_entry(event)
    assert list(entry) == ["seq", "time", "kind", "cause", "round", "node_id", "addr", "role"]
    assert entry == {"seq": 7, "time": 1.5, "kind": "node_departed", "cause": "left", "round": 2,
                     "node_id": "a", "addr": "10.0.0.1", "role": "member"}  # fmt: skip
    page = events_document("job", EventPage([event], 3, 8, 9.0))
    assert page == {"rdzv_id": "job", "first_seq": 3, "next_seq": 8, "now": 9.0, "events": [entry]}


def test_a_cordon_entry_says_how_long_it_still_runs() -> None:
    timed = Cordon("node7", 10.0, 70.0, "bad DIMM", "operator")
    assert cordon_entry(timed, 20.0) == {
        "host": "node7", "since": 10.0, "until": 70.0, "left_s": 50.0, "reason": "bad DIMM", "by": "operator"
    }
    assert cordon_entry(timed, 80.0)["left_s"] == 0.0
    assert cordon_entry(Cordon("h", 1.0, None, "", "flapping"), 5.0)["left_s"] is None
