"""CUDA graphs of the ScratchNet forward, one per (batch bucket, frame size): the capture
primitive (:func:`capture`), the batch buckets and the plain forward graph (:class:`ForwardGraph`).

Lifecycle of one :class:`ForwardGraph` (``GraphState``)::

    NEW ──warm_up()──▶ CAPTURED ──replay()* ──▶ (lives as long as its CudaScratchNet)
         1. allocate every buffer (cuda_net.Buffers), held by the graph for its lifetime;
            synchronise the device, so the weights and zeroed buffers, made on the legacy
            default stream, are complete before the private stream touches them
         2. run the forward once eagerly while recording its launches: every module is
            compiled (or loaded from CuPy's disk cache) and every kernel has run once
         3. capture the recorded launches on a private stream: no allocation, no
            compilation and no Python-side checks happen inside the capture

Batches are served from the smallest bucket (1, 2, 4, 8, 16) that holds them; the unused
slots of a bucket compute on stale frames and their results are ignored. Copies in and out
run on the graph's stream, ordered around the replay.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from scratchd.gpu.cuda_net import Buffers, CudaForward
from scratchd.kernels import _cuda as cu


class GraphState(enum.Enum):
    NEW = "new"
    CAPTURED = "captured"


def capture(stream: Any, enqueue: Callable[[], object]) -> Any:
    """A CUDA graph of what ``enqueue`` launches: run it once eagerly on ``stream`` while
    recording its launches (compiles and loads every module, runs the Python-side checks),
    then capture the recorded launches alone and upload the graph.

    First the device is synchronised: the weights (``cp.asarray`` copies asynchronously
    through pinned memory), their transposes and the zeroed buffers were enqueued on the
    stream current when they were made, the legacy default stream, which a non-blocking
    ``stream`` (and the worker's copy stream) does not wait for. Without this a replay, or
    an upload into a graph input, could overtake them: a forward on weights not yet
    copied, or results and frames zeroed after they were written."""
    cu.cupy().cuda.Device().synchronize()
    return record_and_capture(stream, enqueue)


def record_and_capture(stream: Any, enqueue: Callable[[], object]) -> Any:
    """:func:`capture` without its device synchronisation first: the caller orders whatever
    the launches read before them (``scripts/stress_forward.py`` times the race without)."""
    with stream, cu.recording() as steps:
        enqueue()
    stream.synchronize()
    with stream:
        stream.begin_capture()
        try:
            for step in steps:
                step()
        finally:
            graph = stream.end_capture()
    graph.upload(stream)
    stream.synchronize()
    return graph


class ForwardGraph:
    """One captured forward of ``batch`` frames of ``height x width`` and its buffers."""

    def __init__(self, fwd: CudaForward, batch: int, height: int, width: int) -> None:
        cp = cu.cupy()
        self.fwd = fwd
        self.state = GraphState.NEW
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.buf: Buffers = fwd.buffers(batch, height, width)
        self.graph: Any = None

    def warm_up(self) -> None:
        """Run once eagerly (recording), then capture the recorded launches into a graph."""
        if self.state is GraphState.CAPTURED:
            return
        self.graph = capture(self.stream, lambda: self.fwd.run(self.buf))
        self.state = GraphState.CAPTURED

    def replay(self) -> None:
        """Launch the captured forward on the graph's stream (asynchronous)."""
        if self.state is not GraphState.CAPTURED:
            raise RuntimeError("ForwardGraph.replay before warm_up")
        self.graph.launch(self.stream)
