"""Mask validation: rounding and soft edges are repaired and counted, impossible masks named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from scratchd.dataset.masks import MaskRejected, validate_mask


def square_mask(height: int = 40, width: int = 30) -> np.ndarray:
    mask = np.zeros((height, width), np.uint8)
    mask[10:20, 5:15] = 255
    return mask


def test_binary_mask_passes_unchanged() -> None:
    mask = square_mask()
    checked = validate_mask(mask, (40, 30), "a.png")
    assert checked.repaired_pixels == 0
    np.testing.assert_array_equal(checked.mask, mask)


def test_rounding_noise_and_soft_edges_are_binarised_at_128_and_counted() -> None:
    mask = square_mask()
    mask[0, 0], mask[1, 1] = 2, 127  # below the threshold: background
    mask[10, 5], mask[11, 6] = 253, 128  # at or above: defect
    mask[20, 5:15] = 90  # an anti-aliased lower edge
    original = mask.copy()
    checked = validate_mask(mask, (40, 30), "soft.png")
    assert checked.repaired_pixels == 4 + 10
    assert set(np.unique(checked.mask)) == {0, 255}
    assert checked.mask[10, 5] == 255 and checked.mask[11, 6] == 255
    assert checked.mask[1, 1] == 0 and checked.mask[20, 5] == 0
    np.testing.assert_array_equal(mask, original)  # the caller's array is left alone


@given(hnp.arrays(np.uint8, (12, 9), elements=st.sampled_from([0, 1, 2, 3, 252, 253, 254, 255])))
def test_near_binary_masks_round_to_the_nearer_end(mask: np.ndarray) -> None:
    mask[0, 0] = 0  # keep it from being a 0/1 label map
    mask[0, 1] = 255
    checked = validate_mask(mask, (12, 9), "n.png")
    np.testing.assert_array_equal(checked.mask, np.where(mask >= 128, 255, 0))
    assert checked.repaired_pixels == int(np.count_nonzero((mask != 0) & (mask != 255)))


@pytest.mark.parametrize(
    ("mask", "shape", "words"),
    [
        (square_mask(40, 31), (40, 30), "31x40"),
        (square_mask().T.copy(), (40, 30), "image is 30x40"),
        (np.full((40, 30), 128, np.uint8), (40, 30), "mid-grey"),
        (np.random.default_rng(0).integers(40, 200, (40, 30), dtype=np.uint8), (40, 30), "grey"),
        ((square_mask() // 255).astype(np.uint8), (40, 30), "0 and 1"),
        (square_mask().astype(np.float32), (40, 30), "uint8"),
        (np.zeros((40, 30, 3), np.uint8), (40, 30), "2-D"),
    ],
    ids=["width", "transposed", "grey", "photo", "label-map", "float", "rgb"],
)
def test_impossible_masks_are_rejected_with_the_file_name(
    mask: np.ndarray, shape: tuple[int, int], words: str
) -> None:
    with pytest.raises(MaskRejected) as info:
        validate_mask(mask, shape, "masks/Sc_7.png")
    assert info.value.name == "masks/Sc_7.png"
    assert words in info.value.reason
    assert "masks/Sc_7.png" in str(info.value)


def test_an_empty_mask_is_a_valid_negative() -> None:
    checked = validate_mask(np.zeros((5, 7), np.uint8), (5, 7), "free.png")
    assert checked.repaired_pixels == 0 and not checked.mask.any()
