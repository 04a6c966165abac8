"""Prometheus metrics of the daemon: exactly the table in docs/design.md, collected in-process.

There is no separate exporter. Everything is measured where it happens and travels to the
main process with the result:

    worker ──Result(compute_ns, batch_size, entropy, histogram)──▶ shm ──Completion──▶ main
    main:  observe_reply()  once per reply (every request gets exactly one)
           observe_batch()  once per batch (the first completion of a batch; see below)
    scrape: the live values (queue depth, workers, restarts, drift, entropy, p99,
           fragmentation) are read at collect time from `LiveSources` callables, so they are
           never stale and have one source of truth (the queue, the supervisor).

| name                                  | type      | labels              | source            |
|---------------------------------------|-----------|---------------------|-------------------|
| scratchd_requests_total               | counter   | part_class, status  | observe_reply     |
| scratchd_late_results_total           | counter   | part_class          | observe_late (7)  |
| scratchd_request_duration_seconds     | histogram | part_class          | observe_reply (1) |
| scratchd_request_p99_seconds          | gauge     | part_class          | sliding window (2)|
| scratchd_queue_wait_seconds           | histogram | priority            | observe_reply (3) |
| scratchd_queue_depth                  | gauge     | priority            | LiveSources       |
| scratchd_batch_size                   | histogram | device              | observe_batch     |
| scratchd_compute_seconds              | histogram | device              | observe_batch (4) |
| scratchd_model_output_entropy         | gauge     |                     | LiveSources       |
| scratchd_data_drift_score             | gauge     |                     | LiveSources       |
| scratchd_drift_warming_up             | gauge     |                     | LiveSources       |
| scratchd_workers                      | gauge     | state               | LiveSources       |
| scratchd_worker_restarts_total        | counter   | device              | LiveSources       |
| scratchd_vram_fragmentation_ratio     | gauge     | device              | LiveSources (5)   |
| scratchd_build_info                   | gauge     | version, model      | LiveSources (6)   |
| process_* (cpu, memory, fds, start)   | various   |                     | ProcessCollector  |

(1) Only replies that went through the queue (`ok`, `timeout`, `error`): `overloaded` and
    `invalid` are answered at the door in microseconds and would hide the queue's latency.
    They are still counted in scratchd_requests_total.
(2) p99 of the durations in (1) over the last `window_s` seconds (at most `window_cap`
    samples per class), computed at scrape time. Percentiles of a sliding window do not
    aggregate across instances: use histogram_quantile() on (1) for fleet views.
(3) Claim time minus enqueue time; for a request that expired in the queue, its whole stay.
(4) Per batch, as the worker timed it: CUDA events on GPU workers, wall time on CPU workers.
(5) Absent (no samples, only HELP/TYPE) on CPU-only daemons: there is no device arena, and a
    zero would claim a measurement that was never made.
(6) Always 1: the package version and the model version the workers serve (it changes
    with a reload), to join on (``* on (instance) group_left(model) scratchd_build_info``).
    The ``process_*`` series are the client library's standard ones for the main process.
(7) Requests a worker computed that reached the dispatcher after their deadline: answered
    ``timeout`` (never a late ``ok``), so also in scratchd_requests_total{status="timeout"};
    this tells computed-but-late ones (the device's work wasted) from those that expired
    while queued.

Label values are bounded so a hostile client cannot grow the registry: `part_class` is one
of the configured classes or `other`, `status` one of the five reply statuses, `priority`
0..7. `_created` series are not exported: the table is the contract.

Batch de-duplication: every completion of a batch carries the same `(worker, claim_ns)`
and the same `compute_ns`/`batch_size`; the first one seen is observed, the rest are
skipped by remembering the last `_BATCH_MEMORY` batch keys.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from scratchd import __version__
from scratchd.protocol.wire import PRIORITIES, STATUSES

_STATUS_INDEX: dict[str, int] = {status: i for i, status in enumerate(STATUSES)}
QUEUED_STATUSES = frozenset({"ok", "timeout", "error"})
OTHER_CLASS = "other"
# The supervisor's WorkerState values; each is exported (at 0 when empty), so that
# `scratchd_workers{state="ready"} == 0` can fire rather than the series going missing.
WORKER_STATES = ("starting", "ready", "stopping", "exited")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Millisecond resolution where the deadlines live (1 ms .. 3 s), coarser beyond.
DURATION_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
)  # fmt: skip
QUEUE_WAIT_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
    0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
COMPUTE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
    0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)

_BATCH_MEMORY = 4096


@dataclass
class LiveSources:
    """Read at scrape time; each callable must be cheap and safe on the event loop.
    Until the daemon binds them: no queue, no workers, zeros (``tuple()``, ``dict()``,
    ``float()``)."""

    queue_depth: Callable[[], Sequence[int]] = tuple  # index = priority
    worker_states: Callable[[], Mapping[str, int]] = dict  # state name -> count
    drift_score: Callable[[], float] = float
    output_entropy: Callable[[], float] = float
    signals_warming_up: Callable[[], bool] = bool  # fewer than drift.min_samples answers
    restarts: Callable[[], Mapping[str, int]] = dict  # device -> since start
    fragmentation: Callable[[], Mapping[str, float]] = dict  # GPU device -> ratio
    model_version: Callable[[], str] = str  # the model the workers serve


class SlidingWindow:
    """Values of the last `span_s` seconds, at most `cap` of them (oldest dropped first)."""

    def __init__(self, span_s: float, cap: int) -> None:
        self.span_s = span_s
        self._times: deque[float] = deque(maxlen=cap)
        self._values: deque[float] = deque(maxlen=cap)

    def add(self, now: float, value: float) -> None:
        self._times.append(now)
        self._values.append(value)

    def values(self, now: float) -> np.ndarray:
        while self._times and self._times[0] < now - self.span_s:
            self._times.popleft()
            self._values.popleft()
        return np.fromiter(self._values, dtype=np.float64, count=len(self._values))

    def quantile(self, q: float, now: float) -> float | None:
        values = self.values(now)
        return float(np.quantile(values, q)) if values.size else None


@dataclass(frozen=True)
class Rates:
    rps: float
    by_status: dict[str, float]


class _RateBins:
    """Reply counts per status in one-second bins over the last `seconds` seconds."""

    def __init__(self, seconds: int) -> None:
        self._seconds = max(seconds, 1)
        self._bins: deque[tuple[int, list[int]]] = deque()

    def add(self, now: float, status_index: int) -> None:
        second = int(now)
        if not self._bins or self._bins[-1][0] != second:
            self._bins.append((second, [0] * len(STATUSES)))
        self._bins[-1][1][status_index] += 1

    def totals(self, now: float) -> list[int]:
        while self._bins and self._bins[0][0] <= int(now) - self._seconds:
            self._bins.popleft()
        totals = [0] * len(STATUSES)
        for _, counts in self._bins:
            totals = [a + b for a, b in zip(totals, counts, strict=True)]
        return totals


@dataclass
class WorkerStats:
    """Recent batches of one worker slot, for `scratchd status`."""

    device: str = ""
    batches: int = 0
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=256))

    def summary(self) -> dict[str, float | int | None]:
        if not self.recent:
            return {"batches": self.batches, "batch_size_mean": None, "compute_ms_p50": None}
        sizes, seconds = zip(*self.recent, strict=True)
        return {
            "batches": self.batches,
            "batch_size_mean": round(float(np.mean(sizes)), 2),
            "compute_ms_p50": round(float(np.median(seconds)) * 1e3, 3),
        }


class _TableRegistry(CollectorRegistry):
    """A registry that leaves out the client library's `_created` series."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _LiveCollector:
    """The gauges whose value is read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return list(self._families(with_samples=False))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        m, src = self._metrics, self._metrics.sources
        p99 = GaugeMetricFamily(
            "scratchd_request_p99_seconds",
            f"p99 request duration over the last {m.window_s:g} s (sliding window).",
            labels=["part_class"],
        )
        depth = GaugeMetricFamily(
            "scratchd_queue_depth", "Requests waiting in the queue.", labels=["priority"]
        )
        entropy = GaugeMetricFamily(
            "scratchd_model_output_entropy",
            "Mean binary entropy of the probability map, bits per pixel, recent window.",
        )
        drift = GaugeMetricFamily(
            "scratchd_data_drift_score",
            "KL divergence (nats) of recent input intensities from the training histogram.",
        )
        warming = GaugeMetricFamily(
            "scratchd_drift_warming_up",
            "1 while fewer than drift.min_samples answers are in the drift/entropy window.",
        )
        workers = GaugeMetricFamily(
            "scratchd_workers", "Worker processes by state.", labels=["state"]
        )
        restarts = CounterMetricFamily(
            "scratchd_worker_restarts", "Worker processes replaced after dying.", labels=["device"]
        )
        frag = GaugeMetricFamily(
            "scratchd_vram_fragmentation_ratio",
            "(free - largest free block) / total of the device arena; absent on CPU.",
            labels=["device"],
        )
        build = GaugeMetricFamily(
            "scratchd_build_info",
            "Always 1: the scratchd version and the model version served.",
            labels=["version", "model"],
        )
        if with_samples:
            for part_class, value in m.p99_by_class().items():
                p99.add_metric([part_class], value)
            depths = list(src.queue_depth())
            for priority in range(PRIORITIES):
                depth.add_metric([str(priority)], depths[priority] if priority < len(depths) else 0)
            entropy.add_metric([], src.output_entropy())
            drift.add_metric([], src.drift_score())
            warming.add_metric([], 1.0 if src.signals_warming_up() else 0.0)
            counts = {**dict.fromkeys(m.worker_states, 0), **src.worker_states()}
            for state, count in counts.items():
                workers.add_metric([state], count)
            for device, count in sorted({**m.devices, **src.restarts()}.items()):
                restarts.add_metric([device], count)
            for device, ratio in sorted(src.fragmentation().items()):
                frag.add_metric([device], ratio)
            build.add_metric([__version__, src.model_version()], 1.0)
        yield from (p99, depth, entropy, drift, warming, workers, restarts, frag, build)


class Metrics:
    """The daemon's registry. One instance per daemon, fed from the main process only."""

    def __init__(
        self,
        part_classes: Iterable[str],
        devices: Iterable[str] = (),
        *,
        worker_states: Iterable[str] = WORKER_STATES,
        window_s: float = 60.0,
        window_cap: int = 20_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.part_classes = tuple(dict.fromkeys([*part_classes, OTHER_CLASS]))
        self.worker_states = tuple(worker_states)
        self.window_s = window_s
        self.sources = LiveSources()
        self.registry: CollectorRegistry = _TableRegistry()
        self._clock = clock
        self._started = clock()
        self._latency = {c: SlidingWindow(window_s, window_cap) for c in self.part_classes}
        self._replies = _RateBins(int(window_s))
        self._seen_batches: OrderedDict[Hashable, None] = OrderedDict()
        self.workers: dict[str, WorkerStats] = {}  # by worker name (stable across restarts)
        self.devices: dict[str, int] = {}  # restart counts shown at 0 before the source has any
        self._define(devices)

    def _define(self, devices: Iterable[str]) -> None:
        r = self.registry
        self.requests = Counter(
            "scratchd_requests_total", "Requests answered, by part class and reply status.",
            ["part_class", "status"], registry=r,
        )  # fmt: skip
        self.late = Counter(
            "scratchd_late_results_total",
            "Requests computed but finished after their deadline (answered timeout).",
            ["part_class"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "scratchd_request_duration_seconds",
            "Time from accept to reply of requests that went through the queue.",
            ["part_class"], buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "scratchd_queue_wait_seconds", "Time from enqueue to claim by a worker.",
            ["priority"], buckets=QUEUE_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "scratchd_batch_size", "Requests per batch run by a worker.",
            ["device"], buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.compute = Histogram(
            "scratchd_compute_seconds",
            "Compute time per batch: CUDA events on GPU workers, wall time on CPU workers.",
            ["device"], buckets=COMPUTE_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_LiveCollector(self))
        ProcessCollector(registry=r)
        # Every series a dashboard or alert divides by exists from the first scrape, at 0.
        self._duration_children = {c: self.duration.labels(c) for c in self.part_classes}
        self._request_children: dict[tuple[str, str], Counter] = {
            (c, s): self.requests.labels(c, s) for c in self.part_classes for s in STATUSES
        }
        self._late_children = {c: self.late.labels(c) for c in self.part_classes}
        self._wait_children = {p: self.queue_wait.labels(str(p)) for p in range(PRIORITIES)}
        self._batch_children: dict[str, tuple[Histogram, Histogram]] = {}  # by device
        for device in devices:
            self.add_device(device)

    def add_device(self, device: str) -> None:
        """Create the per-device series (at 0) for a device that workers run on."""
        self._batch_children[device] = (self.batch_size.labels(device), self.compute.labels(device))
        self.devices.setdefault(device, 0)

    def class_label(self, part_class: str) -> str:
        return part_class if part_class in self._latency else OTHER_CLASS

    def observe_reply(
        self,
        part_class: str,
        status: str,
        *,
        total_s: float,
        priority: int | None = None,
        queue_wait_s: float | None = None,
    ) -> None:
        """Account one reply; called exactly once per request, whatever its status."""
        index = _STATUS_INDEX.get(status)
        if index is None:
            raise ValueError(f"unknown reply status {status!r}")
        label = self.class_label(part_class)
        now = self._clock()
        # Label children are looked up in our own dicts: `.labels()` is slow on a hot path.
        self._request_children[label, status].inc()
        self._replies.add(now, index)
        if status in QUEUED_STATUSES:
            self._duration_children[label].observe(total_s)
            self._latency[label].add(now, total_s)
        if queue_wait_s is not None and priority is not None and 0 <= priority < PRIORITIES:
            self._wait_children[priority].observe(max(queue_wait_s, 0.0))

    def observe_late(self, part_class: str) -> None:
        """A request computed but finished after its deadline (its reply: ``timeout``)."""
        self._late_children[self.class_label(part_class)].inc()

    def observe_batch(
        self, *, worker: str, device: str, batch_key: Hashable, batch_size: int, compute_s: float
    ) -> bool:
        """Account one batch; later completions of the same `batch_key` are ignored."""
        if batch_key in self._seen_batches:
            return False
        self._seen_batches[batch_key] = None
        if len(self._seen_batches) > _BATCH_MEMORY:
            self._seen_batches.popitem(last=False)
        children = self._batch_children.get(device)
        if children is None:  # a device not announced by add_device: its series from now on
            children = self.batch_size.labels(device), self.compute.labels(device)
            self._batch_children[device] = children
        children[0].observe(batch_size)
        children[1].observe(compute_s)
        stats = self.workers.setdefault(worker, WorkerStats())
        stats.device = device
        stats.batches += 1
        stats.recent.append((batch_size, compute_s))
        return True

    def p99_by_class(self) -> dict[str, float]:
        """Classes with requests in the window only: an idle class has no p99 to report."""
        now = self._clock()
        out = {}
        for part_class, window in self._latency.items():
            value = window.quantile(0.99, now)
            if value is not None:
                out[part_class] = value
        return out

    def latency_summary(self) -> dict[str, dict[str, float | int]]:
        """p50/p99 in milliseconds and sample count per class over the sliding window."""
        now = self._clock()
        out: dict[str, dict[str, float | int]] = {}
        for part_class, window in self._latency.items():
            values = window.values(now)
            if values.size:
                p50, p99 = np.quantile(values, [0.5, 0.99])
                out[part_class] = {
                    "p50_ms": round(float(p50) * 1e3, 3),
                    "p99_ms": round(float(p99) * 1e3, 3),
                    "count": int(values.size),
                }
        return out

    def throughput(self) -> Rates:
        """Replies per second over the window (or since start when younger), per status."""
        now = self._clock()
        span = max(min(self.window_s, now - self._started), 1.0)
        counts = self._replies.totals(now)
        rates: dict[str, float] = {
            s: round(n / span, 3) for s, n in zip(STATUSES, counts, strict=True)
        }
        return Rates(round(sum(counts) / span, 3), rates)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (version 0.0.4)."""
        return generate_latest(self.registry)
