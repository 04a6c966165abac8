"""The connection places' decisions: who is evicted to make room, and when a newcomer is
refused instead."""

from __future__ import annotations

from scratchd.daemon.frontend.places import Caps, Places

CAPS = Caps(total=6, per_uid=5, per_pid=4, silent_s=1.0)


def test_the_flooding_process_makes_room_never_a_lone_idle_gateway_nor_one_that_spoke() -> None:
    places: Places[str] = Places(CAPS)
    assert places.open("gateway", 10, 100, now=0.0).refusal is None  # silent, the oldest
    assert places.open("talker", 10, 101, now=0.0).refusal is None
    places.spoke("talker")
    for k in range(4):
        assert places.open(f"flood{k}", 20, 200, now=1.0).refusal is None
    decision = places.open("client", 10, 102, now=5.0)
    assert decision.refusal is None and decision.evict == ["flood0"]  # oldest of the most
    assert places.is_silent("gateway") and not places.is_silent("talker")
    assert len(places) == 6


def test_a_newcomer_is_refused_while_the_silent_ones_are_young_or_none_are_silent() -> None:
    places: Places[str] = Places(CAPS)
    for k in range(6):
        places.open(f"c{k}", k, 100 + k, now=0.0)
    refused = places.open("late", 9, 999, now=0.5)  # silent for less than silent_s
    assert refused.refusal == "too many connections (limit 6); retry later"
    assert refused.limit == 6 and refused.evict == []
    for k in range(6):
        places.spoke(f"c{k}")
    assert places.open("later", 9, 999, now=100.0).refusal is not None


def test_per_process_and_per_user_caps_name_the_peer_and_evict_only_within() -> None:
    places: Places[str] = Places(CAPS)
    for k in range(4):
        places.open(f"p{k}", 10, 100, now=0.0)
        places.spoke(f"p{k}")
    refused = places.open("p4", 10, 100, now=9.0)
    assert refused.refusal == "too many connections from pid 100 (limit 4 per process); retry later"
    places.open("other", 20, 300, now=0.0)  # silent, old, but of another user
    refused = places.open("q", 10, 101, now=9.0)  # uid 10's fifth
    assert refused.refusal is None and refused.evict == []
    refused = places.open("r", 10, 102, now=9.0)
    assert refused.refusal == "too many connections from uid 10 (limit 5 per user); retry later"
    places.close("p0")
    assert places.open("r", 10, 102, now=9.0).refusal is None
