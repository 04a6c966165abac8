"""What page-locking a client region costs a CUDA worker: ``cudaHostRegister`` (read-only) of
a ``PROT_READ`` mapping of a sealed memfd, as ``ipc/region_maps.py`` maps a gateway's region,
whole and in ``workers/host_memory.py``'s ``CHUNK`` pieces, with the client's pages written
beforehand ("touched") or not, and ``cudaHostUnregister`` of the same.

    python scripts/bench_host_register.py [--mib 128] [--repeats 3] [--json OUT.json]

Prints one row per case with every repeat's milliseconds (the whole call, and the longest
single piece: what a request arriving meanwhile waits at most) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path
from typing import Any


def region(nbytes: int, touched: bool) -> tuple[int, mmap.mmap]:
    """A memfd of ``nbytes`` (written through if ``touched``) and the worker's read-only map."""
    fd = os.memfd_create("scratchd-bench-register", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    if touched:
        with mmap.mmap(fd, nbytes) as w:
            for off in range(0, nbytes, 1 << 20):
                w[off : off + (1 << 20)] = b"\x01" * (1 << 20)
    return fd, mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)


def one(cp: Any, nbytes: int, piece: int, touched: bool) -> dict[str, float]:
    import numpy as np

    from scratchd.workers.host_memory import HOST_REGISTER_READ_ONLY

    rt = cp.cuda.runtime
    fd, m = region(nbytes, touched)
    pixels = np.frombuffer(m, np.uint8)
    base = int(pixels.ctypes.data)
    ptrs, longest = [], 0.0
    t0 = time.perf_counter()
    for off in range(0, nbytes, piece):
        t = time.perf_counter()
        rt.hostRegister(base + off, min(piece, nbytes - off), HOST_REGISTER_READ_ONLY)
        longest = max(longest, time.perf_counter() - t)
        ptrs.append(base + off)
    lock = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in ptrs:
        rt.hostUnregister(p)
    unlock = time.perf_counter() - t0
    del pixels
    m.close()
    os.close(fd)
    return {"lock_ms": lock * 1e3, "longest_piece_ms": longest * 1e3, "unlock_ms": unlock * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=128, help="region size (a gateway's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import cupy as cp

    from scratchd.workers.host_memory import CHUNK

    cp.cuda.runtime.free(cp.cuda.runtime.malloc(1))  # the context, outside the timings
    nbytes = args.mib << 20
    rows = []
    print(f"{'case':<22} {'lock ms (each repeat)':<28} {'longest piece ms':<24} unlock ms")
    for touched in (False, True):
        for piece in (nbytes, CHUNK):
            runs = [one(cp, nbytes, piece, touched) for _ in range(args.repeats)]
            pieces = "whole" if piece == nbytes else f"{piece >> 20} MiB pieces"
            name = f"{'touched' if touched else 'untouched'} {pieces}"
            rows.append({"case": name, "mib": args.mib, "piece_bytes": piece, "runs": runs})

            def cells(key: str, runs: list[dict[str, float]] = runs) -> str:
                return " ".join(f"{r[key]:.1f}" for r in runs)

            print(f"{name:<22} {cells('lock_ms'):<28} {cells('longest_piece_ms'):<24} "
                  f"{cells('unlock_ms')}")  # fmt: skip
    if args.json:
        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
