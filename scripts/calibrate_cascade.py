"""Calibrate the dynamic-resolution cascade on the inner split; measure it once on ``val``.

    python scripts/calibrate_cascade.py --shards .devdata/shards [--model IN.npz]
        [--out OUT.npz] [--json docs/bench/cascade-calibration.json]
        [--factors 2 4] [--thresholds ...] [--margins ...] [--cores 128 256]
        [--max-passed-up 0.005] [--max-iou-drop 0.01] [--val]

Choice (inner split only, :func:`train_data.inner_split` of the shards' ``train`` side):
every combination of downscale factor, stage-1 threshold (at most the model's pixel and
score thresholds), margin and core size is compared with the same model at full resolution
on the same images. A combination meets the budget when, for each product (``sd900``,
``mtile``), defective parts passed rise by at most ``--max-passed-up``, clean parts
rejected do not rise, and the mean defect IoU falls by at most ``--max-iou-drop``. Of those that
cost fewer multiply-accumulates than full resolution (stage 1 included) the one answering
the most frames at stage 1 wins (then: the fewest multiply-accumulates). When none saves
anything, the within-budget setting of least cost is kept for the record (``"saves":
false``; never enabled).
The inner pass composes each frame's map from the full-resolution map inside the crops'
cores (tests/model/test_cascade.py proves stage 2 equals it there), so it runs the network
once per image and factor.

``--val`` then runs the chosen cascade for real (both stages, ``Cascade.predict``) and the
full model on the ``val`` split, once, timing both on the CPU; ``enabled`` is set in the
written model only when ``val`` met the same bars at a lower cost than full resolution.
Prints the tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import Example, inner_split, load_split

from scratchd.kernels.normalize_pad import padded_size
from scratchd.model import cascade_plan as cp
from scratchd.model.cascade import Cascade, plan_macs, stage1_macs, stage1_map
from scratchd.model.evaluate import Evaluation
from scratchd.model.scratchnet import Prediction, ScratchNet, load_model, save_model

PRODUCTS = ("sd900", "mtile")


@dataclasses.dataclass
class Frame:
    """One image with what every setting reuses: full-resolution map and answer."""

    ex: Example
    full_prob: np.ndarray
    full: Prediction
    stage1: dict[int, np.ndarray]  # factor -> stage-1 map at the frame's size


def prepare(net: ScratchNet, examples: list[Example], factors: list[int]) -> list[Frame]:
    frames = []
    for e in examples:
        prob = net.forward(e.image[None])[0]
        s1 = {f: stage1_map(net, e.image, f) for f in factors}
        frames.append(Frame(e, prob, net.finish(e.image, prob), s1))
    return frames


@dataclasses.dataclass
class Tally:
    """A setting's answers over the frames, beside the full model's."""

    ev: Evaluation = dataclasses.field(default_factory=Evaluation)
    stage1: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    full_res: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # share of px
    macs: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # vs full model

    def add(self, fr: Frame, pred: Prediction, p: cp.Plan | None, mac_ratio: float) -> None:
        e = fr.ex
        self.ev.add(e.group, pred.mask, e.mask, pred.score, pred.verdict)
        if p is None:
            return
        canvas = padded_size(p.height) * padded_size(p.width)
        for g in (e.group.split("/")[0], "all"):
            self.stage1.setdefault(g, []).append(float(not p.tiles))
            self.full_res.setdefault(g, []).append(p.full_res_pixels / canvas)
            self.macs.setdefault(g, []).append(mac_ratio)

    def summary(self) -> dict[str, Any]:
        out = self.ev.summary()
        for key, rows in (("stage1_share", self.stage1), ("full_res_share", self.full_res),
                          ("mac_ratio", self.macs)):  # fmt: skip
            out[key] = {g: round(float(np.mean(v)), 4) for g, v in sorted(rows.items())}
        return out


def mac_ratio(net: ScratchNet, s: cp.CascadeSettings, p: cp.Plan) -> float:
    """The cascade's multiply-accumulates on plan ``p``'s frame against the full model's."""
    cost = stage1_macs(net, s, p.height, p.width) + (plan_macs(net, p) if p.tiles else 0)
    return cost / cp.macs(net.config, p.height, p.width)


def run_setting(net: ScratchNet, frames: list[Frame], s: cp.CascadeSettings) -> Tally:
    """The cascade's answers, composed from the stored maps (see the module docstring)."""
    tally = Tally()
    for fr in frames:
        prob1 = fr.stage1[s.factor]
        p = cp.plan(cp.suspicious(prob1, s.threshold, s.margin), s.core, s.halo)
        if p.whole:
            pred = fr.full
        else:
            cores = [fr.full_prob[t.y0 : t.y1, t.x0 : t.x1] for t in p.tiles]
            pred = net.finish(fr.ex.image, cp.compose(prob1, cores, p))
        tally.add(fr, pred, p, mac_ratio(net, s, p))
    return tally


def verdict_of(
    full: dict[str, Any], casc: dict[str, Any], passed_up: float, iou_drop: float
) -> dict[str, Any]:
    """Per product: the three differences against full resolution and whether all hold."""
    out: dict[str, Any] = {"ok": True}
    for g in PRODUCTS:
        d_pass = casc["defect_passed"].get(g, 0.0) - full["defect_passed"].get(g, 0.0)
        d_rej = casc["clean_rejected"].get(g, 0.0) - full["clean_rejected"].get(g, 0.0)
        d_iou = full["iou"].get(g, 0.0) - casc["iou"].get(g, 0.0)
        ok = d_pass <= passed_up + 1e-9 and d_rej <= 1e-9 and d_iou <= iou_drop + 1e-9
        out[g] = {"passed_up": round(d_pass, 4), "rejected_up": round(d_rej, 4),
                  "iou_drop": round(d_iou, 4), "ok": ok}  # fmt: skip
        out["ok"] = out["ok"] and ok
    return out


def calibrate(net: ScratchNet, frames: list[Frame], args: argparse.Namespace) -> dict[str, Any]:
    full = Tally()
    for fr in frames:
        full.add(fr, fr.full, None, 1.0)
    ref = full.summary()
    halo = cp.receptive_halo(net.config)
    limit = min(net.meta.threshold, net.meta.score_threshold or 1.0)
    rows = []
    grid = itertools.product(args.factors, args.thresholds, args.margins, args.cores)
    for f, t, m, c in grid:
        if t > limit:
            continue
        s = cp.CascadeSettings(factor=f, threshold=t, margin=m, core=c, halo=halo)
        summ = run_setting(net, frames, s).summary()
        bars = verdict_of(ref, summ, args.max_passed_up, args.max_iou_drop)
        rows.append({"factor": f, "threshold": t, "margin": m, "core": c, "summary": summ,
                     "bars": bars})  # fmt: skip
    ok = [r for r in rows if r["bars"]["ok"]]
    cheaper = [r for r in ok if r["summary"]["mac_ratio"]["all"] < 1.0]
    best = max(
        cheaper,
        key=lambda r: (r["summary"]["stage1_share"]["all"], -r["summary"]["mac_ratio"]["all"]),
        default=None,
    )
    if best is None and ok:
        best = min(ok, key=lambda r: r["summary"]["mac_ratio"]["all"])
    if best is not None:
        best = best | {"saves": bool(cheaper)}
    return {"full": ref, "halo": halo, "rows": rows, "chosen": best}


def measure_val(
    net: ScratchNet, s: cp.CascadeSettings, val: list[Example], args: argparse.Namespace
) -> dict[str, Any]:
    """Both models on the ``val`` split for real, timed per image on the CPU."""
    cascade = Cascade(net, s)
    full, casc = Tally(), Tally()
    full_s = casc_s = 0.0
    for e in val:
        t0 = time.perf_counter()
        ref = net.predict([e.image])[0]
        t1 = time.perf_counter()
        pred = cascade.predict_one(e.image)
        t2 = time.perf_counter()
        full_s, casc_s = full_s + t1 - t0, casc_s + t2 - t1
        prob1 = cascade.stage1(e.image)  # the plan again, for the cost accounting
        p = cascade.plan(prob1)
        fr = Frame(e, ref.prob, ref, {})
        full.add(fr, ref, None, 1.0)
        casc.add(fr, pred, p, mac_ratio(net, s, p))
    ref_s, casc_sum = full.summary(), casc.summary()
    return {
        "full": ref_s, "cascade": casc_sum,
        "bars": verdict_of(ref_s, casc_sum, args.max_passed_up, args.max_iou_drop),
        "cpu_ms_per_image": {"full": round(1000 * full_s / len(val), 2),
                             "cascade": round(1000 * casc_s / len(val), 2)},
    }  # fmt: skip


def _row(label: str, summ: dict[str, Any]) -> str:
    cells = [label]
    for g in PRODUCTS:
        cells += [f"{summ['iou'].get(g, 0):.4f}", f"{100 * summ['defect_passed'].get(g, 0):.1f}",
                  f"{100 * summ['clean_rejected'].get(g, 0):.1f}"]  # fmt: skip
        if summ.get("stage1_share"):
            cells += [f"{100 * summ['stage1_share'].get(g, 0):.1f}",
                      f"{100 * summ['full_res_share'].get(g, 0):.1f}",
                      f"{100 * summ['mac_ratio'].get(g, 0):.1f}"]  # fmt: skip
        else:
            cells += ["0.0", "100.0", "100.0"]
    return " | ".join(cells)


HEADER = (
    "setting | sd IoU | sd passed % | sd rejected % | sd stage1 % | sd full-res px % | "
    "sd MACs % | tile IoU | tile passed % | tile rejected % | tile stage1 % | "
    "tile full-res px % | tile MACs %"
)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--model", type=Path, default=None, help="default: the shipped model")
    ap.add_argument("--out", type=Path, default=None, help="write the model with the choice")
    ap.add_argument("--version", default=None, help="the written model's version")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--factors", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--thresholds", type=float, nargs="+",
                    default=[0.05, 0.1, 0.2, 0.22, 0.25, 0.27, 0.3, 0.4, 0.5])  # fmt: skip
    ap.add_argument("--margins", type=int, nargs="+", default=[0, 8, 16, 32])
    ap.add_argument("--cores", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--max-passed-up", type=float, default=0.005)
    ap.add_argument("--max-iou-drop", type=float, default=0.01)
    ap.add_argument("--val", action="store_true", help="measure the choice on val, once")
    args = ap.parse_args()

    net = load_model(args.model, views=("identity",))
    train, _ = load_split(args.shards, "train")
    _fit, inner = inner_split(train)
    t0 = time.perf_counter()
    frames = prepare(net, inner, args.factors)
    result = calibrate(net, frames, args)
    result["inner_images"] = len(inner)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"inner split: {len(inner)} images; full resolution vs each setting "
          f"(f/threshold/margin/core; * = within the budget)")  # fmt: skip
    print(HEADER)
    print(_row("full", result["full"]))
    for r in result["rows"]:
        mark = "*" if r["bars"]["ok"] else " "
        label = f"{mark} {r['factor']}/{r['threshold']}/{r['margin']}/{r['core']}"
        print(_row(label, r["summary"]))
    chosen = result["chosen"]
    if chosen is None:
        print("no setting meets the budget on the inner split")
    else:
        s = cp.CascadeSettings(
            factor=chosen["factor"], threshold=chosen["threshold"], margin=chosen["margin"],
            core=chosen["core"], halo=result["halo"],
            calibration={"split": "inner", "images": len(inner),
                         "max_passed_up": args.max_passed_up, "max_iou_drop": args.max_iou_drop,
                         "inner": chosen["summary"], "command": " ".join(sys.argv)},
        )  # fmt: skip
        print(f"chosen: factor {s.factor}, threshold {s.threshold}, margin {s.margin}, "
              f"core {s.core}, halo {s.halo} (crops {s.crop} px); saves compute on the "
              f"inner split: {chosen['saves']}")  # fmt: skip
        if args.val:
            val, _ = load_split(args.shards, "val")
            result["val"] = measure_val(net, s, val, args)
            v = result["val"]
            print(f"val split, once: {len(val)} images")
            print(HEADER)
            print(_row("full", v["full"]))
            print(_row("cascade", v["cascade"]))
            print(f"bars met: {v['bars']['ok']} {json.dumps(v['bars'])}")
            print(f"CPU ms/image: {v['cpu_ms_per_image']}")
            cheaper = v["cascade"]["mac_ratio"]["all"] < 1.0
            enabled = bool(v["bars"]["ok"]) and cheaper and chosen["saves"]
            s = dataclasses.replace(s, enabled=enabled)
            assert s.calibration is not None
            s.calibration["val"] = {k: v[k] for k in ("bars", "cpu_ms_per_image")}
        if args.out is not None:
            meta = dataclasses.replace(
                load_model(args.model).meta, cascade=s, version=args.version or net.version
            )
            save_model(args.out, net.weights, meta)
            print(f"wrote {args.out} (cascade enabled: {s.enabled})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
