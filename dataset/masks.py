"""Validating and repairing defect masks on their way into a shard.

A mask is a greyscale image of the input's size: 0 = background, 255 = defect. Annotation
tools do not always deliver exactly that, and the two ways they miss differ:

- *near-binary* masks — rounding errors (1, 254) or soft, anti-aliased edges (the ``mtile``
  masks: up to half a percent of the pixels lie between 0 and 255). These are repaired:
  binarised at 128 (``>= 128`` is defect) and the number of changed pixels is counted, so
  a build reports how much the labels were touched;
- *impossible* masks — another size than the image, not a 2-D uint8 array, mostly mid-grey
  (a photograph or a probability map saved in the mask's place), or a 0/1 label map
  (binarising it at 128 would silently erase every defect). These raise
  :class:`MaskRejected` with the file name and the reason; the sample is left out.

Decoding is not done here: the caller decodes with :func:`scratchd.protocol.image.decode_image`
(an undecodable mask is rejected by the caller with that error's reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

THRESHOLD = 128  # values >= THRESHOLD become 255, the rest 0
# "Mid-grey" is anything this far from both ends; soft edges are mid-grey too, but only at
# the border of a defect. Real masks have at most ~0.5 % of such pixels (mtile, measured);
# a quarter of the frame is no annotation.
MID_GREY = (32, 223)
MAX_MID_GREY_FRACTION = 0.25


class MaskRejected(ValueError):
    """A mask that cannot be repaired; ``name`` is its file, ``reason`` says why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class MaskCheck:
    """A validated mask and how many of its pixels the repair changed."""

    mask: np.ndarray  # uint8 (H, W), only 0 and 255
    repaired_pixels: int


def validate_mask(mask: np.ndarray, image_shape: tuple[int, int], name: str) -> MaskCheck:
    """Check ``mask`` against its image's ``(H, W)`` and return it binarised to 0/255.

    Raises :class:`MaskRejected` naming ``name`` when the mask is impossible (see the
    module docstring). The input array is never modified.
    """
    if not isinstance(mask, np.ndarray) or mask.dtype != np.uint8 or mask.ndim != 2:
        kind = f"{mask.dtype} array of {mask.ndim} dims" if isinstance(mask, np.ndarray) else ""
        raise MaskRejected(name, f"expected a 2-D uint8 array, got {kind or type(mask).__name__}")
    if mask.shape != tuple(image_shape):
        raise MaskRejected(
            name,
            f"mask is {mask.shape[1]}x{mask.shape[0]} but its image is "
            f"{image_shape[1]}x{image_shape[0]} (width x height)",
        )
    _reject_label_map(mask, name)
    _reject_mostly_grey(mask, name)
    binary = np.where(mask >= THRESHOLD, np.uint8(255), np.uint8(0))
    repaired = int(np.count_nonzero(binary != mask))
    return MaskCheck(mask=binary, repaired_pixels=repaired)


def _reject_label_map(mask: np.ndarray, name: str) -> None:
    if mask.size and int(mask.max()) == 1:
        raise MaskRejected(
            name, "mask holds only 0 and 1 (a label map): expected 0 = background, 255 = defect"
        )


def _reject_mostly_grey(mask: np.ndarray, name: str) -> None:
    low, high = MID_GREY
    grey = int(np.count_nonzero((mask >= low) & (mask <= high)))
    fraction = grey / max(mask.size, 1)
    if fraction > MAX_MID_GREY_FRACTION:
        raise MaskRejected(
            name,
            f"{fraction:.0%} of the mask is mid-grey ({low}..{high}): not a binary mask "
            f"(at most {MAX_MID_GREY_FRACTION:.0%} allowed)",
        )
