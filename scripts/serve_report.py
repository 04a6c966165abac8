"""How ``bench_serve.py`` shows its results: the console table and the markdown section.

``rewrite_section`` replaces what lies between ``<!-- bench_serve_gpu: start -->`` and
``<!-- bench_serve_gpu: end -->`` (or another section's markers) in a markdown file (the
section is appended when the file has none), so re-running the benchmark never touches the
other benchmarks' sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import serve_load as sl

SECTION: Final = "bench_serve_gpu"


def markers(section: str = SECTION) -> tuple[str, str]:
    return f"<!-- {section}: start -->", f"<!-- {section}: end -->"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def _busy(row: dict[str, Any]) -> str:
    nvml = row.get("gpu_busy_nvml") or {}
    compute = row.get("compute_busy") or {}
    parts = [f"{d} {v:g} %" for d, v in nvml.items()]
    parts += [f"{d} {100 * v:.0f} %" for d, v in compute.items()]
    return ", ".join(parts) or "—"


def _main_cpu(row: dict[str, Any]) -> str:
    if "main_cpu_share" not in row:
        return "—"
    return f"{100 * row['main_cpu_share']:.0f} % · {row['main_cpu_us_per_request']:g} µs"


def _parts(row: dict[str, Any]) -> str:
    """The daemon's p50 queue / device / in-daemon times of the ok replies (ms)."""
    parts = row.get("parts") or {}
    if parts.get(f"{sl.PARTS[-1]}_p50") is None:
        return "—"
    return " / ".join(_ms(parts[f"{key}_p50"]) for key in sl.PARTS)


def print_table(doc: dict[str, Any]) -> None:
    if "open_loop" in doc:
        print_raw_table(doc)
        return
    head = f"{'load':<16}{'sent':>6}{'ok/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}"
    print(head + f"{'lost':>6}  statuses")
    for r in doc["loads"]:
        print(
            f"{r['load']:<16}{r['sent']:>6}{r['throughput_ok_per_s']:>8}{r['p50_ms']!s:>9}"
            f"{r['p99_ms']!s:>9}{r['p99_9_ms']!s:>10}{r['lost']:>6}  {r['statuses']}"
        )
    for r in doc["restarts"]:
        if "worker" in r:
            print(
                f"restart after kill -9: {r['worker']} {r['restart_s'] * 1000:.0f} ms"
                f" ({r['replaced_by']})"
            )
        else:
            print(f"background load during kills: {r}")


def print_raw_table(doc: dict[str, Any]) -> None:
    print(f"{doc['device']}, {doc['date']}")
    head = f"{'load':<28}{'sent':>7}{'ok/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}"
    print(head + f"{'lost':>6}{'late p99':>10}{'main CPU':>18}{'q/gpu/daemon p50':>22}  busy")
    rows = [*doc["open_loop"], doc["burst"]]
    if doc["kill_run"].get("sent"):
        rows.append(doc["kill_run"])
    for r in rows:
        print(
            f"{r['load']:<28}{r['sent']:>7}{r['throughput']:>9}{_ms(r['p50_ms']):>9}"
            f"{_ms(r['p99_ms']):>9}{_ms(r['p999_ms']):>10}{r['lost']:>6}"
            f"{_ms(r['late_p99_ms']):>10}{_main_cpu(r):>18}{_parts(r):>22}  {_busy(r)} "
            f"{r['statuses']}"
        )
    for k in doc["kill_run"].get("kills", []):
        took = f"{k['restart_s'] * 1000:.0f} ms"
        print(f"restart after kill -9: {k['worker']} {took} ({k['replaced_by']}){_back(doc, k)}")
    if doc["kill_run"].get("kills"):
        print(f"lost under kill: {doc['lost_under_kill']}")
    timeline = doc["kill_run"].get("timeline", [])
    if timeline:
        at, width = [k["at_s"] for k in doc["kill_run"]["kills"]], bin_s(doc)
        print(
            "kill run by scheduled send time (s: sent, p50/p99/max ms of ok, "
            "queue slots in use (max), standbys READY (min), statuses):"
        )
        for b in timeline:
            mark = " <- kill -9" if any(b["t_s"] <= a < b["t_s"] + width for a in at) else ""
            print(
                f"  {b['t_s']:6.1f}  {b['sent']:5}  {_ms(b['p50_ms'])}/{_ms(b['p99_ms'])}/"
                f"{_ms(b['max_ms'])}  q {b.get('queue_in_use_max')} sb "
                f"{b.get('standbys_ready_min')}  {b['statuses']}{mark}"
            )


def bin_s(doc: dict[str, Any]) -> float:
    """The kill run's timeline bins' width (records before it was written: 0.5 s)."""
    return float(doc["kill_run"].get("timeline_bin_s", 0.5))


RECOVERED_P99_MS = 20.0
"""A kill run's bin is back to normal when its p99 is within this (the default
``--until-p99-ms`` rate-search limit) and every request due in it was answered ok."""


def recovered_after(timeline: list[dict[str, Any]], at_s: float, width: float) -> float | None:
    """Seconds from a kill at ``at_s`` to the end of the first bin after it that is normal
    again (p99 ≤ ``RECOVERED_P99_MS``, every request due in it answered ok): how long the
    line felt the kill, at the bins' resolution (``width`` s). None if no later bin is
    normal."""
    for b in timeline:
        if b["t_s"] >= at_s and _normal(b):
            return round(b["t_s"] + width - at_s, 3)
    return None


def _normal(b: dict[str, Any]) -> bool:
    p99 = b["p99_ms"]
    return p99 is not None and p99 <= RECOVERED_P99_MS and set(b["statuses"]) == {"ok"}


def _back(doc: dict[str, Any], kill: dict[str, Any]) -> str:
    timeline = doc["kill_run"].get("timeline", [])
    if not timeline or "at_s" not in kill:
        return ""
    back = recovered_after(timeline, kill["at_s"], bin_s(doc))
    return (
        f", latency normal again after {back:.1f} s" if back is not None else ", never normal again"
    )


def record_markdown(doc: dict[str, Any], json_path: str, section: str = SECTION) -> str:
    """The section for ``docs/benchmarks.md``: one table row per load, then the kills."""
    daemon, machine = doc["daemon"], doc["machine"]
    views = daemon.get("views", "the model's")
    start, end = markers(section)
    lines = [
        start,
        f"## Serving end to end (`scripts/bench_serve.py`, {doc['device']}, {doc['date']})",
        "",
        f"Daemon backend `{daemon['backend']}`, model views: {views}, `queue.max_batch` "
        f"{daemon.get('max_batch', '?')}; {daemon['images']}; open-loop load from "
        f"{daemon['clients']} client processes over the Unix socket, {daemon['duration_s']:g} s "
        f"per load; latency from each request's scheduled send to its reply (ok replies). "
        f"`late p99`: the generator's own lateness (send start − schedule). Main CPU: the "
        f"daemon's main process (acceptor, dispatcher, metrics, supervisor), share of one "
        f"core and its CPU time (background work included) per request sent. Busy: "
        f"{doc['gpu_busy_source']}. Load average before/after: "
        f"{machine['loadavg_1m_before']}/{machine['loadavg_1m_after']} on "
        f"{machine['cpus']} cores. Daemon p50: the daemon's own timings of the ok replies, "
        f"queue (enqueue → claim) / gpu (the batch's device time, CUDA events) / daemon "
        f"(frame received → reply written); the rest of the latency is the socket. "
        f"JSON: `{json_path}`.",
        "",
        "| load | sent | ok/s | p50 ms | p99 ms | p99.9 ms | lost | late p99 ms | main CPU "
        "| daemon p50 ms (queue / gpu / daemon) | busy | statuses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    rows = [*doc["open_loop"], doc["burst"]]
    if doc["kill_run"].get("sent"):
        rows.append(doc["kill_run"])
    for r in rows:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))
        lines.append(
            f"| {r['load']} | {r['sent']} | {r['throughput']:g} | {_ms(r['p50_ms'])} | "
            f"{_ms(r['p99_ms'])} | {_ms(r['p999_ms'])} | {r['lost']} | "
            f"{_ms(r['late_p99_ms'])} | {_main_cpu(r)} | {_parts(r)} | {_busy(r)} | {statuses} |"
        )
    kills = doc["kill_run"].get("kills", [])
    if kills:
        each = ", ".join(
            f"{k['worker']} {k['restart_s'] * 1000:.0f} ms ({k['replaced_by']}{_back(doc, k)})"
            for k in kills
        )
        lines += [
            "",
            f"kill -9 → replacement READY: {each}. Lost under kill: {doc['lost_under_kill']}.",
        ]
    lines.append(end)
    return "\n".join(lines) + "\n"


def rewrite_section(path: Path, text_of_section: str, section: str = SECTION) -> None:
    """Put the section (its start … end markers included) in place of the old one, or at
    the end of the file."""
    start, end = markers(section)
    text = path.read_text() if path.exists() else ""
    begin, finish = text.find(start), text.find(end)
    if begin >= 0 and finish > begin:
        text = text[:begin] + text_of_section.rstrip("\n") + text[finish + len(end) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + text_of_section
    path.write_text(text if text.endswith("\n") else text + "\n")
