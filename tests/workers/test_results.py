"""Queue Results from a finished frame (workers/results.py): what a request is answered."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scratchd.ipc.layout import MAX_BOXES
from scratchd.ipc.queue import Status
from scratchd.workers.results import error_result, ok_result


@dataclass
class Frame:
    verdict: str = "defect"
    score: float = 0.75
    boxes: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    entropy: float = 0.125
    histogram: np.ndarray = field(default_factory=lambda: np.arange(64, dtype=np.int64))
    mask: np.ndarray | None = field(default_factory=lambda: np.full((4, 4), 255, np.uint8))


def test_ok_carries_the_frame_and_keeps_the_best_boxes_the_row_can_hold() -> None:
    boxes = [(float(i), 0.0, i + 1.0, 1.0, 1.0 - i / 100) for i in range(MAX_BOXES + 5)]
    r = ok_result(Frame(boxes=boxes), True, 1234, 3)
    assert r.status is Status.OK and r.verdict_defect and r.score == 0.75
    assert r.boxes == boxes[:MAX_BOXES]  # best first already: the first ones are kept
    assert r.histogram.dtype == np.uint32 and r.histogram.tolist() == list(range(64))
    assert (r.compute_ns, r.batch_size, r.entropy, r.error) == (1234, 3, 0.125, "")
    assert r.mask is not None and r.mask.shape == (4, 4)


def test_the_mask_only_when_asked_and_clean_is_not_defect() -> None:
    r = ok_result(Frame(verdict="clean"), False, 0, 1)
    assert r.mask is None and not r.verdict_defect


def test_an_error_says_why_and_carries_nothing_else() -> None:
    r = error_result("model failed: boom", 4, Status.INVALID)
    assert (r.status, r.error, r.batch_size, r.boxes, r.mask) == (
        Status.INVALID,
        "model failed: boom",
        4,
        [],
        None,
    )
    assert r.histogram.shape == (64,) and not r.histogram.any()
