"""Typed stub of the C extension ``scratchd.ipc._native`` (source: ipc/_native.c)."""

from collections.abc import Callable
from typing import Final

from _typeshed import WriteableBuffer

# index, generation, request_id, priority, deadline_ns, height, width, want_mask,
# enqueue_ns, part_class, claim_ns, attempt
ClaimRow = tuple[int, int, int, int, int, int, int, bool, int, int, int, int]
# index, generation, state, abandoned, request_id, conn_id, enqueue_ns, part_class, height,
# width, priority, kills, claim_ns, done_ns, worker
FinishedRow = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, int]

class Contended:
    """Why a native operation did not run: :data:`BUSY` or :data:`OWNER_DIED`."""

BUSY: Final[Contended]  # the mutex is held elsewhere; nothing is held by the caller
OWNER_DIED: Final[Contended]  # EOWNERDEAD: the caller now holds the mutex and must repair

class Mutex:
    """A robust, process-shared pthread mutex at ``offset`` of ``buf``; methods return the
    pthread error code (0 on success)."""

    def __init__(self, buf: WriteableBuffer, offset: int) -> None: ...
    def initialize(self) -> int: ...
    def trylock(self) -> int: ...
    def lock(self) -> int: ...
    def clocklock(self, deadline_ns: int) -> int: ...
    def unlock(self) -> int: ...
    def consistent(self) -> int: ...
    def word(self) -> int: ...
    def close(self) -> None: ...

class Core:
    """The hot critical sections (each locks the mutex itself unless ``held``) and the spins."""

    def __init__(
        self,
        buf: WriteableBuffer,
        offsets: dict[str, int],
        fault: Callable[[str], None] | None = None,
        handle: type[tuple[int, int]] | None = None,
    ) -> None: ...
    def submit(self, held: bool, index: int) -> int | Contended: ...
    def submit_request(
        self,
        index: int,
        generation: int,
        request_id: int,
        conn_id: int,
        deadline_ns: int,
        part_class: int,
        height: int,
        width: int,
        priority: int,
        want_mask: bool,
        region: int,
        region_gen: int,
        region_offset: int,
    ) -> int | Contended | None: ...
    def claim(
        self, held: bool, slot: int, pid: int, max_n: int, now_ns: int, lead_ns: int = 0
    ) -> tuple[list[ClaimRow], int] | Contended | None: ...
    def complete(
        self,
        held: bool,
        index: int,
        generation: int,
        attempt: int,
        slot: int,
        pid: int,
        now_ns: int,
    ) -> bool | Contended: ...
    def owns(self, index: int, generation: int, attempt: int, slot: int, pid: int) -> bool: ...
    def collect(self, held: bool) -> list[FinishedRow] | Contended: ...
    # The ready lists, the timing wheel and the done stack; the caller holds the mutex.
    def link(self, index: int) -> None: ...
    def unlink(self, index: int) -> None: ...
    def expire(self, now_ns: int) -> list[int]: ...
    def best(self) -> int: ...
    def earliest_deadline(self) -> int | None: ...
    def finish(self, index: int, state: int, now_ns: int) -> None: ...
    def finished(self, index: int) -> FinishedRow: ...
    def rebuild(self, order: list[int]) -> None: ...
    def ready_total(self) -> int: ...
    def load_ahead(self, priority: int) -> tuple[int, int, int]: ...
    def free_count(self) -> int: ...
    # The main process's free list: a FREE descriptor as a ``handle`` (index, generation),
    # now WRITTEN; None when no more than ``keep`` are FREE.
    def reserve(self, keep: int = 0) -> tuple[int, int] | None: ...
    def push_free(self, index: int) -> None: ...
    def spin_ready(self, min_ready: int, spin_ns: int) -> bool: ...
    def await_done(self, spin_ns: int) -> bool: ...
    def completion_armed(self) -> bool: ...
    def close(self) -> None: ...

def eventfd_ring(fd: int) -> None: ...
def eventfd_drain(fd: int) -> int: ...

# recv_into_exact's ``why``: the buffer is full, the peer closed, the time ran out, the
# caller cancelled; a positive value is the errno recv or poll failed with.
RECV_FULL: Final[int]
RECV_EOF: Final[int]
RECV_TIMEOUT: Final[int]
RECV_CANCELLED: Final[int]
RECV_SLICE_MS: Final[int]  # the longest a cancel waits to be seen

def recv_into_exact(
    fd: int,
    buf: WriteableBuffer,
    timeout_ms: int,
    cancel: WriteableBuffer,
    after: WriteableBuffer | None = None,
) -> tuple[int, int]:
    """Fill ``buf``, then ``after``, from the socket ``fd`` with the GIL released:
    (bytes received, why)."""
