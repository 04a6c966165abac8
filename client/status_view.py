"""`scratchd status`: the operator's view of a running daemon (rich), and its JSON schema.

The daemon answers a status request with one `StatusReply` (scratchd.protocol.wire);
:func:`status_document` turns it into the document below, which `--json` prints as one JSON
line (`--watch --json`: one a refresh), the default renders with rich and `--watch`
re-renders. The schema of `scratchd status --json` (* = always present; fields are only
ever added):

    {
      "state"*: "serving" (or "draining", ...), "pid"*: 7335, "backend"*: "cpu" | "cuda",
      "uptime_s"*: 12.5,
      "model_version": "scratchnet-1.1",            the model the daemon started with
      "model_views": ["identity", ...],             test-time views in use
      "workers"*:  [{"id", "name", "slot", "pid", "state", "device", "restarts", "requests",
                     "batches", "batch_size_mean", "compute_ms_p50", "model_version",
                     "heartbeat_age_ms"}, ...],
      "standbys"*: [{same keys as a worker}, ...],  warm spares (one per card on CUDA)
      "queue"*:    {"depth": [n0, ..., n7] (index = priority), "slots", "in_use", "in_flight"},
      "classes"*:  {"<part class>": {"priority": 0, "deadline_ms": 3000}, ...},
      "latency"*:  {"<part class>": {"p50_ms", "p99_ms", "count", "deadline_ms"}, ...},
      "throughput"*: {"rps", "by_status": {"ok": x, "timeout": x, ...}},
      "drift"*:    {"score", "threshold", "over_threshold", "window", "samples", "warming_up"},
      "entropy"*:  {"bits", "window", "samples", "warming_up"},
      "requests"*: {"ok": n, ...},                  replies since start, by status
      "reloads"*: n, "reload_error"*: "" | why the last reload failed,
      "reload_needs_restart"*: [dotted keys only a restart applies],
      "refused_connections"*: n, "health_port"*: n, "metrics_port"*: n
    }

The wire's own fields (`id`, `type`) are not part of it, and `standby` (the first card's
spare, also in `standbys`) is left out so each spare appears once.

Latency and throughput are over the daemon's sliding window (60 s), drift and entropy over
the last `drift.window` requests; both are "warming up" (`warming_up`, never
`over_threshold`) until `drift.min_samples` are in it. This module only reads the document:
it never imports the daemon, so `scratchd status` stays quick to start.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from scratchd.protocol.wire import PRIORITIES

REQUIRED_KEYS = ("workers", "queue", "latency", "drift", "entropy")
StatusDoc = Mapping[str, Any]


WIRE_ONLY = ("id", "type", "standby")
"""StatusReply fields that are not in the document: the request id, the message tag, and
the spare that ``standbys`` lists already."""


def status_document(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The documented status (module docstring) from a StatusReply's builtins."""
    doc = {key: value for key, value in reply.items() if key not in WIRE_ONLY}
    classes = reply.get("classes", {})
    doc["classes"] = {
        name: {"priority": priority, "deadline_ms": deadline_ms}
        for name, (priority, deadline_ms) in classes.items()
    }
    return doc


def missing_keys(doc: StatusDoc) -> list[str]:
    return [key for key in REQUIRED_KEYS if key not in doc]


def to_json(doc: StatusDoc) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def queue_depths(queue: Any) -> dict[int, int]:
    """Depth per priority from `{"depth": {...}}`, a plain `{priority: n}` or a list."""
    depth = queue.get("depth", queue) if isinstance(queue, Mapping) else queue
    if isinstance(depth, Mapping):
        items = [(int(k), int(v)) for k, v in depth.items() if str(k).isdigit()]
    else:
        items = [(i, int(v)) for i, v in enumerate(depth or [])]
    return dict(sorted(items))


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 86400}d {s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render_header(doc: StatusDoc) -> Text:
    tp = doc.get("throughput", {})
    line = Text()
    line.append("scratchd ", style="bold")
    state = str(doc.get("state", "?"))
    line.append(state, style="green" if state == "serving" else "bold red")
    line.append(f"  pid {doc.get('pid', '?')}  model {doc.get('model_version') or '?'}")
    views = doc.get("model_views")
    line.append(f"  views {','.join(views)}  " if views else "  ")
    line.append(f"backend {doc.get('backend', '?')}  up {_uptime(doc.get('uptime_s'))}  ")
    line.append(f"{_fmt(tp.get('rps'), ' req/s')}", style="bold")
    by_status = tp.get("by_status", {})
    shown = [f"{s} {r:g}/s" for s, r in by_status.items() if r]
    if shown:
        line.append("  (" + ", ".join(shown) + ")")
    return line


def _table(title: str) -> Table:
    """A table that fits an 80-column terminal: a rule under the header instead of a grid
    (a grid costs three columns a cell), cells that fold rather than end in an ellipsis."""
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )


def _column(table: Table, header: str, left: bool = False) -> None:
    """A column whose header is never cut: at least as wide as its longest word."""
    widest = max(len(word) for word in header.split())
    justify: JustifyMethod = "left" if left else "right"
    table.add_column(header, justify=justify, min_width=widest, overflow="fold")


def render_workers(workers: list[Mapping[str, Any]], model_version: str = "") -> Table:
    """A row per worker. The device column only when a worker is not on the CPU (``cpu0``
    says it all), the model column only when a worker's version is not the header's (during
    and after a reload): the table fits 80 columns without cutting a header."""
    table = _table("workers")
    devices = any(w.get("device", "cpu") != "cpu" for w in workers)
    models = any(w.get("model_version", model_version) != model_version for w in workers)
    columns = (
        "worker",
        *(("device",) if devices else ()),
        "state",
        "pid",
        "restarts",
        "requests",
        "batches",
        "batch",
        "compute",
        *(("model",) if models else ()),
    )
    for col in columns:
        _column(table, col, left=col in ("worker", "device", "state", "model"))
    for w in workers:
        state = str(w.get("state", "?"))
        table.add_row(
            str(w.get("name", w.get("id", "?"))),
            *((str(w.get("device", "?")),) if devices else ()),
            Text(state, style="green" if state == "ready" else "yellow"),
            str(w.get("pid") or "-"),
            Text(str(w.get("restarts", 0)), style="red" if w.get("restarts") else ""),
            _fmt(w.get("requests")),
            _fmt(w.get("batches")),
            _fmt(w.get("batch_size_mean")),
            _fmt(w.get("compute_ms_p50"), " ms"),
            *((str(w.get("model_version") or "-"),) if models else ()),
        )
    if not workers:
        table.add_row("-", Text("none", style="red"), *["-"] * (len(columns) - 2))
    return table


def render_queue(queue: Any) -> Table:
    depths = queue_depths(queue)
    table = _table("queue depth by priority (7 = most urgent)")
    for priority in range(PRIORITIES):
        _column(table, str(priority))
    extra = ("in_flight", "in_use", "slots")
    for col in extra:
        _column(table, col.replace("_", " "))
    info = queue if isinstance(queue, Mapping) else {}
    table.add_row(
        *(str(depths.get(p, 0)) for p in range(PRIORITIES)), *(_fmt(info.get(c)) for c in extra)
    )
    return table


def render_latency(latency: Mapping[str, Mapping[str, Any]]) -> Table:
    table = _table("latency by part class (sliding window)")
    for col in ("class", "p50", "p99", "deadline", "requests"):
        _column(table, col, left=col == "class")
    for part_class, row in sorted(latency.items()):
        p99, deadline = row.get("p99_ms"), row.get("deadline_ms")
        late = p99 is not None and deadline is not None and p99 > deadline
        table.add_row(
            part_class,
            _fmt(row.get("p50_ms"), " ms"),
            Text(_fmt(p99, " ms"), style="bold red" if late else ""),
            _fmt(deadline, " ms"),
            _fmt(row.get("count")),
        )
    if not latency:
        table.add_row("(no requests in the window)", "-", "-", "-", "-")
    return table


def render_signals(drift: Mapping[str, Any], entropy: Mapping[str, Any]) -> Text:
    over = bool(drift.get("over_threshold"))
    line = Text("data drift ")
    score, threshold = _fmt(drift.get("score"), digits=3), _fmt(drift.get("threshold"), digits=2)
    if drift.get("warming_up"):
        line.append("warming up", style="yellow")
    else:
        line.append(f"{score} (threshold {threshold})", style="bold red" if over else "green")
    line.append(f" over {drift.get('samples', 0)}/{drift.get('window', '?')} requests")
    line.append("   output entropy ")
    if entropy.get("warming_up"):
        line.append("warming up", style="yellow")
    else:
        line.append(f"{_fmt(entropy.get('bits'), ' bits', digits=3)}", style="bold")
    line.append(f" over {entropy.get('samples', 0)} answers")
    return line


def render_status(doc: StatusDoc) -> RenderableType:
    return Group(
        render_header(doc),
        render_workers(list(doc.get("workers", [])), str(doc.get("model_version", ""))),
        render_queue(doc.get("queue", {})),
        render_latency(doc.get("latency", {})),
        render_signals(doc.get("drift", {}), doc.get("entropy", {})),
    )


def _render_or_error(fetch: Callable[[], StatusDoc]) -> RenderableType:
    try:
        return render_status(fetch())
    except Exception as exc:  # the daemon may be restarting: say so and keep watching
        when = time.strftime("%H:%M:%S")
        return Panel(f"{when} status unavailable: {exc}", style="red", title="scratchd")


def watch_status(
    fetch: Callable[[], StatusDoc],
    *,
    interval_s: float = 1.0,
    console: Console | None = None,
    iterations: int | None = None,
) -> None:
    """Re-fetch and re-render every `interval_s` until Ctrl-C (or `iterations` refreshes)."""
    console = console or Console()
    with Live(_render_or_error(fetch), console=console, auto_refresh=False) as live:
        done = 1
        try:
            while iterations is None or done < iterations:
                time.sleep(interval_s)
                live.update(_render_or_error(fetch), refresh=True)
                done += 1
        except KeyboardInterrupt:
            pass
