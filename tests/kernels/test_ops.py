"""Each numpy reference op against an independent computation (PyTorch's ops), odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scratchd.kernels.conv3x3 import conv3x3_ref
from scratchd.kernels.dwconv3x3 import dwconv3x3_ref
from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.kernels.prob_head import prob_head_ref
from scratchd.kernels.pwconv import pwconv_ref
from scratchd.kernels.sigmoid import sigmoid_ref
from scratchd.kernels.upsample_bilinear2x import upsample_bilinear2x_ref
from scratchd.kernels.upsample_concat import upsample_concat_ref
from scratchd.model.fold_bn import fold_bn_ref

SHAPES = [(1, 1, 1, 1), (2, 7, 5, 3), (1, 13, 17, 8), (3, 16, 9, 5)]


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


def nchw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x).permute(0, 3, 1, 2)


def nhwc(t: torch.Tensor) -> np.ndarray:
    return t.permute(0, 2, 3, 1).contiguous().numpy()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("act", ["relu", "none"])
def test_conv3x3_matches_torch(shape: tuple[int, ...], stride: int, act: str) -> None:
    rng = np.random.default_rng(1)
    x, w, b = rand(rng, *shape), rand(rng, 3, 3, shape[3], 6), rand(rng, 6)
    ref = F.conv2d(nchw(x), torch.from_numpy(w).permute(3, 2, 0, 1), torch.from_numpy(b), stride, 1)
    ref = F.relu(ref) if act == "relu" else ref
    np.testing.assert_allclose(conv3x3_ref(x, w, b, stride, act), nhwc(ref), atol=1e-5)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("stride", "dilation"), [(1, 1), (2, 1), (1, 2), (1, 4), (2, 3)])
def test_dwconv3x3_matches_torch(shape: tuple[int, ...], stride: int, dilation: int) -> None:
    rng = np.random.default_rng(2)
    c = shape[3]
    x, w, b = rand(rng, *shape), rand(rng, 3, 3, c), rand(rng, c)
    tw = torch.from_numpy(w).permute(2, 0, 1)[:, None]
    ref = F.conv2d(nchw(x), tw, torch.from_numpy(b), stride, dilation, dilation, groups=c)
    got = dwconv3x3_ref(x, w, b, stride, dilation, "relu")
    np.testing.assert_allclose(got, nhwc(F.relu(ref)), atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_pwconv_matches_torch(shape: tuple[int, ...], residual: bool) -> None:
    rng = np.random.default_rng(3)
    x, w, b = rand(rng, *shape), rand(rng, shape[3], 7), rand(rng, 7)
    res = rand(rng, *shape[:3], 7) if residual else None
    ref = F.conv2d(nchw(x), torch.from_numpy(w.T.copy())[:, :, None, None], torch.from_numpy(b))
    if res is not None:
        ref = ref + nchw(res)
    got = pwconv_ref(x, w, b, "relu", res)
    np.testing.assert_allclose(got, nhwc(F.relu(ref)), atol=1e-5)


@pytest.mark.parametrize(
    ("n", "h", "w", "c1", "c2"), [(1, 1, 1, 1, 1), (2, 3, 5, 4, 2), (1, 7, 4, 6, 9)]
)
def test_upsample_concat_matches_torch(n: int, h: int, w: int, c1: int, c2: int) -> None:
    rng = np.random.default_rng(4)
    x, skip = rand(rng, n, h, w, c1), rand(rng, n, 2 * h, 2 * w, c2)
    ref = torch.cat([F.interpolate(nchw(x), scale_factor=2.0, mode="nearest"), nchw(skip)], 1)
    np.testing.assert_array_equal(upsample_concat_ref(x, skip), nhwc(ref))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 4), (1, 9, 2, 1)])
def test_upsample_bilinear2x_matches_torch(shape: tuple[int, ...]) -> None:
    x = rand(np.random.default_rng(5), *shape)
    ref = F.interpolate(nchw(x), scale_factor=2.0, mode="bilinear", align_corners=False)
    np.testing.assert_allclose(upsample_bilinear2x_ref(x), nhwc(ref), atol=1e-6)


def test_sigmoid_matches_torch_including_extremes() -> None:
    x = np.concatenate([rand(np.random.default_rng(6), 1000) * 10, [-1e4, -100, 0, 100, 1e4]])
    x = x.astype(np.float32)
    got = sigmoid_ref(x)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, torch.sigmoid(torch.from_numpy(x)).numpy(), atol=1e-7)


@pytest.mark.parametrize(("h", "w"), [(1, 1), (16, 16), (17, 33), (200, 200)])
def test_normalize_pad(h: int, w: int) -> None:
    img = np.random.default_rng(7).integers(0, 256, (2, h, w), dtype=np.uint8)
    out = normalize_pad_ref(img, 0.4, 0.2)
    hp, wp = -(-h // 16) * 16, -(-w // 16) * 16
    assert out.shape == (2, hp, wp, 1)
    expect = (img.astype(np.float64) / 255 - 0.4) / 0.2
    expect = np.pad(expect, ((0, 0), (0, hp - h), (0, wp - w)), mode="edge")
    np.testing.assert_allclose(out[..., 0], expect, atol=1e-5)


def test_prob_head_matches_torch() -> None:
    logits = rand(np.random.default_rng(8), 2, 8, 13, 1) * 4
    up = F.interpolate(nchw(logits), scale_factor=2.0, mode="bilinear", align_corners=False)
    ref = torch.sigmoid(up[:, 0, :15, :25]).numpy()
    np.testing.assert_allclose(prob_head_ref(logits, 15, 25), ref, atol=1e-6)


def test_fold_bn_equals_conv_then_batchnorm() -> None:
    rng = np.random.default_rng(9)
    x, w = rand(rng, 2, 9, 11, 4), rand(rng, 3, 3, 4, 5)
    gamma, beta, mean = rand(rng, 5), rand(rng, 5), rand(rng, 5)
    var = rng.uniform(0.2, 3, 5).astype(np.float32)
    eps = 1e-5
    conv = F.conv2d(nchw(x), torch.from_numpy(w).permute(3, 2, 0, 1), None, 1, 1)
    ref = F.batch_norm(
        conv, torch.from_numpy(mean), torch.from_numpy(var), torch.from_numpy(gamma),
        torch.from_numpy(beta), training=False, eps=eps,
    )  # fmt: skip
    wf, bf = fold_bn_ref(w, None, gamma, beta, mean, var, eps)
    np.testing.assert_allclose(conv3x3_ref(x, wf, bf, 1, "none"), nhwc(ref), atol=1e-4)


def test_ops_reject_bad_arguments() -> None:
    x = np.zeros((1, 4, 4, 3), np.float32)
    with pytest.raises(ValueError, match="dwconv3x3: w must have shape"):
        dwconv3x3_ref(x, np.zeros((3, 3, 2), np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="pwconv: x must be float32"):
        pwconv_ref(x.astype(np.float64), np.zeros((3, 2), np.float32), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="conv3x3: stride"):
        conv3x3_ref(x, np.zeros((3, 3, 3, 2), np.float32), np.zeros(2, np.float32), stride=3)
    with pytest.raises(ValueError, match="upsample_concat: skip"):
        upsample_concat_ref(x, np.zeros((1, 7, 8, 1), np.float32))
    with pytest.raises(ValueError, match="normalize_pad: images must be uint8"):
        normalize_pad_ref(np.zeros((1, 4, 4), np.float32), 0.5, 0.2)
    with pytest.raises(ValueError, match="act must be one of"):
        pwconv_ref(x, np.zeros((3, 2), np.float32), np.zeros(2, np.float32), act="gelu")  # type: ignore[arg-type]
