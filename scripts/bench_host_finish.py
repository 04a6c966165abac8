"""Benchmark: the GPU path's host finish of one frame, numpy against C (no GPU needed).

The serving graph leaves each frame's foreground as run records on the device; the worker
joins them into components, boxes and (when asked) the mask on the host. This times that
step both ways on the same records:

- ``numpy_ms``: ``postprocess.finish_runs(*unpack_runs(records, count), ...)``, the reference
  (and the CPU path's own finish);
- ``c_ms``: ``kernels._runs.finish_records`` (what ``serve_graph.HostFinish`` calls);

without and with the mask painted, best of ``--reps`` per frame. The records come from real
frames: ``--frames`` 1024x1024 mosaics of the images under ``--data`` (built as
``bench_serve`` builds them), run through the shipped model's CPU forward with the identity
view, thresholded as on the device (``threshold_runs``, run sums rounded to float32 as the
records store them). The two finishes are checked equal on every frame before timing.

    python scripts/bench_host_finish.py --json docs/bench/host-finish.json

Prints a table; writes ``--json`` when given.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import serve_load as sl

from scratchd.cpu import _runs
from scratchd.kernels.postprocess import finish_runs
from scratchd.kernels.row_runs import row_runs_ref, unpack_runs
from scratchd.model.scratchnet import load_model

ROOT = Path(__file__).resolve().parent.parent


def best_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1000.0, 4)


def bench_frame(prob: np.ndarray, threshold: float, min_area: int, reps: int) -> dict[str, Any]:
    h, w = prob.shape  # the device's records: row_runs_ref has its layout; room for all runs
    runs = row_runs_ref(prob[None], threshold, capacity=h * ((w + 1) // 2))
    rec, count = runs.runs[0], int(runs.count[0])
    mask = np.empty((h, w), np.uint8)

    def numpy_finish(paint: bool) -> Any:
        return finish_runs(*unpack_runs(rec, count), h, w, min_area, paint=paint)

    want = numpy_finish(True)
    if _runs.finish_records(rec, count, h, w, min_area, mask) != want.boxes:
        raise SystemExit("finish_records and finish_runs disagree on the boxes")
    if not np.array_equal(mask, want.mask):
        raise SystemExit("finish_records and finish_runs disagree on the mask")
    return {
        "runs": count,
        "boxes": len(want.boxes),
        "numpy_ms": best_ms(lambda: numpy_finish(False), reps),
        "c_ms": best_ms(lambda: _runs.finish_records(rec, count, h, w, min_area), reps),
        "numpy_mask_ms": best_ms(lambda: numpy_finish(True), reps),
        "c_mask_ms": best_ms(lambda: _runs.finish_records(rec, count, h, w, min_area, mask), reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    frames = sl.build_frames(sl.image_paths(args.data), args.size, args.frames, 1)
    model = load_model(views=("identity",))
    meta = model.meta
    load_before = os.getloadavg()[0]
    rows = [
        bench_frame(p.prob, meta.threshold, meta.min_area, args.reps)
        for p in model.predict(list(frames))
    ]
    print(f"{'frame':>5} {'runs':>6} {'boxes':>5} {'numpy ms':>9} {'C ms':>7} {'x':>6} "
          f"{'numpy+mask':>11} {'C+mask':>7}")  # fmt: skip
    for i, r in enumerate(rows):
        print(
            f"{i:>5} {r['runs']:>6} {r['boxes']:>5} {r['numpy_ms']:>9.3f} {r['c_ms']:>7.3f} "
            f"{r['numpy_ms'] / r['c_ms']:>6.1f} {r['numpy_mask_ms']:>11.3f} {r['c_mask_ms']:>7.3f}"
        )
    if args.json:
        record = {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "loadavg_1m_before": round(load_before, 2),
                "loadavg_1m_after": round(os.getloadavg()[0], 2),
            },
            "size": args.size, "reps": args.reps, "frames": rows,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
