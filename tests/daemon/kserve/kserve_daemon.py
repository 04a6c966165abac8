"""A real daemon with its Open Inference Protocol endpoint on, and Triton's clients for it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from scratchd.protocol.image import decode_image

from ..harness import DaemonProcess


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick; tests run side by side)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class KServeDaemon(DaemonProcess):
    """``DaemonProcess`` with ``[kserve]`` HTTP and gRPC ports and a client for each."""

    def __init__(self, **kwargs: Any) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        extra = kwargs.pop("extra", "")
        extra += f"[kserve]\nhttp_port = {self.http_port}\ngrpc_port = {self.grpc_port}\n"
        super().__init__(extra=extra, **kwargs)

    def __enter__(self) -> KServeDaemon:
        self.start()
        return self

    def http(self, timeout: float = 120.0) -> thttp.InferenceServerClient:
        url = f"127.0.0.1:{self.http_port}"
        return thttp.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)

    def grpc(self) -> tgrpc.InferenceServerClient:
        return tgrpc.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")


def fixture_images(data_dir: Path, count: int) -> list[np.ndarray]:
    """``count`` real defect photographs (200x200 grey), decoded."""
    paths = sorted((data_dir / "sd900" / "images").glob("*.png"))[:count]
    return [decode_image(p.read_bytes()) for p in paths]


def http_input(image: np.ndarray, binary: bool = True) -> thttp.InferInput:
    tensor = thttp.InferInput("image", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image, binary_data=binary)
    return tensor


def grpc_input(image: np.ndarray) -> tgrpc.InferInput:
    tensor = tgrpc.InferInput("image", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image)
    return tensor
