"""Which backend a daemon runs, and on which cards: decided in the main process with NVML
only (the main process never creates a CUDA context; workers are exec'd and do).

``workers.backend``:

- ``cpu``: CPU workers (``workers.cpu_workers`` of them).
- ``cuda``: one worker per card of ``workers.gpus`` (``"all"``: every card NVML lists, in
  NVML's order). No card, no NVML library, or no CuPy is a configuration error that says which.
- ``auto``: ``cuda`` when all of that is present, else ``cpu`` — and the start log says why.

Cards are named by NVML index. NVML counts them in PCI bus id order, CUDA by default fastest
first, so the supervisor starts each worker with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` beside
``CUDA_VISIBLE_DEVICES=<NVML index>``: only then does CUDA open the card NVML means.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from scratchd.daemon.config import Config, ConfigError
from scratchd.workers.gpu_memory import nvml


@dataclass(frozen=True)
class Placement:
    backend: Literal["cpu", "cuda"]
    gpus: list[int]  # NVML indices (see the module docstring); empty for cpu
    workers: int
    why: str  # one line for the start log


def visible_gpu_count() -> tuple[int, str]:
    """``(cards NVML sees, "")`` or ``(0, why not)``."""
    if importlib.util.find_spec("cupy") is None:
        return 0, "CuPy is not installed (pip install 'scratchd[cuda]')"
    try:
        count = int(nvml().nvmlDeviceGetCount())
    except Exception as exc:  # no library, no driver: NVML raises its own error types
        return 0, f"NVML unavailable: {exc}"
    return count, "" if count else "NVML lists no GPU"


def place(
    config: Config, count_gpus: Callable[[], tuple[int, str]] = visible_gpu_count
) -> Placement:
    """The backend and cards for ``config`` (``count_gpus`` is replaceable for tests)."""
    w = config.workers
    if w.backend == "cpu":
        return Placement("cpu", [], w.cpu_workers, "workers.backend = 'cpu'")
    count, why_not = count_gpus()
    if count == 0:
        if w.backend == "cuda":
            raise ConfigError(f"workers.backend = 'cuda' but {why_not}")
        return Placement("cpu", [], w.cpu_workers, f"auto: CPU ({why_not})")
    gpus = list(range(count)) if w.gpus == "all" else list(w.gpus)
    missing = [g for g in gpus if g >= count]
    if missing:
        raise ConfigError(f"workers.gpus names card(s) {missing}, but NVML lists {count}")
    if not gpus or len(set(gpus)) != len(gpus):
        raise ConfigError(f"workers.gpus must name distinct cards, got {w.gpus}")
    return Placement("cuda", gpus, len(gpus), f"{w.backend}: CUDA on cards {gpus}")
