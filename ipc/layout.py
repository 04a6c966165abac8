"""The byte layout of the queue's shared-memory segment: geometry, regions, record dtypes.

One POSIX shared-memory object ``/scratchd-<instance>`` (mode 0600), created and owned by the
daemon's main process, mapped by every worker. Every region starts on a 64-byte boundary
(the payload and mask regions on a 4096-byte page, so a GPU worker can register them)::

    offset 0
    ┌──────────────────────────────────────────────────────────────────────────┐
    │ header (HEADER_DTYPE, 512 B)                                             │
    │   magic "SCRATCHQ", layout version, geometry, region offsets, total size │
    │   owner pid, clock base, enqueue sequence, waiting-worker bitmask,       │
    │   wheel cursor, done-stack head, counters, worker spin time,             │
    │   completion-armed flag                                                  │
    │   · robust pthread mutex at MUTEX_OFFSET (64 B)                          │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ descriptor table   slots × DESC_DTYPE   request block (written by one    │
    │                    C call), state, generation, owner, links              │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ result table       slots × RESULT_DTYPE fixed-size results (worker out)  │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ worker table       max_workers × WORKER_DTYPE  pid, heartbeat, counters  │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ region table       MAX_REGIONS × REGION_DTYPE  clients' mapped regions   │
    │                    (fd in the main process, inode, size, generation)     │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ queue index        int32: ready head[8] · ready tail[8] · ready count[8] │
    │                    · wheel bucket head[wheel_ticks]                      │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ input slots        slots × slot_bytes   raw uint8 greyscale, row-major   │
    ├──────────────────────────────────────────────────────────────────────────┤
    │ mask slots         slots × ceil(slot_bytes/8)  np.packbits(mask.ravel()) │
    └──────────────────────────────────────────────────────────────────────────┘

Who writes what (``ipc/queue.py``'s docstring gives the order of writes inside the lock;
``ipc/shm.py`` creates, maps and removes the segment):

- a descriptor's ``state`` FREE ↔ WRITTEN and its ``generation``: the main process only
  (the only process that reserves and frees), without the lock; workers never look at
  FREE or WRITTEN descriptors.
- header geometry, offsets, magic, owner fields: the creator, once, before anyone attaches;
  read-only afterwards. The mutex is initialised by the creator, then used by everyone.
- header sequence, waiting bitmask, wheel cursor, counters; the queue index; descriptor
  fields ``state`` (every other transition), links and ownership: any process, only while
  holding the mutex.
- a descriptor's request fields and its input slot: the main process while the descriptor is
  WRITTEN (it owns it; no lock needed until ``submit`` publishes it).
- a descriptor's result row and mask slot: the claiming worker while the descriptor is
  CLAIMED by it, *before* it flips the state to DONE under the mutex.
- a worker row's heartbeat, counters and ``vram_frag``: that worker only (single writer, no
  lock); its ``pid``/``state``: ``register_worker`` and ``reclaim_worker`` under the mutex.
- a region row (``ipc/region_table.py``): the main process only, without the lock; a row
  changes only while no request names it (its fields first, then ``generation``, then
  ``live``), so a worker reading the row of a request it has claimed sees it whole.
- header ``worker_spin_ns``: the creator, once. ``completion_armed``: the main process only,
  without the lock (a store/fence/load handshake with the workers, ``ipc/queue.py``).
  ``main_cpu`` / ``worker_cpu``: the main process / any worker while it spins, without the
  lock; hints only (whether to yield the CPU between looks), never needed for correctness.

The C fast path (``ipc/_native.c``) reads the same bytes: :func:`native_offsets` hands it
every offset it uses, after checking each field's dtype against the C type it is read as
(:data:`NATIVE_FIELDS`), so this module stays the single source of the layout; so does
:func:`result_offsets` for ``ipc/_results.c``, which reads the result rows.
"""

from __future__ import annotations

import mmap
import struct
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from scratchd.ipc.lock import MUTEX_BYTES
from scratchd.protocol.wire import PRIORITIES

MAGIC = b"SCRATCHQ"
LAYOUT_VERSION = 6  # raised with every change to the layout: a process never maps another's
MAX_BOXES = 64
HISTOGRAM_BINS = 64  # input intensities (kernels/postprocess.py): bin i holds values 4i..4i+3
NS_PER_MS = 1_000_000  # the queue's clock is time.monotonic_ns; config and replies count ms
NS_PER_S = 1_000_000_000
ERROR_BYTES = 200
NIL = -1  # "no descriptor" in every link and list head
MAX_REGIONS = 256  # rows of the region table: client regions mapped at once, all connections

HEADER_BYTES = 512
MUTEX_OFFSET = 448  # last 64 bytes of the header, 64-byte aligned

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("header_bytes", "<u4"),
        ("slots", "<u4"),
        ("max_workers", "<u4"),
        ("slot_bytes", "<u8"),
        ("tick_ms", "<u4"),
        ("wheel_ticks", "<u4"),
        ("total_bytes", "<u8"),
        ("desc_off", "<u8"),
        ("result_off", "<u8"),
        ("worker_off", "<u8"),
        ("region_off", "<u8"),
        ("index_off", "<u8"),
        ("input_off", "<u8"),
        ("mask_off", "<u8"),
        ("owner_pid", "<i8"),
        ("clock_base_ns", "<i8"),
        ("seq", "<u8"),  # enqueue sequence (FIFO tie-break)
        ("waiting", "<u8"),  # bit w set: worker slot w sleeps on its work doorbell
        ("wheel_cursor", "<i8"),  # every tick < cursor has been fully expired
        ("done_head", "<i4"),  # stack of finished descriptors (DONE/EXPIRED/FAILED), via rnext
        ("repairs", "<u8"),  # index rebuilds after a dead lock holder
        ("expired", "<u8"),  # requests answered timeout
        ("requeued", "<u8"),  # claims returned to the queue by reclaim_worker
        ("quarantined", "<u8"),  # requests failed after killing max_kills workers
        ("abandoned", "<u8"),  # requests dropped because their client left
        ("worker_spin_ns", "<i8"),  # how long a worker spins for work before it sleeps
        ("completion_armed", "<u4"),  # 1: ring the completion eventfd; 0: main looks anyway
        ("main_cpu", "<i4"),  # CPU the main process last spun on (-1: never); a hint
        ("worker_cpu", "<i4"),  # CPU a worker last spun on (-1: never); a hint
    ],
    align=True,
)
assert HEADER_DTYPE.itemsize <= MUTEX_OFFSET
assert MUTEX_OFFSET + MUTEX_BYTES <= HEADER_BYTES

DESC_DTYPE = np.dtype(
    [
        # The request block: written by the acceptor while it owns the descriptor (WRITTEN),
        # in one C call (``_native.Core.submit_request``, request_id .. region_offset).
        ("request_id", "<u8"),
        ("conn_id", "<u8"),
        ("enqueue_ns", "<i8"),
        ("deadline_ns", "<i8"),
        ("part_class", "<i4"),
        ("height", "<u4"),
        ("width", "<u4"),
        ("priority", "u1"),
        ("want_mask", "u1"),
        ("abandoned", "u1"),  # client gone: free instead of completing
        ("kills", "u1"),  # workers that died holding this request
        # Where the pixels are: 0, the input slot; else row region - 1 of the region table,
        # as registered under region_gen, at byte region_offset (ipc/region_table.py).
        ("region", "<u4"),
        ("region_gen", "<u4"),
        ("region_offset", "<u8"),
        # Lifecycle (under the lock, except FREE <-> WRITTEN by the main process).
        ("state", "u1"),  # DescState
        ("generation", "<u4"),  # bumped on every move to FREE (so on every reuse)
        ("attempt", "<u4"),  # claims of this request so far; binds a Claim to one claim
        ("seq", "<u8"),  # enqueue sequence number: FIFO among equal deadlines
        # Ownership (claim, reclaim) and completion time.
        ("worker", "<i4"),  # claiming worker slot, NIL when not claimed
        ("worker_pid", "<i4"),
        ("claim_ns", "<i8"),
        ("done_ns", "<i8"),
        # Index links (derived; rebuilt by repair).
        ("rnext", "<i4"),  # ready list links (per priority, deadline then seq order);
        # for a finished descriptor, rnext links the done stack instead
        ("rprev", "<i4"),
        ("wnext", "<i4"),  # timing-wheel bucket links
        ("wprev", "<i4"),
        ("wbucket", "<i4"),  # the wheel bucket it is linked into
    ],
    align=True,
)

RESULT_DTYPE = np.dtype(
    [
        ("status", "u1"),  # Status
        ("verdict", "u1"),
        ("has_mask", "u1"),
        ("n_boxes", "<u2"),
        ("error_len", "<u2"),
        ("batch_size", "<u4"),
        ("score", "<f4"),
        ("entropy", "<f4"),
        ("compute_ns", "<i8"),
        ("histogram", "<u4", (HISTOGRAM_BINS,)),
        ("boxes", "<f4", (MAX_BOXES, 5)),
        ("error", "u1", (ERROR_BYTES,)),
    ],
    align=True,
)
RESULT_FIELDS = ("status", "compute_ns")  # the fixed-size scalars, one struct call

REGION_DTYPE = np.dtype(
    [
        ("generation", "<u4"),  # bumped each time a region is published into the row
        ("live", "u1"),  # 1 while published; 0 once released (the row is free)
        ("fd", "<i4"),  # the region's descriptor in the main process (workers open it there)
        ("size", "<u8"),  # bytes a worker may map and read
        ("dev", "<u8"),  # st_dev, st_ino of the memfd: a worker checks what it opened
        ("ino", "<u8"),
    ],
    align=True,
)

WORKER_DTYPE = np.dtype(
    [
        ("pid", "<i4"),
        ("state", "u1"),  # WorkerSlotState (queue module)
        ("registered_ns", "<i8"),
        ("heartbeat_ns", "<i8"),
        ("batches", "<u8"),
        ("requests", "<u8"),
        ("vram_frag", "<f4"),  # a GPU worker's arena fragmentation ratio; NaN: no arena
    ],
    align=True,
)


class Columns:
    """Per-field views of a structured table, as attributes, for fast scalar access.

    A scalar field is a strided ``memoryview`` over the numpy column (``cols.state[i]``
    reads a Python int, several times faster than a numpy scalar read, and a numpy scalar
    compared with an IntEnum is slower still). Sub-array fields (histogram, boxes, error) stay
    numpy arrays. Vector work (scans, counts) uses the numpy table itself.
    """

    def __init__(self, table: np.ndarray) -> None:
        assert table.dtype.names is not None
        for name in table.dtype.names:
            column = table[name]
            setattr(self, name, column.data if column.ndim == 1 else column)

    if TYPE_CHECKING:  # for mypy only: the fields are set dynamically; a real __getattr__
        # would route every field read through a slower lookup than a plain attribute's

        def __getattr__(self, name: str) -> Any: ...


_STRUCT_CODES = {
    ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
    ("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q", ("f", 4): "f", ("f", 8): "d",
}  # fmt: skip


class Block:
    """Consecutive scalar fields of a table row, packed or unpacked with one struct call
    (about the cost of one field read through a view, for the lot)."""

    def __init__(self, buf: mmap.mmap, table_offset: int, dtype: np.dtype, span: tuple[str, str]):
        names, fields = list(dtype.names or ()), dtype.fields
        assert fields is not None
        chosen = names[names.index(span[0]) : names.index(span[1]) + 1]
        start = pos = fields[span[0]][1]
        fmt = "<"
        for name in chosen:
            dt, off = fields[name][:2]
            fmt += "x" * (off - pos) + _STRUCT_CODES[(dt.kind, dt.itemsize)]
            pos = off + dt.itemsize
        self.names = tuple(chosen)
        self._struct = struct.Struct(fmt)
        self._buf, self._start, self._stride = buf, table_offset + start, dtype.itemsize

    def pack(self, i: int, *values: int | float) -> None:
        self._struct.pack_into(self._buf, self._start + i * self._stride, *values)

    def unpack(self, i: int) -> tuple[Any, ...]:
        return self._struct.unpack_from(self._buf, self._start + i * self._stride)


class Geometry(msgspec.Struct, frozen=True):
    """Sizes of the segment, from the ``[queue]`` config section (immutable once created)."""

    slots: int = 256  # descriptors, input slots and mask slots
    slot_bytes: int = 4 * 1024 * 1024  # largest raw greyscale image, H*W bytes
    tick_ms: int = 1  # timing-wheel resolution
    max_workers: int = 64  # rows of the worker table; ≤ 64 (the waiting bitmask is a u64)
    wheel_ticks: int = 4096  # buckets; deadlines further out wrap and wait for their round

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        limits = {
            "slots": (1, 1 << 20),
            "slot_bytes": (1, 1 << 34),
            "tick_ms": (1, 60_000),
            "max_workers": (1, 64),
            "wheel_ticks": (1, 1 << 22),
        }
        for field, (low, high) in limits.items():
            value = getattr(self, field)
            if not low <= value <= high:
                raise ValueError(f"queue geometry: {field}={value} outside [{low}, {high}]")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def mask_bytes(slot_bytes: int) -> int:
    """Bytes of one mask slot: a bit per input pixel."""
    return (slot_bytes + 7) // 8


def layout(g: Geometry) -> dict[str, int]:
    """Region offsets and the total size for geometry ``g`` (the header records them)."""
    off: dict[str, int] = {}
    at = HEADER_BYTES
    regions = [
        ("desc_off", g.slots * DESC_DTYPE.itemsize, 64),
        ("result_off", g.slots * RESULT_DTYPE.itemsize, 64),
        ("worker_off", g.max_workers * WORKER_DTYPE.itemsize, 64),
        ("region_off", MAX_REGIONS * REGION_DTYPE.itemsize, 64),
        ("index_off", (3 * PRIORITIES + g.wheel_ticks) * 4, 64),
        ("input_off", g.slots * g.slot_bytes, 4096),
        ("mask_off", g.slots * mask_bytes(g.slot_bytes), 4096),
    ]
    for name, size, align in regions:
        at = _align(at, align)
        off[name] = at
        at += size
    off["total_bytes"] = _align(at, 4096)
    return off


# The fields ipc/_native.c reads or writes, with the dtype its C code reads them as.
NATIVE_FIELDS: dict[str, tuple[np.dtype, dict[str, str]]] = {
    "h": (HEADER_DTYPE, {
        "seq": "<u8", "waiting": "<u8", "expired": "<u8", "wheel_cursor": "<i8",
        "done_head": "<i4", "completion_armed": "<u4", "main_cpu": "<i4", "worker_cpu": "<i4",
    }),
    "d": (DESC_DTYPE, {
        "priority": "u1", "abandoned": "u1", "state": "u1", "generation": "<u4",
        "attempt": "<u4", "seq": "<u8", "worker": "<i4", "worker_pid": "<i4",
        "claim_ns": "<i8", "done_ns": "<i8", "rnext": "<i4", "rprev": "<i4", "wnext": "<i4",
        "wprev": "<i4", "wbucket": "<i4", "deadline_ns": "<i8", "request_id": "<u8",
        "conn_id": "<u8", "enqueue_ns": "<i8", "part_class": "<i4", "height": "<u4",
        "width": "<u4", "want_mask": "u1", "kills": "u1", "region": "<u4",
        "region_gen": "<u4", "region_offset": "<u8",
    }),
    "w": (WORKER_DTYPE, {"pid": "<i4", "state": "u1", "batches": "<u8", "requests": "<u8"}),
}  # fmt: skip


def native_offsets(header: np.ndarray) -> dict[str, int]:
    """Everything ``_native.Core`` needs to find its fields in a mapped segment whose
    header is ``header``: field offsets (``"d.state"``: within a descriptor row, ``"h.seq"``:
    in the segment), region offsets, strides and geometry."""
    out: dict[str, int] = {}
    for prefix, (dtype, wanted) in NATIVE_FIELDS.items():
        fields = dtype.fields
        assert fields is not None
        for name, code in wanted.items():
            field_dtype, offset = fields[name][:2]
            assert field_dtype == np.dtype(code), f"{prefix}.{name}: C reads it as {code}"
            out[f"{prefix}.{name}"] = offset
    index = int(header["index_off"])
    out.update(
        desc_off=int(header["desc_off"]), desc_stride=DESC_DTYPE.itemsize,
        slots=int(header["slots"]), worker_off=int(header["worker_off"]),
        worker_stride=WORKER_DTYPE.itemsize, max_workers=int(header["max_workers"]),
        ready_head=index, ready_tail=index + 4 * PRIORITIES, ready_count=index + 8 * PRIORITIES,
        wheel_head=index + 12 * PRIORITIES, wheel_ticks=int(header["wheel_ticks"]),
        base_ns=int(header["clock_base_ns"]), tick_ns=int(header["tick_ms"]) * NS_PER_MS,
        mutex=MUTEX_OFFSET,
    )  # fmt: skip
    return out


# The result row's fields ipc/_results.c reads, with the C type it reads them as.
RESULT_NATIVE_FIELDS: dict[str, str] = {
    "status": "u1", "verdict": "u1", "has_mask": "u1", "n_boxes": "<u2", "error_len": "<u2",
    "batch_size": "<u4", "score": "<f4", "entropy": "<f4", "compute_ns": "<i8",
    "boxes": "<f4", "error": "u1",
}  # fmt: skip


def result_offsets(header: np.ndarray) -> dict[str, int]:
    """Everything ``_results.Reader`` needs to read a mapped segment's result rows: the
    table's offset and stride, each field's offset in a row (``"r.score"``; a sub-array's
    item type checked), the slots and the sub-arrays' sizes."""
    out: dict[str, int] = {}
    fields = RESULT_DTYPE.fields
    assert fields is not None
    for name, code in RESULT_NATIVE_FIELDS.items():
        field_dtype, offset = fields[name][:2]
        item = field_dtype.base if field_dtype.subdtype else field_dtype
        assert item == np.dtype(code), f"r.{name}: C reads it as {code}"
        out[f"r.{name}"] = offset
    out.update(
        result_off=int(header["result_off"]), result_stride=RESULT_DTYPE.itemsize,
        slots=int(header["slots"]), max_boxes=MAX_BOXES, error_bytes=ERROR_BYTES,
    )  # fmt: skip
    return out
