"""The segment layout: aligned regions, and struct blocks that agree with the numpy dtypes."""

from __future__ import annotations

import mmap

import numpy as np

from scratchd.ipc.layout import (
    HEADER_BYTES,
    RESULT_DTYPE,
    RESULT_FIELDS,
    Block,
    Geometry,
    layout,
)


def test_regions_are_aligned_and_inside_the_segment() -> None:
    off = layout(Geometry(slots=3, slot_bytes=1000, max_workers=5, wheel_ticks=7))
    names = ["desc_off", "result_off", "worker_off", "index_off", "input_off", "mask_off"]
    starts = [off[n] for n in names]
    assert starts == sorted(starts) and starts[0] >= HEADER_BYTES
    assert all(s % 64 == 0 for s in starts)
    assert off["input_off"] % 4096 == 0 and off["mask_off"] % 4096 == 0
    assert off["mask_off"] + 3 * 125 <= off["total_bytes"]


def test_the_result_block_agrees_with_its_dtype() -> None:
    """Packing the result block writes exactly the fields numpy reads, at every row."""
    dtype, span = RESULT_DTYPE, RESULT_FIELDS
    rows = 3
    mm = mmap.mmap(-1, 64 + rows * dtype.itemsize)
    table = np.ndarray((rows,), dtype, buffer=mm, offset=64)
    block = Block(mm, 64, dtype, span)
    values = [k + 1 for k in range(len(block.names))]
    block.pack(1, *values)
    assert [table[1][name] for name in block.names] == values
    assert block.unpack(1) == tuple(values)
    assert all(v == 0 for v in table[0].tolist() if not isinstance(v, np.ndarray))
    assert not np.frombuffer(mm, np.uint8, offset=64 + 2 * dtype.itemsize).any()
    del table
