"""Queue ``Result`` rows from what a backend computed for one frame.

Both backends finish a frame into the same fields — the CPU's ``kernels.model.Prediction``
and the GPU's ``kernels.serve_graph.FrameResult`` — and answer it the same way: ``ok`` with
the verdict, score, boxes (the best ``MAX_BOXES``: the shared-memory row holds no more),
entropy, input histogram, and the mask only when the request asked for it. A frame that
could not be computed is answered with a status and its reason (:func:`error_result`).
No model imports here: the worker loop uses this before (and without) loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from scratchd.ipc.layout import HISTOGRAM_BINS, MAX_BOXES
from scratchd.ipc.queue import Result, Status


class Finished(Protocol):
    """One frame's outcome, as either backend produces it."""

    @property
    def verdict(self) -> str: ...
    @property
    def score(self) -> float: ...
    @property
    def boxes(self) -> Sequence[Sequence[float]]: ...
    @property
    def entropy(self) -> float: ...
    @property
    def histogram(self) -> np.ndarray: ...
    @property
    def mask(self) -> np.ndarray | None: ...


def ok_result(frame: Finished, want_mask: bool, compute_ns: int, batch_size: int) -> Result:
    """The ``ok`` answer for ``frame``; ``compute_ns`` is its batch's compute time."""
    return Result(
        status=Status.OK,
        verdict_defect=frame.verdict == "defect",
        score=float(frame.score),
        boxes=[
            (float(x0), float(y0), float(x1), float(y1), float(sc))
            for x0, y0, x1, y1, sc in frame.boxes[:MAX_BOXES]
        ],
        entropy=float(frame.entropy),
        histogram=np.asarray(frame.histogram, dtype=np.uint32),
        compute_ns=compute_ns,
        batch_size=batch_size,
        error="",
        mask=frame.mask if want_mask else None,
    )


def error_result(reason: str, batch_size: int = 0, status: Status = Status.ERROR) -> Result:
    """A result carrying only a status and its reason."""
    return Result(
        status=status,
        verdict_defect=False,
        score=0.0,
        boxes=[],
        entropy=0.0,
        histogram=np.zeros(HISTOGRAM_BINS, dtype=np.uint32),
        compute_ns=0,
        batch_size=batch_size,
        error=reason,
        mask=None,
    )
