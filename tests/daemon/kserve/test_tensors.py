"""Input tensors become request frames and replies become output tensors, for any shape."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.daemon.kserve import tensors
from scratchd.protocol import wire


@given(
    count=st.integers(1, 4),
    height=st.integers(1, 9),
    width=st.integers(1, 9),
    rgb=st.booleans(),
    batch=st.booleans(),
    data=st.data(),
)
def test_an_input_splits_into_its_images(
    count: int, height: int, width: int, rgb: bool, batch: bool, data: st.DataObject
) -> None:
    shape = [height, width, *([3] if rgb else [])]
    if not rgb and width == 3 and not batch:
        shape = [height, width]  # [H, 3] is grey; [N, H, 3] would read as one RGB image
    if batch and not (not rgb and shape[-1] == 3):
        shape = [count, *shape]
    else:
        batch = False
    size = int(np.prod(shape))
    pixels = data.draw(st.lists(st.integers(0, 255), min_size=size, max_size=size))
    array = np.asarray(pixels, np.uint8).reshape(shape)
    opts = tensors.Options("safety", 3, 50)
    frames, got_batch = tensors.images("UINT8", shape, array.tobytes(), opts, want_mask=True)
    assert got_batch == batch
    images = array if batch else array[None]
    assert len(frames) == len(images)
    for i, (frame, image) in enumerate(zip(frames, images, strict=True)):
        assert (frame.id, frame.height, frame.width) == (i, image.shape[0], image.shape[1])
        assert frame.channels == (3 if rgb else 1)
        assert bytes(frame.pixels or b"") == image.tobytes()
        assert (frame.part_class, frame.priority, frame.deadline_ms) == ("safety", 3, 50)
        assert frame.want_mask


@pytest.mark.parametrize(
    ("datatype", "shape", "nbytes", "message"),
    [
        ("FP32", [2, 2], 16, "must be UINT8"),
        ("UINT8", [2], 2, "expected [H, W]"),
        ("UINT8", [2, 0], 0, "must be positive"),
        ("UINT8", [2, 2], 3, "needs 4 bytes, got 3"),
        ("UINT8", [2, 2, 2, 2], 16, "expected [H, W]"),
    ],
)
def test_a_wrong_input_is_refused_with_the_reason(
    datatype: str, shape: list[int], nbytes: int, message: str
) -> None:
    with pytest.raises(tensors.TensorError, match=message.replace("[", r"\[")):
        tensors.images(datatype, shape, bytes(nbytes), tensors.Options(), want_mask=False)


@given(st.lists(st.lists(st.tuples(*[st.floats(0, 500, width=32)] * 5), max_size=4), min_size=1,
                max_size=4))  # fmt: skip
def test_boxes_of_a_batch_are_padded_with_empty_rows(boxes: list[list[tuple[float, ...]]]) -> None:
    replies = [wire.Reply(id=i, status="ok", score=0.5, verdict="clean", boxes=b)  # type: ignore[arg-type]
               for i, b in enumerate(boxes)]  # fmt: skip
    out = {t.name: t for t in tensors.outputs(replies, tensors.DEFAULT_OUTPUTS, batch=True)}
    rows = max(len(b) for b in boxes)
    assert out["boxes"].shape == [len(boxes), rows, 5]
    array = np.frombuffer(out["boxes"].data, "<f4").reshape(len(boxes), rows, 5)
    for i, b in enumerate(boxes):
        np.testing.assert_array_equal(array[i, : len(b)], np.asarray(b, np.float32).reshape(-1, 5))
        assert not array[i, len(b) :].any()
    assert out["defect"].values() == [False] * len(boxes)
    assert out["score"].shape == [len(boxes)]


def test_parameters_and_outputs_are_checked() -> None:
    assert tensors.options({"timeout": 2500}).deadline_ms == 3  # Triton's µs, rounded up
    assert tensors.options({"timeout": 2500, "deadline_ms": 9}).deadline_ms == 9
    with pytest.raises(tensors.TensorError, match="part_class must be a string"):
        tensors.options({"part_class": 3})
    with pytest.raises(tensors.TensorError, match="priority must be an integer"):
        tensors.options({"priority": True})
    assert tensors.wanted_outputs([]) == tensors.DEFAULT_OUTPUTS
    assert tensors.wanted_outputs(["mask", "mask"]) == ("mask",)
    with pytest.raises(tensors.NotFound):
        tensors.check_model("scratchnet", "2", "scratchnet-1.1")
