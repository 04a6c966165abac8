"""Can a trained gate on the shipped network's own low-resolution features separate clean
parts from defective ones well enough for the cascade (issue 20)? An experiment on the
inner split; it changes no model.

    python scripts/gate_probe.py --shards .devdata/shards [--factors 2 4]
        [--json docs/bench/cascade-gate-probe.json]

For each factor f the shipped network runs on every image downscaled f times (stage 1 of
:mod:`scratchd.model.cascade`). Its last decoder features (``w0`` channels at stage 1's
H/2) and its deepest encoder features (``w3`` channels at H/16, repeated up to the decoder's
grid), with the segmentation logit, are the gate's input; a small MLP (torch, CPU) is fitted
on the fit split to say whether a grid cell holds defect pixels (weighted BCE). A frame's
gate score is its highest cell. On the inner split, against the same network at full
resolution:

- ``flag_all``: the gate threshold that sends to stage 2 every defective image the full model
  calls ``defect`` (the cascade's bar: defective parts passed rise by at most 0.5 points,
  which on the inner split's defective images is no miss at all), and the share of clean
  images it answers at stage 1;
- the same at one and at two misses allowed, for the curve's shape;
- the gate's AUROC (clean vs defective images), beside the stage-1 map's own maximum as a
  score, which is what the cascade uses today.

``--tiny MODEL ...`` adds separately trained small networks (``train.py --widths ...``) run
at full resolution as stage 1, their map's highest pixel the frame's gate score.

The cost side: stage 1 costs ``macs(f)`` of the full network; a stream of 90 % clean frames
runs at ``1 / (stage1 + 0.1 + 0.9 * (1 - clean_at_stage1))`` of full resolution's frame
time if every flagged frame runs whole (each image here is no larger than a crop).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import Example, inner_split, load_split

from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.model import cascade_plan as cp
from scratchd.model import net as netdef
from scratchd.model.evaluate import auroc
from scratchd.model.scratchnet import ScratchNet, load_model


def features(
    net: ScratchNet, image: np.ndarray, factor: int, skips_too: bool = False
) -> np.ndarray:
    """``[h, w, w0 + w3 + 1]`` gate input at stage 1's H/2 grid of ``image``: the last decoder
    features, the encoder's output repeated up to that grid, the logit (with ``skips_too``,
    the encoder's three skips as well, each repeated up to that grid)."""
    small = cp.downscale(image, factor)
    m = net.meta
    x = normalize_pad_ref(small[None], m.mean, m.std, multiple=16)
    taps: dict[str, np.ndarray] = {}
    logit = netdef.forward_logits_ref(net.weights, net.config, x, taps)
    dec = taps["dec"]
    parts = [dec, _repeat_to(taps["deep"], dec.shape[1]), logit]
    if skips_too:
        parts += [_repeat_to(taps[n], dec.shape[1]) for n in ("skip0", "skip1", "skip2")]
    # Only the cells over the image itself (the canvas is padded to 16).
    hh, ww = -(-small.shape[0] // 2), -(-small.shape[1] // 2)
    return np.concatenate(parts, axis=-1)[0, :hh, :ww].astype(np.float32)


def _repeat_to(t: np.ndarray, height: int) -> np.ndarray:
    """``[N, h, w, C]`` nearest-repeated up to ``height`` rows (and as many times the columns)."""
    k = height // t.shape[1]
    return np.repeat(np.repeat(t, k, axis=1), k, axis=2)


def cell_labels(mask: np.ndarray, factor: int, hh: int, ww: int) -> np.ndarray:
    """1 where a ``2f x 2f`` cell of the frame holds a defect pixel."""
    c = 2 * factor
    h, w = mask.shape
    padded = np.zeros((hh * c, ww * c), dtype=np.uint8)
    padded[:h, :w] = mask
    return padded.reshape(hh, c, ww, c).max(axis=(1, 3)).astype(np.float32)


def fit_gate(xs: list[np.ndarray], ys: list[np.ndarray], seed: int) -> torch.nn.Module:
    """A 2-layer MLP over cells, weighted BCE (positives to half the weight)."""
    x = torch.from_numpy(np.concatenate([a.reshape(-1, a.shape[-1]) for a in xs]))
    y = torch.from_numpy(np.concatenate([b.reshape(-1) for b in ys]))
    mu, sd = x.mean(0), x.std(0) + 1e-3
    torch.manual_seed(seed)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    model = torch.nn.Sequential(Standardise(mu, sd), mlp)
    pos = float(y.mean())
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos) / max(pos, 1e-6)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(seed)
    steps, batch = 3000, 4096
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        loss = loss_fn(model(x[idx])[:, 0], y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


class Standardise(torch.nn.Module):
    def __init__(self, mu: torch.Tensor, sd: torch.Tensor) -> None:
        super().__init__()
        self.mu, self.sd = mu, sd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mu) / self.sd


def operating_points(
    gate: np.ndarray, clean: np.ndarray, found: np.ndarray
) -> list[dict[str, Any]]:
    """For 0, 1, 2 missed defective images (of those the full model finds): the threshold
    and the share of clean images answered at stage 1."""
    out = []
    fs = np.sort(gate[found])
    for miss in (0, 1, 2):
        if miss >= len(fs):
            break
        t = float(fs[miss])
        out.append(
            {
                "missed": miss,
                "missed_share": miss / len(fs),
                "threshold": t,
                "clean_at_stage1": float((gate[clean] < t).mean()),
            }
        )
    return out


def truth(net: ScratchNet, inner: list[Example]) -> tuple[np.ndarray, np.ndarray]:
    """``(clean, found)`` per inner image: no defect pixel; defective and called ``defect``
    by the full model (what stage 1 must never answer)."""
    clean = np.array([not e.mask.any() for e in inner])
    verdicts = [net.predict([e.image])[0].verdict for e in inner]
    return clean, ~clean & np.array([v == "defect" for v in verdicts])


def scored(gate: np.ndarray, clean: np.ndarray, found: np.ndarray, stage1: float) -> dict:
    """A gate score per image against the truth: AUROC and the operating points, each with
    what it gives a 90 %-clean stream (flagged frames run whole)."""
    points = operating_points(gate, clean, found)
    for p in points:
        p["fps_vs_full_90pct_clean"] = 1.0 / (stage1 + 0.1 + 0.9 * (1 - p["clean_at_stage1"]))
    return {"gate_auroc": auroc(gate[found], gate[clean]), "operating_points": points}


def probe(
    net: ScratchNet,
    fit: list[Example],
    inner: list[Example],
    clean: np.ndarray,
    found: np.ndarray,
    factor: int,
    skips_too: bool,
) -> dict[str, Any]:
    xs, ys = [], []
    for e in fit:
        f = features(net, e.image, factor, skips_too)
        xs.append(f)
        ys.append(cell_labels(e.mask, factor, f.shape[0], f.shape[1]))
    model = fit_gate(xs, ys, seed=0)
    logit_at = net.config.widths[0] + net.config.widths[3]  # features' channel layout
    gate, s1max = [], []
    for e in inner:
        f = features(net, e.image, factor, skips_too)
        with torch.no_grad():
            g = torch.sigmoid(model(torch.from_numpy(f.reshape(-1, f.shape[-1])))).numpy()
        gate.append(float(g.max()))
        s1max.append(float(1 / (1 + np.exp(-f[..., logit_at].max()))))
    stage1 = cp.macs(net.config, 1024 // factor, 1024 // factor) / cp.macs(net.config, 1024, 1024)
    s1 = np.array(s1max)
    return {
        "factor": factor,
        "skips_too": skips_too,
        "stage1_macs_share": stage1,
        "inner_images": len(inner),
        "clean_images": int(clean.sum()),
        "defective_found_by_full": int(found.sum()),
        **scored(np.array(gate), clean, found, stage1),
        "stage1_map_max_auroc": auroc(s1[found], s1[clean]),
        "stage1_map_points": operating_points(s1, clean, found),
    }


def probe_tiny(
    net: ScratchNet, tiny: ScratchNet, inner: list[Example], clean: np.ndarray, found: np.ndarray
) -> dict[str, Any]:
    """A separately trained small network at full resolution as stage 1: its map's highest
    pixel is the frame's gate score."""
    gate = np.array([float(tiny.forward(e.image[None])[0].max()) for e in inner])
    stage1 = cp.macs(tiny.config, 1024, 1024) / cp.macs(net.config, 1024, 1024)
    return {
        "tiny": tiny.version,
        "architecture": tiny.config.to_json(),
        "stage1_macs_share": stage1,
        **scored(gate, clean, found, stage1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--model", type=Path, default=None, help="default: the shipped model")
    ap.add_argument("--factors", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--skips", action="store_true", help="the encoder's skips as gate input too")
    ap.add_argument("--tiny", type=Path, nargs="*", default=[], help="small stage-1 models")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    net = load_model(args.model)
    train, sha = load_split(args.shards, "train")
    fit, inner = inner_split(train)
    clean, found = truth(net, inner)
    rows = [probe(net, fit, inner, clean, found, f, args.skips) for f in args.factors]
    head = "clean images at stage 1 (0 / 1 / 2 missed)"
    print(f"{'factor':>6} {'stage1':>7} {'AUROC gate':>10} {'map max':>8}  {head}")
    for r in rows:
        pts = " / ".join(f"{p['clean_at_stage1']:.1%}" for p in r["operating_points"])
        print(
            f"{r['factor']:>6} {r['stage1_macs_share']:>7.1%} {r['gate_auroc']:>10.3f} "
            f"{r['stage1_map_max_auroc']:>8.3f}  {pts}"
        )
    tiny = [probe_tiny(net, load_model(p), inner, clean, found) for p in args.tiny]
    for t in tiny:
        pts = " / ".join(f"{p['clean_at_stage1']:.1%}" for p in t["operating_points"])
        print(f"{t['tiny']:>14} {t['stage1_macs_share']:>7.1%} {t['gate_auroc']:>10.3f}  {pts}")
    if args.json:
        record = {"model": net.version, "train_sha256": sha, "rows": rows, "tiny": tiny}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
