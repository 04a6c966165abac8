"""The load side of ``bench_serve.py``: frames, send schedules, client processes, summaries.

Kept apart from the orchestration so the logic a reader must trust (when requests are sent,
how latency and lateness are counted, how percentiles are taken) is small and tested
(``tests/scripts/test_bench_serve.py``).

A client process (``bench_serve.py --client``) runs one connection, and a sender thread that
sleeps until the next scheduled send (``pace``) and has the event loop start that request
as its own task (so a slow reply never delays a later send: open loop). It records, per
request, its *lateness* (when the send started minus when it was scheduled: the
generator's own delay) and, on a reply, its
latency from the *scheduled* time (no coordinated omission: a stalled generator cannot
hide a stall of the daemon, it adds to the latency). It prints one JSON object.

Frames for ``--size N``: greyscale N x N uint8 mosaics of real images (SD-900 steel strips
and magnetic tiles, each decoded with ``decode_image`` and resized to a 4 x 4 grid cell),
built once by the orchestrator into a ``.npy`` file that every client maps read-only. They
travel raw (``pixels``), so the benchmark measures the daemon, not a PNG decoder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
from PIL import Image

from scratchd.client.api import AsyncClient, ImageInput
from scratchd.protocol.image import decode_image

GRID: Final = 4
"""Frames are GRID x GRID mosaics of real images."""
BURST_SPREAD_S: Final = 0.3
BURST_PERIOD_S: Final = 2.0
IMAGE_SUFFIXES: Final = (".png", ".jpg", ".jpeg", ".bmp")
SWITCH_INTERVAL_S: Final = 0.0002
WARM_STOP_S: Final = 0.05
"""A warm-up's sends end this long before the measured load begins (``--start-at``)."""


# ---- schedules ----------------------------------------------------------------------------


PARTS = ("queue_ms", "compute_ms", "daemon_ms")
"""The daemon's own timings of an ok reply a row reports (wire.Timings: queue_ms, compute_ms,
total_ms), each as ``<part>_p50`` and ``<part>_p99``."""


def schedule(pattern: str, duration: float, rate: float, seed: int, burst: int = 23) -> list[float]:
    """Send offsets in seconds from the start, ascending, all in ``[0, duration)``.

    ``poisson``: exponential inter-arrival times at ``rate`` per second. ``burst``: the
    seed's pattern, ``burst`` requests spread uniformly over 0.3 s, then idle to 2 s, repeated.
    """
    rng = random.Random(seed)
    times: list[float] = []
    if pattern == "burst":
        cycle = 0.0
        while cycle < duration:
            spread = min(BURST_SPREAD_S, duration - cycle)
            times.extend(sorted(cycle + rng.uniform(0.0, spread) for _ in range(burst)))
            cycle += BURST_PERIOD_S
        return [t for t in times if t < duration]
    if pattern != "poisson":
        raise ValueError(f"unknown pattern {pattern!r} (poisson or burst)")
    if rate <= 0:
        raise ValueError(f"a Poisson rate must be positive, got {rate}")
    t = rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ---- frames -------------------------------------------------------------------------------


def image_paths(data: Path) -> list[Path]:
    """The real images under ``data``, masks left out: files under a ``masks`` folder, and
    a ``.png`` next to a ``.jpg`` of the same name (the magnetic-tile set's masks)."""
    found = []
    for path in sorted(data.rglob("*")):
        if path.suffix.lower() not in IMAGE_SUFFIXES or "masks" in path.parts:
            continue
        if path.suffix.lower() == ".png" and path.with_suffix(".jpg").exists():
            continue
        found.append(path)
    return found


def build_frames(paths: list[Path], size: int, count: int, seed: int) -> np.ndarray:
    """``count`` frames, uint8 ``(count, size, size)``: each a GRID x GRID mosaic of real
    images drawn (seeded) from ``paths``, each image resized to its cell."""
    if not paths:
        raise ValueError("no images to build frames from")
    if size < GRID:
        raise ValueError(f"frame size must be at least {GRID}, got {size}")
    rng = random.Random(seed)
    cell = -(-size // GRID)
    cache: dict[Path, np.ndarray] = {}
    frames = np.empty((count, size, size), np.uint8)
    for k in range(count):
        mosaic = np.empty((cell * GRID, cell * GRID), np.uint8)
        for row in range(GRID):
            for col in range(GRID):
                path = rng.choice(paths)
                if path not in cache:
                    grey = decode_image(path.read_bytes())
                    resized = Image.fromarray(grey).resize((cell, cell), Image.Resampling.BILINEAR)
                    cache[path] = np.asarray(resized, np.uint8)
                mosaic[row * cell : (row + 1) * cell, col * cell : (col + 1) * cell] = cache[path]
        frames[k] = mosaic[:size, :size]
    return frames


def load_payloads(args: argparse.Namespace) -> list[ImageInput]:
    """What a client sends, cycled: raw frames from ``--frames`` (a ``.npy``), or the
    encoded PNGs of ``--data`` (the CPU benchmark's SD-900 images)."""
    if args.frames:
        frames = np.load(args.frames, mmap_mode="r")
        return [np.asarray(frames[k]) for k in range(frames.shape[0])]
    return [p.read_bytes() for p in sorted(Path(args.data).glob("*.png"))[:64]]


# ---- one client process -------------------------------------------------------------------


def pace(
    offsets: list[float],
    start: float,
    loop: asyncio.AbstractEventLoop,
    begin: Callable[[int, float], None],
) -> None:
    """The sender thread: sleep until each send is due, then hand it to the event loop.

    ``time.sleep`` (nanosleep) wakes within tens of microseconds; an event-loop timer wakes
    only at the next millisecond (epoll's timeout resolution), which would add up to 1 ms
    of the generator's own lateness to every latency. ``call_soon_threadsafe`` wakes the
    loop at once.
    """
    for i, at in enumerate(offsets):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        loop.call_soon_threadsafe(begin, i, start + at)


async def run_client(args: argparse.Namespace) -> dict[str, Any]:
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the sender thread gets the GIL when due
    payloads = load_payloads(args)
    offsets = schedule(args.pattern, args.duration, args.rate, args.seed, args.burst)
    latency = [float("nan")] * len(offsets)
    lateness = [float("nan")] * len(offsets)
    outcome = [""] * len(offsets)  # each request's status, for --trace
    # the daemon's own account of each ok reply (wire.Timings): queue, compute, total
    parts: dict[str, list[float]] = {key: [] for key in PARTS}
    statuses: Counter[str] = Counter()
    async with await AsyncClient.connect(args.socket, zero_copy=args.path == "region") as client:
        loop = asyncio.get_running_loop()
        warm: list[asyncio.Task[None]] = []
        if args.start_at:  # the same load until then, on this connection, answers not counted
            warm_offsets = schedule(
                args.pattern, max(0.0, args.start_at - time.perf_counter() - WARM_STOP_S),
                args.rate, args.seed + 1, args.burst,
            )  # fmt: skip

            async def warm_one(i: int) -> None:
                with contextlib.suppress(ConnectionError):  # the measured load will say
                    await client.infer(payloads[i % len(payloads)])

            def begin_warm(i: int, due: float) -> None:
                warm.append(loop.create_task(warm_one(i)))

            await asyncio.to_thread(pace, warm_offsets, time.perf_counter(), loop, begin_warm)
        start = args.start_at or time.perf_counter() + 0.2
        tasks: list[asyncio.Task[None]] = []

        async def one(i: int, due: float) -> None:
            lateness[i] = (time.perf_counter() - due) * 1000.0
            try:
                reply = await client.infer(payloads[i % len(payloads)])
            except ConnectionError:
                statuses["connection_lost"] += 1
                outcome[i] = "connection_lost"
                return
            statuses[reply.status] += 1
            outcome[i] = reply.status
            if reply.status == "ok":
                latency[i] = (time.perf_counter() - due) * 1000.0
                t = reply.timings
                for key, value in zip(PARTS, (t.queue_ms, t.compute_ms, t.total_ms), strict=True):
                    parts[key].append(value)

        def begin(i: int, due: float) -> None:
            tasks.append(loop.create_task(one(i, due)))

        # Every begin() is queued on the loop before the thread's own completion is.
        await asyncio.to_thread(pace, offsets, start, loop, begin)
        end = start + args.duration + args.grace
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, end - time.perf_counter()))
            for task in pending:
                task.cancel()
        if warm:  # answered long before the measured load's end: nothing left to wait for
            await asyncio.wait(warm, timeout=max(0.0, end - time.perf_counter()))
    answered = sum(n for s, n in statuses.items() if s != "connection_lost")
    trace = {}
    if args.trace:  # per request, in send order: when it was due (CLOCK_MONOTONIC s), ...
        trace = {
            "trace": {
                "due_s": [start + at for at in offsets],
                "latency_ms": [x if x == x else None for x in latency],
                "status": outcome,  # "" when no reply came
            }
        }
    return {
        "sent": len(offsets),
        "answered": answered,
        "statuses": dict(statuses),
        "latencies_ms": [x for x in latency if x == x],
        "lateness_ms": [x for x in lateness if x == x],
        **parts,
        "elapsed_s": time.perf_counter() - start,
        **trace,
    }


# ---- summaries ----------------------------------------------------------------------------


def percentile(values: np.ndarray, q: float) -> float | None:
    """The q-th percentile (linear interpolation) rounded to 0.01, or None when empty."""
    return round(float(np.percentile(values, q)), 2) if values.size else None


def summarize(results: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """One load's row from its client processes' results.

    ``lost``: sent and never answered (no reply by the end of the grace period, or the
    connection dropped). Percentiles are over ``ok`` replies; ``ok_share`` says how many
    of the sent those are. ``late_*``: the generator's lateness (send start − schedule).
    ``parts``: p50/p99 of the daemon's own timings of the ok replies (``queue_ms``: enqueue
    to claim; ``compute_ms``: the batch's device time; ``daemon_ms``: frame received to
    reply written); the client's latency less ``daemon_ms`` is the socket both ways.
    """
    latencies = np.array([x for r in results for x in r["latencies_ms"]], np.float64)
    late = np.array([x for r in results for x in r["lateness_ms"]], np.float64)
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r["statuses"])
    sent = sum(r["sent"] for r in results)
    answered = sum(r["answered"] for r in results)
    return {
        "sent": sent,
        "statuses": dict(statuses),
        "lost": sent - answered,
        "ok_share": round(statuses["ok"] / sent, 4) if sent else None,
        "throughput": round(statuses["ok"] / duration, 2),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "p999_ms": percentile(latencies, 99.9),
        "max_ms": round(float(latencies.max()), 2) if latencies.size else None,
        "late_p50_ms": percentile(late, 50),
        "late_p99_ms": percentile(late, 99),
        "late_max_ms": round(float(late.max()), 2) if late.size else None,
        "elapsed_s": round(max((r["elapsed_s"] for r in results), default=0.0), 2),
        "parts": {
            f"{key}_{q}": percentile(
                np.array([x for r in results for x in r.get(key, [])], np.float64), pct
            )
            for key in PARTS
            for q, pct in (("p50", 50), ("p99", 99))
        },
    }


def timeline(results: list[dict[str, Any]], t0: float, bin_s: float) -> list[dict[str, Any]]:
    """The traced requests (``--trace``) in bins of ``bin_s`` seconds by scheduled send time,
    ``t0`` (CLOCK_MONOTONIC, as the clients' perf_counter on Linux) the first bin's start.

    Each bin: its start ``t_s``, how many requests were due in it, how they were answered
    (``statuses``; ``none`` for no reply), and p50/p99/max latency of its ``ok`` replies.
    What a whole-run percentile hides: when after a kill -9 the latency rose, and when it
    came back."""
    due = np.array([d for r in results for d in r["trace"]["due_s"]], np.float64)
    lat = np.array(
        [np.nan if x is None else x for r in results for x in r["trace"]["latency_ms"]],
        np.float64,
    )
    status = [s or "none" for r in results for s in r["trace"]["status"]]
    index = np.floor((due - t0) / bin_s).astype(np.int64)
    rows = []
    for b in range(int(index.max()) + 1 if index.size else 0):
        mine = np.flatnonzero(index == b)
        ok = lat[mine][~np.isnan(lat[mine])]
        rows.append(
            {
                "t_s": round(b * bin_s, 3),
                "sent": int(mine.size),
                "statuses": dict(Counter(status[k] for k in mine)),
                "p50_ms": percentile(ok, 50),
                "p99_ms": percentile(ok, 99),
                "max_ms": round(float(ok.max()), 2) if ok.size else None,
            }
        )
    return rows


def meets(row: dict[str, Any], p99_limit_ms: float) -> bool:
    """Whether a load kept p99 within the limit: nothing lost, at least 99 % answered
    ``ok`` (a p99 over the ok replies says nothing when more than 1 % failed), p99 ≤ limit."""
    p99 = row["p99_ms"]
    share = row["ok_share"] or 0.0
    return row["lost"] == 0 and share >= 0.99 and p99 is not None and p99 <= p99_limit_ms


def next_rate(
    rates: list[float],
    rows: list[dict[str, Any]],
    limit: float | None,
    step: float,
    max_rate: float,
) -> float | None:
    """The next rate to run after ``rows`` (one per rate run so far), or None when done:
    first the listed ``rates``; then, with a ``limit``, the last rate times ``step`` for as
    long as the last load met it and the rate stays within ``max_rate``."""
    if len(rows) < len(rates):
        return rates[len(rows)]
    if limit is None or not rows or not meets(rows[-1], limit):
        return None
    last = rows[-1]["rate"]
    nxt = last * step
    return nxt if nxt <= max_rate else None


def sustained_rate(rows: list[dict[str, Any]], limit: float | None) -> float:
    """The highest rate whose load met ``limit`` (without one: nothing lost, ≥ 99 % ok),
    else the lowest rate run: the load to kill workers under."""
    passed = [r["rate"] for r in rows if meets(r, limit if limit is not None else float("inf"))]
    return max(passed) if passed else min(r["rate"] for r in rows)


# ---- what the GPU did meanwhile -----------------------------------------------------------


@functools.cache
def _nvml_handles() -> tuple[Any, list[Any]]:
    """``pynvml`` and a handle per visible GPU, initialised once per process (not once per
    load), and by a bench before the daemon serves (``NvmlSampler.prepare``), so that none of
    the bench's own setup falls inside a measured load."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except Exception:
        return None, []


class NvmlSampler:
    """Samples ``nvmlDeviceGetUtilizationRates`` (the share of the last sample period in
    which a kernel ran) of every visible GPU every ``interval`` s in a thread, from the
    bench process; ``means()`` is the per-device mean in percent. No NVML: empty."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.samples: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml, self._handles = _nvml_handles()

    @staticmethod
    def prepare() -> None:
        """Initialise NVML now (once per process)."""
        _nvml_handles()

    def device_names(self) -> list[str]:
        names = [self._nvml.nvmlDeviceGetName(h) for h in self._handles]
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]  # old pynvml: bytes

    def __enter__(self) -> NvmlSampler:
        self.samples = {i: [] for i in range(len(self._handles))}
        self._stop.clear()
        if self._handles:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for i, handle in enumerate(self._handles):
                self.samples[i].append(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    def means(self) -> dict[str, float]:
        return {f"gpu{i}": round(float(np.mean(s)), 1) for i, s in self.samples.items() if s}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a local process so far (``/proc/<pid>/stat``), or 0."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def compute_seconds(metrics_text: str) -> dict[str, float]:
    """``scratchd_compute_seconds_sum`` per device from a /metrics page (Prometheus text)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("scratchd_compute_seconds_sum{"):
            labels, value = line.rsplit(" ", 1)
            device = labels.split('device="', 1)[1].split('"', 1)[0]
            out[device] = out.get(device, 0.0) + float(value)
    return out


def scrape_compute(port: int) -> dict[str, float]:
    """The daemon's compute seconds so far per device (empty if /metrics is not served)."""
    if port <= 0:
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            return compute_seconds(page.read().decode())
    except OSError:
        return {}


def busy_share(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float]:
    """Compute seconds spent per device between two scrapes, as a share of ``wall_s``."""
    if wall_s <= 0:
        return {}
    return {d: round((after[d] - before.get(d, 0.0)) / wall_s, 3) for d in after}
