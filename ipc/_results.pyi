"""Typed stub of the C extension ``scratchd.ipc._results`` (source: ipc/_results.c)."""

from collections.abc import Callable

import numpy as np

from scratchd.ipc._native import FinishedRow
from scratchd.ipc.records import Completion, Result

class Reader:
    """Completions of collected FinishedRows, built from the result table in one call."""

    def __init__(self, offsets: dict[str, int], kit: tuple[object, ...]) -> None: ...
    def completions(
        self,
        buf: object,
        rows: list[FinishedRow],
        histogram: np.ndarray,
        read_result: Callable[[int, int, int], Result],
    ) -> list[Completion]: ...
