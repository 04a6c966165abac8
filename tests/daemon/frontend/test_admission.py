"""A request's class, priority and deadline: the class's unless the request sets its own,
and every value out of range refused with a reason that names it."""

from __future__ import annotations

import pytest

from scratchd.daemon.config import MAX_DEADLINE_MS, Config
from scratchd.daemon.frontend.admission import Admission, PartClasses
from scratchd.daemon.frontend.images import Invalid
from scratchd.protocol.wire import InferRequest


def test_a_request_gets_its_class_values_unless_it_sets_its_own() -> None:
    config = Config()
    classes = PartClasses(config)
    safety = config.classes["safety"]
    index = config.class_names().index("safety")
    got = classes.classify(InferRequest(id=1, part_class="safety"))
    assert got == Admission("safety", index, safety.priority, safety.deadline_ms)
    own = classes.classify(InferRequest(id=1, part_class="safety", priority=2, deadline_ms=5))
    assert (own.priority, own.deadline_ms) == (2, 5)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"part_class": "bracket"}, "unknown part class 'bracket'; configured: "),
        ({"priority": 8}, "priority 8 outside 0..7"),
        ({"priority": -1}, "priority -1 outside 0..7"),
        ({"deadline_ms": 0}, "deadline_ms must be positive, got 0"),
        ({"deadline_ms": MAX_DEADLINE_MS + 1}, "exceeds the maximum"),
    ],
)
def test_out_of_range_values_are_refused_by_name(fields: dict[str, object], reason: str) -> None:
    with pytest.raises(Invalid, match=reason):
        PartClasses(Config()).classify(InferRequest(id=1, **fields))  # type: ignore[arg-type]
