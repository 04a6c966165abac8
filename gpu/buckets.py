"""The batch buckets of the GPU path: a CUDA graph is captured per bucket and frame size, and
a batch runs in the smallest bucket that holds it (or is split over several, workers/cuda.py).

Powers of two up to 16: few graphs to capture and hold per frame size, and any batch is the
sum of a few of them.
"""

from __future__ import annotations

from typing import Final

BUCKETS: Final = (1, 2, 4, 8, 16)


def bucket_for(n: int) -> int:
    """The smallest batch bucket holding ``n`` frames."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"batch of {n} exceeds the largest bucket {BUCKETS[-1]}")
