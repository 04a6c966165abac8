"""The shipped model: weights + metadata in one npz, and the predict API the workers call.

File format (``model/weights/scratchnet.npz``): a plain ``.npz`` loaded with
``allow_pickle=False``. One float32 entry per weight (names and shapes from
:func:`scratchd.model.net.weight_shapes`), plus ``__meta__``: a uint8 array holding the
UTF-8 JSON of :class:`ModelMeta` (architecture, input normalisation, decision threshold,
minimum defect area, training intensity histogram, validation metrics, training-data hash,
parameter count, version).

``ScratchNet.predict`` takes uint8 ``(H, W)`` frames of any sizes, runs frames of one size
together (in chunks of at most ``MAX_BATCH_PIXELS`` input pixels, bounding the activation
memory to about 1 GB), and returns one :class:`Prediction` per frame, in order.

Test-time augmentation: ``meta.views`` lists the views of each frame the network sees
(``identity``, ``flip_h`` = columns reversed, ``flip_v`` = rows reversed, ``transpose``);
each view's probability map is mapped back (every view is its own inverse) and the maps are
averaged before post-processing. The shipped model runs one view (its training put into one
pass what views add); ``ScratchNet(..., views=...)``, ``load_model(path, views=...)`` or the
daemon's ``model.views`` run more, each one more forward pass (README.md, "Choosing the
test-time views"). A GPU backend runs the views as one batch.

Small frames: a model with ``meta.upscale_below`` > 0 runs frames whose longer side is at
most that many pixels at twice their size (bilinear, rounded to uint8, as training saw
them) and averages each 2x2 block of the probability map back to the frame's size, so thin
defects on small images cover more of the network's half-resolution output. The
CUDA backend upscales such frames on the host, runs the graphs of the doubled size and
averages their maps back on the host too (:func:`finish_upscaled`): small frames are cheap.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.kernels.postprocess import (
    Box,
    Verdict,
    binary_entropy_bits,
    intensity_histogram,
    postprocess,
)
from scratchd.kernels.upsample_bilinear2x import upsample_bilinear2x_ref
from scratchd.kernels.views import VIEWS, apply_view
from scratchd.model.cascade_plan import CascadeSettings
from scratchd.model.net import (
    NetConfig,
    Weights,
    check_weights,
    count_params,
    forward,
    random_weights,
)

DEFAULT_PATH = Path(__file__).resolve().parent / "weights" / "scratchnet.npz"
META_KEY = "__meta__"
MAX_BATCH_PIXELS = 4 * 1024 * 1024


class ModelError(ValueError):
    """A model file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelMeta:
    """Everything about a model that is not a weight (JSON in the npz)."""

    version: str
    architecture: dict[str, Any]  # NetConfig.to_json()
    mean: float  # input normalisation: (x / 255 - mean) / std
    std: float
    threshold: float  # probability at or above which a pixel is a defect
    min_area: int  # components smaller than this (pixels) are dropped
    score_window: int  # image score: peak mean probability over this square window
    histogram: list[float]  # training intensities, 64 bins over 0..255, sums to 1
    val_metrics: dict[str, Any]
    train_data_sha256: str
    params: int
    training: dict[str, Any] = field(default_factory=dict)  # seed, steps, augmentation, …
    views: list[str] = field(default_factory=lambda: ["identity"])  # test-time augmentation
    # Image decision: "defect" iff score >= score_threshold (chosen for a stated defect recall
    # on data the model was not fitted on, see ``training["calibration"]``). None: the
    # scratchnet-1 rule, "defect" iff a component of at least min_area pixels survived.
    score_threshold: float | None = None
    # Frames whose longer side is at most this many pixels run at twice their size (0: never).
    upscale_below: int = 0
    # The dynamic-resolution cascade's calibrated settings (model/cascade_plan.py); None: the
    # model has none, every frame runs whole at full resolution.
    cascade: CascadeSettings | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelMeta:
        cascade = data.get("cascade")
        if cascade is not None:
            data = {**data, "cascade": CascadeSettings.from_json(cascade)}
        return cls(**data)


@dataclass(frozen=True)
class Prediction:
    prob: np.ndarray  # [H, W] float32 defect probability
    mask: np.ndarray  # [H, W] uint8 0/255: kept components only
    score: float  # image score in [0, 1] (see kernels/postprocess.py)
    verdict: Verdict
    boxes: list[Box]  # (x0, y0, x1, y1, score), x1/y1 exclusive, best first
    entropy: float  # mean per-pixel binary entropy of prob, bits in [0, 1]
    histogram: np.ndarray  # [64] uint32 input intensity counts
    # Cascade only (model/cascade.py): the parts of the frame answered at full resolution,
    # ``(x0, y0, x1, y1)`` (empty: stage 1 alone), and the input pixels run at full
    # resolution. None: no cascade ran (the whole frame at full resolution).
    regions: list[tuple[int, int, int, int]] | None = None
    full_res_pixels: int | None = None


def decide(score: float, has_boxes: bool, score_threshold: float | None) -> Verdict:
    """The image verdict: by the image score when the model states a ``score_threshold``,
    else (scratchnet-1 models) by whether any component survived ``min_area``. The CPU
    path (:meth:`ScratchNet.predict`) and the GPU path (``serve_graph.HostFinish``) both
    decide here."""
    if score_threshold is None:
        return "defect" if has_boxes else "clean"
    return "defect" if score >= score_threshold else "clean"


class ScratchNet:
    """A loaded model: numpy weights, architecture and post-processing settings."""

    def __init__(
        self, weights: Weights, meta: ModelMeta, views: Sequence[str] | None = None
    ) -> None:
        self.config = NetConfig.from_json(meta.architecture)
        check_weights(weights, self.config)
        self.weights = weights
        self.meta = meta
        self.views = tuple(meta.views if views is None else views)
        bad = [v for v in self.views if v not in VIEWS]
        if bad or not self.views:
            raise ValueError(f"views must be a non-empty subset of {VIEWS}, got {self.views}")
        if not isinstance(meta.upscale_below, int) or meta.upscale_below < 0:
            raise ValueError(f"upscale_below must be an int >= 0, got {meta.upscale_below!r}")
        if meta.cascade is not None:
            meta.cascade.check(self.config, meta.threshold, meta.score_threshold)
            if meta.upscale_below:  # the cascade's crops are cut from the frame as it is
                raise ValueError("a model cannot have both a cascade and upscale_below")

    @property
    def version(self) -> str:
        return self.meta.version

    def prob(self, images: np.ndarray) -> np.ndarray:
        """uint8 ``[N, H, W]`` (one size) → probability ``[N, H, W]`` float32, views averaged."""
        total = np.zeros(images.shape, dtype=np.float32)
        for view in self.views:
            x = apply_view(images, view)
            total += apply_view(self.forward(x), view)
        total /= np.float32(len(self.views))
        return total

    def forward(self, images: np.ndarray) -> np.ndarray:
        """One pass of the network: uint8 ``[N, H, W]`` → probability ``[N, H, W]`` (small
        frames at twice their size when the model says so, see the module docstring)."""
        m = self.meta
        if upscales(m, images.shape[1], images.shape[2]):
            return pool2x(forward(self.weights, self.config, upscale2x(images), m.mean, m.std))
        return forward(self.weights, self.config, images, m.mean, m.std)

    def predict(self, images: Sequence[np.ndarray]) -> list[Prediction]:
        """One :class:`Prediction` per uint8 ``(H, W)`` image, in input order."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, img in enumerate(images):
            check_image(img, i)
            by_size.setdefault(img.shape, []).append(i)
        results: list[Prediction | None] = [None] * len(images)
        for (h, w), idx in by_size.items():
            chunk = max(1, MAX_BATCH_PIXELS // (h * w))
            for lo in range(0, len(idx), chunk):
                part = idx[lo : lo + chunk]
                probs = self.prob(np.stack([images[i] for i in part]))
                for i, prob in zip(part, probs, strict=True):
                    results[i] = self.finish(images[i], prob)
        return [r for r in results if r is not None]

    def finish(self, image: np.ndarray, prob: np.ndarray) -> Prediction:
        """Post-processing of one frame's probability map: mask, boxes, score, verdict."""
        m = self.meta
        post = postprocess(prob, m.threshold, m.min_area, m.score_window)
        return Prediction(
            prob=prob,
            mask=post.mask,
            score=post.score,
            verdict=decide(post.score, bool(post.boxes), m.score_threshold),
            boxes=post.boxes,
            entropy=binary_entropy_bits(prob),
            histogram=intensity_histogram(image),
        )


def upscales(meta: ModelMeta, height: int, width: int) -> bool:
    """Whether frames of this size run at twice their size (``meta.upscale_below``)."""
    return 0 < max(height, width) <= meta.upscale_below


def upscale2x(images: np.ndarray) -> np.ndarray:
    """uint8 ``[N, H, W]`` → uint8 ``[N, 2H, 2W]``: bilinear (align_corners=False), rounded
    half to even, the frames a camera at twice the resolution would have given."""
    up = upsample_bilinear2x_ref(images[..., None].astype(np.float32))[..., 0]
    return np.clip(np.rint(up), 0, 255).astype(np.uint8)


def pool2x(prob: np.ndarray) -> np.ndarray:
    """``[N, 2H, 2W]`` → ``[N, H, W]``: the mean of each 2x2 block."""
    n, h2, w2 = prob.shape
    blocks = prob.reshape(n, h2 // 2, 2, w2 // 2, 2)
    return np.ascontiguousarray(blocks.mean(axis=(2, 4), dtype=np.float32))


def finish_upscaled(model: ScratchNet, image: np.ndarray, prob2x: np.ndarray) -> Prediction:
    """A frame that ran at twice its size (:func:`upscales`): its ``[2H, 2W]`` map averaged
    back per 2x2 block, then the usual post-processing at the frame's size (the GPU
    backends' way of giving :meth:`ScratchNet.forward`'s answer)."""
    return model.finish(image, pool2x(prob2x[None])[0])


def check_image(img: np.ndarray, i: int) -> None:
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 2:
        desc = f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__
        raise ValueError(f"image {i}: expected a uint8 (H, W) array, got {desc}")
    if img.size == 0:
        raise ValueError(f"image {i}: empty image {img.shape}")


def random_model(
    seed: int = 0, version: str = "random", cfg: NetConfig | None = None
) -> ScratchNet:
    """An architecture (default: ``NetConfig()``) with random weights and plain metadata: for
    tests and benchmarks of the forward's arithmetic and cost, which do not depend on
    training. Never a model to serve (its answers mean nothing)."""
    cfg = cfg or NetConfig()
    meta = ModelMeta(
        version=version, architecture=cfg.to_json(), mean=0.45, std=0.22, threshold=0.5,
        min_area=8, score_window=5, histogram=[1 / 64] * 64, val_metrics={},
        train_data_sha256="", params=count_params(cfg),
    )  # fmt: skip
    return ScratchNet(random_weights(cfg, seed), meta)


def save_model(path: str | Path, weights: Weights, meta: ModelMeta) -> None:
    """Write ``weights`` and ``meta`` as a plain npz (no pickled objects)."""
    cfg = NetConfig.from_json(meta.architecture)
    check_weights(weights, cfg)
    if meta.params != count_params(cfg):
        raise ValueError(f"meta.params {meta.params} != architecture's {count_params(cfg)}")
    blob = np.frombuffer(json.dumps(meta.to_json(), sort_keys=True).encode(), dtype=np.uint8)
    arrays: dict[str, Any] = {**weights, META_KEY: blob}
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_model(path: str | Path | None = None, views: Sequence[str] | None = None) -> ScratchNet:
    """Load a model file (default: the one shipped in the package); ``views`` overrides
    the test-time augmentation views stored in its metadata."""
    path = Path(path) if path is not None else DEFAULT_PATH
    arrays = _read_arrays(path, None)
    meta = _meta(path, arrays.pop(META_KEY, None))
    try:
        return ScratchNet(arrays, meta, views)
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"{path}: {exc}") from None


def read_meta(path: str | Path | None = None) -> ModelMeta:
    """A model file's metadata alone, parsed as :func:`load_model` parses it (the weights
    stay on disk)."""
    path = Path(path) if path is not None else DEFAULT_PATH
    return _meta(path, _read_arrays(path, META_KEY).get(META_KEY))


def _read_arrays(path: Path, only: str | None) -> dict[str, np.ndarray]:
    """The npz's arrays (just ``only`` when given), its failures as :class:`ModelError`."""
    try:
        with np.load(path, allow_pickle=False) as data:
            names = data.files if only is None else [k for k in data.files if k == only]
            return {k: data[k] for k in names}
    except OSError as exc:
        raise ModelError(f"{path}: not a readable model file: {exc.strerror or exc}") from None
    except (ValueError, zipfile.BadZipFile):  # numpy's ValueError is advice to unpickle it
        raise ModelError(f"{path}: not a model file (not an .npz archive)") from None


def _meta(path: Path, blob: np.ndarray | None) -> ModelMeta:
    if blob is None:
        raise ModelError(f"{path}: no {META_KEY} entry")
    try:
        return ModelMeta.from_json(json.loads(blob.tobytes().decode()))
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"{path}: {exc}") from None
