"""workers/host_memory.py's pinning thread: client regions page-locked off the batch loop's
thread. A stand-in for CUDA's runtime records what is locked (and can hold a call open, to
place a retire exactly while a piece is being locked); nothing here waits on timing: the
tests wait for the thread to settle and check what must hold whatever the interleaving."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.workers.host_memory import CHUNK, HOST_REGISTER_READ_ONLY, PIN_THREAD_ENV, PinnedHost

SETTLE_S = 60.0  # a bound for a hung thread, never reached by a working one


class ThreadedRuntime:
    """``hostRegister`` / ``hostUnregister`` safe to call from two threads, recording which
    thread called; ``hold`` makes the next read-only lock wait until ``release``."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, read_only_supported: bool = True, fail_with: Exception | None = None):
        self.read_only_supported = read_only_supported
        self.fail_with = fail_with
        self.locked: dict[int, int] = {}
        self.callers: set[str] = set()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self._mutex = threading.Lock()

    def hold(self) -> None:
        self.entered.clear()
        self.release.clear()

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        self.callers.add(threading.current_thread().name)
        if flags & HOST_REGISTER_READ_ONLY:
            if self.fail_with is not None:
                raise self.fail_with
            if not self.read_only_supported:
                raise self.CUDARuntimeError("cudaErrorNotSupported")
            self.entered.set()
            assert self.release.wait(SETTLE_S)
        with self._mutex:
            assert ptr not in self.locked, "page-locked twice"
            self.locked[ptr] = nbytes

    def hostUnregister(self, ptr: int) -> None:
        self.callers.add(threading.current_thread().name)
        with self._mutex:
            del self.locked[ptr]

    def bytes_in(self, a: np.ndarray) -> int:
        with self._mutex:
            return sum(n for p, n in self.locked.items()
                       if a.ctypes.data <= p < a.ctypes.data + a.nbytes)  # fmt: skip


def threaded_host(runtime: ThreadedRuntime) -> PinnedHost:
    host = PinnedHost(SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)), copy_stream=None)
    host.start_pinning()
    return host


def test_regions_are_locked_by_the_thread_and_the_loop_has_nothing_to_do() -> None:
    runtime = ThreadedRuntime()
    host = threaded_host(runtime)
    a, b = np.zeros(2 * CHUNK + 7, np.uint8), np.zeros(CHUNK // 3, np.uint8)
    try:
        host.adopt(a)
        host.adopt(b)
        assert not host.pin_pending()  # the worker loop's idle turn: no work of its own
        assert host.wait_settled(SETTLE_S)
        assert runtime.bytes_in(a) == a.nbytes and runtime.bytes_in(b) == b.nbytes
        assert host.region_bytes_locked == a.nbytes + b.nbytes
        assert host.pieces(a.ctypes.data + CHUNK - 3, 10) == [
            (a.ctypes.data + CHUNK - 3, 3), (a.ctypes.data + CHUNK, 7),
        ]  # fmt: skip
        assert runtime.callers == {"scratchd-pin"}  # no CUDA call on the caller's thread
        host.retire(a)
        assert not host.registered(a.ctypes.data, 1)  # out of the lookup at once
        assert host.wait_settled(SETTLE_S)
        assert runtime.bytes_in(a) == 0 and runtime.bytes_in(b) == b.nbytes
        assert host.region_bytes_locked == b.nbytes
    finally:
        host.unregister_all()
    assert runtime.locked == {}


def test_a_region_retired_while_its_piece_is_being_locked_is_never_looked_up_and_is_unlocked(
) -> None:  # fmt: skip
    runtime = ThreadedRuntime()
    host = threaded_host(runtime)
    a = np.zeros(CHUNK, np.uint8)
    runtime.hold()
    host.adopt(a)
    assert runtime.entered.wait(SETTLE_S)  # the thread is inside hostRegister, lock not held
    host.retire(a)  # the worker unmaps it meanwhile: not blocked by the call in progress
    assert not host.registered(a.ctypes.data, 1)
    runtime.release.set()
    assert host.wait_settled(SETTLE_S)
    assert not host.registered(a.ctypes.data, 1)
    assert runtime.locked == {}  # the piece locked late was unlocked, not leaked
    host.unregister_all()


def test_stopping_waits_for_the_piece_in_progress_then_undoes_everything() -> None:
    runtime = ThreadedRuntime()
    host = threaded_host(runtime)
    slots, a = np.zeros(4096, np.uint8), np.zeros(3 * CHUNK, np.uint8)
    host.register(slots)
    runtime.hold()
    host.adopt(a)
    assert runtime.entered.wait(SETTLE_S)
    stopper = threading.Thread(target=host.unregister_all)
    stopper.start()
    runtime.release.set()
    stopper.join(SETTLE_S)
    assert not stopper.is_alive()
    assert runtime.locked == {} and host.ranges == {}


def test_a_failure_on_the_thread_is_raised_on_the_worker_loops_thread() -> None:
    runtime = ThreadedRuntime(fail_with=MemoryError("no pages"))
    host = threaded_host(runtime)
    host.adopt(np.zeros(CHUNK, np.uint8))
    with pytest.raises(RuntimeError, match="page-locking client regions failed") as info:
        host.wait_settled(SETTLE_S)
    assert isinstance(info.value.__cause__, MemoryError)
    with pytest.raises(RuntimeError, match="page-locking client regions failed"):
        host.pin_pending()  # the loop's idle turn re-raises it: the worker is replaced
    host.unregister_all()


def test_a_device_refusing_read_only_locks_leaves_regions_staged_with_the_thread_idle() -> None:
    runtime = ThreadedRuntime(read_only_supported=False)
    host = threaded_host(runtime)
    a = np.zeros(CHUNK, np.uint8)
    host.adopt(a)
    assert host.wait_settled(SETTLE_S)
    assert not host.registered(a.ctypes.data, 1) and runtime.locked == {}
    host.adopt(np.zeros(CHUNK, np.uint8))  # not tried again
    assert host.wait_settled(SETTLE_S) and runtime.locked == {}
    host.unregister_all()


def test_the_idle_turn_mode_can_be_chosen_for_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = ThreadedRuntime()
    monkeypatch.setenv(PIN_THREAD_ENV, "0")
    host = threaded_host(runtime)  # start_pinning starts nothing
    host.adopt(np.zeros(CHUNK + 1, np.uint8))
    assert host.pin_pending() and not host.pin_pending()
    assert runtime.callers == {threading.current_thread().name}
    host.unregister_all()
    monkeypatch.setenv(PIN_THREAD_ENV, "yes")
    with pytest.raises(ValueError, match=PIN_THREAD_ENV):
        threaded_host(ThreadedRuntime())


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["map", "unmap", "look"]), st.integers(0, 3)),
                    max_size=40))  # fmt: skip
def test_whatever_the_interleaving_lookups_see_only_locked_mapped_memory(
    ops: list[tuple[str, int]],
) -> None:
    """Maps, unmaps and lookups from the worker's thread while the pinning thread runs:
    every piece a lookup returns is locked and mapped at that moment; once settled, mapped
    regions are locked whole and unmapped ones not at all."""
    runtime = ThreadedRuntime()
    host = threaded_host(runtime)
    arrays = [np.zeros(n, np.uint8) for n in (CHUNK // 2, CHUNK, 2 * CHUNK + 1, 5)]
    mapped: set[int] = set()
    try:
        for op, i in ops:
            a = arrays[i]
            if op == "map":
                host.adopt(a)
                mapped.add(i)
            elif op == "unmap":
                host.retire(a)
                mapped.discard(i)
            else:
                for ptr, n in host.pieces(a.ctypes.data, a.nbytes) or []:
                    assert i in mapped
                    with runtime._mutex:
                        assert any(p <= ptr and ptr + n <= p + m for p, m in runtime.locked.items())
        assert host.wait_settled(SETTLE_S)
        for i, a in enumerate(arrays):
            assert runtime.bytes_in(a) == (a.nbytes if i in mapped else 0)
            assert host.registered(a.ctypes.data, a.nbytes) == (i in mapped)
    finally:
        host.unregister_all()
    assert runtime.locked == {}
