"""A worker's boot report: the ``worker_booted`` log line with the boot's parts, and how the
log names a worker."""

from __future__ import annotations

import os
import time
from typing import Any

from scratchd.protocol.log import log_event
from scratchd.workers.backend import Backend
from scratchd.workers.protocol import STANDBY_SLOT


def since_exec_ms() -> float:
    """Milliseconds since this process was exec'd (``/proc/self/stat`` start time; the
    kernel counts it in clock ticks, so ±10 ms)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rpartition(")")[2].split()[19])
    ticks = os.sysconf("SC_CLK_TCK")
    return (time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / ticks) * 1000.0


def where(slot: int) -> str:
    """A worker as the log names it: its slot, or ``standby``."""
    return "standby" if slot == STANDBY_SLOT else str(slot)


def log_boot(slot: int, backend: Backend) -> None:
    """One line with the boot's parts in ms, ``boot_ms`` the total since exec and
    ``boot_ms_<part>`` each part the backend measured (the CUDA backend times its own)."""
    parts: dict[str, Any] = {f"boot_ms_{k}": round(v, 1) for k, v in backend.boot_ms.items()}
    log_event(
        "worker_booted",
        worker=where(slot),
        pid=os.getpid(),
        device=backend.device,
        version=backend.version,
        boot_ms=round(since_exec_ms()),
        **parts,
    )
