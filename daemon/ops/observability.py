"""How the daemon's observability parts are wired into the running daemon.

    Daemon._serve ──▶ Listeners.start()            health + metrics listeners (before the
                                                    workers boot: /livez answers, /readyz
                                                    says "no worker is ready" until one is)
    Dispatcher.answer ─▶ Daemon.account ─▶ Observability.account(flight, reply, completion)
                          every reply, exactly once: counters, latency, queue wait, batches,
                          and for `ok` replies the input histogram (drift) and entropy
    Daemon.snapshot  ──▶ Observability.status_fields()   latency / drift / entropy for status
                         Listeners.status_fields()       the listeners' ports
    scrape /metrics  ──▶ LiveSources read the queue and the supervisor at that moment
    Daemon drain/halt ─▶ Listeners.close()

:class:`Observability` accounts replies and needs no running daemon (the benchmarks and
tests build one alone); :class:`Listeners` is built with the daemon's parts it reads.

Everything runs on the daemon's event loop in the main process; workers only write their
results (with compute_ns, batch_size, entropy, histogram) into shared memory.

Accounting must never cost a reply: `account` runs after the reply is written and
catches its own failures (logged, throttled), so a bug here cannot stop the dispatcher
from answering the completions collected with it.

`SCRATCHD_NO_METRICS=1` turns per-request accounting off (the listeners still run, the
counters stay at 0): it exists to measure what the accounting costs (scripts/bench_serve.py
with and without) and for nothing else.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from scratchd.daemon.config import Config
from scratchd.daemon.frontend.dispatch import Dispatcher, InFlight
from scratchd.daemon.ops.drift import DriftMonitor, EntropyMonitor
from scratchd.daemon.ops.health import HealthServer, Readiness, ReadinessInput
from scratchd.daemon.ops.metrics import CONTENT_TYPE, Metrics
from scratchd.daemon.pool.supervisor import Supervisor
from scratchd.ipc.queue import Completion, RequestQueue, Status
from scratchd.model.scratchnet import ModelError, read_meta
from scratchd.protocol import wire
from scratchd.protocol.log import Throttle, log_event

DISABLE_ENV = "SCRATCHD_NO_METRICS"


@dataclass(frozen=True, eq=False)
class ModelReference:
    """What the main process needs from the model file: its version, its own test-time views
    and the drift reference."""

    version: str
    histogram: np.ndarray | None
    problem: str = ""  # why there is no histogram
    views: tuple[str, ...] = ()  # the file's metadata views; config model.views overrides


def read_model_reference(path: str) -> ModelReference:
    """The model's metadata only (the weights stay on disk; workers load those)."""
    try:
        meta = read_meta(path or None)
    except ModelError as exc:  # the workers report a broken model; here drift is just off
        return ModelReference("", None, str(exc))
    histogram = np.asarray(meta.histogram, dtype=np.float64)
    return ModelReference(meta.version, histogram, views=tuple(meta.views))


def _drift_monitor(histogram: np.ndarray, config: Config) -> DriftMonitor:
    drift = config.drift
    return DriftMonitor(histogram, drift.window, drift.threshold, drift.min_samples)


class Observability:
    """Metrics, drift and entropy for one daemon. ``device_of`` names the device of a worker
    slot, for the batch metrics' labels (default: ``devices[0]``, the one device of a pool
    built without a supervisor)."""

    def __init__(
        self,
        config: Config,
        model: ModelReference,
        devices: list[str],
        worker_states: list[str],
        device_of: Callable[[int], str] | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.enabled = os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes")
        self.metrics = Metrics(config.class_names(), devices, worker_states=worker_states)
        self.metrics.sources.model_version = lambda: self.model.version
        self.entropy = EntropyMonitor(config.drift.window, config.drift.min_samples)
        self.drift: DriftMonitor | None = None
        if model.histogram is not None:
            self.drift = _drift_monitor(model.histogram, config)
        else:
            log_event("drift_disabled", logging.WARNING, reason=model.problem)
        self.completed = 0  # requests a worker finished (ok or error): "the queue moves"
        self._failures = Throttle("metrics_failed", burst=3)
        self._device_of = device_of or (lambda slot: devices[0] if devices else "cpu")

    def apply_config(self, config: Config) -> None:
        """A reload: re-read the model's metadata; a new model starts a fresh drift window."""
        self.config = config
        model = read_model_reference(config.model.path)
        if model.histogram is None:
            return  # the reloader refuses a broken model; keep the reference we have
        old = self.model.histogram
        if self.drift is None or old is None or not np.array_equal(model.histogram, old):
            self.drift = _drift_monitor(model.histogram, config)
        self.model = model

    def account(self, flight: InFlight, reply: wire.Reply, completion: Completion | None) -> None:
        """Account one reply; never raises."""
        if not self.enabled:
            return
        try:
            self._account(flight, reply, completion)
        except Exception as exc:
            self._failures.log(logging.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _account(self, flight: InFlight, reply: wire.Reply, completion: Completion | None) -> None:
        timings = reply.timings
        self.metrics.observe_reply(
            flight.part_class,
            reply.status,
            total_s=timings.total_ms / 1e3,
            priority=flight.priority,
            queue_wait_s=timings.queue_ms / 1e3 if completion is not None else None,
        )
        if completion is None or completion.worker < 0:
            return
        if reply.status == "timeout" and completion.status == Status.OK:
            self.metrics.observe_late(flight.part_class)  # the dispatcher's late result
        result = completion.result
        if result is None:
            return
        self.completed += 1
        if result.batch_size > 0:
            # The dispatcher named the worker in the reply (``Dispatcher._reply``).
            name = reply.worker or f"slot{completion.worker}"
            self.metrics.observe_batch(
                worker=name,
                device=self._device_of(completion.worker),
                batch_key=(completion.worker, completion.claim_ns),
                batch_size=result.batch_size,
                compute_s=result.compute_ns / 1e9,
            )
        if reply.status == "ok":
            self.entropy.observe(float(result.entropy))
            if self.drift is not None:
                self.drift.observe(result.histogram)

    def status_fields(self) -> dict[str, Any]:
        """Keyword arguments for `wire.StatusReply`: latency, throughput, drift, entropy..."""
        deadlines = {name: c.deadline_ms for name, c in self.config.classes.items()}
        latency = {
            part_class: wire.ClassLatency(
                p50_ms=float(row["p50_ms"]),
                p99_ms=float(row["p99_ms"]),
                count=int(row["count"]),
                deadline_ms=deadlines.get(part_class, 0),
            )
            for part_class, row in self.metrics.latency_summary().items()
        }
        throughput = self.metrics.throughput()
        drift = self.config.drift
        return {
            "model_version": self.model.version,
            "model_views": list(self.config.model.views or self.model.views),
            "latency": latency,
            "throughput": wire.Throughput(throughput.rps, throughput.by_status),
            "drift": msgspec.convert(self.drift.snapshot(), wire.DriftStatus)
            if self.drift
            else wire.DriftStatus(threshold=drift.threshold, window=drift.window),
            "entropy": msgspec.convert(self.entropy.snapshot(), wire.EntropyStatus),
        }

    def worker_fields(self, name: str) -> dict[str, Any]:
        """Recent batch size and compute time of one worker, for its status row."""
        stats = self.metrics.workers.get(name)
        if stats is None:
            return {}
        summary = stats.summary()
        return {k: summary[k] for k in ("batch_size_mean", "compute_ms_p50")}


class Listeners:
    """The health and metrics listeners of one daemon: /readyz and the scrape-time sources
    of ``obs.metrics`` read the daemon's parts at the moment they are asked."""

    def __init__(
        self,
        obs: Observability,
        queue: RequestQueue,
        supervisor: Supervisor,
        dispatcher: Dispatcher,
        lifecycle: Callable[[], str],
    ) -> None:
        self.config = obs.config.server
        src = obs.metrics.sources
        src.queue_depth = queue.depth_by_priority
        src.worker_states = lambda: _count_states(supervisor)
        src.restarts = lambda: {supervisor.device: sum(x.restarts for x in supervisor.lineage)}
        src.fragmentation = lambda: _fragmentation(queue, supervisor)
        src.drift_score = lambda: obs.drift.score() if obs.drift else 0.0
        src.output_entropy = obs.entropy.mean
        src.signals_warming_up = lambda: obs.entropy.warming_up

        def readiness_input() -> ReadinessInput:
            return ReadinessInput(
                ready_workers=supervisor.ready_count(),
                total_workers=supervisor.count,
                pending=len(dispatcher.pending),
                completed=obs.completed,
                lifecycle=lifecycle(),
            )

        # "Not moving" after as long as a batch may take before the supervisor calls its
        # worker hung: a slow batch of big frames is not a stall.
        stall_s = obs.config.workers.hang_timeout_ms / 1000.0
        readiness = Readiness(readiness_input, stall_after_s=stall_s)
        self.readiness = readiness  # /readyz's decision, also the KServe endpoint's
        self.server = HealthServer(
            self.config.bind,
            self.config.health_port,
            self.config.metrics_port,
            readiness=readiness.check,
            metrics=obs.metrics.exposition,
            metrics_content_type=CONTENT_TYPE,
            max_connections=self.config.http_max_connections,
            header_timeout_s=self.config.http_header_timeout_ms / 1000.0,
        )

    async def start(self) -> None:
        await self.server.start()
        log_event("listening", bind=self.config.bind, **self.server.bound)

    async def close(self) -> None:
        await self.server.close()

    def status_fields(self) -> dict[str, Any]:
        """Keyword arguments for `wire.StatusReply`: the ports the listeners are bound to."""
        bound = self.server.bound
        return {"health_port": bound.get("health", 0), "metrics_port": bound.get("metrics", 0)}


def worker_device(supervisor: Supervisor) -> Callable[[int], str]:
    """``device_of`` for :class:`Observability`: the device of the worker in a slot."""

    def device_of(slot: int) -> str:
        worker = supervisor.workers.get(slot)
        return worker.device if worker is not None else supervisor.device

    return device_of


def _count_states(supervisor: Supervisor) -> dict[str, int]:
    counts: dict[str, int] = {}
    for worker in supervisor.workers.values():
        counts[worker.state.value] = counts.get(worker.state.value, 0) + 1
    return counts


def _fragmentation(queue: RequestQueue, supervisor: Supervisor) -> dict[str, float]:
    """GPU workers' arena fragmentation by worker name (``cuda0`` is card ``gpus[0]``), as
    each last wrote it into its worker row; workers without an arena (NaN) are left out."""
    ratios: dict[str, float] = {}
    for row in queue.worker_rows():
        name = supervisor.worker_name(row.slot)
        if name is not None and not math.isnan(row.vram_frag):
            ratios[name] = row.vram_frag
    return ratios
