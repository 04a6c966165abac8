"""The robust process-shared mutex: exclusion across processes, repair after a dead holder."""

from __future__ import annotations

import mmap
import os
import signal
from collections.abc import Callable

import numpy as np
import pytest

from scratchd.ipc.lock import LockError, RobustMutex


def shared_mutex(repair: Callable[[], None] | None = None) -> tuple[mmap.mmap, RobustMutex]:
    mm = mmap.mmap(-1, 4096)  # MAP_SHARED | MAP_ANONYMOUS: shared with forked children
    mutex = RobustMutex(mm, 0, repair=repair)
    mutex.initialize()
    return mm, mutex


def die_holding(mutex: RobustMutex) -> None:
    mutex.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def fork_child(body: Callable[[], None]) -> int:
    """Fork; the child runs ``body`` and exits. Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    return pid


def run_child(body: Callable[[], None]) -> int:
    """Run ``body`` in a child; its wait status (killed children included)."""
    return os.waitpid(fork_child(body), 0)[1]


def test_holder_killed_inside_the_critical_section_is_repaired_once() -> None:
    repairs: list[int] = []
    _mm, mutex = shared_mutex(lambda: repairs.append(os.getpid()))

    status = run_child(lambda: die_holding(mutex))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    mutex.acquire()  # EOWNERDEAD: repaired, made consistent, held
    assert repairs == [os.getpid()]
    mutex.release()
    with mutex.held():  # an ordinary lock again: no second repair
        pass
    assert repairs == [os.getpid()] and mutex.repairs == 1


def test_a_failing_repair_still_leaves_a_usable_mutex() -> None:
    def broken_repair() -> None:
        raise RuntimeError("repair bug")

    _mm, mutex = shared_mutex(broken_repair)
    run_child(lambda: die_holding(mutex))
    with pytest.raises(RuntimeError, match="repair bug"):
        mutex.acquire()
    assert mutex.try_acquire()  # consistent and released, not ENOTRECOVERABLE
    mutex.release()


def test_try_acquire_sees_another_process_holding_it() -> None:
    _mm, mutex = shared_mutex()
    held_r, held_w = os.pipe()  # child → parent: "I hold it"
    done_r, done_w = os.pipe()  # parent → child: "let go"
    pid = os.fork()
    if pid == 0:
        mutex.acquire()
        os.write(held_w, b"x")
        os.read(done_r, 1)
        mutex.release()
        os._exit(0)
    assert os.read(held_r, 1) == b"x"
    try:
        assert not mutex.try_acquire()
    finally:
        os.write(done_w, b"y")
        os.waitpid(pid, 0)
    assert mutex.try_acquire()
    mutex.release()


def test_mutual_exclusion_across_processes() -> None:
    mm, mutex = shared_mutex()
    counter = np.ndarray((1,), np.int64, buffer=mm, offset=128)
    rounds = 20_000

    def bump() -> None:
        for _ in range(rounds):
            with mutex.held():
                counter[0] = counter[0] + 1  # a read-modify-write: lost updates without the lock

    pids = [fork_child(bump) for _ in range(2)]  # both run at once
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    assert counter[0] == 2 * rounds


def test_unlock_of_a_mutex_not_held_is_an_error() -> None:
    _mm, mutex = shared_mutex()
    with pytest.raises(LockError, match="pthread_mutex_unlock"):
        mutex.release()


def test_offset_must_be_aligned() -> None:
    mm = mmap.mmap(-1, 4096)
    with pytest.raises(LockError, match="aligned"):
        RobustMutex(mm, 8)


def test_a_stopped_holder_is_reported_with_its_thread_id() -> None:
    reported: list[int] = []

    def kill_it(tid: int) -> None:
        reported.append(tid)
        os.kill(tid, signal.SIGKILL)

    mm = mmap.mmap(-1, 4096)
    mutex = RobustMutex(mm, 0, on_stuck=kill_it, stuck_after_s=0.1)
    mutex.initialize()
    held_r, held_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        mutex.acquire()
        os.write(held_w, b"x")
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    assert os.read(held_r, 1) == b"x"
    assert mutex.holder_tid() == pid
    mutex.acquire()  # waits 0.1 s, reports the holder (killed), then EOWNERDEAD: held
    assert reported == [pid] and mutex.repairs == 1
    mutex.release()
    assert os.WTERMSIG(os.waitpid(pid, 0)[1]) == signal.SIGKILL


def test_relocking_by_the_holder_is_an_error_not_a_hang() -> None:
    _mm, mutex = shared_mutex()
    with mutex, pytest.raises(LockError, match="deadlock avoided"):
        mutex.acquire()
    assert mutex.try_acquire()  # released by the with block
    mutex.release()
