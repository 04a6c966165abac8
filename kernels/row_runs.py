"""``row_runs``: the horizontal runs of ``prob >= threshold`` of each frame, compacted into a
bounded buffer, so that only the runs (not the map) cross to the host for the components.

Output of a batch of ``N`` maps, capacity ``cap`` runs per frame::

    runs   int32 [N, cap, 4]   record k of frame n: (row, start, end, sum bits)
                               end exclusive; sum = prob summed over the run, float32 bits
    count  int32 [N]           runs the frame has; count > cap: overflowed, only cap stored

Both the reference and the kernels (``row_runs.cu``: count the runs of each row, then
write each row's runs at the offset the rows above it leave) store the runs row-major
(``postprocess.find_runs`` order), so on overflow both keep the frame's first ``cap``
runs. The records are equal; the sums differ by rounding only (reference: float64 prefix
sums rounded to float32; kernel: float32 warp sums). :func:`unpack_runs` turns a frame's
records into the host finish's input (``postprocess.finish_runs``). A frame that
overflowed must not be finished from its runs: its caller fetches the frame's map and runs
the host path instead (``serve_graph.py`` counts these).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import check_array
from scratchd.kernels.postprocess import threshold_runs

RECORD = 4  # int32 words per run
WARPS = 8  # rows per 256-thread block (row_runs.cu)


class RowRuns(NamedTuple):
    runs: Any  # [N, cap, 4] int32
    count: Any  # [N] int32


def _check_capacity(capacity: int) -> None:
    if not 1 <= capacity <= 2**24:
        raise ValueError(f"row_runs: capacity must be in 1..{2**24}, got {capacity}")


def row_runs_ref(prob: np.ndarray, threshold: float, capacity: int) -> RowRuns:
    """Runs of ``prob [N, H, W] float32 >= threshold`` per frame, the first ``capacity``
    stored (row-major), unused records zero."""
    check_array("row_runs", "prob", prob, ndim=3)
    _check_capacity(capacity)
    n = len(prob)
    runs = np.zeros((n, capacity, RECORD), dtype=np.int32)
    count = np.zeros(n, dtype=np.int32)
    for i, p in enumerate(prob):
        row, start, end, run_sum = threshold_runs(p, threshold)
        sums = run_sum.astype(np.float32)
        k = min(len(row), capacity)
        count[i] = len(row)
        runs[i, :k, 0], runs[i, :k, 1], runs[i, :k, 2] = row[:k], start[:k], end[:k]
        runs[i, :k, 3] = sums[:k].view(np.int32)
    return RowRuns(runs, count)


def unpack_runs(
    records: np.ndarray,  # [cap, 4] int32 of one frame, row-major (as both producers write)
    count: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(row, start, end, run_sum)`` of one frame's stored runs, row-major (int64,
    float64): what ``postprocess.finish_runs`` takes. The caller checks overflow first.
    Not sorted here: the reference and the kernels store the records in ``find_runs`` order
    (test_row_runs checks both), which ``finish_runs`` relies on."""
    if count > len(records):
        raise ValueError(f"row_runs: {count} runs overflowed the capacity {len(records)}")
    rec = records[:count]
    row, start, end = (rec[:, j].astype(np.int64) for j in range(3))
    return row, start, end, rec[:, 3].view(np.float32).astype(np.float64)


def row_runs_buffers(n: int, capacity: int) -> RowRuns:
    """Device buffers for :func:`row_runs_cuda`'s ``out`` (allocated once, reused)."""
    cp = cu.cupy()
    return RowRuns(cp.empty((n, capacity, RECORD), np.int32), cp.empty((n,), np.int32))


def row_runs_cuda(
    prob: Any,  # [N, H, W] float32 (CuPy)
    threshold: float,
    capacity: int,
    *,
    out: RowRuns | None = None,  # from row_runs_buffers(N, capacity)
    scratch: Any | None = None,  # [N * H] int32: runs per row (kept with `out`)
) -> RowRuns:
    """CUDA twin of :func:`row_runs_ref` (unused records are left unwritten)."""
    op = "row_runs"
    cu.check_device_array(op, "prob", prob, ndim=3, dtype=np.float32)
    _check_capacity(capacity)
    n, h, w = prob.shape
    out = out if out is not None else row_runs_buffers(n, capacity)
    cu.check_device_array(op, "out.runs", out.runs, ndim=3, dtype=np.int32)
    cu.check_shape(op, "out.runs", out.runs, (n, capacity, RECORD))
    cu.check_device_array(op, "out.count", out.count, ndim=1, dtype=np.int32)
    cu.check_shape(op, "out.count", out.count, (n,))
    scratch = cu.output(op, scratch, (n * h,), np.int32, "scratch")
    cu.zero(out.count)
    grid, block = (-(-h // WARPS), n), (32 * WARPS,)
    counts = cu.kernel("row_runs.cu", "row_run_counts", ("row_runs",))
    thr = cu.f32(threshold)
    cu.launch(counts, grid, block, (prob, scratch, out.count, cu.i32(h), cu.i32(w), thr))
    func = cu.kernel("row_runs.cu", "row_runs", ("row_run_counts",))
    dims = (*map(cu.i32, (h, w, capacity)), thr)
    cu.launch(func, grid, block, (prob, scratch, out.runs, *dims))
    return out
