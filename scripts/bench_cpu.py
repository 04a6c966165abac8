"""CPU benchmark: the numpy forward against onnxruntime on the same weights.

    python scripts/bench_cpu.py [--model PATH] [--repeats 5] [--threads N]
        [--json docs/bench/cpu.json]

For each frame size (200x200 single SD-900 tile, 1024x1024 line-camera frame) it times one
pass of the network (``ScratchNet.forward``: normalise + pad, network, head; no test-time
views, no post-processing) and the same weights exported to ONNX from the fused PyTorch
mirror, run by onnxruntime with ``intra_op_num_threads`` = the thread count numpy's BLAS
uses (``--threads``; default: all cores). The ONNX graph starts from the normalised, padded
input (onnxruntime gets that work for free). ``--repeats`` runs of each after one warm-up;
the table shows the fastest run of each (``*_median_ms`` in the JSON:
the medians) and the largest probability difference between the two. Also times the full
``predict`` (post-processing and the model's test-time views included, median) per image.
Time it on an otherwise idle machine (``uptime`` load well under 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F

from scratchd.kernels.model import ScratchNet, load_model
from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.kernels.torchnet import TorchScratchNet, load_weights

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


def run_seconds(fn: Any, repeats: int) -> list[float]:
    """``repeats`` run times of ``fn`` after one warm-up (page faults, thread start,
    onnxruntime's first-run allocations). Each side is timed in its own block: onnxruntime's
    idle threads spin for a while after a run, which would slow a numpy run right after."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def bench_size(model: ScratchNet, h: int, w: int, threads: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    image = np.clip(rng.normal(110, 25, (1, h, w)), 0, 255).astype(np.uint8)
    sess = onnx_session(model, h, w, threads)
    x = normalize_pad_ref(image, model.meta.mean, model.meta.std).transpose(0, 3, 1, 2).copy()
    ours = model.forward(image)
    theirs = sess.run(["prob"], {"x": x})[0]
    t_np = run_seconds(lambda: model.forward(image), repeats)
    t_ort = run_seconds(lambda: sess.run(["prob"], {"x": x}), repeats)
    t_pred = run_seconds(lambda: model.predict([image[0]]), max(1, repeats // 2))
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
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=Path("docs/bench/cpu.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    rows = [bench_size(model, h, w, args.threads, args.repeats) for h, w in SIZES]
    head = ("size", "numpy ms", "ort ms", "ratio", "(median)", "max diff", "predict ms")
    print("{:>10} {:>10} {:>10} {:>6} {:>9} {:>9} {:>11}".format(*head))
    for r in rows:
        print(
            f"{r['size']:>10} {r['numpy_ms']:>10.1f} {r['onnxruntime_ms']:>10.1f} "
            f"{r['ratio']:>6.2f} {r['ratio_median']:>9.2f} {r['max_abs_prob_diff']:>9.1e} "
            f"{r['predict_ms']:>11.1f}"
        )
    report = {
        "machine": {
            "cpu_count": os.cpu_count(), "threads": args.threads, "numpy": np.__version__,
            "onnxruntime": ort.__version__, "python": platform.python_version(),
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
