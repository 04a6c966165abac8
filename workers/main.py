"""A worker process: ``python -m scratchd.workers.main --queue … --slot …`` (see protocol.py).

Boot, in order: ask for SIGKILL on parent death (``prctl(PR_SET_PDEATHSIG)``) and check the
parent is still the one that started us (it may have died before the prctl); attach the
queue; register in the worker table; build the backend and run one forward pass (warm-up);
then write READY. A standby worker (protocol.py) maps the queue and warms up the same way (a
GPU standby also page-locks the queue's input slots, the slowest part of a take-over if left
to it), and registers only when it is told which slot to take over, after READY. Any failure
up to there writes ``BOOT_ERROR <reason>`` on the READY pipe and exits
``ExitCode.BOOT_ERROR``: the supervisor halts the pool with that reason.

The loop (all waiting is on the work doorbell, with the heartbeat interval as timeout)::

    heartbeat ─▶ plan (workers/batching.py) ─┬─ claim n ─▶ compute ─▶ complete each ─┐
        ▲                                    └─ wait for work / a fuller batch ──────┤
        └────────────────────────────────────────────────────────────────────────────┘

Signals only record and wake: SIGTERM sets the stop flag and rings our own work doorbell,
so a sleeping worker wakes at once; the batch in hand is finished and completed before the
loop exits with ``ExitCode.OK``. SIGINT is ignored (a terminal's Ctrl-C reaches the whole
process group; the main process decides about shutdown). The death pipe is checked every
turn: at EOF the main process is gone and the worker leaves without touching the queue.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Claim, QueueError, RequestQueue, Result
from scratchd.ipc.regions import RegionError
from scratchd.protocol.log import configure, log_event
from scratchd.workers.backend import AsyncBackend, Backend, DeviceMemory
from scratchd.workers.batching import BatchPolicy, ewma
from scratchd.workers.boot_log import log_boot, where
from scratchd.workers.gpu_memory import ARENA_MB, RESERVE_MB, WARM_SIZES
from scratchd.workers.protocol import (
    STANDBY_SLOT,
    ExitCode,
    parse_size,
    parse_take,
    parse_views,
    ready_line,
)
from scratchd.workers.results import error_result

PR_SET_PDEATHSIG: Final = 1
LEAD_FLOOR_NS: Final = 100_000
"""The least time before a computing batch's expected end at which the next one is claimed."""
LEAD_WEIGHT: Final = 0.1
"""Weight of the newest claim + submit time in its running estimate."""


class StopFlag:
    """Set by SIGTERM; the handler also rings the worker's own doorbell to end a wait."""

    def __init__(self, wake_fd: int) -> None:
        self.requested = False
        self.wake_fd = wake_fd  # -1 while a standby has no doorbell yet

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.requested = True
        if self.wake_fd < 0:  # a standby: its poll() wakes within 0.25 s and sees the flag
            return
        with contextlib.suppress(OSError):
            os.eventfd_write(self.wake_fd, 1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scratchd-worker", description="scratchd worker process")
    p.add_argument("--queue", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--gpu-reserve-mb", type=int, default=RESERVE_MB)
    p.add_argument("--gpu-arena-mb", type=int, default=ARENA_MB)
    p.add_argument(
        "--gpu-warm-size", action="append", default=[], metavar="HxW",
        help="a frame size whose graphs are captured before READY (repeatable)",
    )  # fmt: skip
    p.add_argument("--model", default="")
    p.add_argument(
        "--views", type=parse_views, default=(), metavar="V[,V...]",
        help="test-time views, comma-separated (default: the model file's)",
    )  # fmt: skip
    p.add_argument(
        "--cascade", choices=["on", "off"], default=None,
        help="the model's dynamic-resolution cascade (default: the model file's; CPU only)",
    )  # fmt: skip
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-delay-ms", type=int, default=10)
    p.add_argument("--heartbeat-ms", type=int, default=250)
    p.add_argument("--parent-pid", type=int, required=True)
    for fd in ("ready", "death", "done"):
        p.add_argument(f"--{fd}-fd", type=int, required=True)
    p.add_argument("--work-fd", type=int, default=-1, help="-1: standby (see protocol.py)")
    p.add_argument("--control-fd", type=int, default=-1)
    return p.parse_args(argv)


def die_with_parent(parent_pid: int) -> bool:
    """Ask for SIGKILL when the parent dies; False if it is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent_pid


def make_backend(args: argparse.Namespace) -> Backend:
    # Imported here for start-up time: a CPU worker need not load the CUDA backend's modules.
    if args.backend == "cuda":
        from scratchd.workers.cuda import CudaBackend

        sizes = [parse_size(s) for s in args.gpu_warm_size] or list(WARM_SIZES)
        return CudaBackend(
            args.model or None, args.max_batch, args.gpu_reserve_mb, sizes, args.gpu_arena_mb,
            views=args.views,
        )  # fmt: skip
    from scratchd.workers.cpu import CpuBackend

    cascade = None if args.cascade is None else args.cascade == "on"
    return CpuBackend(args.model or None, args.max_batch, views=args.views, cascade=cascade)


def boot(args: argparse.Namespace) -> tuple[RequestQueue, Backend]:
    """Attach and register (a standby maps the queue without taking a slot), load, warm up,
    page-lock the queue's inputs for a GPU backend: a standby does that at boot too, so a
    take-over only registers the slot (``take_slot``)."""
    queue = RequestQueue.attach(args.queue, completion_fd=args.done_fd)
    if args.slot != STANDBY_SLOT:
        take_slot(queue, args.slot, args.work_fd)
    backend = make_backend(args)
    backend.warm_up()
    share_inputs(queue, backend)
    return queue, backend


def take_slot(queue: RequestQueue, slot: int, work_fd: int) -> None:
    """Serve from worker ``slot``: its work doorbell and our row in the worker table (at
    boot, or a standby's take-over on the mapping it made at boot)."""
    queue.adopt_work_fd(work_fd)
    queue.register_worker(slot, os.getpid())


def share_inputs(queue: RequestQueue, backend: Backend) -> None:
    """A backend with device memory page-locks the input slots and client regions it maps."""
    if isinstance(backend, DeviceMemory):
        backend.register_host(queue.input_region())
        queue.region_maps.set_hooks(backend.register_region, backend.unregister_region)


def wait_readable(fds: Sequence[int], timeout_s: float) -> set[int]:
    """Which of ``fds`` are readable (or at EOF) within ``timeout_s``. ``poll``, not ``select``:
    our descriptors keep the main process's numbers (``pass_fds``), past 1023 when it holds
    many connections, and ``select`` refuses those (``FD_SETSIZE``)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(timeout_s * 1000.0)}


def await_takeover(control_fd: int, death_fd: int, stop: StopFlag) -> tuple[int, int] | None:
    """Standby: wait for ``TAKE <slot>`` and the slot's work eventfd (None: stopped, orphaned)."""
    control = socket.socket(fileno=control_fd)
    while not stop.requested:
        readable = wait_readable([control_fd, death_fd], 0.25)
        if death_fd in readable:
            return None
        if control_fd in readable:
            message, fds, _, _ = socket.recv_fds(control, 64, 1)
            slot = parse_take(message)
            if slot is None or len(fds) != 1:
                return None  # the supervisor hung up (or spoke nonsense): nothing to serve
            control.close()
            return slot, fds[0]
    return None


class WorkerLoop:
    """Claim, compute, complete until told to stop or orphaned."""

    def __init__(
        self,
        queue: RequestQueue,
        slot: int,
        backend: Backend,
        stop: StopFlag,
        death_fd: int,
        max_delay_ms: int,
        heartbeat_ms: int,
    ) -> None:
        self.queue = queue
        self.slot = slot
        self.backend = backend
        self.stop = stop
        self.death_poll = select.poll()  # the death pipe, checked every turn: built once
        self.death_poll.register(death_fd, select.POLLIN)
        self.policy = BatchPolicy(max(1, backend.max_batch), max_delay_ms * NS_PER_MS)
        self.heartbeat_s = heartbeat_ms / 1000.0
        self.memory_reported_ns = 0
        self.claimed_ns = 0  # when the loop last decided to claim (PipelinedLoop's lead)
        # A backend with device memory limits claims and reports fragmentation (backend.py).
        self.memory = backend if isinstance(backend, DeviceMemory) else None

    def run(self) -> ExitCode:
        while not self.stop.requested:
            if self.parent_gone():
                return ExitCode.PARENT_GONE
            now = time.monotonic_ns()
            self.queue.heartbeat(self.slot, now)
            self.queue.region_maps.forget_released()  # regions whose last request is answered
            self.report_memory(now)
            ready = self.queue.ready_count()
            oldest = self.queue.oldest_ready() if ready else None
            plan = self.policy.plan(now, ready, oldest, idle=self.device_idle(now))
            if plan.claim and oldest is not None:  # a claim: requests are ready
                self.claimed_ns = now
                n = self.policy.fit(min(plan.claim, self.limit()), now, oldest[1])
                claims = self.queue.claim_batch(self.slot, n, now, self.policy.expected_ns(n))
                if claims:
                    self.take(claims)
                    continue
            if self.settle() or plan.claim:
                continue
            if self.memory is not None and self.memory.pin_pending():
                continue  # a piece of page-locking done: look for work again before more
            if plan.wake_ns is None:
                self.queue.wait_for_work(self.slot, self.heartbeat_s)
            else:
                timeout = min(self.heartbeat_s, max(0.0, (plan.wake_ns - now) / 1e9))
                self.queue.wait_for_work(self.slot, timeout, min_ready=self.policy.max_batch)
        self.drain()
        return ExitCode.OK

    def report_memory(self, now_ns: int) -> None:
        """A GPU backend's arena fragmentation into our worker row, once a heartbeat."""
        if self.memory is not None and now_ns - self.memory_reported_ns >= self.heartbeat_s * 1e9:
            self.memory_reported_ns = now_ns
            self.queue.report_device_memory(self.slot, self.memory.fragmentation_ratio())

    def limit(self) -> int:
        """The backend's batch limit now (a GPU's follows its free memory)."""
        if self.memory is None:
            return self.policy.max_batch
        return max(1, self.memory.batch_limit())

    def take(self, claims: list[Claim]) -> None:
        self.serve(claims)

    def settle(self) -> bool:
        """Nothing to claim now: move in-flight work one step; True if the loop should plan
        again before sleeping (a pipelined loop has work in flight)."""
        return False

    def device_idle(self, now_ns: int) -> bool:
        """Whether a partial batch goes at once (BatchPolicy.plan's ``idle``). A synchronous
        backend batches by its window (``--max-delay-ms``; the CPU's is 0 by default)."""
        return False

    def drain(self) -> None:
        """Finish the batch in flight, if any (a pipelined loop has one)."""

    def parent_gone(self) -> bool:
        return bool(self.death_poll.poll(0))

    def serve(self, claims: list[Claim]) -> None:
        claims, images = self.inputs(claims)
        if not claims:
            return
        start = time.monotonic_ns()
        try:
            results = self.backend.infer(images, [c.want_mask for c in claims])
        except Exception as exc:  # the backend isolates per-image errors; this is a bug
            results = [error_result(f"backend failed: {exc}", len(claims)) for _ in claims]
        self.policy.observe(len(claims), time.monotonic_ns() - start)
        for claim, result in zip(claims, results, strict=True):
            self.complete(claim, result)

    def inputs(self, claims: list[Claim]) -> tuple[list[Claim], list[np.ndarray]]:
        """The claims whose pixels can be read, and their images; a claim whose client region
        cannot be (``ipc/region_maps.py``) is answered ``error`` alone."""
        kept, images = [], []
        for c in claims:
            try:
                images.append(self.queue.input_view(c))
                kept.append(c)
            except RegionError as exc:
                self.complete(c, error_result(f"image not readable: {exc}"))
        return kept, images

    def complete(self, claim: Claim, result: Result) -> None:
        try:
            self.queue.complete(self.slot, claim, result)
        except ValueError as exc:  # a malformed result: answer error, never a half write
            self.queue.complete(self.slot, claim, error_result(f"malformed result: {exc}"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure()  # the daemon's line format on the stderr we share with it
    if not die_with_parent(args.parent_pid):
        return ExitCode.PARENT_GONE
    stop = StopFlag(args.work_fd)
    stop.install()
    try:
        queue, backend = boot(args)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        log_event("worker_boot_failed", logging.ERROR, worker=where(args.slot), reason=reason)
        _write_all(args.ready_fd, f"BOOT_ERROR {reason}\n".encode())
        return ExitCode.BOOT_ERROR
    log_boot(args.slot, backend)
    _write_all(args.ready_fd, ready_line(backend.device, backend.version))
    os.close(args.ready_fd)
    slot = args.slot
    if slot == STANDBY_SLOT:  # a standby: serve once told which slot to take over
        taken = await_takeover(args.control_fd, args.death_fd, stop)
        if taken is None:
            return ExitCode.OK if stop.requested else ExitCode.PARENT_GONE
        slot, work_fd = taken
        stop.wake_fd = work_fd
        try:
            take_slot(queue, slot, work_fd)
        except Exception as exc:
            log_event("takeover_failed", logging.ERROR, worker="standby", slot=slot, reason=exc)
            return ExitCode.CRASH
    return serve(queue, slot, backend, stop, args)


class PipelinedLoop(WorkerLoop):
    """The loop of a backend that computes asynchronously (CUDA: ``submit`` uploads,
    ``start`` launches, ``collect`` waits for the device and copies the small outputs,
    ``finish_each`` works on the host). Batch k+1 is claimed and uploaded while batch k
    computes, and k is finished on the host and completed while k+1 computes::

        claim k+1 ─ submit k+1 ─ collect k ─ start k+1 ─ finish k ─ complete k ─ claim k+2 …
        GPU: ─────── compute k ───────────┘             └────── compute k+1 ──────────

    When batch k+1 is claimed: at once when a full batch is ready, or when nothing computes
    (an idle device takes what is ready: workers/batching.py says why); otherwise it fills
    while k computes, until ``lead`` before k's expected end (its start plus the backend's
    ``expected_ms``, the graphs' measured device time), so that the claim and the upload of
    k+1 happen during k's last stretch and k+1 launches right behind k instead of after a
    claim and an upload on an idle device. ``lead`` is twice the measured claim + submit
    time plus ``LEAD_FLOOR_NS``. A batch without a measurement yet (``expected_ms`` 0) has
    k+1 claimed as soon as anything is ready.

    A failure of the asynchronous backend (a CUDA error) leaves the device in an unknown
    state, and a backend that breaks ``finish_each``'s contract cannot be trusted: the worker
    exits (``ExitCode.CRASH``) completing nothing more (the frames of a batch already
    answered stay answered); the supervisor re-queues its other claims, and a request that
    keeps killing workers is quarantined (``max_kills``). A frame whose host finish fails is
    not such a failure: the backend answers it ``error`` and serves the rest.
    """

    backend: AsyncBackend[Any]
    inflight: tuple[list[Claim], Any, int] | None = None  # launched, not collected
    collected: tuple[list[Claim], Any, int] | None = None  # collected, not finished
    busy_until_ns: int = 0  # the in-flight batch's expected end on the device
    submit_ns: float = 0.0  # EWMA of claim + submit time

    def __init__(
        self,
        queue: RequestQueue,
        slot: int,
        backend: AsyncBackend[Any],
        stop: StopFlag,
        death_fd: int,
        max_delay_ms: int,
        heartbeat_ms: int,
    ) -> None:
        super().__init__(queue, slot, backend, stop, death_fd, max_delay_ms, heartbeat_ms)

    def take(self, claims: list[Claim]) -> None:
        b = self.backend
        claims, images = self.inputs(claims)
        if not claims:
            return
        batch = b.submit(images, [c.want_mask for c in claims])
        submitted = time.monotonic_ns()
        self._collect()
        b.start(batch)
        now = time.monotonic_ns()
        expected_ns = int(b.expected_ms(batch) * 1e6)
        self.busy_until_ns = now + expected_ns
        # A submit that captured a new graph takes far longer than any batch computes: it
        # cannot be hidden behind one, so it must not stretch the lead. The lead only
        # matters against an expected device time: with none (a graph not timed yet, which
        # is what a capture on first use gives) nothing is learned.
        if expected_ns:
            sample = min(submitted - self.claimed_ns, expected_ns)
            self.submit_ns = ewma(self.submit_ns, sample, LEAD_WEIGHT)
        self.inflight = (claims, batch, now)
        self._finish()

    def device_idle(self, now_ns: int) -> bool:
        """Nothing is computing, or what is will end within ``lead``: a partial batch goes
        now (see the class docstring)."""
        return self.inflight is None or now_ns >= self.busy_until_ns - self.lead_ns

    @property
    def lead_ns(self) -> int:
        return LEAD_FLOOR_NS + int(2 * self.submit_ns)

    def settle(self) -> bool:
        """Nothing to claim now. While a batch computes, lock a staged frame's pages if that
        fits before ``lead`` ahead of its expected end, else sleep until then (a full batch or
        a new request wakes us earlier), then wait for the device; else finish the batch."""
        if self.inflight is not None:
            wake = self.busy_until_ns - self.lead_ns
            now = time.monotonic_ns()
            if self.memory is not None and now < wake and self.memory.pin_within(wake - now):
                return True  # a staged frame's pages locked in the batch's compute time
            if now < wake:
                timeout = min(self.heartbeat_s, (wake - now) / 1e9)
                self.queue.wait_for_work(self.slot, timeout, min_ready=self.policy.max_batch)
                return True
            self._collect()
            return True
        self._finish()
        return False

    def drain(self) -> None:
        self._collect()
        self._finish()

    def _collect(self) -> None:
        if self.inflight is not None:
            self.backend.collect(self.inflight[1])
            self.inflight, self.collected = None, self.inflight

    def _finish(self) -> None:
        """Finish the collected batch on the host, completing each frame as it is done (the
        first frames' replies do not wait for the batch's last), then check that every claim
        got its result: a backend that skips one is a crash, and the supervisor re-queues
        what was not completed."""
        if self.collected is None:
            return
        (claims, batch, started), self.collected = self.collected, None
        done = [False] * len(claims)
        for pos, result in self.backend.finish_each(batch):
            if not 0 <= pos < len(claims) or done[pos]:
                raise RuntimeError(f"finish_each gave batch position {pos} twice or out of range")
            done[pos] = True
            self.complete(claims[pos], result)
        if not all(done):
            missing = [i for i, d in enumerate(done) if not d]
            raise RuntimeError(f"finish_each gave no result for batch positions {missing}")
        self.policy.observe(len(claims), time.monotonic_ns() - started)


def serve(
    queue: RequestQueue, slot: int, backend: Backend, stop: StopFlag, args: argparse.Namespace
) -> int:
    parts = (stop, args.death_fd, args.max_delay_ms, args.heartbeat_ms)
    loop: WorkerLoop
    if isinstance(backend, AsyncBackend):
        loop = PipelinedLoop(queue, slot, backend, *parts)
    else:
        loop = WorkerLoop(queue, slot, backend, *parts)
    try:
        code = loop.run()
    except QueueError as exc:  # e.g. our slot was reclaimed: we must not claim any more
        log_event("worker_left", logging.ERROR, worker=slot, reason=exc)
        return ExitCode.CRASH
    except Exception as exc:  # the asynchronous backend, or its broken contract (PipelinedLoop)
        if not isinstance(loop, PipelinedLoop):
            raise
        log_event("backend_failed", logging.ERROR, worker=slot, reason=repr(exc))
        return ExitCode.CRASH
    if code is ExitCode.OK:
        queue.close()
    return code


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # the supervisor is gone or stopped listening; our exit code still tells


if __name__ == "__main__":
    sys.exit(main())
