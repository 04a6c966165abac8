"""The CPU backend: ScratchNet's numpy forward (``scratchd.model.scratchnet``) on uint8 frames.

The worker hands it the zero-copy input views of a claimed batch; it returns one queue
``Result`` per image, in order. One bad image must not fail its batch neighbours: if the
batched ``predict`` raises, each image is run alone and only the ones that still raise are
answered ``error`` with the exception's message.

Threads: numpy's BLAS runs with the thread count the supervisor put in the worker's
environment (``OMP_NUM_THREADS`` etc.: the cores divided among the CPU workers), so two
workers do not fight over the same cores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import numpy as np

from scratchd.ipc.queue import Result
from scratchd.model.cascade import Cascade, resolve
from scratchd.model.scratchnet import Prediction, ScratchNet, load_model
from scratchd.workers.results import error_result, ok_result

WARM_UP_SHAPE: Final = (64, 64)


class CpuBackend:
    """ScratchNet on numpy. ``max_batch`` is fixed (config ``workers.cpu_max_batch``);
    ``views`` (config ``model.views``) replaces the model file's test-time views;
    ``cascade`` (config ``model.cascade``; None: the model file's default) answers through
    the model's dynamic-resolution cascade."""

    device: str = "cpu"

    def __init__(
        self,
        model_path: str | None,
        max_batch: int,
        views: Sequence[str] | None = None,
        cascade: bool | None = None,
    ) -> None:
        self.model: ScratchNet = load_model(model_path or None, views=views or None)
        self.cascade: Cascade | None = resolve(self.model, cascade)
        self.predictor: ScratchNet | Cascade = self.cascade or self.model
        self.max_batch = max_batch
        self.version: str = self.model.version
        self.boot_ms: dict[str, float] = {}  # the boot is the model load: the total says it

    def warm_up(self) -> None:
        """Run one forward pass so the first real request does not pay for lazy setup."""
        self.predictor.predict([np.zeros(WARM_UP_SHAPE, dtype=np.uint8)])

    def infer(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> list[Result]:
        start = time.monotonic_ns()
        try:
            outcomes: list[Prediction | Exception] = list(self.predictor.predict(images))
        except Exception:
            outcomes = [self._predict_one(image) for image in images]
        compute_ns = time.monotonic_ns() - start
        return [
            _to_result(outcome, want, compute_ns, len(images))
            for outcome, want in zip(outcomes, want_mask, strict=True)
        ]

    def _predict_one(self, image: np.ndarray) -> Prediction | Exception:
        try:
            return self.predictor.predict([image])[0]
        except Exception as exc:
            return exc


def _to_result(
    outcome: Prediction | Exception, want_mask: bool, compute_ns: int, batch_size: int
) -> Result:
    if isinstance(outcome, Exception):
        return error_result(f"model failed: {type(outcome).__name__}: {outcome}", batch_size)
    return ok_result(outcome, want_mask, compute_ns, batch_size)
