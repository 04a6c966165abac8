"""Stress: the captured CUDA forward, built and replayed again and again, against itself and numpy.

Cases: the shipped model (when its file is there) and random-weight models, on odd frame
sizes. Each case's first result (built, then the device synchronised) is the reference bits;
its numpy forward (``ScratchNet.forward``, one view like ``CudaScratchNet.run``) the
reference values. Then, per phase, until its share of ``--budget`` seconds is spent, round
robin over the cases: a fresh ``CudaScratchNet`` (weights, buffers, graph capture: where the
stream-ordering defect lived), replayed ``--replays`` times; every result is compared with
the case's first bits (any difference in prob, mask, score, entropy or hist) and with numpy
(prob max abs diff > 2e-2, or not finite: counted, its diff recorded as -1).

A phase is ``[pre-fix:]CONTENTION[+delay]``:

- CONTENTION: ``none``; ``process``, another process (its own CUDA context: time slicing)
  multiplying 4096² fp16 matrices and copying 64 MB host → device in a loop; ``thread``, the
  same on another stream of this process;
- ``+delay``: before each net is built, a kernel spins ``--delay-ms`` on the legacy default
  stream, so the weights' copies and the buffers' memsets queue behind it (the defect made
  deterministic);
- ``pre-fix:``: graphs captured by a copy of ``cuda_graph.capture`` without the device
  synchronisation, as before the fix, to show what it prevents.

Prints a table; writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.gpu import cuda_graph, serve_graph
from scratchd.gpu.cuda_scratchnet import CudaScratchNet
from scratchd.kernels import _cuda as cu
from scratchd.model.scratchnet import DEFAULT_PATH, ScratchNet, load_model, random_model

PROB_ATOL = 2e-2
DEFAULT_PHASES = "none,process,process+delay,pre-fix:process,pre-fix:process+delay"
RANDOM_SHAPES = ((3, 37, 50), (2, 129, 301), (1, 17, 23))
SHIPPED_SHAPES = ((3, 72, 104), (1, 37, 50))
SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class Case:
    """A model on fixed frames, with its reference bits and numpy probabilities."""

    def __init__(self, name: str, model: ScratchNet, images: np.ndarray) -> None:
        self.name, self.model, self.images = name, model, images
        self.want = model.forward(images)
        self.first = CudaScratchNet(model).run(images)
        cu.cupy().cuda.Device().synchronize()


@contextmanager
def capture_as(pre_fix: bool) -> Iterator[None]:
    fixed = cuda_graph.capture
    if pre_fix:
        cuda_graph.capture = serve_graph.capture = cuda_graph.record_and_capture
    try:
        yield
    finally:
        cuda_graph.capture = serve_graph.capture = fixed


def contend(stop: Any) -> None:
    """Keep the GPU's compute and copy engines busy until ``stop`` is set."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.random.standard_normal((4096, 4096)).astype(cp.float16)
        dev = cp.empty((64 << 20,), cp.uint8)
    host = np.ones((64 << 20,), np.uint8)
    while not stop.is_set():
        with stream:
            for _ in range(8):
                a = (a @ a) * cp.float16(1e-3)
            dev.set(host, stream=stream)
        stream.synchronize()


@contextmanager
def contention(kind: str) -> Iterator[None]:
    if kind == "none":
        yield
        return
    if kind == "process":
        ctx = mp.get_context("spawn")
        pstop = ctx.Event()
        proc = ctx.Process(target=contend, args=(pstop,), daemon=True)
        proc.start()
        time.sleep(3.0)  # its CUDA context and first matmuls are up
        try:
            yield
        finally:
            pstop.set()
            proc.join(10)
        return
    tstop = threading.Event()
    thread = threading.Thread(target=contend, args=(tstop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        tstop.set()
        thread.join(10)


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def run_phase(
    phase: str, cases: list[Case], seconds: float, replays: int, delay_ms: float
) -> dict[str, Any]:
    pre_fix = phase.startswith("pre-fix:")
    kind, _, delay = phase.removeprefix("pre-fix:").partition("+")
    cp = cu.cupy()
    spin = cp.RawKernel(SPIN_SOURCE, "spin")
    row: dict[str, Any] = {
        "phase": phase, "capture": "pre-fix" if pre_fix else "fixed", "contention": kind,
        "delay_ms": delay_ms if delay else 0.0, "nets": 0, "forwards": 0,
        "vs_first": 0, "vs_numpy": 0, "not_finite": 0, "max_diff": 0.0, "failed": [],
    }  # fmt: skip
    with contention(kind), capture_as(pre_fix):
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            case = cases[i % len(cases)]
            i += 1
            if delay:
                with cp.cuda.Stream.null:
                    spin((1,), (1,), (np.uint64(delay_ms * 1e6),))
            net = CudaScratchNet(case.model)
            row["nets"] += 1
            for _ in range(replays):
                got = net.run(case.images)
                row["forwards"] += 1
                finite = bool(np.all(np.isfinite(got["prob"])))
                diff = float(np.abs(got["prob"] - case.want).max()) if finite else -1.0
                row["not_finite"] += not finite
                row["max_diff"] = max(row["max_diff"], diff)
                bad_numpy = not finite or diff > PROB_ATOL
                bad_first = not same_bits(got, case.first)
                row["vs_numpy"] += bad_numpy
                row["vs_first"] += bad_first
                if (bad_numpy or bad_first) and len(row["failed"]) < 8:
                    row["failed"].append({"case": case.name, "diff": diff})
            del net
            cp.cuda.Device().synchronize()  # a late memset must not reach the next net
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Stress the captured CUDA forward (see the docstring)."
    )
    ap.add_argument("--budget", type=float, default=80.0, help="seconds for everything")
    ap.add_argument("--phases", default=DEFAULT_PHASES, help="comma-separated, see above")
    ap.add_argument("--replays", type=int, default=2, help="replays of each fresh net")
    ap.add_argument("--delay-ms", type=float, default=150.0, help="spin of a +delay phase")
    ap.add_argument("--seed", type=int, default=1329691375)
    ap.add_argument("--out", type=Path, default=Path("stress_forward.json"))
    args = ap.parse_args()
    start = time.monotonic()
    cp = cu.cupy()
    rng = np.random.default_rng(args.seed)
    cases = [
        Case(
            f"random{s}",
            random_model(args.seed % 1000 + k, "stress"),
            rng.integers(0, 256, s, np.uint8),
        )
        for k, s in enumerate(RANDOM_SHAPES)
    ]
    if DEFAULT_PATH.is_file():
        shipped = load_model(views=("identity",))
        cases += [
            Case(f"shipped{s}", shipped, rng.integers(0, 256, s, np.uint8)) for s in SHIPPED_SHAPES
        ]
    phases = [p for p in args.phases.split(",") if p]
    warm_s = time.monotonic() - start
    startups = 3.0 * sum("process" in p for p in phases)  # the contending process's start
    share = max(1.0, (args.budget - warm_s - startups) / len(phases))
    rows = [run_phase(p, cases, share, args.replays, args.delay_ms) for p in phases]
    head = (
        f"{'phase':<28}{'nets':>6}{'fwds':>6}{'≠first':>8}{'≠numpy':>8}{'nonfin':>8}{'maxdiff':>10}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['phase']:<28}{r['nets']:>6}{r['forwards']:>6}{r['vs_first']:>8}"
            f"{r['vs_numpy']:>8}{r['not_finite']:>8}{r['max_diff']:>10.3g}"
        )
    doc = {
        "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "cases": [c.name for c in cases], "seed": args.seed, "replays": args.replays,
        "warm_up_s": round(warm_s, 1), "phase_s": round(share, 1), "phases": rows,
    }  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out} ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
