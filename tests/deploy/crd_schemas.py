"""Structural schemas of the three custom resources deploy/kubernetes uses, for validation
without a cluster.

The Kubernetes schemas (PyPI ``kubernetes-validate``) know only the built-in kinds, and the
projects behind these resources publish their CRDs in their repositories, not in a package
the test extra could install. So each resource's own fields are listed here, by their
camelCase names, from the published definitions:

* ``monitoring.coreos.com/v1`` ``PodMonitor``: the Prometheus Operator's CRD (the generated
  models of PyPI ``cloudcoil-models-prometheus-operator`` list the same fields);
* ``serving.kserve.io/v1alpha1`` ``ServingRuntime`` and ``serving.kserve.io/v1beta1``
  ``InferenceService``: KServe's CRDs (its SDK, PyPI ``kserve``, ``kserve.models``: the
  ``openapi_types`` of ``V1alpha1ServingRuntimeSpec``, ``V1beta1PredictorSpec``,
  ``V1beta1ModelSpec``).

Every object these resources define is closed (``additionalProperties: false``): a
misspelled or invented field is an error, as the API server's structural-schema pruning
would silently drop it. Where a resource embeds a Kubernetes type (a ``Container``, a
``Toleration``, a pod's field), the schema refers to that type in kubernetes-validate's own
definitions for the Kubernetes version under test, so those parts are checked exactly as a
built-in kind's are. Fields scratchd's manifests leave out are allowed by name with any
value; the ones they use are typed.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"
ANY: Schema = {}
STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
INTEGER: Schema = {"type": "integer"}
STRING_MAP: Schema = {"type": "object", "additionalProperties": STRING}

# Prometheus duration: units from years down to milliseconds, largest first ("15s", "1m30s").
DURATION: Schema = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}

# The fields a KServe predictor shares with a core/v1 PodSpec (V1beta1PredictorSpec).
PREDICTOR_POD_FIELDS = (
    "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
    "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases",
    "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname", "hostnameOverride",
    "imagePullSecrets", "initContainers", "nodeName", "nodeSelector", "os", "overhead",
    "preemptionPolicy", "priority", "priorityClassName", "readinessGates", "resourceClaims",
    "restartPolicy", "runtimeClassName", "schedulerName", "schedulingGates",
    "schedulingGroup", "securityContext", "serviceAccount", "serviceAccountName",
    "setHostnameAsFQDN", "shareProcessNamespace", "subdomain", "terminationGracePeriodSeconds",
    "tolerations", "topologySpreadConstraints", "volumes",
)  # fmt: skip

# KServe's own predictor fields: scaling and rollout, and the per-framework shortcuts.
PREDICTOR_KSERVE_FIELDS: Schema = {
    "minReplicas": {"type": "integer", "minimum": 0},
    "maxReplicas": {"type": "integer", "minimum": 0},
    "scaleTarget": INTEGER, "scaleMetric": STRING, "scaleMetricType": STRING,
    "containerConcurrency": INTEGER, "timeout": INTEGER, "canaryTrafficPercent": INTEGER,
    "labels": STRING_MAP, "annotations": STRING_MAP, "name": STRING,
    "autoScaling": ANY, "batcher": ANY, "deploymentStrategy": ANY, "logger": ANY,
    "storageContainerName": STRING, "storageUris": ANY, "workerSpec": ANY,
    "huggingface": ANY, "lightgbm": ANY, "onnx": ANY, "paddle": ANY, "pmml": ANY,
    "pytorch": ANY, "sklearn": ANY, "tensorflow": ANY, "triton": ANY, "xgboost": ANY,
}  # fmt: skip

# The fields a KServe model (V1beta1ModelSpec) shares with a core/v1 Container.
MODEL_CONTAINER_FIELDS = (
    "args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle",
    "livenessProbe", "name", "ports", "readinessProbe", "resizePolicy", "resources",
    "restartPolicy", "restartPolicyRules", "securityContext", "startupProbe", "stdin",
    "stdinOnce", "terminationMessagePath", "terminationMessagePolicy", "tty",
    "volumeDevices", "volumeMounts", "workingDir",
)  # fmt: skip


def core(name: str) -> Schema:
    """A reference to core Kubernetes type ``name`` (``io.k8s.api.core.v1.Container``)."""
    return {"$ref": f"{DEFINITIONS_ID}#/$defs/{name}"}


def closed(properties: Schema, required: tuple[str, ...] = ()) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **closed(
            {
                "apiVersion": {"const": api_version},
                "kind": {"const": kind},
                "metadata": core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
                "spec": spec,
                "status": ANY,
            },
            ("apiVersion", "kind", "metadata", "spec"),
        ),
    }


def _shared(type_name: str, fields: tuple[str, ...], definitions: Schema) -> Schema:
    """``fields`` of core type ``type_name`` as that type defines them in ``definitions``
    (a field this Kubernetes version lacks is allowed by name)."""
    known = definitions["$defs"][type_name]["properties"]
    return {
        f: {"$ref": f"{DEFINITIONS_ID}#/$defs/{type_name}/properties/{f}"} if f in known else ANY
        for f in fields
    }


def pod_monitor() -> Schema:
    endpoint = closed(
        {
            "port": STRING,
            "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
            "targetPort": {"type": ["integer", "string"]},
            "path": STRING,
            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
            "interval": DURATION,
            "scrapeTimeout": DURATION,
            "params": ANY,
            "honorLabels": BOOLEAN,
            "honorTimestamps": BOOLEAN,
            "trackTimestampsStaleness": BOOLEAN,
            "enableHttp2": BOOLEAN,
            "filterRunning": BOOLEAN,
            "followRedirects": BOOLEAN,
            "proxyUrl": STRING,
            "relabelings": {"type": "array"},
            "metricRelabelings": {"type": "array"},
            "authorization": ANY,
            "basicAuth": ANY,
            "bearerTokenSecret": ANY,
            "oauth2": ANY,
            "tlsConfig": ANY,
        }
    )
    limit = {"type": "integer", "minimum": 0}
    spec = closed(
        {
            "selector": core("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
            "namespaceSelector": closed(
                {"any": BOOLEAN, "matchNames": {"type": "array", "items": STRING}}
            ),
            "podMetricsEndpoints": {"type": "array", "items": endpoint},
            "podTargetLabels": {"type": "array", "items": STRING},
            "jobLabel": STRING,
            "sampleLimit": limit,
            "targetLimit": limit,
            "labelLimit": limit,
            "labelNameLengthLimit": limit,
            "labelValueLengthLimit": limit,
            "keepDroppedTargets": limit,
            "bodySizeLimit": STRING,
            "attachMetadata": ANY,
            "fallbackScrapeProtocol": STRING,
            "nativeHistogramBucketLimit": limit,
            "nativeHistogramMinBucketFactor": ANY,
            "scrapeClass": STRING,
            "scrapeClassicHistograms": BOOLEAN,
            "scrapeProtocols": {"type": "array"},
            "selectorMechanism": STRING,
        },
        ("selector",),
    )
    return resource("monitoring.coreos.com/v1", "PodMonitor", spec)


def serving_runtime() -> Schema:
    def listed(type_name: str) -> Schema:
        return {"type": "array", "items": core(f"io.k8s.api.core.v1.{type_name}")}

    model_format = closed(
        {"name": STRING, "version": STRING, "autoSelect": BOOLEAN,
         "priority": {"type": "integer", "minimum": 1}},
        ("name",),
    )  # fmt: skip
    spec = closed(
        {
            "supportedModelFormats": {"type": "array", "items": model_format},
            "protocolVersions": {"type": "array", "items": STRING},
            "containers": {
                "type": "array",
                "minItems": 1,
                "items": core("io.k8s.api.core.v1.Container"),
            },
            "volumes": listed("Volume"),
            "tolerations": listed("Toleration"),
            "imagePullSecrets": listed("LocalObjectReference"),
            "resourceClaims": listed("PodResourceClaim"),
            "affinity": core("io.k8s.api.core.v1.Affinity"),
            "nodeSelector": STRING_MAP,
            "annotations": STRING_MAP,
            "labels": STRING_MAP,
            "multiModel": BOOLEAN,
            "disabled": BOOLEAN,
            "hostIPC": BOOLEAN,
            "replicas": INTEGER,
            "schedulerName": STRING,
            "grpcEndpoint": STRING,
            "grpcDataEndpoint": STRING,
            "httpDataEndpoint": STRING,
            "builtInAdapter": ANY,
            "storageHelper": ANY,
            "workerSpec": ANY,
        },
        ("containers",),
    )
    return resource("serving.kserve.io/v1alpha1", "ServingRuntime", spec)


def inference_service(definitions: Schema) -> Schema:
    model_format = closed({"name": STRING, "version": STRING}, ("name",))
    model = closed(
        {
            **_shared("io.k8s.api.core.v1.Container", MODEL_CONTAINER_FIELDS, definitions),
            "modelFormat": model_format,
            "runtime": STRING,
            "runtimeVersion": STRING,
            "protocolVersion": STRING,
            "storageUri": STRING,
            "storage": ANY,
            "confidential": ANY,
        },
        ("modelFormat",),
    )
    predictor = closed(
        {
            **_shared("io.k8s.api.core.v1.PodSpec", PREDICTOR_POD_FIELDS, definitions),
            **PREDICTOR_KSERVE_FIELDS,
            "model": model,
        }
    )
    spec = closed(
        {"predictor": predictor, "transformer": ANY, "explainer": ANY, "canary": ANY,
         "tracing": ANY},
        ("predictor",),
    )  # fmt: skip
    return resource("serving.kserve.io/v1beta1", "InferenceService", spec)
