"""Benchmark: each DS block of the shipped model fused (``ds_block.cu``) vs split
(``ds_split.cu``: depthwise + tiled GEMM), and the whole forward under each split mode.

Per block, at ``--batch`` view frames of 1024x1024 (the serving graph runs 4 views per frame,
so 16 view frames = a bucket of 4): device time from CUDA events around ``--reps`` eager
launches of the block on the forward's own activations, median of ``--rounds`` rounds.
A split block is also timed per ``--gemms`` pipeline (``BK:STAGES`` of ``pw_gemm``) and
broken into its depthwise and GEMM launches, and timed on the tiled path (``ds_tiled``: one
launch on the GEMM's tiling, the head included) and on the halo path (``ds_halo``: stride-1
blocks with their input tiles staged in shared memory). Then the whole forward (stem → blocks →
output path) captured as a CUDA graph with ``SCRATCHD_DS_SPLIT`` = none / auto / all /
tiled / halo: median graph time. The forward's rule (``ds_split.block_path``) should pick the
fastest path per block; this is its evidence.

Prints a table; writes ``--out`` (default ``docs/bench/ds-split.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.kernels.ds_split import DEFAULT_GEMM, GEMM_ENV, SPLIT_ENV
from scratchd.model.scratchnet import load_model

ROOT = Path(__file__).resolve().parent.parent
SIZE = 1024


def forward(mode: str) -> Any:
    from scratchd.gpu.cuda_net import CudaForward

    os.environ[SPLIT_ENV] = mode
    m = load_model()
    meta = m.meta
    return CudaForward(m.weights, m.config, meta.mean, meta.std, meta.threshold, meta.score_window)


def timed(cp: Any, fn: Any, reps: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean device µs of ``reps`` back-to-back calls."""
    fn()
    per = []
    for _ in range(rounds):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        per.append(cp.cuda.get_elapsed_time(start, stop) * 1000.0 / reps)
    return statistics.median(per)


def split_parts(cp: Any, fn: Any, reps: int, rounds: int) -> tuple[float, float]:
    """Device µs of the depthwise launch and of the GEMM launch of one split block."""
    from scratchd.kernels import _cuda as cu

    with cu.recording() as steps:
        fn()
    dw, gemm = steps
    return round(timed(cp, dw, reps, rounds), 2), round(timed(cp, gemm, reps, rounds), 2)


def per_block(
    cp: Any, batch: int, reps: int, rounds: int, gemms: list[str]
) -> list[dict[str, Any]]:
    from scratchd.kernels.stem import stem_cuda

    fused, split, tiled = forward("none"), forward("all"), forward("tiled")
    halo = forward("halo")
    buf = split.buffers(batch, SIZE, SIZE)
    unsplit = replace(buf, split=frozenset())  # the same arrays, every block fused
    rng = np.random.default_rng(5)
    buf.images.set(rng.integers(0, 256, buf.images.shape, dtype=np.uint8))
    w = split.w
    h = stem_cuda(buf.images, split.mean, split.std, w["stem.w"], w["stem.b"], out=buf.acts["stem"])
    skips = {"skip0": h}
    rows = []
    for b in split.plan:
        row: dict[str, Any] = {
            "block": b.name, "cin": b.cin, "cout": b.cout, "stride": b.stride,
            "dilation": b.dilation, "join": b.join is not None,
        }  # fmt: skip
        run_fused = partial(fused._block, b, h, skips, unsplit)
        row["fused_us"] = round(timed(cp, run_fused, reps, rounds), 2)
        if tiled.path[b.name] == "tiled":
            run_tiled = partial(tiled._block, b, h, skips, unsplit)
            row["tiled_us"] = round(timed(cp, run_tiled, reps, rounds), 2)
        if halo.path[b.name] == "halo":
            run_halo = partial(halo._block, b, h, skips, unsplit)
            row["halo_us"] = round(timed(cp, run_halo, reps, rounds), 2)
        if split.path[b.name] == "split":
            run = partial(split._block, b, h, skips, buf)
            for spec in gemms:
                os.environ[GEMM_ENV] = spec
                row[f"split_us@{spec}"] = round(timed(cp, run, reps, rounds), 2)
                row[f"dw_us@{spec}"], row[f"gemm_us@{spec}"] = split_parts(cp, run, reps, rounds)
            os.environ.pop(GEMM_ENV, None)
            row["split_us"] = row[f"split_us@{DEFAULT_GEMM}"]
        out = split._block(b, h, skips, buf)
        row["out_shape"] = list(out.shape)
        rows.append(row)
        if b.saves is not None:
            skips[b.saves] = out
        h = out
    return rows


def whole(cp: Any, batch: int, reps: int, rounds: int) -> dict[str, float]:
    from scratchd.gpu.cuda_graph import capture

    result = {}
    for mode in ("none", "auto", "all", "tiled", "halo"):
        fwd = forward(mode)
        buf = fwd.buffers(batch, SIZE, SIZE)
        stream = cp.cuda.Stream(non_blocking=True)
        graph = capture(stream, partial(fwd.run, buf))
        with stream:
            result[mode] = round(timed(cp, lambda g=graph, s=stream: g.launch(s), reps, rounds), 1)
        del graph, buf
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="view frames of 1024x1024")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--gemms", default=DEFAULT_GEMM, help=f"pw_gemm BK:STAGES to compare ({GEMM_ENV})"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "ds-split.json")
    args = ap.parse_args()
    import cupy as cp

    gemms = args.gemms.split(",")
    if DEFAULT_GEMM not in gemms:
        gemms.append(DEFAULT_GEMM)
    rows = per_block(cp, args.batch, args.reps, args.rounds, gemms)
    graphs = whole(cp, args.batch, args.reps, args.rounds)
    os.environ.pop(SPLIT_ENV, None)
    print(
        f"{'block':10} {'cin→cout':>10} {'s':>2} {'d':>2} {'join':>5} "
        f"{'fused µs':>10} {'split µs':>10} {'x':>6} {'tiled µs':>10} {'x':>6}"
        f" {'halo µs':>10} {'x':>6}"
        "  split = dw + gemm µs per BK:STAGES"
    )
    for r in rows:
        s = r.get("split_us")
        ratio = f"{r['fused_us'] / s:6.2f}" if s else "     -"
        t = r.get("tiled_us")
        tiled_ratio = f"{r['fused_us'] / t:6.2f}" if t else "     -"
        hu = r.get("halo_us")
        halo_ratio = f"{r['fused_us'] / hu:6.2f}" if hu else "     -"
        print(
            f"{r['block']:10} {r['cin']:>4}→{r['cout']:<5} {r['stride']:>2} {r['dilation']:>2} "
            f"{r['join']!s:>5} {r['fused_us']:>10.1f} {s if s else '-':>10} {ratio} "
            f"{r.get('tiled_us', '-'):>10} {tiled_ratio} {r.get('halo_us', '-'):>10} {halo_ratio}  "
            + "  ".join(
                f"{g}: {r[f'dw_us@{g}']:.0f}+{r[f'gemm_us@{g}']:.0f}"
                for g in gemms
                if f"dw_us@{g}" in r
            )
        )
    print(f"whole forward (graph), {args.batch} view frames of {SIZE}²: " + ", ".join(
        f"{k} {v:.1f} µs" for k, v in graphs.items()))  # fmt: skip
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    record = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "batch_view_frames": args.batch, "size": SIZE, "reps": args.reps,
        "rounds": args.rounds, "gemms": gemms, "default_gemm": DEFAULT_GEMM,
        "blocks": rows, "forward_graph_us": graphs,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
