"""CPU benchmark: the numpy forward against onnxruntime on the same weights.

    python scripts/bench_cpu.py [--model PATH] [--repeats 5] [--threads N] [--profile]
        [--json docs/bench/cpu.json]

For each frame size (200x200 single SD-900 tile, 1024x1024 line-camera frame) it times one
pass of the network (``ScratchNet.forward``: normalise + pad, network, head; no test-time
views, no post-processing) and the same weights exported to ONNX from the fused PyTorch
mirror, run by onnxruntime with ``intra_op_num_threads`` = ``--threads`` (default: the
numpy forward's band threads, ``cpu_bands.THREADS``: the CPUs this process may run on; its
BLAS runs single-threaded inside them). The ONNX graph starts from the normalised, padded
input (onnxruntime gets that work for free). ``--repeats`` runs of each after 0.5 s
(``WARM_S``) of warm-up runs; the table shows the fastest run of each (``*_median_ms`` in
the JSON: the medians) and the largest probability difference between the two. Also times the full
``predict`` (post-processing and the model's test-time views included, median) per image.
``--profile`` adds each layer's median time within the forward (``layers_ms`` in the JSON;
the schedule's layer functions timed in place, so the sum is a little under the total).
Time it on an otherwise idle machine (``uptime`` load well under 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F

from scratchd.cpu import _cpu
from scratchd.cpu import bands as cpu_bands
from scratchd.cpu import schedule as cpu_schedule
from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.model import net
from scratchd.model.scratchnet import ScratchNet, load_model
from scratchd.model.torchnet import TorchScratchNet, load_weights

SIZES = ((200, 200), (1024, 1024))


class ProbModel(torch.nn.Module):
    """Normalised padded input → probabilities cropped to ``height x width``."""

    def __init__(self, net: TorchScratchNet, height: int, width: int) -> None:
        super().__init__()
        self.net, self.height, self.width = net, height, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = F.interpolate(self.net(x), scale_factor=2.0, mode="bilinear", align_corners=False)
        return torch.sigmoid(up[:, 0, : self.height, : self.width])


def onnx_session(model: ScratchNet, h: int, w: int, threads: int) -> ort.InferenceSession:
    net = load_weights(model.weights, model.config)
    x = torch.from_numpy(normalize_pad_ref(np.zeros((1, h, w), np.uint8), 0.5, 0.2))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scratchnet.onnx"
        torch.onnx.export(
            ProbModel(net, h, w).eval(), (x.permute(0, 3, 1, 2),), path, dynamo=False,
            input_names=["x"], output_names=["prob"], opset_version=17,
        )  # fmt: skip
        data = path.read_bytes()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


WARM_S = 0.5


def settle() -> None:
    """Let onnxruntime's threads stop spinning (they spin for a while after each run; timed
    right after one, numpy's first runs shared the cores with them)."""
    time.sleep(0.5)


def run_seconds(fn: Any, repeats: int) -> list[float]:
    """``repeats`` run times of ``fn`` after ``WARM_S`` seconds of warm-up runs (page faults,
    thread start, onnxruntime's first-run allocations, and the cores: after an idle pause
    the first few forwards on two threads run at one thread's speed while the second core
    comes up to speed; onnxruntime's spinning threads hide that within
    its block, so each side gets the same warm-up). Each side is timed in its own block:
    onnxruntime's idle threads spin for a while after a run, which would slow a numpy run
    right after (hence :func:`settle` before every numpy block)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < WARM_S:
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


@contextlib.contextmanager
def layer_timer(model: ScratchNet) -> Iterator[dict[str, list[float]]]:
    """Times every layer function the CPU forward calls (by name, one list per layer),
    by wrapping them in ``cpu_schedule`` / ``net`` for the duration."""
    times: dict[str, list[float]] = {}
    blocks = [b.name for b in net.block_plan(model.config)]
    calls = {"n": 0}
    names = {"stem_cpu": "stem", "prob_head_cpu": "prob_head"}
    saved = {k: getattr(cpu_schedule, k) for k in ("stem_cpu", "ds_block_cpu", "prob_head_cpu")}
    saved_head = net.pwconv_ref

    def timed(fn: Any, label: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            times.setdefault(label(), []).append(time.perf_counter() - t)
            return out

        return wrapper

    def block() -> str:
        calls["n"] += 1
        return blocks[(calls["n"] - 1) % len(blocks)]

    for k, fn in saved.items():
        setattr(cpu_schedule, k, timed(fn, block if k == "ds_block_cpu" else lambda k=k: names[k]))
    net.pwconv_ref = timed(saved_head, lambda: "head")
    try:
        yield times
    finally:
        for k, fn in saved.items():
            setattr(cpu_schedule, k, fn)
        net.pwconv_ref = saved_head


def profile_layers(model: ScratchNet, image: np.ndarray, repeats: int) -> dict[str, float]:
    """Median milliseconds of each layer over ``repeats`` forwards (after one warm-up)."""
    model.forward(image)
    with layer_timer(model) as times:
        for _ in range(repeats):
            model.forward(image)
    return {k: round(statistics.median(v) * 1000, 3) for k, v in times.items()}


def bench_size(
    model: ScratchNet, h: int, w: int, threads: int, repeats: int, profile: bool
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    image = np.clip(rng.normal(110, 25, (1, h, w)), 0, 255).astype(np.uint8)
    sess = onnx_session(model, h, w, threads)
    x = normalize_pad_ref(image, model.meta.mean, model.meta.std).transpose(0, 3, 1, 2).copy()
    ours = model.forward(image)
    theirs = sess.run(["prob"], {"x": x})[0]
    settle()
    t_np = run_seconds(lambda: model.forward(image), repeats)
    t_ort = run_seconds(lambda: sess.run(["prob"], {"x": x}), repeats)
    settle()
    t_pred = run_seconds(lambda: model.predict([image[0]]), max(1, repeats // 2))
    layers = profile_layers(model, image, max(repeats, 10)) if profile else None
    return {
        "size": f"{h}x{w}",
        "numpy_ms": round(min(t_np) * 1000, 2),
        "onnxruntime_ms": round(min(t_ort) * 1000, 2),
        "ratio": round(min(t_np) / min(t_ort), 2),
        "numpy_median_ms": round(statistics.median(t_np) * 1000, 2),
        "onnxruntime_median_ms": round(statistics.median(t_ort) * 1000, 2),
        "ratio_median": round(statistics.median(t_np) / statistics.median(t_ort), 2),
        "max_abs_prob_diff": float(np.abs(ours - theirs).max()),
        "predict_ms": round(statistics.median(t_pred) * 1000, 2),
        "predict_views": len(model.views),
        **({"layers_ms": layers} if layers else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=cpu_bands.THREADS)
    ap.add_argument("--json", type=Path, default=Path("docs/bench/cpu.json"))
    ap.add_argument("--profile", action="store_true", help="also time each layer")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    rows = [bench_size(model, h, w, args.threads, args.repeats, args.profile) for h, w in SIZES]
    head = ("size", "numpy ms", "ort ms", "ratio", "(median)", "max diff", "predict ms")
    print("{:>10} {:>10} {:>10} {:>6} {:>9} {:>9} {:>11}".format(*head))
    for r in rows:
        print(
            f"{r['size']:>10} {r['numpy_ms']:>10.1f} {r['onnxruntime_ms']:>10.1f} "
            f"{r['ratio']:>6.2f} {r['ratio_median']:>9.2f} {r['max_abs_prob_diff']:>9.1e} "
            f"{r['predict_ms']:>11.1f}"
        )
    for r in rows:
        if "layers_ms" in r:
            print(f"{r['size']} per layer (median ms): " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["layers_ms"].items()
            ))  # fmt: skip
    report = {
        "machine": {
            "cpu_count": os.cpu_count(), "threads": args.threads, "numpy": np.__version__,
            "onnxruntime": ort.__version__, "python": platform.python_version(),
            "kernels_isa": _cpu.ISAS[-1],
        },
        "model": model.version,
        "params": model.meta.params,
        "repeats": args.repeats,
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
        "rows": rows,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
