"""`scratchd status`: the operator's view of a running daemon (rich), and its JSON shape.

The daemon answers a status request with one `StatusReply` (scratchd.protocol.wire); `--json`
prints it as one JSON line, the default renders it with rich, `--watch` re-fetches and
re-renders. The keys this view reads (* = guaranteed by the daemon, the rest shown when
present):

    {
      "state": "serving", "pid": 7335, "backend": "cpu", "uptime_s": 12.5,
      "model_version": "...", "model_views": ["identity", ...],   test-time views in use
      "workers"*:  [{"id", "name", "pid", "state", "device", "restarts", "requests",
                     "batches", "batch_size_mean", "compute_ms_p50", "model_version"}, ...],
      "queue"*:    {"depth": [n0, ..., n7], "slots", "in_use", "in_flight"},
      "latency"*:  {"<part class>": {"p50_ms", "p99_ms", "count", "deadline_ms"}, ...},
      "throughput": {"rps", "by_status": {"ok": x, "timeout": x, ...}},
      "drift"*:    {"score", "threshold", "over_threshold", "window", "samples", "warming_up"},
      "entropy"*:  {"bits", "window", "samples", "warming_up"},
      "requests": {"ok": n, ...}          replies since start, by status
    }

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

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from scratchd.protocol.wire import PRIORITIES

REQUIRED_KEYS = ("workers", "queue", "latency", "drift", "entropy")
StatusDoc = Mapping[str, Any]


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


def render_workers(workers: list[Mapping[str, Any]]) -> Table:
    table = Table(title="workers", title_justify="left", expand=False)
    # Each worker's model version (it changes worker by worker during a reload), when the
    # daemon reports one.
    models = any(w.get("model_version") for w in workers)
    for col in ("worker", "device", "state", "pid", "restarts", "requests", "batches", "batch",
                "compute", *(("model",) if models else ())):  # fmt: skip
        left = col in ("worker", "device", "state", "model")
        table.add_column(col, justify="left" if left else "right")
    for w in workers:
        state = str(w.get("state", "?"))
        table.add_row(
            str(w.get("name", w.get("id", "?"))),
            str(w.get("device", "?")),
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
        table.add_row("-", "-", Text("none", style="red"), *["-"] * 6)
    return table


def render_queue(queue: Any) -> Table:
    depths = queue_depths(queue)
    table = Table(title="queue depth by priority (7 = most urgent)", title_justify="left")
    for priority in range(PRIORITIES):
        table.add_column(str(priority), justify="right")
    extra = ("in_flight", "in_use", "slots")
    for col in extra:
        table.add_column(col.replace("_", " "), justify="right")
    info = queue if isinstance(queue, Mapping) else {}
    table.add_row(
        *(str(depths.get(p, 0)) for p in range(PRIORITIES)), *(_fmt(info.get(c)) for c in extra)
    )
    return table


def render_latency(latency: Mapping[str, Mapping[str, Any]]) -> Table:
    table = Table(title="latency by part class (sliding window)", title_justify="left")
    for col in ("class", "p50", "p99", "deadline", "requests"):
        table.add_column(col, justify="left" if col == "class" else "right")
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
        render_workers(list(doc.get("workers", []))),
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
