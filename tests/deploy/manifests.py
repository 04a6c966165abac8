"""The manifests under deploy/kubernetes as the tests read them, and the daemon configuration
each one ships (its ConfigMap's scratchd.toml through daemon/config.py's loader)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
import pytest
import yaml

from scratchd.daemon.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
DAEMONSET = KUBE / "daemonset"
KSERVE = KUBE / "kserve"
KUSTOMIZATIONS = (DAEMONSET, KSERVE)

Doc = dict[str, Any]


def source(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def one(docs: list[Doc], kind: str) -> Doc:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(pod_spec: Doc, name: str) -> Doc:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container {name!r}"
    return found[0]


def ports(c: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def mounts(c: Doc) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def volumes(spec: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in spec["volumes"]}


def config_path(c: Doc) -> PurePosixPath:
    argv = [*c.get("command", []), *c.get("args", [])]
    assert argv[:2] == ["scratchd", "serve"], argv
    return PurePosixPath(argv[argv.index("--config") + 1])


def quantity_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    assert match, f"unexpected quantity {text!r}"
    return int(match[1]) * units.get(match[2] or "", 1)


def generated_toml(kustomization: Path) -> tuple[str, Path]:
    """The generated ConfigMap's name and the scratchd.toml it is made from."""
    (generator,) = yaml.safe_load(kustomization.joinpath("kustomization.yaml").read_text())[
        "configMapGenerator"
    ]
    (file,) = generator["files"]
    assert file == "scratchd.toml", "the key is the file name serve --config reads"
    return generator["name"], kustomization / file


def daemon_config(path: Path, tmp_path: Path) -> tuple[Config, dict[str, Any]]:
    """``path`` through daemon/config.py's loader, and every section as the daemon sees it.

    A loader without the ``[kserve]`` section (the Open Inference Protocol endpoint is built
    apart from these manifests) refuses it as an unknown key: the rest of the file still goes
    through the loader, and the section is taken from the file as written."""
    text = path.read_text(encoding="utf-8")
    raw = tomllib.loads(text)
    if "kserve" not in Config.__struct_fields__:
        text = re.sub(r"(?ms)^\[kserve\]\n.*?(?=^\[)", "", text)
        path = tmp_path / path.name
        path.write_text(text, encoding="utf-8")
    config = load_config(path, environ={})
    sections: dict[str, Any] = msgspec.to_builtins(config)
    sections.setdefault("kserve", raw["kserve"])
    return config, sections


def pod_spec(kustomization: Path) -> tuple[Doc, Doc]:
    """The pod spec that runs the daemon, and the daemon's container."""
    if kustomization == DAEMONSET:
        spec = one(source(DAEMONSET / "daemonset.yaml"), "DaemonSet")["spec"]["template"]["spec"]
        return spec, container(spec, "scratchd")
    spec = one(source(KSERVE / "servingruntime.yaml"), "ServingRuntime")["spec"]
    return spec, container(spec, "kserve-container")


@pytest.fixture(params=KUSTOMIZATIONS, ids=lambda p: p.name)
def kustomization(request: pytest.FixtureRequest) -> Path:
    """Each kustomization in turn (a test module imports this fixture to use it)."""
    path: Path = request.param
    return path
