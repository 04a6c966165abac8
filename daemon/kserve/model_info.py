"""What the endpoint says about itself and the model, the same on HTTP and gRPC.

``Served`` is read on every call (the model version changes with a reload, readiness with
the workers and the lifecycle); both transports build their answers from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from scratchd import __version__
from scratchd.daemon.kserve import tensors

EXTENSIONS: Final = ("binary_tensor_data", "parameters", "model_configuration")
DATA_TYPES: Final[dict[str, int]] = {"BOOL": 1, "UINT8": 2, "FP32": 11}
"""Triton's ``DataType`` enum values of our datatypes (the gRPC model configuration's)."""


@dataclass(frozen=True)
class Served:
    """Callables into the daemon: whether it serves now, and the model version it serves."""

    ready: Callable[[], bool]
    version: Callable[[], str]


def server_metadata() -> dict[str, Any]:
    return {"name": tensors.SERVER, "version": __version__, "extensions": list(EXTENSIONS)}


def _tensor(name: str) -> dict[str, Any]:
    return {"name": name, "datatype": tensors.DATATYPES[name], "shape": tensors.SHAPES[name]}


def model_metadata(version: str) -> dict[str, Any]:
    return {
        "name": tensors.MODEL,
        "versions": [version],
        "platform": tensors.PLATFORM,
        "inputs": [_tensor(tensors.INPUT)],
        "outputs": [_tensor(name) for name in tensors.OUTPUTS],
    }


def model_config(*, numeric_types: bool = False) -> dict[str, Any]:
    """The model-configuration extension's answer (what perf_analyzer asks before it loads
    a model): no server-side batching dimension (``max_batch_size`` 0: a batch is an input
    of shape [N, H, W], answered as N requests), the tensors with Triton's type names (JSON)
    or ``DataType`` values (``numeric_types``: protobuf)."""

    def entry(name: str) -> dict[str, Any]:
        datatype = tensors.DATATYPES[name]
        return {
            "name": name,
            "data_type": DATA_TYPES[datatype] if numeric_types else "TYPE_" + datatype,
            "dims": tensors.SHAPES[name],
        }

    return {
        "name": tensors.MODEL,
        "platform": tensors.PLATFORM,
        "backend": tensors.PLATFORM,
        "max_batch_size": 0,
        "input": [entry(tensors.INPUT)],
        "output": [entry(name) for name in tensors.OUTPUTS],
    }
