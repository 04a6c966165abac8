"""Types of the C extension ``scratchd.cpu._runs`` (source and layout: ``_runs.c``)."""

import numpy as np

def finish_records(
    records: np.ndarray,  # [cap, 4] int32: row, start, end, float32 bits of the run's prob sum
    count: int,  # the frame's runs: records[:count]
    height: int,
    width: int,
    min_area: int,
    mask: np.ndarray | None = None,  # [height, width] uint8, overwritten: kept components 255
    /,
) -> list[tuple[float, float, float, float, float]]: ...  # (x0, y0, x1, y1, score), best first
