"""ServeGraph (gpu-marked) against the CPU model's ``predict``: shipped weights, real frames.
Its host half (``HostFinish``) is checked on the CPU against ``postprocess``.

Square 1024x1024 frames are mosaics of real SD-900 tiles; the non-square frames are real
magnetic-tile photographs cropped to one common (odd) size. The device runs fp16, the CPU
fp32, so pixels right at the threshold may flip: verdicts must agree, scores within 1e-2,
box counts equal and the masks' IoU at least 0.99.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scratchd.gpu.serve_graph import Collected, HostFinish
from scratchd.kernels.postprocess import postprocess
from scratchd.kernels.row_runs import row_runs_ref
from scratchd.model.scratchnet import DEFAULT_PATH, Prediction, ScratchNet, decide, load_model
from scratchd.protocol.image import decode_image

SCORE_TOL = 1e-2
IOU_MIN = 0.99


def mosaic(tiles: list[np.ndarray], size: int) -> np.ndarray:
    """A ``size x size`` frame of real tiles laid row by row (cycling), cropped."""
    th, tw = tiles[0].shape
    rows, cols = -(-size // th), -(-size // tw)
    grid = [
        np.hstack([tiles[(r * cols + c) % len(tiles)] for c in range(cols)]) for r in range(rows)
    ]
    return np.ascontiguousarray(np.vstack(grid)[:size, :size])


def _sd900(data_dir: Path, prefix: str, count: int, offset: int = 0) -> list[np.ndarray]:
    files = sorted((data_dir / "sd900" / "images").glob(f"{prefix}_*.png"))[offset : offset + count]
    return [decode_image(f.read_bytes()) for f in files]


def square_frames(data_dir: Path, n: int) -> list[np.ndarray]:
    """Scratch-heavy, defect-mixed and clean-ish 1024x1024 mosaics."""
    kinds = [("Sc", 0), ("In", 0), ("Pa", 0), ("Sc", 40)]
    return [mosaic(_sd900(data_dir, p, 36, off + 7 * i), 1024) for i, (p, off) in
            zip(range(n), (kinds * n)[:n], strict=True)]  # fmt: skip


def tile_frames(data_dir: Path, n: int) -> list[np.ndarray]:
    """Real magnetic-tile photographs (crack and free) cropped to one non-square size."""
    files = sorted((data_dir / "mtile" / "crack").glob("*.jpg"))[: n - n // 3]
    files += sorted((data_dir / "mtile" / "free").glob("*.jpg"))[: n // 3]
    imgs = [decode_image(f.read_bytes()) for f in files]
    h, w = min(i.shape[0] for i in imgs), min(i.shape[1] for i in imgs)
    h, w = (h, w - 1) if h == w else (h, w)
    return [np.ascontiguousarray(i[:h, :w]) for i in imgs]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    fa, fb = a > 0, b > 0
    union = np.count_nonzero(fa | fb)
    return 1.0 if union == 0 else np.count_nonzero(fa & fb) / union


def serve(model: ScratchNet, frames: list[np.ndarray], bucket: int, capacity: int = 4096) -> list:
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet
    from scratchd.gpu.serve_graph import ServeGraph

    h, w = frames[0].shape
    g = ServeGraph(CudaScratchNet(model), bucket, h, w, run_capacity=capacity)
    assert g.footprint_bytes > bucket * h * w * 4 * len(model.views)
    results = []
    for lo in range(0, len(frames), bucket):
        part = np.stack(frames[lo : lo + bucket])
        k = (lo // bucket) % len(g.inputs)
        g.inputs[k][: len(part)].set(part, stream=g.stream)
        g.launch(k)
        results += g.fetch(len(part), [True] * len(part))
        assert g.last_compute_ms > 0
    return results


def assert_matches(got: list, want: list[Prediction], what: str) -> None:
    worst_iou, worst_score = 1.0, 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        ctx = f"{what} frame {i}"
        assert g.verdict == w.verdict, f"{ctx}: verdict {g.verdict} != {w.verdict}"
        assert abs(g.score - w.score) <= SCORE_TOL, f"{ctx}: score {g.score} vs {w.score}"
        assert abs(g.entropy - w.entropy) <= SCORE_TOL, f"{ctx}: entropy {g.entropy} vs {w.entropy}"
        assert len(g.boxes) == len(w.boxes), f"{ctx}: {len(g.boxes)} boxes vs {len(w.boxes)}"
        np.testing.assert_array_equal(g.histogram, w.histogram, err_msg=ctx)
        assert g.mask is not None and g.mask.shape == w.mask.shape and g.mask.dtype == np.uint8
        assert set(np.unique(g.mask)) <= {0, 255}
        worst_iou = min(worst_iou, iou(g.mask, w.mask))
        worst_score = max(worst_score, abs(g.score - w.score))
        assert iou(g.mask, w.mask) >= IOU_MIN, f"{ctx}: mask IoU {iou(g.mask, w.mask):.4f}"
    print(f"{what}: worst mask IoU {worst_iou:.5f}, worst score diff {worst_score:.2e}")


@pytest.fixture(scope="module")
def shipped() -> ScratchNet:
    if not DEFAULT_PATH.is_file():
        pytest.skip(f"the shipped weights {DEFAULT_PATH} are not there yet")
    return load_model()


@pytest.mark.gpu
def test_serve_graph_matches_cpu_on_real_1024_square_frames(
    full_data_dir: Path, shipped: ScratchNet
) -> None:
    frames = square_frames(full_data_dir, 3)  # mosaics of 36 images each: the full sets
    want = shipped.predict(frames)
    assert "defect" in {p.verdict for p in want}, "the mosaics should show defects"
    got = serve(shipped, frames, bucket=2, capacity=1 << 17)  # a full batch, a partial one
    assert not any(r.host_path for r in got), f"runs per frame: {[r.runs for r in got]}"
    assert_matches(got, want, "1024x1024")
    print(f"1024x1024 runs per frame: {[r.runs for r in got]}")


@pytest.mark.gpu
def test_serve_graph_matches_cpu_on_real_non_square_frames(
    full_data_dir: Path, shipped: ScratchNet
) -> None:
    frames = tile_frames(full_data_dir, 9)  # six cracks: more than the committed fixture
    assert frames[0].shape[0] != frames[0].shape[1]
    want = shipped.predict(frames)
    assert_matches(serve(shipped, frames, bucket=4), want, f"{frames[0].shape}")


@pytest.mark.gpu
def test_serve_graph_single_identity_view(full_data_dir: Path) -> None:
    model = load_model(views=("identity",))
    frames = tile_frames(full_data_dir, 6)
    assert_matches(serve(model, frames, bucket=8), model.predict(frames), "identity")


@pytest.mark.gpu
def test_run_overflow_takes_the_host_path_and_stays_right(
    data_dir: Path, shipped: ScratchNet
) -> None:
    frames = tile_frames(data_dir, 4)
    want = shipped.predict(frames)
    got = serve(shipped, frames, bucket=4, capacity=2)
    flagged = [r.host_path for r in got]
    assert flagged == [r.runs > 2 for r in got] and any(flagged)
    assert_matches(got, want, "overflow")


@pytest.mark.gpu
def test_lifecycle_and_masks_only_where_wanted(data_dir: Path, shipped: ScratchNet) -> None:
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet
    from scratchd.gpu.serve_graph import ServeGraph

    frames = np.stack(tile_frames(data_dir, 3))
    g = ServeGraph(CudaScratchNet(shipped), 4, *frames.shape[1:])
    with pytest.raises(RuntimeError, match="no batch launched"):
        g.fetch(1, [True])
    g.inputs[1][:3].set(frames, stream=g.stream)
    g.launch(1)
    with pytest.raises(RuntimeError, match="not fetched"):
        g.launch(0)
    with pytest.raises(ValueError):
        g.fetch(3, [True])
    got = g.fetch(3, [False, True, False])
    assert [r.mask is None for r in got] == [True, False, True]
    # Pipelined: collect batch 1, launch the same frames reversed from input 0, finish
    # batch 1 while it runs; both match the frames' own results (the graphs share buffers).
    g.inputs[0][:3].set(frames[::-1].copy(), stream=g.stream)
    g.launch(1)
    first = g.collect(3)
    g.launch(0)
    again = g.finish(first, [True] * 3)
    reversed_ = g.fetch(3, [True] * 3)[::-1]
    for results in (again, reversed_):
        assert [r.boxes for r in results] == [r.boxes for r in got]
        assert [r.score for r in results] == [r.score for r in got]
        assert [r.runs for r in results] == [r.runs for r in got]


def test_host_finish_matches_postprocess_on_real_maps(data_dir: Path) -> None:
    """The GPU path's host half on runs from the reference op: equal to the CPU path's
    post-processing for frames finished from runs, from their map on overflow, and for a
    clean frame without runs."""
    model = load_model(views=("identity",))
    m = model.meta
    images = np.stack(_sd900(data_dir, "Sc", 3) + _sd900(data_dir, "Pa", 2))
    probs = np.concatenate([model.prob(images), np.zeros((1, *images.shape[1:]), np.float32)])
    counts = row_runs_ref(probs, m.threshold, probs[0].size).count
    capacity = int(np.sort(counts[counts > 0])[0])  # the sparsest frame fits, others overflow
    runs = row_runs_ref(probs, m.threshold, capacity)
    over = runs.count > capacity
    assert over.any() and (~over & (runs.count > 0)).any() and (runs.count == 0).any()
    batch = Collected(
        score=np.arange(len(probs), dtype=np.float32) / 10,
        entropy=np.full(len(probs), 0.25, np.float32),
        count=runs.count,
        hist=np.zeros((len(probs), 64), np.uint32),
        runs=runs.runs,
        maps={j: probs[j] for j in np.flatnonzero(over).tolist()},
        compute_ms=1.0,
    )
    height, width = images.shape[1:]
    host = HostFinish(height, width, m.threshold, m.min_area, m.score_window)
    by_score = HostFinish(height, width, m.threshold, m.min_area, m.score_window, 0.25)
    for j, prob in enumerate(probs):
        want = postprocess(prob, m.threshold, m.min_area, m.score_window)
        # With a score threshold the verdict reads the (device's) score, not the boxes.
        assert by_score.frame(batch, j, False).verdict == decide(float(batch.score[j]), False, 0.25)
        got = host.frame(batch, j, True)
        assert got.host_path == bool(over[j]) and got.runs == int(runs.count[j])
        assert got.mask is not None and np.array_equal(got.mask, want.mask), f"frame {j}"
        assert [b[:4] for b in got.boxes] == [b[:4] for b in want.boxes], f"frame {j}"
        np.testing.assert_allclose([b[4] for b in got.boxes], [b[4] for b in want.boxes], 1e-6)
        assert got.verdict == want.verdict and got.score == float(batch.score[j])
        plain = host.frame(batch, j, False)
        assert plain.mask is None and plain.boxes == got.boxes
    # An overflowed frame with components, so the host path's boxes and mask were checked.
    assert any(host.frame(batch, j, False).boxes for j in np.flatnonzero(over).tolist())


@pytest.mark.gpu
def test_footprint_counts_every_buffer_the_graph_allocates(shipped: ScratchNet) -> None:
    """The batch sizer trusts ``footprint_bytes``: it must cover what building the graph took
    from the allocator (every forward buffer, the split blocks' scratch included)."""
    import cupy as cp

    from scratchd.gpu.cuda_scratchnet import CudaScratchNet
    from scratchd.gpu.serve_graph import ServeGraph

    net = CudaScratchNet(shipped)
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    g = ServeGraph(net, 2, 200, 232)
    taken = pool.used_bytes() - before
    assert g.footprint_bytes <= taken
    assert taken - g.footprint_bytes <= 0.02 * taken + (1 << 20), (taken, g.footprint_bytes)
