"""workers/host_memory.py's staging areas, with a stand-in for the copy stream: a copy reads
its source when the stand-in's "device" gets to it, so a staging area rewritten before its
copies ran shows up as a frame uploaded with another frame's bytes."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.workers.host_memory import PinnedHost


class FakeCopyStream:
    """Copies enqueued in order and run when the device gets to them (``advance``), or when
    the host waits for them (an event's ``synchronize``, or the stream's own)."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, bytes]] = []  # (source, bytes, what it must read)
        self.done = 0  # copies run so far
        self.enqueued = 0
        self.stream_syncs = 0
        self.uploaded: list[bytes] = []

    def copy(self, src: int, n: int, expected: bytes) -> None:
        self.pending.append((src, n, expected))
        self.enqueued += 1

    def advance(self, k: int) -> None:
        for _ in range(min(k, len(self.pending))):
            src, n, expected = self.pending.pop(0)
            got = ctypes.string_at(src, n)  # the DMA reads the host memory now
            assert got == expected, "a staging area was rewritten before its copy ran"
            self.uploaded.append(got)
            self.done += 1

    def run_until(self, count: int) -> None:
        self.advance(count - self.done)

    def synchronize(self) -> None:
        self.stream_syncs += 1
        self.advance(len(self.pending))


class FakeEvent:
    def __init__(self, disable_timing: bool = True) -> None:
        self.at: int | None = None
        self.stream: FakeCopyStream | None = None

    def record(self, stream: FakeCopyStream) -> None:
        self.stream, self.at = stream, stream.enqueued

    def synchronize(self) -> None:
        if self.stream is not None and self.at is not None:
            self.stream.run_until(self.at)


def host_with(stream: FakeCopyStream) -> PinnedHost:
    cp: Any = SimpleNamespace(cuda=SimpleNamespace(runtime=None, Event=FakeEvent))
    return PinnedHost(cp, stream, alloc_pinned=lambda n: np.zeros(n, np.uint8))


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    progress=st.lists(st.integers(0, 8), min_size=12, max_size=12),
    frame=st.sampled_from([3, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_staged_frames_reach_the_device_intact_without_waiting_for_the_stream(
    chunks: list[int], progress: list[int], frame: int, seed: int
) -> None:
    """Whatever the chunk sizes and however far behind the device runs, every staged frame's
    copy reads that frame's bytes, and no upload waits for the whole copy stream."""
    rng = np.random.default_rng(seed)
    stream = FakeCopyStream()
    host = host_with(stream)
    sent = []
    for n, ahead in zip(chunks, progress, strict=False):
        with host.chunk():
            for j in range(n):
                img = rng.integers(0, 256, frame, dtype=np.uint8)
                for src, length in host.sources(img, j, frame):
                    stream.copy(src, length, img.tobytes())
                sent.append(img.tobytes())
        stream.advance(ahead)
    stream.advance(len(stream.pending))
    assert stream.uploaded == sent
    assert stream.stream_syncs == 0


def test_a_chunk_waits_only_for_the_chunk_that_used_its_area() -> None:
    """With the device idle, the third chunk (the first's area again) runs the first chunk's
    copies and no more: the second chunk's stay queued."""
    stream = FakeCopyStream()
    host = host_with(stream)
    frames = [np.full(8, i, np.uint8) for i in range(3)]
    for img in frames:
        with host.chunk():
            ((src, n),) = host.sources(img, 0, 8)
            stream.copy(src, n, img.tobytes())
    assert stream.done == 1 and len(stream.pending) == 2


def test_staging_outside_a_chunk_is_refused_and_frames_in_registered_memory_need_none() -> None:
    stream = FakeCopyStream()
    host = host_with(stream)
    with pytest.raises(RuntimeError, match="outside"):
        host.sources(np.zeros(8, np.uint8), 0, 8)
    with host.chunk(), pytest.raises(RuntimeError, match="reentrant"), host.chunk():
        pass
    assert stream.enqueued == 0


def test_an_error_inside_a_chunk_still_guards_its_area() -> None:
    """A chunk that fails after enqueueing a staged copy still records its event, so the
    area's next user waits for that copy."""
    stream = FakeCopyStream()
    host = host_with(stream)
    img = np.arange(8, dtype=np.uint8)
    with pytest.raises(ValueError), host.chunk():
        ((src, n),) = host.sources(img, 0, 8)
        stream.copy(src, n, img.tobytes())
        raise ValueError("the copy after it failed")
    with host.chunk():
        pass  # the other area
    with host.chunk():
        ((src, n),) = host.sources(np.zeros(8, np.uint8), 0, 8)  # waits for the failed chunk's copy
        stream.copy(src, n, bytes(8))
    stream.advance(2)
    assert stream.uploaded == [img.tobytes(), bytes(8)]
