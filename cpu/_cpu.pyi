"""Types of the C extension ``scratchd.cpu._cpu`` (source and layouts: ``_cpu.c``)."""

import numpy as np

ISAS: tuple[str, ...]  # the instruction sets this CPU runs, widest last (the one picked at import)

def use_isa(name: str) -> str: ...  # tests: switch process-wide, returns the previous
def current_cpu() -> int: ...  # sched_getcpu()
def leave_cpu(cpu: int, /) -> bool: ...  # move the calling thread off cpu now, if it is there
def dwconv3x3(
    x: np.ndarray,  # [H, W, C] float32
    w: np.ndarray,  # [3, 3, C]
    b: np.ndarray,  # [C]
    y: np.ndarray,  # [R, Wo, C], written: relu(b + dwconv) rows r0 .. r0 + R - 1
    r0: int,
    stride: int,
    dilation: int,
    /,
) -> None: ...
def dwconv3x3_join(
    x: np.ndarray,  # [h, w, C1] float32, nearest-2x upsampled by the join
    skip: np.ndarray,  # [2h, 2w, C2]
    w: np.ndarray,  # [3, 3, C1 + C2]
    b: np.ndarray,  # [C1 + C2]
    y: np.ndarray,  # [R, 2w, C1 + C2], written
    r0: int,
    /,
) -> None: ...
def stem3x3(
    x: np.ndarray,  # [H, W] float32
    w: np.ndarray,  # [9, Cout] (= [3, 3, 1, Cout])
    b: np.ndarray,  # [Cout]
    y: np.ndarray,  # [R, (W - 1) // 2 + 1, Cout], written
    r0: int,
    /,
) -> None: ...
def bias_relu(
    o: np.ndarray,  # [P, C] float32, updated in place: relu(o + b (+ res))
    b: np.ndarray,  # [C]
    res: np.ndarray | None,  # [P, C]
    /,
) -> None: ...
def bilinear2x(
    x: np.ndarray,  # [h, w] float32
    y: np.ndarray,  # [R, width], written: rows r0 .. of upsample_bilinear2x_ref(x), cropped
    r0: int,
    /,
) -> None: ...
