"""One worker process as the supervisor sees it: launching it, its READY pipe, its exit.

The supervisor (``daemon/pool/supervisor.py``) decides *when*; this module knows *how*: the exec
of ``python -m scratchd.workers.main`` with exactly the file descriptors it needs
(``pass_fds``: its READY pipe's write end, the shared death pipe's read end, its own work
doorbell and the completion doorbell; nothing else is inherited), its environment (BLAS
threads = cores / workers), a pidfd for its exit, and what it said on the READY pipe.

Test-only fault injection: ``SCRATCHD_WORKER_FAULT="<name>=<point>"`` in the daemon's
environment arms the queue's fault point (``scratchd.ipc.faults``) in the *first* process
of worker ``<name>`` only, so that its replacement serves normally; ``*=<point>`` arms it in
every worker process (a request that kills whoever takes it: quarantine).
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Final

from scratchd.ipc.faults import ENV as FAULT_ENV
from scratchd.ipc.queue import RequestQueue
from scratchd.workers.protocol import (
    STANDBY_SLOT,
    ExitCode,
    WorkerSpec,
    parse_ready,
    take_message,
)

WORKER_FAULT_ENV: Final = "SCRATCHD_WORKER_FAULT"
MAX_BACKOFF_S: Final = 10.0
STABLE_AFTER_S: Final = 30.0
"""A worker (or standby) READY this long has its restart backoff reset."""
BLAS_THREAD_VARS: Final = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    EXITED = "exited"


@dataclass
class Worker:
    """One worker process as the supervisor tracks it."""

    id: int
    device: str
    slot: int
    proc: subprocess.Popen[bytes]
    pidfd: int
    ready_fd: int
    state: WorkerState = WorkerState.STARTING
    started_ns: int = field(default_factory=time.monotonic_ns)
    ready_ns: int = 0
    term_ns: int = 0
    version: str = ""
    retiring: bool = False
    boot_message: bytes = b""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    control: socket.socket | None = None
    """Our end of a standby's control socketpair (None once it serves, or for others)."""
    group: int = 0
    """The standby group (the card, for CUDA) this worker belongs to (supervisor.py)."""

    @property
    def name(self) -> str:
        return f"{self.device}{self.id}" if self.id >= 0 else f"{self.device}-standby"

    @property
    def standby(self) -> bool:
        return self.slot == STANDBY_SLOT

    def take_boot_output(self, chunk: bytes) -> bool:
        """Add what the READY pipe delivered; True once a whole READY line has arrived."""
        self.boot_message += chunk
        first, newline, _ = self.boot_message.partition(b"\n")
        parsed = parse_ready(first) if newline else None
        if parsed is None or self.state is not WorkerState.STARTING:
            return False
        _device, self.version = parsed
        self.state = WorkerState.READY
        self.ready_ns = time.monotonic_ns()
        self.ready.set()
        return True

    def boot_reason(self) -> str:
        """What a worker that failed to boot wrote on its READY pipe."""
        text = self.boot_message.decode("utf-8", "replace").strip()
        return text.removeprefix("BOOT_ERROR").strip() or "no reason given (see its stderr)"


@dataclass
class Lineage:
    """What survives a worker's replacement: restarts and the backoff state of logical id."""

    restarts: int = 0
    spawned: int = 0
    failures: int = 0
    boot_failures: int = 0
    last_restart_s: float = 0.0
    pending: asyncio.TimerHandle | None = None


def launch(
    wid: int,
    device: str,
    spec: WorkerSpec,
    queue: RequestQueue,
    death_r: int,
    env: dict[str, str],
) -> Worker:
    """Exec the worker process described by ``spec`` (``spec.slot == STANDBY_SLOT``: a
    standby, given a control socket instead of a work doorbell); READY pipe non-blocking."""
    ready_r, ready_w = os.pipe()
    done_fd = queue.completion_fd
    control, child_control = None, None
    if spec.slot == STANDBY_SLOT:
        control, child_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        work_fd, extra = -1, child_control.fileno()
    else:
        work_fd = extra = queue.work_fd(spec.slot)
    argv = spec.argv(
        ready_fd=ready_w,
        death_fd=death_r,
        work_fd=work_fd,
        done_fd=done_fd,
        control_fd=child_control.fileno() if child_control else -1,
    )
    try:
        proc = subprocess.Popen(
            argv, pass_fds=(ready_w, death_r, extra, done_fd), env=env, stdin=subprocess.DEVNULL
        )
    except BaseException:
        os.close(ready_r)
        if control is not None:
            control.close()
        raise
    finally:
        os.close(ready_w)
        if child_control is not None:
            child_control.close()
    os.set_blocking(ready_r, False)
    return Worker(
        id=wid,
        device=device,
        slot=spec.slot,
        proc=proc,
        pidfd=os.pidfd_open(proc.pid),
        ready_fd=ready_r,
        control=control,
    )


def hand_over(standby: Worker, slot: int, work_fd: int) -> bool:
    """Tell a warm standby to serve ``slot`` (its work eventfd travels with the message);
    False if it is gone. The standby registers in the slot itself."""
    assert standby.control is not None
    try:
        socket.send_fds(standby.control, [take_message(slot)], [work_fd])
    except OSError:
        return False
    finally:
        standby.control.close()
        standby.control = None
    return True


def worker_env(name: str, workers: int, *, arm_fault: bool) -> dict[str, str]:
    """The environment of worker ``name``: ours, BLAS threads = cores / workers, and the
    test-only fault point when ``arm_fault`` (see the module docstring)."""
    threads = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    env = dict(os.environ)
    for var in BLAS_THREAD_VARS:
        env.setdefault(var, threads)
    env.pop(FAULT_ENV, None)
    target, _, point = os.environ.get(WORKER_FAULT_ENV, "").partition("=")
    if point and (target == "*" or (target == name and arm_fault)):
        env[FAULT_ENV] = point
    return env


def restart_delay(failures: int) -> float:
    """Backoff before respawning after the ``failures``-th death in a row: the first
    replacement starts at once (a killed worker must serve again within a second), then
    0.1 s, 0.2 s, 0.4 s, … up to 10 s."""
    return 0.0 if failures <= 1 else min(0.1 * 2 ** (failures - 2), MAX_BACKOFF_S)


def describe_exit(code: int) -> str:
    """``signal SIGKILL`` / ``code 3 (BOOT_ERROR)`` for a Popen return code."""
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    try:
        return f"code {code} ({ExitCode(code).name})"
    except ValueError:
        return f"code {code}"
