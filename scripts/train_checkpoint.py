"""scripts/train.py's checkpoints: a trainer's whole state in one ``.npz`` of numeric arrays
and JSON, no pickle.

Every tensor of the state becomes an array entry ``t<i>``; the structure around them (dicts
with str or int keys, lists, numbers, strings, None, and the tensors by name) is JSON under
``meta``. A checkpoint carries every command line of its schedule, so the file alone says how
it was made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from train_loop import Trainer


def save_checkpoint(path: Path, trainer: Trainer, extra: dict[str, Any]) -> None:
    """Write ``trainer``'s state and ``extra`` (JSON-able) to ``path`` atomically, as
    :func:`encode_state` does: numpy arrays and JSON in one ``.npz``, no pickle."""
    tmp = path.with_name(path.name + ".tmp")
    # Numeric arrays only (encode_state), so np.savez writes no pickle; its keyword
    # arguments are typed as its options, hence the Any.
    arrays: dict[str, Any] = encode_state(trainer.state() | {"extra": extra})
    with tmp.open("wb") as f:
        np.savez(f, **arrays)
    tmp.replace(path)


def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote, its tensors on ``device``."""
    with np.load(path, allow_pickle=False) as z:
        return decode_state({k: z[k] for k in z.files}, device)


def encode_state(state: Any) -> dict[str, np.ndarray]:
    """A nested state (dicts with str or int keys, lists, tuples, numbers, strings, None,
    tensors) as arrays: every tensor becomes an entry ``t<i>``, and the structure, with
    tensors by name, is JSON under ``meta`` (UTF-8 bytes). Tuples come back as lists."""
    arrays: dict[str, np.ndarray] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"t{len(arrays)}"
            if x.dtype == torch.bfloat16:
                raise ValueError("encode_state: bfloat16 tensors have no numpy dtype")
            arrays[name] = x.detach().cpu().numpy()
            return {"tensor": name, "dtype": str(x.dtype).removeprefix("torch.")}
        if isinstance(x, dict):
            if not all(isinstance(k, str | int) and not isinstance(k, bool) for k in x):
                raise ValueError(f"encode_state: keys must be str or int: {list(x)[:5]}")
            return {"dict": [[k, enc(v)] for k, v in x.items()]}
        if isinstance(x, list | tuple):
            return {"list": [enc(v) for v in x]}
        if x is None or isinstance(x, bool | int | float | str):
            return {"value": x}
        raise ValueError(f"encode_state: cannot store {type(x).__name__}")

    meta = json.dumps(enc(state)).encode()
    return {"meta": np.frombuffer(meta, np.uint8), **arrays}


def decode_state(arrays: dict[str, np.ndarray], device: torch.device) -> Any:
    """:func:`encode_state`'s inverse, tensors on ``device``."""

    def dec(x: dict[str, Any]) -> Any:
        if "tensor" in x:
            t = torch.from_numpy(np.array(arrays[x["tensor"]]))
            want = getattr(torch, x["dtype"])
            if t.dtype != want:
                raise ValueError(f"decode_state: {x['tensor']} is {t.dtype}, not {want}")
            return t.to(device)
        if "dict" in x:
            return {k: dec(v) for k, v in x["dict"]}
        if "list" in x:
            return [dec(v) for v in x["list"]]
        return x["value"]

    return dec(json.loads(arrays["meta"].tobytes()))
