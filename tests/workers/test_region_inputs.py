"""A worker process reads a request's pixels from the client region its descriptor names, in
place, and answers a request whose region it cannot read ``error`` alone, the rest of its batch
served (workers/main.py ``WorkerLoop.inputs``); workers/host_memory.py's page-locking of read-only
mappings, with a stand-in for CUDA's runtime (the GPU path itself: tests/workers/test_cuda.py)."""

from __future__ import annotations

import fcntl
import io
import itertools
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scratchd.ipc.queue import Geometry, RequestQueue, Status
from scratchd.ipc.regions import Region
from scratchd.model.scratchnet import load_model
from scratchd.protocol.image import decode_image
from scratchd.protocol.log import configure, parse_line
from scratchd.workers.host_memory import (
    CHUNK,
    FIRST_NS_PER_MIB,
    HOST_REGISTER_READ_ONLY,
    PAGE,
    PinnedHost,
)
from scratchd.workers.protocol import ExitCode

from .test_main import MODEL, spawn, wait_completions


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(
        f"/scratchd-test-region-worker-{os.getpid()}",
        Geometry(slots=8, slot_bytes=1 << 18, max_workers=4),
    )
    yield q
    q.close()


def sealed_region(images: list[np.ndarray]) -> Region:
    data = b"".join(i.tobytes() for i in images)
    fd = os.memfd_create("scratchd-region-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return Region.from_descriptor(1, fd, len(data))
    finally:
        os.close(fd)


def test_a_worker_reads_region_pixels_in_place_and_answers_an_unreadable_one_alone(
    queue: RequestQueue, data_dir: Path
) -> None:
    images = [
        decode_image((data_dir / "sd900" / "images" / f"Sc_{i}.png").read_bytes())[:128, :160]
        for i in (1, 2)
    ]
    images = [np.ascontiguousarray(i) for i in images]
    region = sealed_region(images)
    assert queue.regions.publish(region) and region.row is not None
    offsets = [0, images[0].size]
    named = [(region.row, region.generation, o) for o in offsets]
    named.insert(1, (region.row, region.generation + 1, 0))  # a generation never published
    worker = spawn(queue)
    try:
        assert worker.read_ready()
        for rid, where in enumerate(named):
            h = queue.reserve()
            assert h is not None
            queue.submit(
                h, request_id=rid, conn_id=1, priority=0, part_class=0,
                deadline_ns=time.monotonic_ns() + 60 * 10**9, height=128, width=160,
                want_mask=True, region=where,
            )  # fmt: skip
        done = sorted(wait_completions(queue, 3), key=lambda c: c.request_id)
        assert [c.status for c in done] == [Status.OK, Status.ERROR, Status.OK]
        assert done[1].result is not None and "not published" in done[1].result.error
        expected = load_model(MODEL or None).predict(images)
        for completion, pred in zip([done[0], done[2]], expected, strict=True):
            assert completion.result is not None
            assert completion.result.score == pytest.approx(pred.score, abs=1e-6)
            np.testing.assert_array_equal(completion.result.mask, pred.mask)
        maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
        assert "memfd:scratchd-region-test" in maps  # its own mapping, read in place
        queue.regions.retire(region)
        deadline = time.monotonic() + 30
        while "memfd:scratchd-region-test" in maps and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker drops it on its next turn (a heartbeat at most)
            maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
        assert "memfd:scratchd-region-test" not in maps
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == ExitCode.OK
    finally:
        worker.close()


class FakeRuntime:
    """CUDA's ``hostRegister`` / ``hostUnregister``, recording calls; read-only registration
    refused when ``read_only_supported`` is False, as a device without the attribute does."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, read_only_supported: bool) -> None:
        self.read_only_supported = read_only_supported
        self.locked: dict[int, tuple[int, int]] = {}

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        if flags & HOST_REGISTER_READ_ONLY and not self.read_only_supported:
            raise self.CUDARuntimeError("cudaErrorNotSupported")
        assert ptr not in self.locked, "page-locked twice"
        self.locked[ptr] = (nbytes, flags)

    def hostUnregister(self, ptr: int) -> None:
        del self.locked[ptr]


def fake_cupy(runtime: FakeRuntime) -> Any:
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))


def pin_all(host: PinnedHost) -> int:
    """Call ``pin_pending`` until it reports nothing left; how many calls that took."""
    calls = 1
    while host.pin_pending():
        calls += 1
        assert calls < 10_000, "pin_pending never finishes"
    return calls


def test_a_region_is_page_locked_read_only_a_piece_a_call_and_unlocked_the_same_way() -> None:
    runtime = FakeRuntime(read_only_supported=True)
    host = PinnedHost(fake_cupy(runtime), copy_stream=None)
    slots, region = np.zeros(1 << 16, np.uint8), np.zeros(2 * CHUNK + 100, np.uint8)
    base = region.ctypes.data
    host.register(slots)  # at boot, whole, read-write
    host.adopt(region)
    host.adopt(region)  # again (mapped again by the same address): one region
    # Nothing is locked on the claim path: until its piece is, a frame goes staged.
    assert list(runtime.locked) == [slots.ctypes.data]
    assert not host.registered(base, 16)
    assert host.pin_pending()  # the first piece; more to come
    assert host.registered(base, CHUNK) and not host.registered(base + CHUNK, 16)
    assert not host.registered(base + CHUNK - 8, 16)  # the second piece is not locked yet
    assert pin_all(host) == 2
    flags = {ptr: f for ptr, (_, f) in runtime.locked.items()}
    assert flags == {
        slots.ctypes.data: 0, base: HOST_REGISTER_READ_ONLY,
        base + CHUNK: HOST_REGISTER_READ_ONLY, base + 2 * CHUNK: HOST_REGISTER_READ_ONLY,
    }  # fmt: skip
    assert runtime.locked[base + 2 * CHUNK][0] == 100
    assert host.registered(base + 2 * CHUNK + 50, 50)
    # A frame across pieces is read in place, one copy per piece.
    assert host.pieces(base + CHUNK - 8, CHUNK + 16) == [
        (base + CHUNK - 8, 8), (base + CHUNK, CHUNK), (base + 2 * CHUNK, 8),
    ]  # fmt: skip
    assert not host.registered(base + len(region) - 10, 20)  # runs past the end
    host.retire(region)  # unmapped: out of the lookup at once, unlocked a piece a call
    assert not host.registered(base, 16)
    assert len(runtime.locked) == 4
    assert pin_all(host) == 3
    assert list(runtime.locked) == [slots.ctypes.data]
    host.unregister_all()
    assert runtime.locked == {}


class NoCopyEvent:
    """An event over a copy stream the test never runs (the staged bytes are not checked here:
    tests/workers/test_staging.py does that)."""

    def __init__(self, disable_timing: bool = True) -> None:
        pass

    def record(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_a_region_fully_locked_is_logged_once_with_the_frames_staged_until_then() -> None:
    """An operator sees when a gateway's frames start going straight to the card, what locking
    its region cost, and how many frames took the staging copy meanwhile."""
    runtime = FakeRuntime(read_only_supported=True)
    cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Event=NoCopyEvent))
    host = PinnedHost(cp, copy_stream=None, alloc_pinned=lambda n: np.zeros(n, np.uint8))
    region = np.arange(2 * CHUNK + 100, dtype=np.uint64).astype(np.uint8)
    stream = io.StringIO()
    configure("info", stream=stream, journald=False)
    try:
        host.adopt(region)
        with host.chunk():
            for j in range(2):  # not locked yet: both staged
                ((src, length),) = host.sources(region[j * 64 : (j + 1) * 64], j, 64)
                assert src != region.ctypes.data + j * 64 and length == 64
        assert host.pin_pending() and host.pin_pending()  # two of three pieces
        assert stream.getvalue() == ""  # not whole yet
        with host.chunk():  # in a locked piece now: read in place, not staged
            assert host.sources(region[:64], 0, 64) == [(region.ctypes.data, 64)]
        assert not host.pin_pending()  # the last piece
        assert not host.pin_pending()  # nothing more: logged once
    finally:
        configure("info", stream=sys.stderr)
    (line,) = stream.getvalue().splitlines()
    fields = parse_line(line)
    assert fields["event"] == "region_page_locked"
    assert (int(fields["bytes"]), int(fields["pieces"])) == (2 * CHUNK + 100, 3)
    assert int(fields["frames_staged"]) == 2
    assert float(fields["lock_ms"]) >= 0 and float(fields["after_ms"]) >= float(fields["lock_ms"])


def staging_host(runtime: FakeRuntime) -> PinnedHost:
    cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Event=NoCopyEvent))
    return PinnedHost(cp, copy_stream=None, alloc_pinned=lambda n: np.zeros(n, np.uint8))


def stage(host: PinnedHost, frame: np.ndarray) -> bool:
    """Upload ``frame`` as a worker does; whether it went through a staging area."""
    with host.chunk():
        got = host.sources(frame, 0, frame.nbytes)
    return got != host.pieces(frame.ctypes.data, frame.nbytes)


def locked_disjoint(runtime: FakeRuntime) -> list[tuple[int, int]]:
    spans = sorted((p, p + n) for p, (n, _) in runtime.locked.items())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "pages locked twice"
    return spans


def test_a_staged_frames_pages_are_locked_first_and_in_compute_time_only_when_they_fit() -> None:
    runtime = FakeRuntime(read_only_supported=True)
    host = staging_host(runtime)
    region = np.zeros(3 * CHUNK, np.uint8)
    base = region.ctypes.data
    host.adopt(region)
    frame = region[CHUNK + 5000 : CHUNK + 15000]
    assert stage(host, frame)
    lo, hi = (CHUNK + 5000) // PAGE * PAGE, -(-(CHUNK + 15000) // PAGE) * PAGE
    cost = (hi - lo) * FIRST_NS_PER_MIB / (1 << 20)  # nothing timed yet: the first guess
    assert not host.pin_within(0) and not host.pin_within(int(cost) - 1)
    assert runtime.locked == {}
    assert host.pin_within(int(cost) + 1)
    assert runtime.locked == {base + lo: (hi - lo, HOST_REGISTER_READ_ONLY)}  # its pages only
    assert not stage(host, frame)  # read in place from now on
    assert not host.pin_within(10**12)  # the rest waits for turns with nothing to claim
    assert host.pin_pending()
    assert locked_disjoint(runtime)[0] == (base, base + CHUNK)  # then piece by piece
    pin_all(host)
    assert sum(e - s for s, e in locked_disjoint(runtime)) == region.nbytes
    assert len(runtime.locked) == 5  # frame's pages; piece; gap up to them; two after them
    assert host.registered(base, region.nbytes)  # every byte, across the five


def test_the_piece_size_can_be_set_for_benchmarks_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime = FakeRuntime(read_only_supported=True)
    monkeypatch.setenv("SCRATCHD_PIN_PIECE_MIB", "1")
    host = PinnedHost(fake_cupy(runtime), copy_stream=None)
    region = np.zeros(3 << 20, np.uint8)
    host.adopt(region)
    assert pin_all(host) == 3
    assert sorted(n for n, _ in runtime.locked.values()) == [1 << 20] * 3
    monkeypatch.setenv("SCRATCHD_PIN_PIECE_MIB", "3")
    with pytest.raises(ValueError, match="SCRATCHD_PIN_PIECE_MIB"):
        PinnedHost(fake_cupy(runtime), copy_stream=None)


def test_unregister_all_undoes_every_piece_at_once() -> None:
    runtime = FakeRuntime(read_only_supported=True)
    host = PinnedHost(fake_cupy(runtime), copy_stream=None)
    a, b = np.zeros(3 * CHUNK, np.uint8), np.zeros(CHUNK, np.uint8)
    host.adopt(a)
    host.adopt(b)
    host.pin_pending()
    host.pin_pending()
    host.retire(a)  # two pieces of a locked, retiring
    host.pin_pending()  # unlocks one of them before locking any of b
    assert len(runtime.locked) == 1 and host.ranges == {}
    slots = np.zeros(4096, np.uint8)
    host.register(slots)
    assert len(runtime.locked) == 2
    host.unregister_all()
    assert runtime.locked == {} and host.ranges == {} and not host.pin_pending()


def test_a_device_that_cannot_lock_read_only_memory_falls_back_to_staging() -> None:
    runtime = FakeRuntime(read_only_supported=False)
    host = PinnedHost(fake_cupy(runtime), copy_stream=None)
    region, other = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    host.adopt(region)
    host.adopt(other)
    assert not host.pin_pending()  # refused once: no region is tried again
    assert not host.registered(region.ctypes.data, 16)  # its frames go through the staging
    host.adopt(np.zeros(4096, np.uint8))
    assert not host.pin_pending()
    host.retire(region)  # nothing to undo, nothing raised
    assert runtime.locked == {}


@given(
    cuts=st.lists(st.integers(1, 255), min_size=1, max_size=12, unique=True),
    keep=st.lists(st.booleans(), min_size=13, max_size=13),
    start=st.integers(0, 255),
    length=st.integers(1, 256),
)
def test_pieces_cover_a_frame_exactly_with_registered_ranges_or_say_none(
    cuts: list[int], keep: list[bool], start: int, length: int
) -> None:
    host = PinnedHost(fake_cupy(FakeRuntime(read_only_supported=True)), copy_stream=None)
    buf = np.zeros(512, np.uint8)
    bounds = [0, *sorted(cuts), 256]
    covered: set[int] = set()
    for (lo, hi), k in zip(itertools.pairwise(bounds), keep, strict=False):
        if k:  # adjacent registered ranges, as a region's pieces are
            host.register(buf[lo:hi])
            covered.update(range(lo, hi))
    base = buf.ctypes.data
    got = host.pieces(base + start, length)
    wanted = set(range(start, start + length))
    if not wanted <= covered:
        assert got is None
        return
    assert got is not None
    at = base + start
    for ptr, n in got:  # in order, contiguous, each inside one registered range
        assert ptr == at and n > 0
        assert any(lo <= ptr and ptr + n <= lo + size for lo, size in host.ranges.items())
        at += n
    assert at == base + start + length


class PinningMachine(RuleBasedStateMachine):
    """Whatever the order of maps, unmaps and pinning turns: a range counts as registered
    only while CUDA holds it locked and its region is mapped, nothing is locked twice, and
    once the turns run out every mapped region is locked whole and every unmapped one
    unlocked."""

    def __init__(self) -> None:
        super().__init__()
        self.runtime = FakeRuntime(read_only_supported=True)
        self.host = staging_host(self.runtime)
        self.arrays = [np.zeros(n, np.uint8) for n in (CHUNK // 2, CHUNK, 2 * CHUNK + 1, 5)]
        self.mapped: set[int] = set()

    @rule(i=st.integers(0, 3))
    def map(self, i: int) -> None:
        self.host.adopt(self.arrays[i])
        self.mapped.add(i)

    @rule(i=st.integers(0, 3))
    def unmap(self, i: int) -> None:
        self.host.retire(self.arrays[i])
        self.mapped.discard(i)

    @rule()
    def turn(self) -> None:
        self.host.pin_pending()

    @rule(i=st.integers(0, 3), at=st.floats(0, 1), length=st.integers(1, 3 * PAGE))
    def frame(self, i: int, at: float, length: int) -> None:
        """A frame of a mapped region uploaded (staged unless its bytes are locked)."""
        if i in self.mapped:
            a = self.arrays[i]
            lo = min(int(at * a.nbytes), a.nbytes - 1)
            stage(self.host, a[lo : min(a.nbytes, lo + length)])

    @rule(budget=st.integers(0, 2 * 10**6))
    def compute_time(self, budget: int) -> None:
        self.host.pin_within(budget)

    @invariant()
    def no_page_is_locked_twice(self) -> None:
        locked_disjoint(self.runtime)

    @invariant()
    def lookups_only_see_locked_mapped_memory(self) -> None:
        for ptr, nbytes in self.host.ranges.items():
            assert self.runtime.locked[ptr][0] == nbytes
            owner = [
                i
                for i, a in enumerate(self.arrays)
                if a.ctypes.data <= ptr < a.ctypes.data + a.nbytes
            ]
            assert owner and owner[0] in self.mapped

    def teardown(self) -> None:
        pin_all(self.host)
        for i, a in enumerate(self.arrays):
            whole = self.host.pieces(a.ctypes.data, a.nbytes) is not None
            assert whole == (i in self.mapped)
            locked = sum(n for p, (n, _) in self.runtime.locked.items()
                         if a.ctypes.data <= p < a.ctypes.data + a.nbytes)  # fmt: skip
            assert locked == (a.nbytes if i in self.mapped else 0)
        self.host.unregister_all()
        assert self.runtime.locked == {}


TestPinning = PinningMachine.TestCase
TestPinning.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
