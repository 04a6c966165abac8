"""The queue's value types and the fixed-size result record they are stored as.

``DescState`` is the descriptor lifecycle. Every transition, who makes it and where::

    FREE     → WRITTEN   reserve                                    main     queue.py
    WRITTEN  → FREE      release                                    main     queue.py
    WRITTEN  → QUEUED    submit                                     main     queue.py
    QUEUED   → CLAIMED   claim_batch                                worker   claims.py
    QUEUED   → EXPIRED   claim_batch: deadline within the lead      worker   claims.py
    QUEUED   → FREE      expire_due (answered TIMEOUT at once),     main     queue.py
                         abandon_connection, shed (answered
                         OVERLOADED at once)
    CLAIMED  → DONE      complete                                   worker   claims.py
    CLAIMED  → QUEUED    reclaim_worker: owner died, deadline ahead main     claims.py
    CLAIMED  → EXPIRED   reclaim_worker: owner died, deadline past  main     claims.py
    CLAIMED  → FAILED    reclaim_worker: died holding it max_kills  main     claims.py
    CLAIMED  → FREE      reclaim_worker: owner died, client left    main     claims.py
    DONE | EXPIRED | FAILED → FREE   collect_completed              main     queue.py

Every move to FREE bumps the descriptor's generation, so a :class:`Handle` or :class:`Claim`
from an earlier use is recognisably stale.

A worker's :class:`Result` is written into the descriptor's row of the result table and its
mask slot (bit-packed) by :func:`write_result`, *before* the state flips to DONE; the main
process reads it back with :func:`read_result` after it took the descriptor off the done
stack (nobody writes a finished descriptor's result any more).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import numpy as np

from scratchd.ipc.layout import ERROR_BYTES, HISTOGRAM_BINS, MAX_BOXES, Block, Columns


class QueueError(RuntimeError):
    """Misuse of the queue that the caller must fix (the message says what)."""


class StaleHandle(QueueError):
    """A handle whose descriptor was freed and reused, or is not in the expected state."""


class DescState(enum.IntEnum):
    FREE = 0
    WRITTEN = 1  # reserved by the acceptor, which is filling the input slot
    QUEUED = 2  # in the ready lists and the timing wheel
    CLAIMED = 3  # owned by a worker (worker slot, pid and claim_ns recorded)
    DONE = 4  # result written; waits for collect_completed
    EXPIRED = 5  # deadline passed before a worker got it; answered timeout
    FAILED = 6  # quarantined after killing max_kills workers; answered error


class Status(enum.IntEnum):
    """Reply status codes (the wire protocol names them ok/timeout/overloaded/invalid/error)."""

    OK = 0
    TIMEOUT = 1
    OVERLOADED = 2
    INVALID = 3
    ERROR = 4


_STATUSES = tuple(Status)  # code → member without the (slow) enum call


class WorkerSlotState(enum.IntEnum):
    EMPTY = 0  # no worker (never registered, or reclaimed)
    ACTIVE = 1  # registered; may claim


Box = tuple[float, float, float, float, float]  # x0, y0, x1, y1, score


class Handle(NamedTuple):
    """A descriptor as of one use: index plus the generation it had when handed out.

    A NamedTuple (immutable, hashed and compared in C): built and hashed several times per
    request (reserve, the in-flight table, the connection's set, the completion). Its
    ``index`` field hides tuple's ``index()`` method, which nothing calls on a handle."""

    index: int  # type: ignore[assignment]
    generation: int


def _empty_histogram() -> np.ndarray:
    return np.zeros(HISTOGRAM_BINS, np.uint32)


class Result(msgspec.Struct):
    """What a worker writes back for one request (fixed size in shared memory).

    A msgspec Struct (built in C) rather than a dataclass: one per request on each side of
    the queue. Never encoded."""

    status: Status
    verdict_defect: bool = False
    score: float = 0.0
    boxes: list[Box] = msgspec.field(default_factory=list)  # at most MAX_BOXES are kept
    entropy: float = 0.0
    histogram: np.ndarray = msgspec.field(default_factory=_empty_histogram)  # uint32[64]
    compute_ns: int = 0
    batch_size: int = 0
    error: str = ""  # at most ERROR_BYTES of UTF-8, cut at a character boundary
    mask: np.ndarray | None = None  # uint8 (H, W), 0 or 255; stored one bit per pixel


class Claim(NamedTuple):
    """A request handed to a worker by ``claim_batch``; pass it back to ``complete``.

    A NamedTuple (immutable) because it is built per claimed request on the hot path:
    several times faster to construct than a frozen dataclass."""

    handle: Handle
    request_id: int
    priority: int
    deadline_ns: int
    height: int
    width: int
    want_mask: bool
    enqueue_ns: int
    part_class: int
    claim_ns: int
    attempt: int  # 1 on the first claim; > 1 after its earlier workers died


class Completion(msgspec.Struct):
    """A finished request as the main process sees it (one per submitted request; a
    msgspec Struct, built in C, never encoded)."""

    handle: Handle
    request_id: int
    conn_id: int
    part_class: int
    priority: int
    status: Status
    result: Result | None  # None for TIMEOUT and quarantine (ERROR) completions
    enqueue_ns: int
    claim_ns: int  # 0 if never claimed
    done_ns: int
    worker: int  # worker slot that served it, -1 if none
    error: str = ""  # why, for TIMEOUT / ERROR completions made by the queue itself


@dataclass(frozen=True, slots=True)
class WorkerRow:
    slot: int
    pid: int
    state: WorkerSlotState
    registered_ns: int
    heartbeat_ns: int
    batches: int
    requests: int
    claimed: int  # descriptors it holds right now
    vram_frag: float = float("nan")  # the worker's device arena fragmentation; NaN: none


@dataclass(slots=True)
class ReclaimReport:
    """What ``reclaim_worker`` did with a dead worker's claims."""

    slot: int
    pid: int
    requeued: list[Handle] = field(default_factory=list)
    expired: list[Handle] = field(default_factory=list)
    quarantined: list[Handle] = field(default_factory=list)
    dropped: list[Handle] = field(default_factory=list)  # abandoned by their client: freed


def _clip_utf8(text: str, limit: int) -> bytes:
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode("utf-8")


def write_result(
    fixed: Block,
    r: Columns,
    masks: np.ndarray,
    i: int,
    result: Result,
    height: int,
    width: int,
    between: Callable[[], None] | None = None,
) -> None:
    """Store ``result`` as descriptor ``i``'s result row and mask slot (request ``height × width``).

    Validates first and raises ValueError, writing nothing, for a histogram that is not 64
    bins, a box that is not 5 numbers or a mask whose shape is not ``(height, width)``.
    ``between`` (fault injection) runs after the fixed fields and before the mask.
    """
    hist = np.asarray(result.histogram).ravel()
    if hist.shape != (HISTOGRAM_BINS,):
        raise ValueError(f"histogram has {hist.size} bins, expected {HISTOGRAM_BINS}")
    n_boxes = min(len(result.boxes), MAX_BOXES)
    boxes = (
        np.asarray(result.boxes[:MAX_BOXES], np.float32).reshape(n_boxes, 5) if n_boxes else None
    )
    mask = result.mask
    if mask is not None and mask.shape != (height, width):
        raise ValueError(f"mask shape {mask.shape} != request shape {(height, width)}")
    error = _clip_utf8(result.error, ERROR_BYTES) if result.error else b""
    fixed.pack(
        i, int(result.status), 1 if result.verdict_defect else 0, 0,  # has_mask: below
        n_boxes, len(error), result.batch_size, result.score, result.entropy, result.compute_ns,
    )  # fmt: skip
    r.histogram[i] = hist
    if boxes is not None:
        r.boxes[i, :n_boxes] = boxes
    if error:
        r.error[i, : len(error)] = np.frombuffer(error, np.uint8)
    if between is not None:
        between()
    if mask is not None:
        packed = np.packbits(np.asarray(mask).ravel() != 0)
        masks[i, : len(packed)] = packed
        r.has_mask[i] = 1


def read_result(
    fixed: Block, r: Columns, masks: np.ndarray, i: int, height: int, width: int
) -> Result:
    """The :class:`Result` stored by :func:`write_result` (mask unpacked to 0/255 uint8)."""
    status, verdict, has_mask, n_boxes, n_error, batch, score, entropy, compute = fixed.unpack(i)
    boxes: list[Box] = []
    if n_boxes:
        boxes = [(b[0], b[1], b[2], b[3], b[4]) for b in r.boxes[i, :n_boxes].tolist()]
    mask = None
    if has_mask:
        n = height * width
        bits = np.unpackbits(masks[i, : (n + 7) // 8], count=n)
        mask = (bits * np.uint8(255)).reshape(height, width)
    error = r.error[i, :n_error].tobytes().decode("utf-8", "replace") if n_error else ""
    return Result(
        _STATUSES[status], bool(verdict), score, boxes, entropy, r.histogram[i].copy(),
        compute, batch, error, mask,
    )  # fmt: skip
