"""deploy/kubernetes in step with the daemon it runs, without any tool.

Each ConfigMap's ``scratchd.toml`` loads with the daemon's own loader (daemon/config.py), and
the ports, paths, probes, grace period, /dev/shm size and GPU count in the manifests are the
ones that configuration, the daemon's defaults and its health listener imply, so that
neither side can change without the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import yaml

import scratchd
from scratchd.daemon.config import Config
from scratchd.daemon.kserve.tensors import MODEL
from scratchd.daemon.ops.health import HealthServer
from scratchd.ipc.layout import Geometry, layout
from scratchd.protocol.defaults import DEFAULT_SOCKET, SOCKET_ENV
from tests.deploy.manifests import (
    DAEMONSET,
    KSERVE,
    Doc,
    config_path,
    daemon_config,
    generated_toml,
    kustomization,
    mounts,
    one,
    pod_spec,
    ports,
    quantity_bytes,
    source,
    volumes,
)

__all__ = ["kustomization"]  # the fixture, used by name

DRAIN_MARGIN_S = 5  # after the drain and the workers' stop: unlink the segment, exit


def test_each_configmap_toml_loads_with_the_daemons_loader(
    kustomization: Path, tmp_path: Path
) -> None:
    _, toml = generated_toml(kustomization)
    config, sections = daemon_config(toml, tmp_path)
    assert config.workers.backend == "cuda"  # a GPU node without CUDA must stop, not limp on CPU
    assert config.workers.gpus == "all"  # every card the device plugin gave the pod
    assert config.server.bind == "0.0.0.0"  # probes and scrapers come from outside the pod
    ports = [sections["server"]["health_port"], sections["server"]["metrics_port"]]
    ports += [sections["kserve"]["http_port"], sections["kserve"]["grpc_port"]]
    assert all(ports) and len(set(ports)) == 4, ports  # all four listen, on four ports


def test_health_and_metrics_ports_are_the_daemons_defaults(
    kustomization: Path, tmp_path: Path
) -> None:
    """Dashboards, firewalls and the systemd unit's notes assume the defaults: a pod on other
    ports would be a second convention to keep in mind."""
    config, _ = daemon_config(generated_toml(kustomization)[1], tmp_path)
    defaults = Config().server
    assert (config.server.health_port, config.server.metrics_port) == (
        defaults.health_port,
        defaults.metrics_port,
    )


def test_the_container_listens_where_the_config_says(kustomization: Path, tmp_path: Path) -> None:
    _, sections = daemon_config(generated_toml(kustomization)[1], tmp_path)
    _, daemon = pod_spec(kustomization)
    listed = set(ports(daemon).values())
    expected = {sections["kserve"]["http_port"], sections["kserve"]["grpc_port"]}
    if kustomization == DAEMONSET:  # KServe's runtime declares only the served ports
        expected |= {sections["server"]["health_port"], sections["server"]["metrics_port"]}
    assert listed == expected
    if kustomization == KSERVE:  # KServe routes the first port: the HTTP endpoint
        assert daemon["ports"][0]["containerPort"] == sections["kserve"]["http_port"]


def _probe_port(daemon: Doc, probe: Doc) -> int:
    port = probe["httpGet"]["port"]
    return ports(daemon)[port] if isinstance(port, str) else int(port)


def test_probes_ask_the_health_listener(kustomization: Path, tmp_path: Path) -> None:
    config, _ = daemon_config(generated_toml(kustomization)[1], tmp_path)
    _, daemon = pod_spec(kustomization)
    paths = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _probe_port(daemon, daemon[kind]) == config.server.health_port, kind
        paths[kind] = daemon[kind]["httpGet"]["path"]
    # Liveness is the event loop only; a stalled queue or a booting pool is "not ready".
    assert paths == {
        "startupProbe": "/readyz",
        "readinessProbe": "/readyz",
        "livenessProbe": "/livez",
    }


def test_the_startup_probe_outlasts_a_workers_boot(kustomization: Path, tmp_path: Path) -> None:
    """Liveness waits for startup; a boot the daemon itself still waits for must not be cut
    short by a restart."""
    config, _ = daemon_config(generated_toml(kustomization)[1], tmp_path)
    startup = pod_spec(kustomization)[1]["startupProbe"]
    patience_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert patience_s >= config.workers.boot_timeout_ms / 1000


def test_the_probe_and_scrape_paths_are_the_daemons_routes() -> None:
    """Each path a probe or the PodMonitor asks is answered 200 by the daemon's own listener
    (daemon/ops/health.py) behind the port that probe names."""
    _, daemon = pod_spec(DAEMONSET)
    monitor = one(source(DAEMONSET / "podmonitor.yaml"), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    asked = [(daemon[kind]["httpGet"]["port"], daemon[kind]["httpGet"]["path"])
             for kind in ("startupProbe", "readinessProbe", "livenessProbe")]  # fmt: skip
    asked.append((endpoint["port"], endpoint["path"]))

    async def main() -> dict[tuple[str, str], int]:
        server = HealthServer(
            "127.0.0.1", 0, 0, readiness=lambda: (True, "ready"), metrics=lambda: b"up 1\n"
        )
        await server.start()
        try:
            listener = {"health": server.bound["health"], "metrics": server.bound["metrics"]}
            return {(port, path): await _get(listener[port], path) for port, path in asked}
        finally:
            await server.close()

    assert asyncio.run(main()) == dict.fromkeys(asked, 200)


async def _get(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    status_line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return int(status_line.split()[1])


def test_the_service_and_podmonitor_name_the_containers_ports(tmp_path: Path) -> None:
    _, sections = daemon_config(generated_toml(DAEMONSET)[1], tmp_path)
    by_name = ports(pod_spec(DAEMONSET)[1])
    service = one(source(DAEMONSET / "service.yaml"), "Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per node's pod
    served = {p["targetPort"]: p["port"] for p in service["spec"]["ports"]}
    assert served == {name: by_name[name] for name in served}
    assert set(served.values()) == {
        sections["kserve"]["http_port"],
        sections["kserve"]["grpc_port"],
    }
    monitor = one(source(DAEMONSET / "podmonitor.yaml"), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert by_name[endpoint["port"]] == sections["server"]["metrics_port"]
    template_labels = one(source(DAEMONSET / "daemonset.yaml"), "DaemonSet")["spec"]["template"][
        "metadata"
    ]["labels"]
    pdb = one(source(DAEMONSET / "poddisruptionbudget.yaml"), "PodDisruptionBudget")
    for selector in (service["spec"]["selector"], monitor["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):  # fmt: skip
        assert selector.items() <= template_labels.items()


def test_config_and_socket_paths(kustomization: Path, tmp_path: Path) -> None:
    name, toml = generated_toml(kustomization)
    config, _ = daemon_config(toml, tmp_path)
    spec, daemon = pod_spec(kustomization)
    at = mounts(daemon)
    read = config_path(daemon)  # serve --config reads the ConfigMap's key
    assert read.name == toml.name
    assert volumes(spec)[at[str(read.parent)]]["configMap"]["name"] == name
    socket_dir = str(PurePosixPath(config.server.socket).parent)
    socket_volume = volumes(spec)[at[socket_dir]]
    if kustomization == DAEMONSET:
        # The node's gateways and `scratchd infer` there find it without --socket.
        assert config.server.socket == DEFAULT_SOCKET
        assert socket_volume["hostPath"]["path"] == socket_dir
        env = {e["name"]: e["value"] for e in daemon["env"]}
        assert env[SOCKET_ENV] == config.server.socket
    else:
        assert "emptyDir" in socket_volume


def test_every_path_the_daemon_writes_is_a_volume(kustomization: Path, tmp_path: Path) -> None:
    """The root filesystem is read-only: the socket's directory, /dev/shm, /tmp and the
    caches (HOME, CuPy's, CUDA's) are mounts."""
    config, _ = daemon_config(generated_toml(kustomization)[1], tmp_path)
    _, daemon = pod_spec(kustomization)
    security = daemon.get("securityContext", {})
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e["value"] for e in daemon["env"]}
    written = [str(PurePosixPath(config.server.socket).parent), "/dev/shm", "/tmp"]
    written += [env["HOME"], env["CUPY_CACHE_DIR"], env["CUDA_CACHE_PATH"]]
    writable = {
        path for path, _ in mounts(daemon).items() if path != str(config_path(daemon).parent)
    }
    for path in written:
        assert any(PurePosixPath(path).is_relative_to(w) for w in writable), path


def test_the_daemonset_runs_as_the_user_that_owns_the_socket_dir(tmp_path: Path) -> None:
    config, _ = daemon_config(generated_toml(DAEMONSET)[1], tmp_path)
    spec, _ = pod_spec(DAEMONSET)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    (init,) = spec["initContainers"]
    assert f"chown {pod['runAsUser']}:{pod['runAsGroup']} " in init["command"][-1]
    assert init["volumeMounts"] == [
        {"name": "socket", "mountPath": str(PurePosixPath(config.server.socket).parent)}
    ]
    assert config.server.socket_mode & 0o060 == 0o060  # the group (gateways) may connect


def _shm_and_memory(kustomization: Path) -> tuple[int, int]:
    spec, daemon = pod_spec(kustomization)
    shm = volumes(spec)[mounts(daemon)["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    return quantity_bytes(shm["sizeLimit"]), quantity_bytes(daemon["resources"]["limits"]["memory"])


def test_dev_shm_holds_the_queue(kustomization: Path, tmp_path: Path) -> None:
    """The queue's segment, sized by the configuration, fits the memory-backed /dev/shm, and
    the container's memory limit (which that volume is charged to) holds both."""
    config, _ = daemon_config(generated_toml(kustomization)[1], tmp_path)
    q = config.queue
    segment = layout(Geometry(slots=q.slots, slot_bytes=q.slot_bytes, tick_ms=q.tick_ms))[
        "total_bytes"
    ]
    shm, memory_limit = _shm_and_memory(kustomization)
    assert segment <= shm < memory_limit


def test_the_grace_period_covers_the_drain(kustomization: Path, tmp_path: Path) -> None:
    config, _ = daemon_config(generated_toml(kustomization)[1], tmp_path)
    if kustomization == DAEMONSET:
        grace = pod_spec(DAEMONSET)[0]["terminationGracePeriodSeconds"]
    else:
        isvc = one(source(KSERVE / "inferenceservice.yaml"), "InferenceService")
        grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
    stop_s = (config.server.drain_timeout_ms + config.workers.kill_grace_ms) / 1000
    assert grace >= stop_s + DRAIN_MARGIN_S


def test_one_daemonset_pod_takes_every_card_of_its_node() -> None:
    spec, daemon = pod_spec(DAEMONSET)
    resources = daemon["resources"]
    cards = resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"]["nvidia.com/gpu"] == cards
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    (count,) = [e for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.count"]
    assert count == {"key": "nvidia.com/gpu.count", "operator": "In", "values": [str(cards)]}
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]


def test_the_kserve_runtime_serves_scratchnet_over_both_protocols() -> None:
    runtime = one(source(KSERVE / "servingruntime.yaml"), "ServingRuntime")
    isvc = one(source(KSERVE / "inferenceservice.yaml"), "InferenceService")
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    assert [f["name"] for f in runtime["spec"]["supportedModelFormats"]] == [MODEL]
    model = isvc["spec"]["predictor"]["model"]
    assert (model["modelFormat"]["name"], model["runtime"]) == (
        MODEL,
        runtime["metadata"]["name"],
    )
    assert model["protocolVersion"] == "v2"
    annotations = runtime["spec"]["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == Config().server.metrics_port


def test_the_image_tag_is_the_package_version(kustomization: Path) -> None:
    images = yaml.safe_load(kustomization.joinpath("kustomization.yaml").read_text())["images"]
    assert images == [{"name": "scratchd", "newTag": scratchd.__version__}]


def _all_containers(kustomization: Path) -> Iterator[Doc]:
    spec, _ = pod_spec(kustomization)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def test_every_container_runs_the_image_kustomize_pins(kustomization: Path) -> None:
    assert {c["image"] for c in _all_containers(kustomization)} == {"scratchd"}
