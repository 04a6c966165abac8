"""Event lines: one per event, parseable, injection-proof, journald-aware, throttled."""

from __future__ import annotations

import io
import logging
import os
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.protocol.log import Throttle, configure, format_fields, log_event, parse_line


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    configure(level="info", stream=out, journald=False)
    yield out
    logging.getLogger("scratchd").handlers.clear()


def _parse(line: str) -> dict[str, str]:
    return parse_line(line)


def test_one_line_per_event_with_timestamp_and_level(stream: io.StringIO) -> None:
    log_event("worker_died", logging.WARNING, worker=1, pid=4711, cause="SIGKILL")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    fields = _parse(lines[0])
    assert fields == {
        "level": "warning",
        "event": "worker_died",
        "worker": "1",
        "pid": "4711",
        "cause": "SIGKILL",
    }
    assert lines[0].split(" ", 1)[0].endswith("Z")


def test_hostile_values_cannot_forge_lines_or_keys(stream: io.StringIO) -> None:
    log_event("access_refused", reason='x\nevent=ready forged="1"', part="a b")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    fields = _parse(lines[0])
    assert fields["event"] == "access_refused"
    assert "forged" not in fields
    assert fields["part"] == "a b"


def test_debug_events_are_off_by_default(stream: io.StringIO) -> None:
    log_event("request", logging.DEBUG, id=1)
    assert stream.getvalue() == ""


def test_journald_lines_carry_the_syslog_priority() -> None:
    out = io.StringIO()
    configure(stream=out, journald=True)
    log_event("drain", logging.WARNING, pending=3)
    log_event("ready")
    assert out.getvalue().splitlines() == ["<4>event=drain pending=3", "<6>event=ready"]


def test_journald_is_detected_from_journal_stream() -> None:
    with tempfile.TemporaryFile("w+") as out:
        st = os.fstat(out.fileno())
        old = os.environ.get("JOURNAL_STREAM")
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        try:
            configure(stream=out)
            log_event("start", pid=1)
        finally:
            if old is None:
                del os.environ["JOURNAL_STREAM"]
            else:
                os.environ["JOURNAL_STREAM"] = old
        out.seek(0)
        assert out.read() == "<6>event=start pid=1\n"


def test_unknown_level_is_an_error() -> None:
    with pytest.raises(ValueError, match="verbose"):
        configure(level="verbose", stream=io.StringIO())


def test_throttle_keeps_a_burst_then_summarises(stream: io.StringIO) -> None:
    throttle = Throttle("malformed_frame", burst=3, window=10.0)
    written = [throttle.log(now=float(i) / 100, conn=i) for i in range(50)]
    assert written == [True] * 3 + [False] * 47
    assert throttle.log(now=11.0, conn=99)  # a new window: summary first, then the line
    events = [_parse(line)["event"] for line in stream.getvalue().splitlines()]
    assert events == ["malformed_frame"] * 3 + ["malformed_frame_suppressed", "malformed_frame"]
    assert "count=47" in stream.getvalue()


@given(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), st.text(max_size=30)))
def test_any_value_round_trips_on_one_line(fields: dict[str, str]) -> None:
    fields.pop("event", None)
    line = format_fields("evt", fields)
    assert "\n" not in line
    assert _parse(line) == {"event": "evt", **fields}
