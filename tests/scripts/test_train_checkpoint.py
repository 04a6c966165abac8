"""scripts/train_checkpoint.py's format: every state a trainer saves comes back as it was,
from numeric arrays and JSON alone (no pickle)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .test_train import _mod

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]
_tensors = st.builds(
    lambda shape, dtype, seed: (torch.rand(shape, generator=torch.Generator().manual_seed(seed))
                                * 100).to(dtype),
    st.lists(st.integers(0, 4), max_size=3), st.sampled_from(_DTYPES), st.integers(0, 2**31),
)  # fmt: skip
_leaves = (
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.text(max_size=8)
    | st.floats(allow_nan=False) | _tensors
)  # fmt: skip
_states = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=20,
)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=80, deadline=None)
@given(_states)
def test_checkpoint_codec_round_trips_any_state(state: object) -> None:
    """encode_state/decode_state (the checkpoint's format): the same structure, key types,
    values and tensors (dtype, shape, bits) back, through the arrays np.savez stores."""
    ck = _mod("train_checkpoint")
    buf = io.BytesIO()
    np.savez(buf, **ck.encode_state(state))
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        back = ck.decode_state({k: z[k] for k in z.files}, torch.device("cpu"))
    assert _same(state, back)


def test_checkpoint_codec_refuses_what_it_cannot_store() -> None:
    ck = _mod("train_checkpoint")
    with pytest.raises(ValueError, match="cannot store"):
        ck.encode_state({"x": {1, 2}})
    with pytest.raises(ValueError, match="keys"):
        ck.encode_state({(1, 2): 0})
    with pytest.raises(ValueError, match="bfloat16"):
        ck.encode_state([torch.zeros(2, dtype=torch.bfloat16)])
