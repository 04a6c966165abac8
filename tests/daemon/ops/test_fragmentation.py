"""The VRAM fragmentation gauge's source: worker rows → ratio by worker name."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scratchd.daemon.ops.observability import _fragmentation
from scratchd.ipc.queue import WorkerRow, WorkerSlotState


@dataclass
class Rows:
    rows: list[WorkerRow]

    def worker_rows(self) -> list[WorkerRow]:
        return self.rows


@dataclass
class Names:
    names: dict[int, str]

    def worker_name(self, slot: int) -> str | None:
        return self.names.get(slot)


def row(slot: int, frag: float) -> WorkerRow:
    return WorkerRow(slot, 100 + slot, WorkerSlotState.ACTIVE, 0, 0, 0, 0, 0, frag)


def test_gpu_workers_are_reported_by_name_and_cpu_workers_left_out() -> None:
    rows = Rows([row(0, 0.125), row(1, math.nan), row(2, 0.0), row(3, 0.5)])
    names = Names({0: "cuda0", 1: "cpu1", 2: "cuda1"})  # slot 3: not one of ours (any more)
    assert _fragmentation(rows, names) == {"cuda0": 0.125, "cuda1": 0.0}  # type: ignore[arg-type]
