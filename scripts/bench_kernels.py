"""Benchmark: ScratchNet through our CUDA graph vs PyTorch on one GPU.

Implementations, all fp16 on the same weights (the shipped model, or He-initialised random
weights when it is absent — the JSON says which):

- ``scratchd``: our captured graph, uint8 frames → prob, mask, score, entropy, histogram;
- ``torch_eager``: the fused TorchScratchNet (NCHW), uint8 → normalise → net → bilinear → sigmoid;
- ``torch_graph``: the same, channels-last, ``cudnn.benchmark``, captured in a CUDA graph;
- ``torch_compile``: ``torch.compile`` (inductor, default mode) of the same, where it compiles
  within the time budget.

Each (batch, size) is timed with CUDA events around every one of ``--reps`` (≥ 50) launches
after warm-up: median and p99. Each of our kernels is timed alone (median of 30 launches of
batch 16 at 1024²) and its bytes moved (every array argument read or written once) give its
GB/s against a device-to-device copy measured in the same run; their sum over the copy rate
is the bytes-moved floor of the whole forward (METHOD.md).

Writes ``<out-dir>/kernels.json`` and ``<md>`` (a markdown table), prints the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from serve_report import markers, rewrite_section

from scratchd.model.scratchnet import DEFAULT_PATH, ScratchNet, load_model, random_model

ROOT = Path(__file__).resolve().parent.parent
CASES = [(1, 1024), (4, 1024), (16, 1024), (1, 256), (4, 256), (16, 256)]
START, END = markers("bench_kernels")  # its section of docs/benchmarks.md


def load_bench_model() -> tuple[ScratchNet, str]:
    if DEFAULT_PATH.is_file():
        return load_model(), "shipped"
    return random_model(0), "random"


def time_events(
    step: Callable[[], None], reps: int, event: Any, sync: Callable[[], None]
) -> list[float]:
    """Milliseconds of each of ``reps`` launches of ``step``, bracketed by device events."""
    for _ in range(5):
        step()
    sync()
    marks = [(event(), event()) for _ in range(reps)]
    for start, end in marks:
        start.record()
        step()
        end.record()
    sync()
    return [float(start.elapsed_time(end)) for start, end in marks]


def summary(ms: list[float]) -> tuple[float, float]:
    return float(np.median(ms)), float(np.percentile(ms, 99))


# ---------------------------------------------------------------- ours


def bench_ours(net: Any, batch: int, size: int, reps: int, rng: np.random.Generator) -> list[float]:

    g = net.graph(batch, size, size)
    frames = rng.integers(0, 256, (batch, size, size), dtype=np.uint8)
    g.buf.images.set(frames, stream=g.stream)
    stream = g.stream

    def event() -> Any:
        return _CupyEvent(stream)

    return time_events(g.replay, reps, event, stream.synchronize)


class _CupyEvent:
    def __init__(self, stream: Any) -> None:
        import cupy as cp

        self.cp, self.stream, self.ev = cp, stream, cp.cuda.Event()

    def record(self) -> None:
        self.ev.record(self.stream)

    def elapsed_time(self, end: _CupyEvent) -> float:
        return float(self.cp.cuda.get_elapsed_time(self.ev, end.ev))


def kernel_table(net: Any, batch: int, size: int, ceiling: float) -> list[dict[str, Any]]:
    """Each recorded step of one forward timed alone: µs, bytes moved, GB/s."""
    import cupy as cp

    from scratchd.kernels import _cuda as cu

    g = net.graph(batch, size, size)
    with g.stream, cu.recording() as steps:
        net.fwd.run(g.buf)
    g.stream.synchronize()
    rows = []
    for step in steps:
        if not isinstance(step, cu.Launch):
            continue
        arrays = {a.data.ptr: a.nbytes for a in step.args if isinstance(a, cp.ndarray)}
        nbytes = sum(arrays.values())
        with g.stream:
            ms = time_events(step, 30, lambda: _CupyEvent(g.stream), g.stream.synchronize)
        med = float(np.median(ms))
        name = readable(str(getattr(step.func, "name", "?")))
        gbps = nbytes / (med * 1e-3) / 1e9
        rows.append({"op": name, "gbps": round(gbps, 1), "ceiling_gbps": round(ceiling, 1),
                     "batch": batch, "size": size, "us": round(med * 1e3, 2),
                     "mb": round(nbytes / 1e6, 2), "grid": step.grid[0],
                     "regs": int(step.func.num_regs)})  # fmt: skip
    return rows


def readable(name: str) -> str:
    """``_Z8ds_blockILi24ELi0E...ELb1E...`` → ``ds_block<24, 0, ..., 1>`` (template kernels)."""
    m = re.match(r"_Z(\d+)", name)
    if not m:
        return name
    start = m.end()
    func = name[start : start + int(m.group(1))]
    args = re.findall(r"L[ib](\d+)E", name[start:])
    return f"{func}<{', '.join(args)}>" if args else func


def copy_ceiling() -> float:
    """Device-to-device copy of 2 GiB, GB/s counting bytes read plus written (median of 20)."""
    import cupy as cp

    nbytes = 2 << 30
    a, b = cp.empty(nbytes, np.uint8), cp.empty(nbytes, np.uint8)
    a.fill(1)
    stream = cp.cuda.get_current_stream()

    def step() -> None:
        b.data.copy_from_device_async(a.data, nbytes, stream)

    ms = time_events(step, 20, lambda: _CupyEvent(stream), stream.synchronize)
    return 2 * nbytes / (float(np.median(ms)) * 1e-3) / 1e9


# ---------------------------------------------------------------- torch


def torch_pipeline(model: ScratchNet, channels_last: bool) -> tuple[Any, Callable[[Any], Any]]:
    import torch
    import torch.nn.functional as F

    from scratchd.model.torchnet import load_weights

    tnet = load_weights(model.weights, model.config).half().cuda().eval()
    if channels_last:
        tnet = tnet.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    scale, shift = 1.0 / (255.0 * model.meta.std), -model.meta.mean / model.meta.std

    def fn(images: Any) -> Any:  # uint8 [N, 1, H, W] (H, W multiples of 16)
        x = images.half() * scale + shift
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        logits = tnet(x)
        return torch.sigmoid(F.interpolate(logits, scale_factor=2.0, mode="bilinear"))

    return tnet, fn


def bench_torch(
    fn: Callable[[Any], Any], batch: int, size: int, reps: int, graph: bool,
    rng: np.random.Generator,
) -> list[float]:  # fmt: skip
    import torch

    images = torch.from_numpy(rng.integers(0, 256, (batch, 1, size, size), dtype=np.uint8)).cuda()
    with torch.no_grad():
        if not graph:
            return time_events(lambda: fn(images), reps, _torch_event, torch.cuda.synchronize)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn(images)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(images)
        return time_events(g.replay, reps, _torch_event, torch.cuda.synchronize)


def _torch_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def bench_variants(
    model: ScratchNet, args: argparse.Namespace, rng: np.random.Generator
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Time our graph (b1 and b16 at 1024²) under each depthwise schedule of ``--variants``
    (``SWEEP:HOIST``, see ``ds_block.dw_schedule``) and leave the fastest one set."""
    import cupy as cp

    from scratchd.gpu.cuda_scratchnet import CudaScratchNet
    from scratchd.kernels import ds_block as dsb

    rows: list[dict[str, Any]] = []
    specs = [v.split(":") for v in args.variants.split(",") if v]
    for sweep, hoist in specs:
        os.environ[dsb.SWEEP_ENV], os.environ[dsb.HOIST_ENV] = sweep, hoist
        net = CudaScratchNet(model)
        for batch, size in ((1, 1024), (16, 1024)):
            med, p99 = summary(bench_ours(net, batch, size, args.reps, rng))
            rows.append({"sweep": sweep, "hoist": hoist, "batch": batch, "size": size,
                         "median_ms": round(med, 4), "p99_ms": round(p99, 4)})  # fmt: skip
            print(f"variant sweep={sweep} hoist={hoist} b{batch} {size}: {med:.4f} ms", flush=True)
        net.graphs.clear()
        del net
        cp.get_default_memory_pool().free_all_blocks()
    if not rows:
        return rows, {"sweep": dsb.DEFAULT_SWEEP, "hoist": dsb.DEFAULT_HOIST}
    best_case = {(r["batch"], r["size"]): min(
        x["median_ms"] for x in rows if (x["batch"], x["size"]) == (r["batch"], r["size"])
    ) for r in rows}  # fmt: skip

    def cost(sweep: str, hoist: str) -> float:
        mine = [r for r in rows if (r["sweep"], r["hoist"]) == (sweep, hoist)]
        return sum(r["median_ms"] / best_case[(r["batch"], r["size"])] for r in mine)

    sweep, hoist = min(((s, h) for s, h in specs), key=lambda v: cost(*v))
    os.environ[dsb.SWEEP_ENV], os.environ[dsb.HOIST_ENV] = sweep, hoist
    return rows, {"sweep": sweep, "hoist": hoist}


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp
    import torch

    from scratchd.gpu.cuda_scratchnet import CudaScratchNet

    torch.backends.cudnn.benchmark = True
    rng = np.random.default_rng(0)
    model, which = load_bench_model()
    variants, policy = bench_variants(model, args, rng)
    print(f"depthwise schedule used below: {policy}", flush=True)
    net = CudaScratchNet(model)
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.0f} GB/s; weights: {which}", flush=True)
    results: list[dict[str, Any]] = []

    def add(impl: str, batch: int, size: int, ms: list[float]) -> None:
        med, p99 = summary(ms)
        results.append({"impl": impl, "batch": batch, "size": size,
                        "median_ms": round(med, 4), "p99_ms": round(p99, 4)})  # fmt: skip
        print(
            f"{impl:14s} b{batch:<3d} {size:5d}  median {med:8.4f} ms  p99 {p99:8.4f} ms",
            flush=True,
        )

    for batch, size in CASES:
        add("scratchd", batch, size, bench_ours(net, batch, size, args.reps, rng))
    kernels = kernel_table(net, 16, 1024, ceiling) + kernel_table(net, 1, 1024, ceiling)
    net.graphs.clear()
    cp.get_default_memory_pool().free_all_blocks()
    _, eager = torch_pipeline(model, channels_last=False)
    _, cl = torch_pipeline(model, channels_last=True)
    for batch, size in CASES:
        add("torch_eager", batch, size, bench_torch(eager, batch, size, args.reps, False, rng))
        add("torch_graph", batch, size, bench_torch(cl, batch, size, args.reps, True, rng))
    compile_errors = bench_compile(cl, args, rng, add)
    floor_mb = sum(k["mb"] for k in kernels if k["batch"] == 16)
    return {
        "device": torch.cuda.get_device_name(0),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "weights": which,
        "reps": args.reps,
        "copy_ceiling_gbps": round(ceiling, 1),
        "floor_b16_1024": {
            "mb": round(floor_mb, 1),
            "ms": round(floor_mb / 1e3 / ceiling * 1e3, 4),
        },
        "compile_errors": compile_errors,
        "dw_schedule": policy,
        "dw_schedule_variants": variants,
        "results": results,
        "kernels": kernels,
    }


def bench_compile(
    fn: Callable[[Any], Any], args: argparse.Namespace, rng: np.random.Generator,
    add: Callable[[str, int, int, list[float]], None],
) -> list[str]:  # fmt: skip
    """torch.compile per case until the compile budget is spent; returns what failed."""
    import torch

    errors: list[str] = []
    t0 = time.monotonic()
    compiled = torch.compile(fn, dynamic=False)
    for batch, size in CASES:
        if time.monotonic() - t0 > args.compile_budget_s:
            errors.append(f"b{batch} {size}: skipped, compile budget spent")
            continue
        try:
            add(
                "torch_compile",
                batch,
                size,
                bench_torch(compiled, batch, size, args.reps, False, rng),
            )
        except Exception as exc:  # torch.compile failing is a result, not a crash
            errors.append(f"b{batch} {size}: {type(exc).__name__}: {exc}"[:300])
    return errors


def markdown(report: dict[str, Any]) -> str:
    rows = {(r["impl"], r["batch"], r["size"]): r for r in report["results"]}
    lines = [
        f"## GPU forward (`scripts/bench_kernels.py`, {report['device']}, {report['date']})",
        "",
        f"Weights: {report['weights']}. Median / p99 of {report['reps']} launches timed with "
        "CUDA events, ms per batch. `scratchd`: our CUDA graph, uint8 frames in, prob + mask + "
        "score + entropy + histogram out; torch: uint8 → normalise → net → bilinear → sigmoid.",
        "",
        "| batch | size | scratchd | torch eager | torch graph (CL + cuDNN) | torch.compile | "
        "vs torch graph |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, size in CASES:
        cells = []
        for impl in ("scratchd", "torch_eager", "torch_graph", "torch_compile"):
            r = rows.get((impl, batch, size))
            cells.append(f"{r['median_ms']:.3f} / {r['p99_ms']:.3f}" if r else "—")
        ours, ref = rows.get(("scratchd", batch, size)), rows.get(("torch_graph", batch, size))
        speed = f"{ref['median_ms'] / ours['median_ms']:.2f}x" if ours and ref else "—"
        lines.append(f"| {batch} | {size} | " + " | ".join(cells) + f" | {speed} |")
    floor = report["floor_b16_1024"]
    lines += [
        "",
        f"Copy ceiling (device-to-device, read + write): {report['copy_ceiling_gbps']:.0f} GB/s. "
        f"Bytes-moved floor of our forward at batch 16, 1024²: {floor['mb']:.0f} MB → "
        f"{floor['ms']:.3f} ms.",
        "",
        "| kernel (batch, size) | µs | MB moved | GB/s | % of copy |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in report["kernels"]:
        pct = 100 * k["gbps"] / k["ceiling_gbps"]
        lines.append(
            f"| `{k['op']}` (b{k['batch']}, {k['size']}) | {k['us']:.1f} | {k['mb']:.1f} | "
            f"{k['gbps']:.0f} | {pct:.0f} % |"
        )
    if report.get("dw_schedule_variants"):
        lines += [
            "",
            "Depthwise schedules tried (`ds_block.dw_schedule`: sweep = largest P, hoist = all "
            f"rows loaded first); the tables above use {report['dw_schedule']}:",
            "",
            "| sweep | hoist | batch | size | median ms |",
            "|---|---|---:|---:|---:|",
        ]
        for v in report["dw_schedule_variants"]:
            row = (v["sweep"], v["hoist"], v["batch"], v["size"], f"{v['median_ms']:.3f}")
            lines.append("| " + " | ".join(map(str, row)) + " |")
    if report["compile_errors"]:
        lines += ["", "torch.compile: " + "; ".join(report["compile_errors"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--compile-budget-s", type=float, default=150.0)
    parser.add_argument(
        "--variants", default="",
        help="depthwise schedules SWEEP:HOIST to compare first, e.g. auto:1,auto:0,4:1,1:1",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument(
        "--profile", action="store_true",
        help="only build the batch-16 1024² graph (one eager forward first) and exit: for ncu",
    )  # fmt: skip
    args = parser.parse_args()
    if args.profile:
        from scratchd.gpu.cuda_scratchnet import CudaScratchNet

        CudaScratchNet(load_bench_model()[0]).graph(16, 1024, 1024)
        return
    if args.reps < 50:
        parser.error("--reps must be at least 50")
    report = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    args.md.parent.mkdir(parents=True, exist_ok=True)
    rewrite_section(args.md, f"{START}\n{text}{END}\n", "bench_kernels")
    print(text)


if __name__ == "__main__":
    main()
