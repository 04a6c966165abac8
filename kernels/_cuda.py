"""Loading and launching the CUDA kernels: CuPy ``RawModule`` over NVRTC, compiled for the
device's architecture (sm_90 on the H200), cached on disk and per device in memory.

Source assembly: ``kernels/<op>.cu`` names its headers with ``#include "x.cuh"``; the loader
pastes each header's text in place (once per module), so the source CuPy hashes is the whole
program and its on-disk cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) can never
serve a module built from an older header. A restarted worker therefore loads cubins from
disk instead of recompiling (milliseconds instead of a large part of a second).

Template kernels are asked for by their C++ name (``"pwconv<24, 48, false, true>"``); the
loader compiles every name a caller needs from one file into one module, memoised per
``(device, file, names)``. CuPy is imported lazily: without it (or without a GPU) this module
imports fine and only :func:`cupy` raises.

Kernel arguments cross as exact C types: int → ``np.int32``, float → ``np.float32`` (a bare
Python int would be passed as a 64-bit integer).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent
NVRTC_OPTIONS = ("--std=c++17",)
INT32_LIMIT = 2**31 - 1
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"\s*$', re.MULTILINE)
_modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_lock = threading.Lock()


class CudaUnavailable(RuntimeError):
    """CuPy (or a CUDA device) is not there: the CUDA backend cannot run here."""


def cupy() -> Any:
    """The ``cupy`` module, imported on first use."""
    try:
        import cupy as cp
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise CudaUnavailable(f"CuPy is not installed: {exc}") from None
    return cp


def module_source(file: str) -> str:
    """``kernels/<file>`` with its ``#include "x.cuh"`` lines replaced by the headers' text."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(file)


def _nvrtc_options() -> tuple[str, ...]:
    cp = cupy()
    options = list(NVRTC_OPTIONS)
    cuda_path = os.environ.get("CUDA_PATH") or cp.cuda.get_cuda_path()
    if cuda_path and (Path(cuda_path) / "include" / "cuda_fp16.h").is_file():
        options.append(f"-I{Path(cuda_path) / 'include'}")
    return tuple(options)


def load_module(file: str, names: Sequence[str]) -> Any:
    """The compiled ``RawModule`` of ``kernels/<file>`` holding ``names`` (current device)."""
    cp = cupy()
    key = (cp.cuda.runtime.getDevice(), file, tuple(sorted(set(names))))
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = cp.RawModule(
                code=module_source(file), options=_nvrtc_options(), name_expressions=key[2]
            )
            module.compile()
            _modules[key] = module
    return module


def kernel(file: str, name: str, module_names: Sequence[str] = ()) -> Any:
    """One kernel of ``kernels/<file>``; ``module_names`` lists its module's other kernels."""
    return load_module(file, [name, *module_names]).get_function(name)


def template_name(func: str, *args: int | bool | str) -> str:
    """C++ spelling of a template instance: ``template_name("f", 3, True)`` → ``f<3, true>``."""
    parts = [str(a).lower() if isinstance(a, bool) else str(a) for a in args]
    return f"{func}<{', '.join(parts)}>"


_sm_counts: dict[int, int] = {}
_grids: dict[tuple[int, int, int, int], int] = {}
_opted_in: dict[int, int] = {}  # kernel → the most dynamic shared memory it opted in to


def sm_count() -> int:
    """Multiprocessors of the current device (memoised: asked once per device)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    if dev not in _sm_counts:
        _sm_counts[dev] = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _sm_counts[dev]


def grid_size(items: int, threads: int, waves: int = 8) -> int:
    """Blocks for a grid-stride loop over ``items``: enough to fill the device, no more."""
    return max(1, min(-(-items // threads), sm_count() * waves))


def blocks_per_sm(func: Any, threads: int, smem: int) -> int:
    """Resident blocks per multiprocessor (sm_90 limits: 2048 threads, 64K registers,
    228 KB shared memory with 1 KB reserved per block, 32 blocks), from the kernel's own
    register and static shared-memory counts."""
    regs = max(int(func.num_regs), 1)
    warp_regs = -(-regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    by_regs = 65536 // (warp_regs * -(-threads // 32))
    by_smem = smem_blocks(smem + int(func.shared_size_bytes))
    return max(1, min(32, 2048 // threads, by_regs, by_smem))


def opt_in_smem(func: Any, smem: int) -> None:
    """Let ``func`` launch with ``smem`` bytes of dynamic shared memory (beyond the 48 KB
    default a kernel must opt in). Memoised per kernel: the driver is told only when a
    launch needs more than before."""
    ptr = int(func.kernel.ptr)
    if smem > max(48 * 1024, _opted_in.get(ptr, 0)):
        func.max_dynamic_shared_size_bytes = smem
        _opted_in[ptr] = smem


def persistent_grid(func: Any, threads: int, smem: int, tiles: int) -> int:
    """Blocks for a persistent kernel: as many as can be resident at once (≤ ``tiles``).

    Also opts ``func`` in to ``smem`` bytes of dynamic shared memory (:func:`opt_in_smem`).
    Memoised, so a recorded forward asks the driver nothing at replay.
    """
    key = (int(func.kernel.ptr), threads, smem, tiles)
    if key not in _grids:
        opt_in_smem(func, smem)
        _grids[key] = max(1, min(tiles, blocks_per_sm(func, threads, smem) * sm_count()))
    return _grids[key]


# The pointwise tile of pw_tile.cuh: its constants and shared-memory size, mirrored here.
PW_BM = 64
PW_THREADS = 128


def pw_smem_bytes(cin: int, cout: int) -> int:
    """Dynamic shared memory of a pw_tile.cuh kernel (``PwShape<CIN, COUT>::SMEM_BYTES``)."""
    kp = -(-cin // 16) * 16
    ks, np_ = kp + 8, -(-cout // 8) * 8
    cs = np_ + 16 if (np_ + 8) % 16 == 0 else np_ + 8
    area = max(ks, cs) * PW_BM
    return (np_ * ks + area) * 2


SMEM_LIMIT = 227 * 1024  # dynamic shared memory one block may opt in to (sm_90)
SM_SMEM = 228 * 1024  # shared memory of an SM (sm_90), 1 KB of it reserved per block
GEMM_BM = 128  # mma_tile.cuh: rows (pixels) of a tensor-core GEMM tile
GEMM_THREADS = 256  # mma_tile.cuh: threads of a GEMM block


def smem_blocks(smem: int) -> int:
    """Blocks of ``smem`` bytes of shared memory (dynamic + static) an SM holds."""
    return SM_SMEM // (smem + 1024)


MAX_SLICE = 192  # output channels per block: 96 fp32 accumulators a thread in the GEMM


def pw_slices(cin: int, cout: int, extra_smem: int = 0) -> int:
    """The fewest slices of the output channels (blockIdx.y) whose tile fits: each slice a
    whole number of 8-channel groups, at most ``MAX_SLICE`` wide, its shared memory under
    ``SMEM_LIMIT``. ScratchNet's default widths (up to 192) all take one slice."""
    for ns in range(1, cout + 1):
        cs = cout // ns
        if cout % ns or (ns > 1 and cs % 8) or cs > MAX_SLICE:
            continue
        if pw_smem_bytes(cin, cs) + extra_smem <= SMEM_LIMIT:
            return ns
    raise ValueError(f"pointwise {cin}->{cout}: no slicing of the output channels fits")


def launch_pw(
    func: Any, cin: int, cout: int, pixels: int, args: tuple[Any, ...], extra_smem: int = 0,
    slices: int = 1,
) -> None:  # fmt: skip
    """Launch a pw_tile.cuh kernel over ``pixels`` output pixels: a persistent grid of
    tiles in x, ``slices`` slices of the output channels in y."""
    smem = pw_smem_bytes(cin, cout // slices) + extra_smem
    if smem > SMEM_LIMIT:
        raise ValueError(f"pointwise {cin}->{cout} needs {smem} B of shared memory (> 227 KB)")
    tiles = -(-pixels // PW_BM)
    grid = max(1, min(tiles, persistent_grid(func, PW_THREADS, smem, tiles) // slices))
    launch(func, (grid, slices), (PW_THREADS,), args, smem)


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def check_device_array(
    op: str, name: str, arr: Any, *, ndim: int | None, dtype: type | np.dtype
) -> None:
    """Raise unless ``arr`` is a C-contiguous CuPy array of ``dtype`` (with ``ndim`` axes)."""
    cp = cupy()
    if not isinstance(arr, cp.ndarray):
        raise TypeError(f"{op}: {name} must be a cupy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"{op}: {name} must be {np.dtype(dtype)}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} axes, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be C-contiguous")
    if arr.size > INT32_LIMIT:
        raise ValueError(f"{op}: {name} has {arr.size} elements; the kernels index with int32")
    if arr.device.id != cp.cuda.runtime.getDevice():
        raise ValueError(f"{op}: {name} lives on device {arr.device.id}, not the current one")


def check_shape(op: str, name: str, arr: Any, shape: tuple[int, ...]) -> None:
    if tuple(arr.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(arr.shape)}")


def output(
    op: str, out: Any | None, shape: tuple[int, ...], dtype: type | np.dtype, name: str = "out"
) -> Any:
    """``out`` checked against ``shape``/``dtype``, or a new array (never inside a capture).
    ``name``: the argument's name in the error (an output, or a scratch buffer)."""
    if out is None:
        return cupy().empty(shape, dtype=dtype)
    check_device_array(op, name, out, ndim=len(shape), dtype=dtype)
    check_shape(op, name, out, shape)
    return out


class Launch:
    """One kernel launch, kept so that a recorded forward can be replayed (and captured)."""

    __slots__ = ("args", "block", "func", "grid", "smem")

    def __init__(
        self, func: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
        smem: int = 0,
    ) -> None:  # fmt: skip
        self.func, self.grid, self.block, self.args, self.smem = func, grid, block, args, smem

    def __call__(self) -> None:
        self.func(self.grid, self.block, self.args, shared_mem=self.smem)


class Memset:
    """Zero a device array on the current stream (recorded like a launch; a memset node)."""

    __slots__ = ("arr",)

    def __init__(self, arr: Any) -> None:
        self.arr = arr

    def __call__(self) -> None:
        cp = cupy()
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memsetAsync(self.arr.data.ptr, 0, self.arr.nbytes, stream.ptr)


Step = Launch | Memset
_recording: list[list[Step]] = []


class recording:
    """``with recording() as launches:`` runs the ops as usual and appends each launch."""

    def __enter__(self) -> list[Step]:
        self.launches: list[Step] = []
        _recording.append(self.launches)
        return self.launches

    def __exit__(self, *exc: object) -> None:
        _recording.remove(self.launches)


def launch(
    func: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], smem: int = 0
) -> None:
    """Launch ``func`` on the current stream (and record it when a recording is open)."""
    _run(Launch(func, grid, block, args, smem))


def zero(arr: Any) -> None:
    """Zero ``arr`` on the current stream (and record it when a recording is open)."""
    _run(Memset(arr))


def _run(step: Step) -> None:
    step()
    for launches in _recording:
        launches.append(step)
