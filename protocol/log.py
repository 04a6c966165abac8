"""One structured line per event that matters, on stderr, readable by people and by journald.

A line is ``key=value`` pairs, the event name first::

    event=ready workers=2 backend=cpu socket=/run/scratchd/scratchd.sock
    event=worker_died worker=1 pid=4711 cause=SIGKILL requeued=3
    event=access_refused uid=1001 gid=1001 pid=5150 reason="peer uid=1001 … not in …"

Values with spaces, quotes, ``=`` or control characters are double-quoted with JSON escapes,
so a hostile string (a part class, a refusal reason) can never forge a second line or key.
Under systemd (``JOURNAL_STREAM`` names our stderr) each line starts with the syslog
priority prefix ``<N>`` that journald turns into the entry's priority and the timestamp is
left to the journal; in a terminal an ISO-8601 UTC timestamp and ``level=`` lead instead.

The daemon and its worker processes write the same lines to the stderr they share (a
worker calls :func:`configure` first thing), which is why this module sits below both.
What is logged: start, ready, each worker's boot (``event=worker_booted`` with its parts in
ms) or boot failure, worker death and its cause, restart, reload, drain, refusals. Nothing
per request unless the level is DEBUG (``SCRATCHD_LOG_LEVEL=debug``): a line per part at
line rate would drown the journal.
Floods of one event (refusals, malformed frames from a broken gateway) go through
:class:`Throttle`, which keeps the first lines of each window and then one summary.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, TextIO

LOGGER_NAME = "scratchd"

_SYSLOG_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def format_value(value: object) -> str:
    """One value as it appears after ``key=``: bare when safe, else a JSON string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if text and all(c.isprintable() and c not in ' "=\\' for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)


def format_fields(event: str, fields: dict[str, Any]) -> str:
    parts = [f"event={format_value(event)}"]
    parts.extend(f"{key}={format_value(value)}" for key, value in fields.items())
    return " ".join(parts)


def parse_line(line: str) -> dict[str, str]:
    """The fields of one event line (the inverse of :func:`format_fields`), for tests and tools.

    A leading ``<N>`` priority, timestamp or ``level=`` is kept as fields where present
    (``level``) or skipped (priority, timestamp).
    """
    fields: dict[str, str] = {}
    decoder = json.JSONDecoder()
    pos = 0
    if line.startswith("<") and ">" in line[:4]:
        pos = line.index(">") + 1
    while pos < len(line):
        end_key = line.find("=", pos)
        space = line.find(" ", pos)
        if end_key < 0 or (0 <= space < end_key):  # a bare token (the timestamp): skip it
            pos = len(line) if space < 0 else space + 1
            continue
        key, pos = line[pos:end_key], end_key + 1
        if line.startswith('"', pos):
            value, pos = decoder.raw_decode(line, pos)
        else:
            space = line.find(" ", pos)
            space = len(line) if space < 0 else space
            value, pos = line[pos:space], space
        fields[key] = value
        pos += 1  # the separating space
    return fields


def _under_journald(stream: TextIO) -> bool:
    """True when ``stream`` is the journal stream systemd connected (``JOURNAL_STREAM``)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


class KeyValueFormatter(logging.Formatter):
    """Renders records made by :func:`log_event` (and plain ones, as ``msg=``)."""

    def __init__(self, journald: bool) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "event", None)
        fields: dict[str, Any] = getattr(record, "fields", {})
        if event is None:
            event, fields = "message", {"msg": record.getMessage(), "logger": record.name}
        if record.exc_info:
            fields = {**fields, "exc": self.formatException(record.exc_info)}
        line = format_fields(event, fields)
        if self.journald:
            return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{line}"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        millis = int(record.msecs)
        return f"{stamp}.{millis:03d}Z level={record.levelname.lower()} {line}"


def configure(
    level: str | int | None = None, stream: TextIO | None = None, journald: bool | None = None
) -> logging.Logger:
    """Send scratchd's events to ``stream`` (stderr); idempotent, the last call wins.

    ``level`` defaults to ``SCRATCHD_LOG_LEVEL`` or INFO; ``journald`` to auto-detection.
    """
    stream = sys.stderr if stream is None else stream
    if level is None:
        level = os.environ.get("SCRATCHD_LOG_LEVEL", "info")
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ValueError(f"unknown log level {level!r} (debug, info, warning, error)")
        level = resolved
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        KeyValueFormatter(_under_journald(stream) if journald is None else journald)
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event line: ``log_event("worker_died", logging.WARNING, worker=1, cause=…)``."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"event": event, "fields": fields})


class Throttle:
    """At most ``burst`` lines of one event per ``window`` seconds, then one summary line.

    The summary (``event=<name>_suppressed count=N``) is written when the next line of that
    event arrives after the window, so a flood costs ``burst + 1`` lines per window and a
    quiet period costs nothing.
    """

    def __init__(self, event: str, burst: int = 10, window: float = 60.0) -> None:
        self.event = event
        self.burst = burst
        self.window = window
        self._window_start = -float("inf")
        self._emitted = 0
        self.suppressed = 0

    def log(self, level: int = logging.INFO, now: float | None = None, **fields: Any) -> bool:
        """Log unless over budget; True when the line was written."""
        now = time.monotonic() if now is None else now
        if now - self._window_start >= self.window:
            if self.suppressed:
                log_event(f"{self.event}_suppressed", logging.WARNING, count=self.suppressed)
            self._window_start, self._emitted, self.suppressed = now, 0, 0
        if self._emitted >= self.burst:
            self.suppressed += 1
            return False
        self._emitted += 1
        log_event(self.event, level, **fields)
        return True
