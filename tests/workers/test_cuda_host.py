"""CudaBackend's host side with fake graphs (no GPU needed): how ``finish_each`` answers the
frames of a collected batch, and how a new graph's device time is measured at boot."""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from scratchd.ipc.queue import Status
from scratchd.protocol.log import configure, parse_line
from scratchd.workers.cuda import REMEASURE_S, TIME_REPLAYS, Batch, Chunk, CudaBackend


@dataclass
class Frame:
    score: float
    verdict: str = "clean"
    boxes: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    entropy: float = 0.1
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(64, np.uint32))
    mask: np.ndarray | None = None


@dataclass
class Collected:
    compute_ms: float


@dataclass
class FakeGraph:
    """A serving graph whose host finish of frame j scores it j / 10, or raises for the
    frames in ``broken``; its replays take ``replay_ms`` in turn."""

    bucket: int = 4
    height: int = 8
    width: int = 8
    broken: tuple[int, ...] = ()
    replay_ms: list[float] = field(default_factory=list)
    launches: int = 0

    def finish_frame(self, batch: Collected, j: int, want_mask: bool) -> Frame:
        if j in self.broken:
            raise ValueError(f"runs of frame {j} do not add up")
        return Frame(score=j / 10)

    def launch(self, k: int) -> None:
        self.launches += 1

    def collect(self, n: int) -> Collected:
        return Collected(self.replay_ms[self.launches - 1])


class FakeCupy:
    class cuda:  # the attribute path CudaBackend uses: cp.cuda.Device()
        class Device:
            def synchronize(self) -> None:
                pass


def host_backend() -> Any:
    """A CudaBackend with only what its host side reads (no device, no arena)."""
    b: Any = object.__new__(CudaBackend)
    b.graph_ms, b.graph_at, b.remeasure, b.graphs = {}, {}, set(), {}
    b.cp = FakeCupy
    return b


def collected_batch(*chunks: tuple[FakeGraph, list[int]], size: int) -> Batch:
    batch = Batch(size)
    for graph, positions in chunks:
        chunk = Chunk(graph, positions, [], [False] * len(positions))
        chunk.collected = Collected(compute_ms=2.5)
        batch.chunks.append(chunk)
    batch.started = batch.collected = True
    return batch


def test_finish_each_answers_errors_first_then_each_chunks_frames_in_order() -> None:
    b = host_backend()
    batch = collected_batch((FakeGraph(), [0, 2]), (FakeGraph(bucket=1), [3]), size=4)
    batch.errors[1] = (Status.INVALID, "frame 1 is 3x3")
    got = list(b.finish_each(batch))
    assert [pos for pos, _ in got] == [1, 0, 2, 3]
    assert got[0][1].status is Status.INVALID and got[0][1].error == "frame 1 is 3x3"
    assert [r.status for _, r in got[1:]] == [Status.OK] * 3
    assert [r.score for _, r in got[1:]] == pytest.approx([0.0, 0.1, 0.0])
    assert all(r.compute_ns == 2_500_000 for _, r in got[1:])
    assert b.graph_ms == {}  # two chunks overlapped on the device: neither timed alone


def test_a_frame_whose_host_finish_fails_is_answered_error_and_the_rest_are_served() -> None:
    b = host_backend()
    batch = collected_batch((FakeGraph(broken=(1,)), [0, 1, 2]), size=3)
    got = dict(b.finish_each(batch))
    assert sorted(got) == [0, 1, 2]
    assert got[1].status is Status.ERROR
    assert got[1].error == "host finish: ValueError: runs of frame 1 do not add up"
    assert got[0].status is Status.OK and got[2].status is Status.OK
    assert b.graph_ms == {(4, 8, 8): 2.5}  # one chunk alone: its time is learned


def test_finish_before_collect_is_refused() -> None:
    batch = collected_batch((FakeGraph(), [0]), size=1)
    batch.collected = False
    with pytest.raises(RuntimeError, match="before collect"):
        list(host_backend().finish_each(batch))


def test_a_new_graph_is_timed_by_its_fastest_replay_after_an_untimed_one() -> None:
    """The first replay is left out (cold caches and clocks make it unrepresentative; here
    it is the fastest, so only leaving it out gives 1.0), and of the others the fastest is
    the graph's device time: another process computing on the card only ever adds time."""
    b = host_backend()
    replays = [0.5, 4.0, 1.0, 1.5, 3.0, 2.0, 9.0][: TIME_REPLAYS + 1]  # the untimed fastest
    g = FakeGraph(bucket=8, replay_ms=replays)
    b._time(g)
    assert g.launches == TIME_REPLAYS + 1
    assert b.graph_ms == {(8, 8, 8): min(replays[1:])} and min(replays[1:]) == 1.0
    assert time.monotonic() - b.graph_at[(8, 8, 8)] < REMEASURE_S  # fresh


def timed_backend(eight_ms: float, age_s: float) -> tuple[Any, FakeGraph]:
    """Held graphs of 1, 2, 4 and 8 frames of 8x8, their times measured ``age_s`` ago; the
    8-frame graph's (its FakeGraph is returned) ``eight_ms``, the others realistic."""
    b = host_backend()
    measured = {1: 0.5, 2: 0.9, 4: 1.6, 8: eight_ms}
    for bucket, ms in measured.items():
        b.graphs[(bucket, 8, 8)] = FakeGraph(bucket=bucket)
        b.graph_ms[(bucket, 8, 8)] = ms
        b.graph_at[(bucket, 8, 8)] = time.monotonic() - age_s
    return b, b.graphs[(8, 8, 8)]


@pytest.fixture
def log() -> Iterator[io.StringIO]:
    """The worker's log lines, as the daemon's format writes them."""
    stream = io.StringIO()
    configure("info", stream=stream, journald=False)
    yield stream
    configure("info", stream=sys.stderr)


def test_a_bucket_timed_too_slow_is_run_again_once_its_time_is_stale(log: io.StringIO) -> None:
    b, g8 = timed_backend(eight_ms=10.0, age_s=2 * REMEASURE_S)  # 4 + 4 looks cheaper
    assert b._plan(8, 8, (8, 8)) == [8]  # stale and avoided: run whole, to re-time it
    assert b._plan(8, 8, (8, 8)) == [4, 4]  # one re-measurement at a time
    b._observe(g8, 3.0)  # that batch's device time replaces the stale one (no EWMA)
    assert b.graph_ms[(8, 8, 8)] == 3.0 and not b.remeasure
    (line,) = log.getvalue().splitlines()
    fields = parse_line(line)
    assert (fields["event"], fields["graph"]) == ("graph_retimed", "8 x 8x8")
    assert (float(fields["before_ms"]), float(fields["ms"])) == (10.0, 3.0)
    del b.graph_ms[(2, 8, 8)]  # a graph captured while serving, never run alone yet
    b.remeasure.add((2, 8, 8))
    b._observe(b.graphs[(2, 8, 8)], 0.9)  # its first time is not a correction: no note
    assert b.graph_ms[(2, 8, 8)] == 0.9 and len(log.getvalue().splitlines()) == 1
    assert b._plan(8, 8, (8, 8)) == [8]  # now cheaper than 4 + 4 by its own time
    b._observe(g8, 5.0)  # an ordinary batch is blended in
    assert b.graph_ms[(8, 8, 8)] == pytest.approx(0.9 * 3.0 + 0.1 * 5.0)


def test_a_fresh_time_or_a_bucket_beyond_the_limit_keeps_the_cheapest_split() -> None:
    b, _ = timed_backend(eight_ms=10.0, age_s=0.0)
    assert b._plan(8, 8, (8, 8)) == [4, 4]  # measured just now: believed
    b, _ = timed_backend(eight_ms=10.0, age_s=2 * REMEASURE_S)
    assert b._plan(8, 4, (8, 8)) == [4, 4]  # 8 is beyond the free-memory limit
    assert b._plan(12, 8, (8, 8)) == [4, 4, 4]  # no bucket within the limit takes 12
    del b.graphs[(8, 8, 8)]
    assert b._plan(8, 8, (8, 8)) == [4, 4]  # not held: nothing to re-time
    assert not b.remeasure
