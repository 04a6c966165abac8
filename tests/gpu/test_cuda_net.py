"""The whole CUDA forward (fused plan, CUDA graphs) against the numpy fp32 forward.

The CPU test checks the fusion plan itself (its numpy twin equals ``net.forward_logits``);
the gpu tests run captured graphs: on random weights and odd frame sizes, and with the
shipped model on real validation images (identical verdicts, prob max abs diff ≤ 2e-2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scratchd.dataset.folders import scan_dataset, split_of
from scratchd.gpu.cuda_net import plan_paths
from scratchd.kernels.ds_split import SPLIT_ENV
from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.model.net import (
    NetConfig,
    block_plan,
    forward_logits,
    random_weights,
)
from scratchd.model.scratchnet import DEFAULT_PATH, ScratchNet, load_model, random_model
from scratchd.protocol.image import decode_image

from ..kernels.cuda_helpers import fresh_rng

PROB_ATOL = 2e-2
# scratchnet-1.1's architecture: the widest net the kernels serve (its dec0.0 is the block
# that reaches the int32 indexing limit first).
SN1 = NetConfig(widths=(48, 96, 192, 384), depths=(1, 2, 2, 1), dilations=(2, 4), dec_depth=2)


@pytest.fixture(scope="module")
def data_dir(full_data_dir: Path) -> Path:
    """The full sets: 40 validation images, more than the committed fixture holds."""
    return full_data_dir


@pytest.mark.parametrize(
    "cfg", [NetConfig(), NetConfig(widths=(48, 96, 192, 384), dec_depth=2)],
    ids=["default", "shipped-shape"],
)  # fmt: skip
def test_fused_plan_matches_the_numpy_forward(cfg: NetConfig) -> None:
    from scratchd.gpu.cuda_net import fused_logits_ref

    weights = random_weights(cfg, seed=3)
    rng = np.random.default_rng()
    images = rng.integers(0, 256, (2, 37, 50), dtype=np.uint8)
    x = normalize_pad_ref(images, 0.4, 0.2)
    np.testing.assert_allclose(
        fused_logits_ref(weights, cfg, images, 0.4, 0.2), forward_logits(weights, cfg, x),
        rtol=1e-4, atol=1e-4,
    )  # fmt: skip


def test_the_shipped_plan_splits_exactly_its_wide_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    plan = block_plan(SN1)
    paths = plan_paths(SN1)
    assert list(paths) == [b.name for b in plan]
    split = [name for name, path in paths.items() if path == "split"]
    assert split == ["enc3.0", "enc3.d0", "enc3.d1", "dec2.0"]
    # The stride-1 blocks of up to 288 channels and 96 out (the joins dec1.0 and dec0.0
    # included) run on ds_halo; none is left tiled.
    halo = ["enc0.0", "enc1.1", "dec1.0", "dec1.1", "dec0.0", "dec0.1"]
    assert [name for name, path in paths.items() if path == "halo"] == halo
    assert "tiled" not in paths.values()
    monkeypatch.setenv(SPLIT_ENV, "all")
    every = [name for name, path in plan_paths(SN1).items() if path == "split"]
    assert every == [b.name for b in plan[:-1]]  # never the head block
    monkeypatch.setenv(SPLIT_ENV, "tiled")
    assert set(plan_paths(SN1).values()) == {"tiled"}  # the head too: 48 channels
    monkeypatch.setenv(SPLIT_ENV, "none")
    assert set(plan_paths(SN1).values()) == {"fused"}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 64, 64), (3, 37, 50), (5, 200, 200), (2, 129, 301)])
def test_cuda_forward_matches_numpy_on_random_weights(shape: tuple[int, int, int]) -> None:
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet

    rng, seed = fresh_rng()
    model = random_model(seed % 1000)
    images = rng.integers(0, 256, shape, dtype=np.uint8)
    want = model.prob(images)
    got = CudaScratchNet(model).run(images)
    diff = np.abs(got["prob"] - want).max()
    assert diff <= PROB_ATOL, f"seed={seed} shape={shape}: prob max abs diff {diff}"


def _val_images(data_dir: Path, limit: int) -> list[np.ndarray]:
    samples = [s for s in scan_dataset(data_dir) if split_of(s.rel) == "val"]
    sd = [s for s in samples if s.rel.startswith("sd900/")][: limit * 3 // 4]
    tile = [s for s in samples if s.rel.startswith("mtile/")][: limit - len(sd)]
    return [decode_image(s.image.read_bytes()) for s in sd + tile]


@pytest.mark.gpu
@pytest.mark.parametrize("views", [None, ("identity",)], ids=["shipped-views", "identity"])
def test_cuda_predict_matches_numpy_on_real_validation_images(
    data_dir: Path, views: tuple[str, ...] | None
) -> None:
    """Shipped weights, real validation frames: the CUDA backend's predictions are the CPU
    backend's (with the model's own test-time views, and with the single identity view, where
    score, entropy and histogram come from the device)."""
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet

    if not DEFAULT_PATH.is_file():
        pytest.skip(f"the shipped weights {DEFAULT_PATH} are not there yet")
    model = load_model(views=views)
    images = _val_images(data_dir, 40)
    assert len(images) >= 20, "too few validation images found"
    want = model.predict(images)
    got = CudaScratchNet(model).predict(images)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = float(np.abs(g.prob - w.prob).max())
        assert diff <= PROB_ATOL, f"image {i} {w.prob.shape}: prob max abs diff {diff}"
        assert g.verdict == w.verdict, f"image {i}: verdict {g.verdict} != {w.verdict}"
        assert abs(g.score - w.score) <= PROB_ATOL, f"image {i}: score {g.score} vs {w.score}"
        assert abs(g.entropy - w.entropy) <= PROB_ATOL, f"image {i}: entropy"
        np.testing.assert_array_equal(g.histogram, w.histogram, err_msg=f"image {i}")


@pytest.mark.gpu
def test_cuda_predict_averages_test_time_views_like_numpy() -> None:
    """All four views on a non-square frame (the transpose runs as its own shape)."""
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet

    rng = np.random.default_rng()
    base = random_model(11)
    model = ScratchNet(base.weights, base.meta, ("identity", "flip_h", "flip_v", "transpose"))
    images = [rng.integers(0, 256, (40, 72), dtype=np.uint8) for _ in range(3)]
    want = model.predict(images)
    got = CudaScratchNet(model).predict(images)
    for g, w in zip(got, want, strict=True):
        assert np.abs(g.prob - w.prob).max() <= PROB_ATOL
        assert abs(g.score - w.score) <= PROB_ATOL


@pytest.mark.gpu
def test_cuda_predict_runs_small_frames_at_twice_their_size_like_numpy() -> None:
    """``upscale_below``: frames with a longer side at or below it run at 2x and come back at
    their own size, as the numpy forward defines it; larger frames are untouched."""
    import dataclasses

    from scratchd.gpu.cuda_scratchnet import CudaScratchNet

    rng = np.random.default_rng()
    base = random_model(12)
    model = ScratchNet(base.weights, dataclasses.replace(base.meta, upscale_below=48))
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in [(40, 44), (48, 30), (40, 72)]]
    want = model.predict(images)
    got = CudaScratchNet(model).predict(images)
    for img, g, w in zip(images, got, want, strict=True):
        assert g.prob.shape == w.prob.shape == img.shape
        assert np.abs(g.prob - w.prob).max() <= PROB_ATOL
        assert abs(g.score - w.score) <= PROB_ATOL and g.verdict == w.verdict
        np.testing.assert_array_equal(g.histogram, w.histogram)


@pytest.mark.gpu
def test_graph_replays_new_frames_and_partial_buckets() -> None:
    """One captured graph serves different frames and a batch smaller than its bucket."""
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet

    rng = np.random.default_rng()
    model = random_model(7)
    net = CudaScratchNet(model)
    for n in (4, 3, 4):
        images = rng.integers(0, 256, (n, 48, 80), dtype=np.uint8)
        got = net.run(images)
        assert got["prob"].shape == (n, 48, 80)
        assert np.abs(got["prob"] - model.prob(images)).max() <= PROB_ATOL
    assert list(net.graphs) == [(4, 48, 80)]


@pytest.mark.parametrize(
    "cfg", [NetConfig(), NetConfig(widths=(48, 96, 192, 384), dec_depth=2)],
    ids=["default", "shipped-shape"],
)  # fmt: skip
def test_every_block_gets_a_launch_that_fits_shared_memory(cfg: NetConfig) -> None:
    """Host-side launch planning (no GPU needed): each fused block's tile, sliced over the
    output channels where needed, stays within the 227 KB a block may use, and the block
    that carries the head is never sliced."""
    from scratchd.kernels._cuda import SMEM_LIMIT, pw_slices, pw_smem_bytes

    plan = block_plan(cfg)
    for b in plan:
        dw_smem = 9 * (-(-b.cin // 16) * 16) * 4
        slices = pw_slices(b.cin, b.cout, dw_smem)
        assert b.cout % slices == 0
        assert pw_smem_bytes(b.cin, b.cout // slices) + dw_smem <= SMEM_LIMIT, b.name
        if b is plan[-1]:
            assert slices == 1, "the head block must keep every channel in one block"


def test_a_kernel_opts_in_to_shared_memory_once_and_only_upward() -> None:
    """``_cuda.opt_in_smem`` (used by every launcher past 48 KB): the driver attribute is set
    when a launch needs more than the kernel has, never lowered, and not asked again."""
    from types import SimpleNamespace

    from scratchd.kernels._cuda import opt_in_smem

    sets: list[int] = []

    class Func:
        kernel = SimpleNamespace(ptr=0x5C7A7C4D)

        @property
        def max_dynamic_shared_size_bytes(self) -> int:
            raise AssertionError("the attribute is never read back")

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, value: int) -> None:
            sets.append(value)

    f = Func()
    for smem in (40 * 1024, 100 * 1024, 100 * 1024, 60 * 1024, 120 * 1024):
        opt_in_smem(f, smem)
    assert sets == [100 * 1024, 120 * 1024]
