"""What the supervisor and a worker process agree on: argv, the READY line, exit codes.

A worker is started by exec (``python -m scratchd.workers.main``), never by fork, so nothing
the main process holds (the asyncio loop, sockets, a CUDA context) leaks into it. It receives:

- ``--queue NAME --slot N``: the shared-memory queue to attach and its worker-table row;
- ``--ready-fd``: the write end of a pipe; after warm-up (model loaded, one forward pass run)
  the worker writes one line ``READY <device> <model version>\\n`` and closes it. A worker
  that exits before READY failed to boot;
- ``--death-fd``: the read end of a pipe whose write end only the main process holds. It
  becomes readable (EOF) when the main process dies, however it died; the worker also asks
  the kernel for SIGKILL on parent death (``PR_SET_PDEATHSIG``) as a second line of defence;
- ``--work-fd`` / ``--done-fd``: the eventfd doorbells (see ``scratchd.ipc.doorbell``).

A **standby** worker (``--slot -1``, no work doorbell) boots the same way, writes READY, and
then waits, warm, on ``--control-fd`` (one end of a socketpair) for one message
``TAKE <slot>\n`` carrying the slot's work eventfd (SCM_RIGHTS). It then registers in that
slot and serves: replacing a dead worker takes milliseconds instead of a process start, an
interpreter, imports and a model load (about 0.3 s on an idle machine, seconds on a busy one).

Exit codes are named here and mapped to a decision by the supervisor: ``BOOT_ERROR`` halts
the pool with the worker's stderr as the reason (a broken model file must not be respawned
forever); anything else after READY is a crash that is restarted with backoff.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import Final

READY_WORD: Final = "READY"
TAKE_WORD: Final = "TAKE"
STANDBY_SLOT: Final = -1


class ExitCode(enum.IntEnum):
    OK = 0
    """Asked to stop (SIGTERM) and finished the batch in hand."""
    CRASH = 1
    """An unexpected exception after READY (Python's own exit status for one)."""
    BOOT_ERROR = 3
    """Could not attach the queue, load the model or run the warm-up forward."""
    PARENT_GONE = 4
    """The main process died; the worker left without touching the queue further."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to know, passed as command-line flags."""

    queue: str
    slot: int
    backend: str
    model_path: str
    max_batch: int
    max_delay_ms: int
    heartbeat_ms: int
    parent_pid: int
    extra: tuple[str, ...] = ()
    """Backend-specific flags (CUDA: ``--gpu-reserve-mb``, ``--gpu-warm-size``)."""

    def argv(
        self, *, ready_fd: int, death_fd: int, work_fd: int, done_fd: int, control_fd: int = -1
    ) -> list[str]:
        return [
            sys.executable,
            "-m",
            "scratchd.workers.main",
            f"--queue={self.queue}",
            f"--slot={self.slot}",
            f"--backend={self.backend}",
            f"--model={self.model_path}",
            f"--max-batch={self.max_batch}",
            f"--max-delay-ms={self.max_delay_ms}",
            f"--heartbeat-ms={self.heartbeat_ms}",
            f"--parent-pid={self.parent_pid}",
            f"--ready-fd={ready_fd}",
            f"--death-fd={death_fd}",
            f"--work-fd={work_fd}",
            f"--done-fd={done_fd}",
            f"--control-fd={control_fd}",
            *self.extra,
        ]


def ready_line(device: str, version: str) -> bytes:
    return f"{READY_WORD} {device} {version}\n".encode()


def parse_ready(line: bytes) -> tuple[str, str] | None:
    """``(device, version)`` from a READY line, or None if it is not one."""
    parts = line.decode("utf-8", "replace").strip().split(" ", 2)
    if len(parts) != 3 or parts[0] != READY_WORD:
        return None
    return parts[1], parts[2]


def take_message(slot: int) -> bytes:
    return f"{TAKE_WORD} {slot}\n".encode()


def parse_take(message: bytes) -> int | None:
    """The slot of a ``TAKE <slot>`` message, or None."""
    parts = message.decode("ascii", "replace").split()
    if len(parts) != 2 or parts[0] != TAKE_WORD or not parts[1].isdigit():
        return None
    return int(parts[1])


def parse_views(text: str) -> tuple[str, ...]:
    """``--views identity,flip_h`` → the names (the model checks them when it loads)."""
    return tuple(v for v in text.split(",") if v)


def parse_size(text: str) -> tuple[int, int]:
    """``--gpu-warm-size 1024x768`` → ``(height, width)``."""
    h, sep, w = text.lower().partition("x")
    if not sep or not h.isdigit() or not w.isdigit() or int(h) < 1 or int(w) < 1:
        raise ValueError(f"--gpu-warm-size: expected HxW, got {text!r}")
    return int(h), int(w)
