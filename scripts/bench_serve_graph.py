"""Benchmark: the serving graph per batch bucket, 1024x1024 frames.

For each bucket (1, 2, 4, 8, 16) a :class:`ServeGraph` of the shipped model (its four
test-time views) is fed real-image mosaics (SD-900 tiles) and measured:

- ``graph_ms``: device time of one launch (view_stack → forward of 4 x bucket view frames →
  view_mean → row_runs), from the CUDA events around the replay: median and p90 of
  ``--reps`` launches after warm-up, alternating the two input buffers;
- ``collect_ms``: host wall time of ``collect`` once the graph has finished (device → host
  copies of the small outputs and their event waits), per frame;
- ``finish_ms``: the host finish from the runs, per frame, without masks and with every
  mask painted;
- frames/s served serially (graph + collect + finish) and pipelined (each batch's finish
  overlapping the next batch's graph);
- the device footprint and the runs per frame.

The same again with the single ``identity`` view (``results_identity_view``).
``CudaScratchNet.predict`` (the model API: a serving graph plus the mean map copied back
for ``prob``) is timed on 4 frames, end to end from host frames.

Prints a table; writes ``--out`` (default ``docs/bench/serve-graph.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.gpu.buckets import BUCKETS
from scratchd.gpu.cuda_scratchnet import CudaScratchNet
from scratchd.gpu.serve_graph import ServeGraph
from scratchd.model.scratchnet import load_model
from scratchd.protocol.image import decode_image

ROOT = Path(__file__).resolve().parent.parent
SIZE = 1024


def mosaics(data_dir: Path, count: int) -> np.ndarray:
    """``count`` 1024x1024 frames, each a mosaic of real 200x200 SD-900 tiles."""
    files = sorted((data_dir / "sd900" / "images").glob("*.png"))
    tiles = [decode_image(f.read_bytes()) for f in files]
    per = -(-SIZE // 200)
    frames = []
    for i in range(count):
        pick = [tiles[(i * 37 + j * 11) % len(tiles)] for j in range(per * per)]
        rows = [np.hstack(pick[r * per : (r + 1) * per]) for r in range(per)]
        frames.append(np.vstack(rows)[:SIZE, :SIZE])
    return np.ascontiguousarray(np.stack(frames))


def bench_bucket(net: CudaScratchNet, frames: np.ndarray, bucket: int, reps: int) -> dict[str, Any]:
    g = ServeGraph(net, bucket, SIZE, SIZE)
    for k, buf in enumerate(g.inputs):
        buf.set(frames[k * bucket : (k + 1) * bucket], stream=g.stream)
    graph_ms: list[float] = []
    collect_s: list[float] = []
    plain_s: list[float] = []
    mask_s: list[float] = []
    runs: list[int] = []
    for r in range(reps + 3):
        k = r % len(g.inputs)
        g.launch(k)
        g.released[k].synchronize()  # graph done: what follows is the host's own time
        t0 = time.perf_counter()
        batch = g.collect(bucket)
        t1 = time.perf_counter()
        want = [r % 2 == 1] * bucket
        results = g.finish(batch, want)
        t2 = time.perf_counter()
        if r < 3:
            continue  # warm-up
        graph_ms.append(g.last_compute_ms)
        collect_s.append(t1 - t0)
        (mask_s if want[0] else plain_s).append(t2 - t1)
        runs += [res.runs for res in results]
    fps = pipelined_fps(g, bucket, reps)
    med = float(np.median(graph_ms))
    return {
        "bucket": bucket,
        "view_frames": bucket * len(net.model.views),
        "graph_ms_median": round(med, 4),
        "graph_ms_p90": round(float(np.percentile(graph_ms, 90)), 4),
        "graph_ms_per_frame": round(med / bucket, 4),
        "collect_ms_per_frame": round(1e3 * float(np.median(collect_s)) / bucket, 4),
        "finish_ms_per_frame_no_mask": round(1e3 * float(np.median(plain_s)) / bucket, 4),
        "finish_ms_per_frame_mask": round(1e3 * float(np.median(mask_s)) / bucket, 4),
        "pipelined_frames_per_s": round(fps, 1),
        "serial_frames_per_s": round(
            bucket / (1e-3 * med + float(np.median(collect_s)) + float(np.median(plain_s))), 1
        ),
        "runs_per_frame": round(float(np.mean(runs)), 1),
        "host_fallbacks": g.host_fallbacks,
        "footprint_mb": round(g.footprint_bytes / 2**20, 1),
    }


def pipelined_fps(g: ServeGraph, bucket: int, reps: int) -> float:
    """Frames/s of launch → collect → (next launch) → finish: the host finish (no masks)
    of batch i overlaps the graph of batch i + 1."""
    t0 = time.perf_counter()
    g.launch(0)
    for r in range(1, reps + 1):
        batch = g.collect(bucket)
        g.launch(r % len(g.inputs))
        g.finish(batch, [False] * bucket)
    g.finish(g.collect(bucket), [False] * bucket)
    return (reps + 1) * bucket / (time.perf_counter() - t0)


def predict_ms(net: CudaScratchNet, frames: np.ndarray) -> float:
    """Wall ms per frame of CudaScratchNet.predict on 4 frames (after a warm-up call)."""
    part = list(frames[:4])
    net.predict(part)  # warm-up: captures its graph
    t0 = time.perf_counter()
    net.predict(part)
    return 1e3 * (time.perf_counter() - t0) / len(part)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [c for c in rows[0] if c != "view_frames"]
    print(" ".join(f"{c.replace('_per_frame', '/f')[:13]:>13}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]!s:>13}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "serve-graph.json")
    ap.add_argument(
        "--model", type=Path, default=None, help="model file to time (default: the shipped one)"
    )
    ap.add_argument("--buckets", type=int, nargs="*", default=list(BUCKETS), help="buckets to time")
    args = ap.parse_args()
    if not set(args.buckets) <= set(BUCKETS):
        ap.error(f"--buckets: each one of {BUCKETS}")
    import cupy as cp

    model = load_model(args.model)
    frames = mosaics(args.data, 2 * max(args.buckets))
    tables: dict[str, list[dict[str, Any]]] = {}
    for views in dict.fromkeys((model.views, ("identity",))):
        net = CudaScratchNet(load_model(args.model, views=views))
        rows = tables.setdefault("+".join(views), [])
        for b in args.buckets:
            rows.append(bench_bucket(net, frames, b, args.reps))
            cp.get_default_memory_pool().free_all_blocks()
    pred = predict_ms(CudaScratchNet(model), frames)
    for name, rows in tables.items():
        print(f"views {name}")
        print_table(rows)
    print(f"CudaScratchNet.predict ({len(model.views)} views, with prob): {pred:.2f} ms/frame")
    props = cp.cuda.runtime.getDeviceProperties(0)
    record = {
        "device": props["name"].decode(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "size": SIZE,
        "model": model.version,
        "architecture": model.meta.architecture,
        "views": list(model.views),
        "reps": args.reps,
        "frames": "1024x1024 mosaics of real SD-900 tiles",
        "results": tables["+".join(model.views)],
        "results_identity_view": tables["identity"],
        "predict_ms_per_frame": round(pred, 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
