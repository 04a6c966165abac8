"""Open-loop load against a real daemon: latency percentiles, throughput, statuses, losses,
and how long a worker takes to come back after kill -9.

The GPU record, on the device machine (16 cores there):

    python scripts/bench_serve.py --backend cuda --size 1024 --rates 500,1000,2000,4000 \\
        --until-p99-ms 20 --duration 10 --kills 3 \\
        --json docs/bench/serve-gpu.json --markdown docs/benchmarks.md

Item 8 on a two-GPU host: one worker per card, then one card alone, each in its own section:

    python scripts/bench_serve.py --backend cuda --gpus 0,1 --rates 1000,2000,4000,8000 \
        --until-p99-ms 20 --kills 2 --json docs/bench/serve-gpu-x2.json \
        --markdown docs/benchmarks.md --section bench_serve_gpu_x2

The same code path at a tiny scale on CPU (the smoke check of the above):

    python scripts/bench_serve.py --backend cpu --size 64 --rates 5,10 --until-p99-ms 400 \\
        --max-rate 40 --duration 3 --kills 2 --json /tmp/serve-smoke.json

The CPU record (SD-900 200x200 PNGs, sent encoded; its JSON keeps its own layout):

    python scripts/bench_serve.py                       # starts its own daemon (CPU, 2 workers)
    python scripts/bench_serve.py --rates 2,5,10 --duration 10 --json docs/bench/serve-cpu.json
    python scripts/bench_serve.py --socket /run/scratchd/scratchd.sock   # an existing daemon

Load is open loop (requests are sent on schedule whether or not earlier ones were answered,
as a production line does) from client *processes* separate from the daemon (this script run
with ``--client``; ``--clients``: in raw mode half the cores, at least 2, at most 12; else 2),
so the generator never shares a core's event loop with the acceptor. The schedules, frames and
summaries are in ``serve_load.py``:

- ``poisson@R``: exponential inter-arrival times at R requests/s in total, split over the
  client processes (a superposition of Poisson streams is Poisson);
- ``burst``: the seed's pattern, ``--burst`` (23) requests spread over 0.3 s, then idle to
  2 s, repeated (from one client process: the pattern is a total).

``--warmup W``: each Poisson load's clients first send the same load for W s on the same
connections, uncounted, and the measured load (and the CPU, GPU and compute samplers) starts
after it: a gateway's steady state, its region page-locked, rather than its first seconds.

Latency is measured from each request's *scheduled* send time to its reply (no coordinated
omission). Each row also gives the generator's lateness (send start − schedule, p50/p99/max):
when it is small next to the latency, the generator was not the bottleneck. ``lost`` counts
requests without a reply when the run ends (duration + ``--grace``) and dropped connections.

Raw mode (``--size N``, the default N = 1024 with ``--backend cuda``): N x N greyscale mosaics
of the real images under ``--data`` sent as raw pixels; rates from ``--rates``, then with
``--until-p99-ms L`` the last rate times ``--rate-step`` (2) while a load meets L (p99 ≤ L,
≥ 99 % ok, nothing lost), up to ``--max-rate``; the burst pattern; then ``--kills`` SIGKILLs
of a worker (round robin, ``--kill-gap`` s apart) during Poisson load at ``--kill-rate``
(default: the highest rate that met ``--until-p99-ms``, or that lost nothing and answered
≥ 99 % ok when no limit is given; the lowest rate run if none did):
restart ms = kill → the replacement READY in the daemon's status (the status request
``scratchd status --json`` prints, polled every 5 ms), and what was lost meanwhile.
GPU busy share: ``gpu_busy_nvml`` is NVML's utilisation (share of time a kernel ran) sampled
every 50 ms *by this process* per visible GPU, mean over the load; ``compute_busy`` is the
daemon's ``scratchd_compute_seconds`` (CUDA events per batch on GPU) added up over the load
from its /metrics, per device label, as a share of the load's wall time.
JSON: ``{"device", "date", "open_loop": [{"rate", "size", "p50_ms", "p99_ms", "p999_ms",
"throughput", "lost", ...}], "restart_ms": [...], "lost_under_kill", ...}``; ``--markdown``
rewrites the ``--section`` (``bench_serve_gpu``) of the given markdown file.

CPU record mode (no ``--size``): ``--rates`` then the burst, then each worker SIGKILLed
``--kills`` times in turn under a light load (3 req/s), with what replaced it: the warm
standby (at once, when it is READY), or a fresh process (after a backoff when deaths come in
a row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import serve_load as sl
import uvloop
from serve_daemon import daemon_ports, kill_worker, start_daemon, worker_names
from serve_report import print_table, record_markdown, rewrite_section

from scratchd.client.api import Client

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
LEGACY_KEYS = {"throughput": "throughput_ok_per_s", "p999_ms": "p99_9_ms"}
TIMELINE_BIN_S = 0.5
"""The kill run's timeline bins, s."""
CLIENT_START_S = 2.0
"""Time given to client processes to start and connect before a ``--warmup`` begins (a slower
start shortens the warm-up, never the measured load)."""


# ---- load ---------------------------------------------------------------------------------


def start_clients(
    args: argparse.Namespace,
    sock: str,
    pattern: str,
    rate: float,
    duration: float,
    trace: bool = False,
    start_at: float = 0.0,
) -> list[subprocess.Popen[str]]:
    """The load's client processes; with ``start_at`` (CLOCK_MONOTONIC s) each sends the
    same load from its connection until then, uncounted (a warm-up), and the measured one
    from then."""
    procs = []
    clients = 1 if pattern == "burst" else args.clients  # the burst pattern is a total
    for k in range(clients):
        cmd = [sys.executable, __file__, "--client", "--socket", sock, "--pattern", pattern]
        cmd += ["--rate", str(rate / clients), "--duration", str(duration)]
        cmd += ["--seed", str(1000 * k + int(rate)), "--burst", str(args.burst)]
        cmd += ["--grace", str(args.grace), "--data", args.data]
        cmd += ["--frames", args.frames] if args.frames else []
        cmd += ["--trace"] if trace else []
        cmd += ["--path", args.path]
        cmd += ["--start-at", repr(start_at)] if start_at else []
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    results = []
    for p in procs:
        out = p.communicate()[0]
        if p.returncode != 0:
            raise SystemExit(f"a client process failed with status {p.returncode}")
        results.append(json.loads(out))
    return results


def run_load(args: argparse.Namespace, sock: str, pattern: str, rate: float) -> dict[str, Any]:
    """One load; in raw mode with the GPU's busy share (NVML here, compute from /metrics)."""
    port, pid = daemon_ports(sock) if args.size else (0, 0)
    procs = []
    warm = bool(args.warmup) and pattern != "burst"
    # A /metrics scrape while requests flow would land in the measured load's latency, so
    # with a warm-up the compute seconds are read before it and cover warm-up and load.
    before = sl.scrape_compute(port)
    start_at = 0.0
    if warm:  # clients warm up; the CPU and GPU samplers start after it
        start_at = time.perf_counter() + CLIENT_START_S + args.warmup
        procs = start_clients(args, sock, pattern, rate, args.duration, True, start_at)
        time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu_before = sl.process_cpu_s(pid)
    with sl.NvmlSampler() as nvml:
        procs = procs or start_clients(args, sock, pattern, rate, args.duration, trace=True)
        results = collect(procs)
    main_cpu_s = sl.process_cpu_s(pid) - cpu_before
    row = sl.summarize(results, args.duration)
    # When in the load its latency rose: a whole-run p99 hides a stall of the first second.
    start = min((r["trace"]["due_s"][0] for r in results if r["trace"]["due_s"]), default=0.0)
    row["timeline"] = sl.timeline(results, start, TIMELINE_BIN_S)
    row["timeline_bin_s"] = TIMELINE_BIN_S
    load = "burst" if pattern == "burst" else f"poisson@{rate:g}/s"
    if not args.size:
        keep = ("sent", "statuses", "lost", "throughput", "p50_ms", "p99_ms", "p999_ms")
        legacy = {"load": load, **{LEGACY_KEYS.get(k, k): row[k] for k in keep}}
        return {**legacy, "max_ms": row["max_ms"], "elapsed_s": row["elapsed_s"]}
    row = {"load": load, "rate": rate, "size": args.size, "path": args.path, **row}
    row["gpu_busy_nvml"] = nvml.means()
    # with a warm-up: from its first requests' due time to now
    span = args.warmup + time.perf_counter() - start_at if warm else row["elapsed_s"]
    row["compute_busy"] = sl.busy_share(before, sl.scrape_compute(port), span)
    if warm:
        row["warmup_s"] = args.warmup
        row["compute_busy_span_s"] = round(span, 2)
    # the daemon's main process (acceptor, dispatcher, metrics): is it the bottleneck?
    row["main_cpu_share"] = round(main_cpu_s / max(row["elapsed_s"], 1e-9), 3)
    row["main_cpu_us_per_request"] = round(main_cpu_s / max(row["sent"], 1) * 1e6, 1)
    print(f"  {load}: p50 {row['p50_ms']} p99 {row['p99_ms']} ms, {row['statuses']}", flush=True)
    print(f"    daemon's timings: {row['parts']}", flush=True)
    bins = ", ".join(f"{b['p99_ms']}" for b in row["timeline"])
    print(f"    p99 ms per {TIMELINE_BIN_S:g} s: {bins}", flush=True)
    return row


class StatusSampler:
    """Polls the daemon's status every ``interval`` s (not at all if 0) in a thread while a
    load runs: when each sample was taken (CLOCK_MONOTONIC), the queue slots in use and the
    warm standbys READY."""

    def __init__(self, sock: str, interval: float = 0.1) -> None:
        self.sock, self.interval = sock, interval
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatusSampler:
        # --status-interval 0: the load alone (each status request costs the daemon's event
        # loop a percentile over its latency window)
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        with Client(self.sock, timeout=5) as client:
            while not self._stop.wait(self.interval):
                status = client.status()
                ready = sum(s.state == "ready" for s in status.standbys)
                self.samples.append((time.monotonic(), status.queue.in_use, ready))


def kill_run(args: argparse.Namespace, sock: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Poisson load at ``--kill-rate``; a worker SIGKILLed every ``--kill-gap`` s. The row
    carries a ``timeline`` (``serve_load.timeline``, ``TIMELINE_BIN_S`` bins from the load's
    start, each with the most queue slots in use and the fewest warm standbys READY that the
    daemon's status showed in it) and each kill its time ``at_s`` on that axis."""
    duration = args.kill_gap * (args.kills + 1)
    names = worker_names(sock)
    with StatusSampler(sock, args.status_interval) as sampler:
        procs = start_clients(args, sock, "poisson", args.kill_rate, duration, trace=True)
        t0, kills, killed_at = time.monotonic() + 0.2, [], []
        for k in range(args.kills):
            time.sleep(max(0.0, t0 + (k + 1) * args.kill_gap - time.monotonic()))
            kill, at = kill_worker(sock, names[k % len(names)])
            kills.append(kill)
            killed_at.append(at)
        results = collect(procs)
    # the clients' own start (each ~0.2 s after it began) is the axis' zero
    start = min((r["trace"]["due_s"][0] for r in results if r["trace"]["due_s"]), default=t0)
    for kill, at in zip(kills, killed_at, strict=True):
        kill["at_s"] = round(at - start, 3)
    row = sl.summarize(results, duration)
    row["timeline"] = timeline = sl.timeline(results, start, TIMELINE_BIN_S)
    row["timeline_bin_s"] = TIMELINE_BIN_S
    seen: list[list[tuple[int, int]]] = [[] for _ in timeline]
    for at, used, ready in sampler.samples:  # into sl.timeline's bins, in one pass
        k = int((at - start) // TIMELINE_BIN_S)
        if 0 <= k < len(seen):
            seen[k].append((used, ready))
    for b, mine in zip(timeline, seen, strict=True):
        b["queue_in_use_max"] = max((u for u, _ in mine), default=None)
        b["standbys_ready_min"] = min((r for _, r in mine), default=None)
    load = f"poisson@{args.kill_rate:g}/s + kill -9"
    return {
        "load": load,
        "rate": args.kill_rate,
        "size": args.size,
        "path": args.path,
        **row,
    }, kills


def measure_restarts(args: argparse.Namespace, sock: str) -> list[dict[str, Any]]:
    """CPU record: each worker killed ``--kills`` times in turn under 3 req/s."""
    cmd = [sys.executable, __file__, "--client", "--socket", sock, "--pattern", "poisson"]
    cmd += ["--rate", "3", "--duration", str(5.0 * args.kills * 2 + 2), "--data", args.data]
    cmd += ["--path", args.path]
    background = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = []
    for name in worker_names(sock):
        for _ in range(args.kills):
            time.sleep(3.0)  # time for a new standby to boot after the previous kill
            out.append(kill_worker(sock, name)[0])
    result = collect([background])[0]
    lost = result["sent"] - result["answered"]
    out.append(
        {
            "background_sent": result["sent"],
            "background_lost": lost,
            "background_statuses": result["statuses"],
        }
    )
    return out


# ---- the two records ----------------------------------------------------------------------


def raw_record(args: argparse.Namespace, sock: str) -> dict[str, Any]:
    rates = [float(r) for r in args.rates.split(",")]
    rows: list[dict[str, Any]] = []
    while rate := sl.next_rate(rates, rows, args.until_p99_ms, args.rate_step, args.max_rate):
        rows.append(run_load(args, sock, "poisson", rate))
    burst = run_load(args, sock, "burst", 0.0)
    if args.kill_rate is None:  # the highest rate that held: the line's sustained load
        args.kill_rate = sl.sustained_rate(rows, args.until_p99_ms)
    kill_row, kills = kill_run(args, sock) if args.kills > 0 else ({}, [])
    device = device_name(args.backend, sl.NvmlSampler().device_names(), args.gpus)
    return assemble_record(device, rows, burst, kill_row, kills, args.until_p99_ms)


def assemble_record(
    device: str,
    rows: list[dict[str, Any]],
    burst: dict[str, Any],
    kill_row: dict[str, Any],
    kills: list[dict[str, Any]],
    p99_limit_ms: float | None,
) -> dict[str, Any]:
    """The record (``device``, ``date``, ``open_loop``, ``restart_ms``,
    ``lost_under_kill``) and, beyond it, the burst, the kill run and how busy was measured."""
    return {
        "device": device,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "open_loop": rows,
        "restart_ms": [round(k["restart_s"] * 1000.0, 1) for k in kills],
        "lost_under_kill": int(kill_row.get("lost", 0)),
        "burst": burst,
        "kill_run": {**kill_row, "kills": kills},
        "p99_limit_ms": p99_limit_ms,
        "gpu_busy_source": "gpu_busy_nvml: NVML utilisation sampled by the bench process; "
        "compute_busy: the daemon's scratchd_compute_seconds over the load's wall time",
    }


def device_name(backend: str, gpus: list[str], chosen: str = "all") -> str:
    """The GPU(s) serving (``chosen``: ``--gpus``), or the CPU."""
    if backend != "cpu" and gpus:
        count = len(gpus) if chosen == "all" else len(chosen.split(","))
        return gpus[0] if count == 1 else f"{count} x {gpus[0]}"
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def cpu_record(args: argparse.Namespace, sock: str) -> dict[str, Any]:
    rows = [run_load(args, sock, "poisson", float(r)) for r in args.rates.split(",")]
    rows.append(run_load(args, sock, "burst", 0.0))
    restarts = measure_restarts(args, sock) if args.kills > 0 else []
    return {"loads": rows, "restarts": restarts}


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--socket", default=None, help="use a running daemon instead of starting one")
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--workers", type=int, default=2, help="CPU workers")
    p.add_argument("--gpus", default="all", help="cuda: all, or card indices: 0 or 0,1")
    p.add_argument("--model", default="", help="model file (default: the shipped model)")
    p.add_argument("--size", type=int, default=None, help="raw NxN frames (cuda: 1024)")
    p.add_argument(
        "--path", choices=["socket", "region"], default="socket",
        help="raw frames' pixels in the socket frame, or in each client's registered region",
    )  # fmt: skip
    p.add_argument("--frame-count", type=int, default=64, help="distinct frames (raw mode)")
    p.add_argument("--slots", type=int, default=512, help="queue slots (raw mode)")
    p.add_argument("--max-batch", type=int, default=16, help="queue.max_batch (raw mode)")
    p.add_argument(
        "--views", default="", help="model.views, comma-separated (default: the model's own)"
    )
    p.add_argument("--rates", default=None, help="Poisson rates, requests/s")
    p.add_argument("--until-p99-ms", type=float, default=None)
    p.add_argument("--rate-step", type=float, default=2.0)
    p.add_argument("--max-rate", type=float, default=64000.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument(
        "--warmup", type=float, default=0.0,
        help="s of the same load on the same connections before each Poisson load, uncounted "
        "(a gateway's steady state: its region page-locked); 0: none",
    )  # fmt: skip
    p.add_argument("--clients", type=int, default=None, help="raw: cores / 2 in 2..12; CPU: 2")
    p.add_argument("--burst", type=int, default=23, help="requests per burst")
    p.add_argument("--kills", type=int, default=2, help="kill -9 rounds (CPU: per worker)")
    p.add_argument("--kill-rate", type=float, default=None, help="default: highest that held")
    p.add_argument("--kill-gap", type=float, default=3.0, help="s between kills (raw mode)")
    p.add_argument("--data", default=None, help="images (default: shared/data or sd900)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None, metavar="MD", help="rewrite its section")
    p.add_argument("--section", default="bench_serve_gpu", help="the markdown section's name")
    p.add_argument("--daemon-log", default=None, help="copy the daemon's log here at the end")
    p.add_argument(
        "--status-interval",
        type=float,
        default=0.1,
        help="s between the kill run's status samples (0: none)",
    )
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--frames", default="", help=argparse.SUPPRESS)
    p.add_argument("--pattern", default="poisson", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--grace", type=float, default=8.0, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.size is None and args.backend == "cuda":
        args.size = 1024
    raw = bool(args.size)
    if args.clients is None:
        args.clients = max(2, min(12, (os.cpu_count() or 2) // 2)) if raw else 2
    args.rates = args.rates or ("500,1000,2000,4000" if raw else "2,5,10")
    args.data = args.data or str(DATA if raw else DATA / "sd900" / "images")
    default_json = "serve-gpu.json" if args.backend == "cuda" else "serve-cpu.json"
    default_json = default_json if not raw or args.backend == "cuda" else "serve-raw-cpu.json"
    args.json = args.json or str(ROOT / "docs" / "bench" / default_json)
    return args


def main() -> None:
    args = parse_args()
    if args.client:
        # uvloop, as the daemon: the stdlib loop's transport moves a 1 MiB frame through its
        # own buffer in small sends, so the generator falls behind its schedule at high rates,
        # and that lateness counts in each latency.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            print(json.dumps(runner.run(sl.run_client(args))))
        return
    load_before = os.getloadavg()
    if args.size:
        sl.NvmlSampler.prepare()  # NVML's first init before the daemon serves, not in a load
    with tempfile.TemporaryDirectory(prefix="sdbench-", dir="/tmp") as tmp:
        if args.size:
            frames = sl.build_frames(
                sl.image_paths(Path(args.data)), args.size, args.frame_count, 0
            )
            args.frames = str(Path(tmp) / "frames.npy")
            np.save(args.frames, frames)
        proc, sock = (None, args.socket) if args.socket else start_daemon(args, Path(tmp))
        try:
            doc = raw_record(args, sock) if args.size else cpu_record(args, sock)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
                if args.daemon_log:  # the workers' boot lines, restarts, warnings
                    shutil.copyfile(Path(tmp) / "serve.log", args.daemon_log)
    print_table(doc)
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        # other work on the machine shares the cores: numbers are only comparable at a
        # similar load
        "loadavg_1m_before": round(load_before[0], 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    images = "SD-900 200x200 PNG (encoded)"
    if args.size:
        images = f"{args.size}x{args.size} raw grey mosaics of the real images in {args.data}"
    workers = {"workers": args.workers} if args.backend == "cpu" else {}
    daemon = {"backend": args.backend, **workers, "duration_s": args.duration}
    daemon |= {"clients": args.clients, "images": images, "views": args.views or "model's"}
    if args.size:  # queue.max_batch is only configured in raw mode
        daemon["max_batch"] = args.max_batch
    doc = {"machine": machine, "daemon": daemon, **doc}
    if not args.size:  # the CPU record's layout, as before
        doc = {k: doc[k] for k in ("machine", "daemon", "loads", "restarts")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    if args.markdown and args.size:
        section = record_markdown(doc, args.json, args.section)
        rewrite_section(Path(args.markdown), section, args.section)
        print(f"rewrote the {args.section} section of {args.markdown}")


if __name__ == "__main__":
    main()
