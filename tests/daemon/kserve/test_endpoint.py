"""The Open Inference Protocol endpoint of a real daemon (CPU backend), through Triton's own
clients (``tritonclient`` HTTP and gRPC), nothing mocked: what a plant's existing tooling
sees when it is pointed at scratchd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from scratchd.client.api import Client
from scratchd.model.scratchnet import load_model
from scratchd.protocol import wire

from .kserve_daemon import KServeDaemon, fixture_images, grpc_input, http_input

VERSION = load_model().meta.version


@pytest.fixture(scope="module")
def daemon() -> Iterator[KServeDaemon]:
    d = KServeDaemon(workers=1, slots=64, slot_bytes=1 << 18)
    with d:
        yield d


def test_server_and_model_health_and_metadata(daemon: KServeDaemon) -> None:
    http, grpc = daemon.http(), daemon.grpc()
    for client in (http, grpc):
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("scratchnet")
    assert not http.is_model_ready("resnet50")  # 404
    with pytest.raises(InferenceServerException, match="NOT_FOUND"):
        grpc.is_model_ready("resnet50")
    meta = http.get_server_metadata()
    assert meta["name"] == "scratchd" and "binary_tensor_data" in meta["extensions"]
    assert grpc.get_server_metadata().name == "scratchd"
    model = http.get_model_metadata("scratchnet")
    assert model["versions"] == [VERSION]
    assert model["inputs"] == [{"name": "image", "datatype": "UINT8", "shape": [-1, -1]}]
    assert [o["name"] for o in model["outputs"]] == ["score", "defect", "boxes", "mask"]
    gmodel = grpc.get_model_metadata("scratchnet", VERSION)
    assert [(t.name, t.datatype) for t in gmodel.outputs] == [
        ("score", "FP32"), ("defect", "BOOL"), ("boxes", "FP32"), ("mask", "UINT8")
    ]  # fmt: skip
    with pytest.raises(InferenceServerException, match="no version"):
        http.get_model_metadata("scratchnet", "7")
    with pytest.raises(InferenceServerException, match="unknown model"):
        grpc.get_model_metadata("resnet50")


def _unix_reply(daemon: KServeDaemon, image: np.ndarray) -> wire.Reply:
    with Client(daemon.socket, timeout=120) as client:
        reply = client.infer(image, want_mask=True)
    assert reply.status == "ok", reply.error
    return reply


def _assert_same(result: thttp.InferResult | tgrpc.InferResult, reply: wire.Reply) -> None:
    assert result.as_numpy("score").tolist() == [np.float32(reply.score)]
    assert result.as_numpy("defect").tolist() == [reply.verdict == "defect"]
    boxes = np.asarray(reply.boxes, dtype=np.float32).reshape(-1, 5)
    np.testing.assert_array_equal(result.as_numpy("boxes"), boxes)
    mask = result.as_numpy("mask")
    if mask is not None:
        np.testing.assert_array_equal(mask, wire.unpack_mask(reply))


def test_infer_answers_what_the_unix_socket_answers(daemon: KServeDaemon, data_dir: Path) -> None:
    http, grpc = daemon.http(), daemon.grpc()
    for image in fixture_images(data_dir, 3):
        reply = _unix_reply(daemon, image)
        outputs = ["score", "defect", "boxes", "mask"]
        binary = http.infer(
            "scratchnet",
            [http_input(image)],
            outputs=[thttp.InferRequestedOutput(n, binary_data=True) for n in outputs],
        )
        _assert_same(binary, reply)
        as_json = http.infer("scratchnet", [http_input(image, binary=False)], model_version=VERSION)
        assert as_json.as_numpy("mask") is None  # only when asked for
        _assert_same(as_json, reply)
        requested = [tgrpc.InferRequestedOutput(n) for n in outputs]
        _assert_same(grpc.infer("scratchnet", [grpc_input(image)], outputs=requested), reply)


def test_an_rgb_image_and_a_batch(daemon: KServeDaemon, data_dir: Path) -> None:
    images = fixture_images(data_dir, 3)
    rgb = np.stack([images[0], images[1][::-1], images[2].T], axis=-1)
    reply = _unix_reply(daemon, rgb)
    _assert_same(daemon.grpc().infer("scratchnet", [grpc_input(rgb)]), reply)
    batch = np.stack(images)
    replies = [_unix_reply(daemon, image) for image in images]
    result = daemon.http().infer(
        "scratchnet", [http_input(batch)], outputs=[thttp.InferRequestedOutput("boxes")]
    )
    boxes = result.as_numpy("boxes")
    assert boxes.shape == (3, max(len(r.boxes) for r in replies), 5)
    for i, r in enumerate(replies):
        np.testing.assert_array_equal(boxes[i, : len(r.boxes)], np.asarray(r.boxes, np.float32))
        assert not boxes[i, len(r.boxes) :].any()  # padding rows are empty boxes
    scores = daemon.grpc().infer("scratchnet", [grpc_input(batch)]).as_numpy("score")
    assert scores.tolist() == [np.float32(r.score) for r in replies]


def test_parameters_reach_the_queue(daemon: KServeDaemon, data_dir: Path) -> None:
    image = fixture_images(data_dir, 1)[0]
    before = daemon.status().requests.get("ok", 0)
    params = {"part_class": "safety", "deadline_ms": 60_000}
    # tritonclient sends `priority` (and `timeout`, µs) from its own keyword arguments
    daemon.http().infer("scratchnet", [http_input(image)], parameters=params, priority=7)
    daemon.grpc().infer("scratchnet", [grpc_input(image)], parameters=params, priority=7)
    daemon.grpc().infer("scratchnet", [grpc_input(image)], timeout=60_000_000)
    assert daemon.status().requests["ok"] == before + 3


@pytest.mark.parametrize(
    ("parameters", "shape", "message"),
    [
        ({"part_class": "nope"}, None, "unknown part class 'nope'"),
        ({"priority": 9}, None, "priority 9 outside 0..7"),
        ({"deadline_ms": 0}, None, "deadline_ms must be positive"),
        ({"deadline_ms": "soon"}, None, "deadline_ms must be an integer"),
        ({}, [2, 3, 4, 5], "expected [H, W]"),
        ({}, [1, 2000, 2000], "exceeds the limit"),
    ],
)
def test_invalid_requests_are_400_and_invalid_argument(
    daemon: KServeDaemon, parameters: dict[str, object], shape: list[int] | None, message: str
) -> None:
    image = np.zeros(shape or [32, 32], dtype=np.uint8)
    kwargs: dict[str, object] = {"parameters": dict(parameters)}
    if "priority" in parameters:  # a keyword argument of tritonclient's, not a parameter
        kwargs = {"priority": parameters["priority"]}
    with pytest.raises(InferenceServerException) as http_error:
        daemon.http().infer("scratchnet", [http_input(image)], **kwargs)
    assert http_error.value.status() == "400" and message in http_error.value.message()
    with pytest.raises(InferenceServerException) as grpc_error:
        daemon.grpc().infer("scratchnet", [grpc_input(image)], **kwargs)
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert message in grpc_error.value.message()


def test_wrong_tensors_are_refused(daemon: KServeDaemon) -> None:
    floats = thttp.InferInput("image", [4, 4], "FP32")
    floats.set_data_from_numpy(np.zeros((4, 4), np.float32))
    with pytest.raises(InferenceServerException, match="must be UINT8"):
        daemon.http().infer("scratchnet", [floats])
    other = tgrpc.InferInput("pixels", [4, 4], "UINT8")
    other.set_data_from_numpy(np.zeros((4, 4), np.uint8))
    with pytest.raises(InferenceServerException, match="unknown input 'pixels'"):
        daemon.grpc().infer("scratchnet", [other])
    with pytest.raises(InferenceServerException, match="unknown output 'logits'"):
        daemon.http().infer(
            "scratchnet",
            [http_input(np.zeros((4, 4), np.uint8))],
            outputs=[thttp.InferRequestedOutput("logits")],
        )
    with pytest.raises(InferenceServerException, match="unknown model"):
        daemon.grpc().infer("resnet50", [grpc_input(np.zeros((4, 4), np.uint8))])
