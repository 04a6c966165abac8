"""Time scripts/train.py's training step in each activation layout and precision, side by side.

    python scripts/bench_train_step.py --shards .devdata/shards --widths 32 80 160 320 \
        --dec-depth 1 --steps 30 --repeats 3 --json OUT/train-step.json

Each (layout, precision, mode) of ``--layouts``, ``--precisions`` (default: all) and
``--modes`` (eager, compiled: through torch.compile; default eager) gets a fresh trainer (same
seed, same architecture and recipe as train.py with the same flags), runs the warm-up shapes,
then ``--steps`` timed steps, ``--repeats`` times in alternation; the table shows every
repeat's ms a step, and the JSON's ``best`` is the fastest by median as train.py flags
(``--memory-format X --precision Y [--compile]``); ``first_steps_s`` is each trainer's
warm-up (autotuning, compiling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import config_of, gpu_images, parse_args, recipe_of
from train_data import inner_split, load_split, sample_weights
from train_loop import CROPS, MEMORY_FORMATS, PRECISIONS, Trainer

from scratchd.model.torchnet import TorchScratchNet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layouts", nargs="+", choices=sorted(MEMORY_FORMATS), default=None)
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None)
    ap.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager"])
    own, rest = ap.parse_known_args()
    args = parse_args(["--out", "/nonexistent", *rest])
    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    train_set, data_hash = load_split(args.shards, "train")
    fit, _ = inner_split(train_set, args.inner_fraction)
    data, _ = gpu_images(args, fit, data_hash, dev)
    probs = torch.tensor(sample_weights(fit, args.free_weight), device=dev)
    cfg = config_of(args)
    variants = [
        (lay, prec, mode)
        for mode in own.modes
        for lay in own.layouts or MEMORY_FORMATS
        for prec in own.precisions or PRECISIONS
    ]
    trainers = {}
    warmup_s = {}
    for layout, precision, mode in variants:
        torch.manual_seed(args.seed)
        fmt = MEMORY_FORMATS[layout]
        t = Trainer(
            TorchScratchNet(cfg), recipe_of(args), dev, args.seed, fmt, precision,
            compiled=mode == "compiled",
        )  # fmt: skip
        t0 = time.perf_counter()
        key = (layout, precision, mode)
        try:
            for _ in range(2 * len(CROPS)):
                t.train_step(data, probs, 0.45, 0.2)
            t._sync()
        except Exception as exc:  # a variant that cannot run here is reported, not timed
            print(f"{' '.join(key)}: failed: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        trainers[key] = t
        warmup_s[key] = round(time.perf_counter() - t0, 1)
        print(f"{' '.join(key)}: first {2 * len(CROPS)} steps in {warmup_s[key]} s", flush=True)
    runs: dict[tuple[str, str, str], list[float]] = {key: [] for key in trainers}
    for _ in range(own.repeats):
        for key, trainer in trainers.items():
            trainer._sync()
            t0 = time.perf_counter()
            for _ in range(own.steps):
                trainer.train_step(data, probs, 0.45, 0.2)
            trainer._sync()
            runs[key].append(round((time.perf_counter() - t0) / own.steps * 1e3, 2))
    best = min(runs, key=lambda k: statistics.median(runs[k]))
    print(f"{'layout':>14} {'precision':>9} {'mode':>9} {'median ms/step':>15}  repeats")
    for (layout, precision, mode), values in runs.items():
        med = statistics.median(values)
        print(f"{layout:>14} {precision:>9} {mode:>9} {med:>15.2f}  {values}")
    best_args = f"--memory-format {best[0]} --precision {best[1]}"
    best_args += " --compile" if best[2] == "compiled" else ""
    print(f"best: {best_args}")
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    record = {
        "device": device, "architecture": cfg.to_json(), "batch": args.batch,
        "steps": own.steps, "ms_per_step": {" ".join(k): v for k, v in runs.items()},
        "first_steps_s": {" ".join(k): v for k, v in warmup_s.items()}, "best": best_args,
    }  # fmt: skip
    if own.json:
        own.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
