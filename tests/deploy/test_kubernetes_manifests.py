"""The Kubernetes manifests (deploy/kubernetes) as `kubectl kustomize` renders them, and the Dockerfile.

Checked against the code they deploy: the queue names come from conveyor.core.settings, the scaling path from
conveyor.api.routes.scaling, so renaming either without the manifests fails here. Core objects are validated
against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail too). kubectl is required:
without it the test fails, since the manifests would otherwise go unchecked.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from conveyor.api.host_check import host_allowed
from conveyor.api.routes.scaling import SCALING_PATH
from conveyor.api.schemas.scaling import QueueScaling
from conveyor.core.settings import Settings, default_queues

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZATION = REPO / "deploy" / "kubernetes"
TWO_MODELS = KUSTOMIZATION / "overlays" / "two-models"  # a registry of two models, a worker pool each
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise to fit
CORE_KINDS = {"Namespace", "Deployment", "Service", "Job", "ConfigMap", "Secret", "ServiceAccount",
              "PodDisruptionBudget"}
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
SCALED_METRIC = "load"  # the field of /v1/scaling's per-queue body the workers scale on
GPU = "nvidia.com/gpu"
API_SERVICE = "conveyor-api"

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    return rendered(KUSTOMIZATION)


@pytest.fixture(scope="module")
def two_models() -> list[Manifest]:
    return rendered(TWO_MODELS)


def rendered(kustomization: Path) -> list[Manifest]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: it renders deploy/kubernetes (`kubectl kustomize`)")
    result = subprocess.run([kubectl, "kustomize", str(kustomization)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def named(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = [m for m in of_kind(manifests, kind) if m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name}, found {len(found)}"
    return found[0]


def config_map(manifests: list[Manifest]) -> dict[str, str]:
    maps = of_kind(manifests, "ConfigMap")
    assert len(maps) == 1, "expected one ConfigMap (conveyor-config)"
    data: dict[str, str] = maps[0].get("data", {})
    return data


def secret_data(manifests: list[Manifest]) -> dict[str, str]:
    secrets = of_kind(manifests, "Secret")
    assert len(secrets) == 1, "expected one Secret (conveyor-secrets)"
    encoded: dict[str, str] = secrets[0].get("data", {})
    return {key: base64.b64decode(value).decode() for key, value in encoded.items()}


def pod_spec(workload: Manifest) -> Manifest:
    spec: Manifest = workload["spec"]["template"]["spec"]
    return spec


def all_containers(workload: Manifest) -> list[Manifest]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def main_container(workload: Manifest) -> Manifest:
    containers: list[Manifest] = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: one container per pod expected"
    return containers[0]


def container_env(manifests: list[Manifest], container: Manifest) -> dict[str, str]:
    """The CONVEYOR_* environment a container starts with: the ConfigMap, the Secret, then its own env."""
    env = {**config_map(manifests), **secret_data(manifests)}
    env.update({item["name"]: item["value"] for item in container.get("env", []) if "value" in item})
    return env


def workers(manifests: list[Manifest]) -> list[Manifest]:
    found = [m for m in of_kind(manifests, "Deployment")
             if m["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    assert found, "no worker Deployment rendered"
    return found


def workloads(manifests: list[Manifest]) -> list[Manifest]:
    return of_kind(manifests, "Deployment") + of_kind(manifests, "Job")


def queue_of(scaled_object: Manifest) -> str:
    """The queue a ScaledObject scales on, read from its valueLocation `queues.<name>.load`."""
    location: str = trigger(scaled_object)["metadata"]["valueLocation"]
    match = re.fullmatch(rf"queues\.([a-z0-9_-]+)\.{SCALED_METRIC}", location)
    assert match, f"valueLocation {location!r} is not queues.<queue>.{SCALED_METRIC}"
    return match.group(1)


def trigger(scaled_object: Manifest) -> Manifest:
    triggers: list[Manifest] = scaled_object["spec"]["triggers"]
    assert len(triggers) == 1, "one metrics-api trigger per pool expected"
    return triggers[0]


def test_renders_every_part(manifests: list[Manifest]) -> None:
    kinds = {m["kind"] for m in manifests}
    assert kinds <= CORE_KINDS | KEDA_KINDS, f"unexpected kinds {kinds - CORE_KINDS - KEDA_KINDS}"
    assert {"Deployment", "Service", "Job", "ConfigMap", "Secret", "ServiceAccount",
            "PodDisruptionBudget", "ScaledObject", "TriggerAuthentication"} <= kinds


def schema_error(manifest: Manifest) -> str | None:
    """The first schema violation of one object, as one line (the schema itself would fill the screen)."""
    try:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(map(str, exc.path))
        return f"{manifest['kind']}/{manifest['metadata']['name']}: {exc.message} at {where}"
    return None


def test_core_objects_fit_the_kubernetes_schemas(manifests: list[Manifest]) -> None:
    errors = [schema_error(m) for m in manifests if m["kind"] in CORE_KINDS]
    assert [e for e in errors if e] == []


def test_every_queue_has_a_scaled_pool(manifests: list[Manifest]) -> None:
    scaled = {queue_of(so) for so in of_kind(manifests, "ScaledObject")}
    assert scaled == set(default_queues())


def test_scaled_objects_read_the_scaling_endpoint(manifests: list[Manifest]) -> None:
    assert SCALED_METRIC in QueueScaling.model_fields
    service = named(manifests, "Service", API_SERVICE)
    port = service["spec"]["ports"][0]["port"]
    for scaled_object in of_kind(manifests, "ScaledObject"):
        url = urlsplit(trigger(scaled_object)["metadata"]["url"])
        namespace = scaled_object["metadata"]["namespace"]
        assert trigger(scaled_object)["type"] == "metrics-api"
        assert url.hostname in (f"{API_SERVICE}.{namespace}.svc",
                                f"{API_SERVICE}.{namespace}.svc.cluster.local")
        assert (url.port, url.path) == (port, SCALING_PATH)


def test_targets_match_each_queues_max_running(manifests: list[Manifest]) -> None:
    config = config_map(manifests)
    for scaled_object in of_kind(manifests, "ScaledObject"):
        queue = queue_of(scaled_object)
        key = f"CONVEYOR_QUEUES__{queue.upper()}__MAX_RUNNING"
        assert key in config, f"{key} must be set in the ConfigMap, beside the ScaledObject's targetValue"
        assert float(trigger(scaled_object)["metadata"]["targetValue"]) == int(config[key])


def test_each_pool_consumes_the_queue_it_scales_on(manifests: list[Manifest]) -> None:
    for scaled_object in of_kind(manifests, "ScaledObject"):
        target = named(manifests, "Deployment", scaled_object["spec"]["scaleTargetRef"]["name"])
        env = container_env(manifests, main_container(target))
        assert env.get("CONVEYOR_WORKER_QUEUES") == queue_of(scaled_object)
        assert "replicas" not in target["spec"], "KEDA owns a pool's replica count"


def test_documents_scale_to_zero_and_interactive_stays_warm(manifests: list[Manifest]) -> None:
    scaled = of_kind(manifests, "ScaledObject")
    minimum = {queue_of(so): so["spec"].get("minReplicaCount", 0) for so in scaled}  # KEDA's default: 0
    assert minimum["documents"] == 0
    assert minimum["interactive"] >= 1


def test_trigger_authenticates_with_the_metrics_token(manifests: list[Manifest]) -> None:
    [secret] = of_kind(manifests, "Secret")
    for scaled_object in of_kind(manifests, "ScaledObject"):
        assert trigger(scaled_object)["metadata"]["authMode"] == "bearer"
        auth = named(manifests, "TriggerAuthentication", trigger(scaled_object)["authenticationRef"]["name"])
        [ref] = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "token"
        assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "CONVEYOR_METRICS_TOKEN")


def test_workers_hold_one_gpu_and_outlast_their_drain(manifests: list[Manifest]) -> None:
    for worker in workers(manifests):
        container = main_container(worker)
        resources = container["resources"]
        assert str(resources["limits"][GPU]) == "1"
        assert str(resources.get("requests", {}).get(GPU, "1")) == "1"
        explicit = container_env(manifests, container)
        assert "CONVEYOR_WORKER_SHUTDOWN_GRACE_S" in explicit, "set the drain explicitly, not by default"
        grace_s = float(explicit["CONVEYOR_WORKER_SHUTDOWN_GRACE_S"])
        assert pod_spec(worker)["terminationGracePeriodSeconds"] > grace_s


def test_api_binds_everywhere_with_auth_and_no_gpu(manifests: list[Manifest], monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    api = named(manifests, "Deployment", "conveyor-api")
    container = main_container(api)
    for name in [n for n in os.environ if n.startswith("CONVEYOR_")]:
        monkeypatch.delenv(name)  # the pod's environment only
    for name, value in container_env(manifests, container).items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.host == "0.0.0.0"
    settings.check_bind()  # refuses a non-loopback address without auth
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert [p["containerPort"] for p in container["ports"]] == [settings.port]
    assert not any(GPU in str(c.get("resources")) for c in all_containers(api))


def test_the_api_answers_the_names_keda_and_the_kubelet_send(manifests: list[Manifest],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The API answers only allowed_hosts (api/host_check.py): KEDA names the Service, a kubelet probe the
    pod's IP; bound to every address with auth on, the default answers any name (docs: how to list them)."""
    api = named(manifests, "Deployment", "conveyor-api")
    for name in [n for n in os.environ if n.startswith("CONVEYOR_")]:
        monkeypatch.delenv(name)
    for name, value in container_env(manifests, main_container(api)).items():
        monkeypatch.setenv(name, value)
    allowed = Settings().allowed_hosts or []
    keda = [urlsplit(trigger(so)["metadata"]["url"]).hostname for so in of_kind(manifests, "ScaledObject")]
    for name in [*keda, "10.42.7.19", "conveyor.example.com"]:
        assert host_allowed(str(name), allowed), name


def test_workers_serve_their_engine_metrics_where_the_annotations_say(
    manifests: list[Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker's settings turn its metrics port on, beyond loopback, and the pod's scrape annotations
    and container port name that port."""
    for worker in workers(manifests):
        container = main_container(worker)
        for name in [n for n in os.environ if n.startswith("CONVEYOR_")]:
            monkeypatch.delenv(name)  # the pod's environment only
        for name, value in container_env(manifests, container).items():
            monkeypatch.setenv(name, value)
        settings = Settings()
        port = settings.worker_metrics_port
        assert port is not None and settings.host == "0.0.0.0", worker["metadata"]["name"]
        annotations = worker["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == port
        assert annotations["prometheus.io/path"] == "/metrics"
        assert {"name": "metrics", "containerPort": port} in container["ports"]


def test_every_pod_migrates_before_it_starts(manifests: list[Manifest]) -> None:
    for deployment in of_kind(manifests, "Deployment"):
        init = pod_spec(deployment).get("initContainers", [])
        assert [c.get("args") for c in init] == [["migrate"]], deployment["metadata"]["name"]
    assert main_container(named(manifests, "Job", "conveyor-migrate"))["args"] == ["migrate"]


def test_every_container_runs_as_non_root(manifests: list[Manifest]) -> None:
    for workload in workloads(manifests):
        pod = pod_spec(workload).get("securityContext", {})
        for container in all_containers(workload):
            context = {**pod, **container.get("securityContext", {})}
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser", 0) != 0, where
            assert context.get("allowPrivilegeEscalation") is False, where
        assert pod_spec(workload).get("automountServiceAccountToken") is False


def test_service_account_mounts_no_token(manifests: list[Manifest]) -> None:
    for account in of_kind(manifests, "ServiceAccount"):
        assert account.get("automountServiceAccountToken") is False


def test_no_secret_sits_in_the_config_map(manifests: list[Manifest]) -> None:
    secret_name = re.compile(r"TOKEN|SECRET|PASSWORD|_KEY|DATABASE_URL|BROKER_URL")
    password_in_url = re.compile(r"://[^/@\s]*:[^/@\s]+@")
    for key, value in config_map(manifests).items():
        assert not secret_name.search(key), f"{key} belongs in the Secret"
        assert not password_in_url.search(value), f"{key} holds a URL with a password"
    secret_keys = set(secret_data(manifests))
    assert {"CONVEYOR_DATABASE_URL", "CONVEYOR_BROKER_URL", "CONVEYOR_METRICS_TOKEN"} <= secret_keys


def test_the_api_has_a_disruption_budget(manifests: list[Manifest]) -> None:
    api_labels = named(manifests, "Deployment", "conveyor-api")["spec"]["template"]["metadata"]["labels"]
    budgets = [b["spec"]["selector"]["matchLabels"] for b in of_kind(manifests, "PodDisruptionBudget")]
    assert any(selector.items() <= api_labels.items() for selector in budgets)


# --- Dockerfile ---


def pod_settings(manifests: list[Manifest], workload: Manifest, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a workload's main container starts with (its environment only)."""
    for name in [n for n in os.environ if n.startswith("CONVEYOR_")]:
        monkeypatch.delenv(name)
    for name, value in container_env(manifests, main_container(workload)).items():
        monkeypatch.setenv(name, value)
    return Settings()


def test_the_two_model_overlay_fits_the_kubernetes_schemas(two_models: list[Manifest]) -> None:
    errors = [schema_error(m) for m in two_models if m["kind"] in CORE_KINDS]
    assert [e for e in errors if e] == []


def test_each_model_has_its_own_pool_scaled_from_zero_on_its_own_load(
    two_models: list[Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = pod_settings(two_models, named(two_models, "Deployment", "conveyor-api"), monkeypatch)
    assert registry.model_ids() == ["small", "large"] and not registry.model
    pools = {}
    for scaled_object in of_kind(two_models, "ScaledObject"):
        location = trigger(scaled_object)["metadata"]["valueLocation"]
        match = re.fullmatch(rf"models\.([a-z0-9_-]+)\.{SCALED_METRIC}", location)
        assert match, f"{location!r} is not models.<id>.{SCALED_METRIC}"
        target = named(two_models, "Deployment", scaled_object["spec"]["scaleTargetRef"]["name"])
        worker = pod_settings(two_models, target, monkeypatch)
        assert worker.worker_model_id() == match.group(1), "a pool serves the model it scales on"
        assert worker.worker_queues is None, "it serves every queue of its model"
        assert scaled_object["spec"]["minReplicaCount"] == 0, "each model scales to zero on its own"
        served = worker.for_model(worker.worker_model_id())
        assert float(trigger(scaled_object)["metadata"]["targetValue"]) == sum(
            q.max_running for q in served.queues.values())
        pools[match.group(1)] = target["spec"]["selector"]["matchLabels"]
    assert set(pools) == set(registry.model_ids())
    assert pools["small"] != pools["large"], "each pool selects its own model's pods only"
    assert all(w["metadata"]["labels"]["conveyor/pool"] == "model" for w in workers(two_models))


def dockerfile_stages() -> dict[str, tuple[str | None, list[str]]]:
    """stage name -> (the stage it builds FROM, its instruction lines without comments)."""
    stages: dict[str, tuple[str | None, list[str]]] = {}
    current: list[str] = []
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        match = re.fullmatch(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, flags=re.IGNORECASE)
        if match:
            current = []
            stages[match.group(2)] = (match.group(1), current)
        elif line and not line.startswith("#"):
            current.append(line)
    return stages


def stage_lineage(stages: dict[str, tuple[str | None, list[str]]], name: str) -> list[str]:
    """The lines of a stage and of every stage it builds on or copies from."""
    parent, lines = stages[name]
    copied = [m.group(1) for line in lines for m in [re.search(r"--from=(\S+)", line)] if m]
    inherited = [line for dep in [parent, *copied] if dep in stages for line in stage_lineage(stages, dep)]
    return inherited + lines


def test_dockerfile_has_api_and_worker_targets() -> None:
    stages = dockerfile_stages()
    assert {"api", "worker"} <= set(stages)
    for target in ("api", "worker"):
        assert any(re.fullmatch(r"USER\s+10001(:10001)?", line) for line in stages[target][1]), target


def test_api_image_installs_no_torch() -> None:
    lineage = stage_lineage(dockerfile_stages(), "api")
    assert not [line for line in lineage if re.search(r"torch|\[engine|cuda|nvidia", line, re.IGNORECASE)]
    assert any(re.search(r"pip install (-e )?\.$", line) for line in lineage)
    # `pip install .` brings the base dependencies: none of them may be torch or Triton.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [dep for dep in project["dependencies"] if re.match(r"(torch|triton)\b", dep)]


def test_worker_image_installs_torch_and_the_engine_extra() -> None:
    lineage = stage_lineage(dockerfile_stages(), "worker")
    assert any("pip install --index-url" in line and "TORCH" in line for line in lineage)
    assert any(re.search(r"pip install (-e )?'\.\[engine[],]", line) for line in lineage)


def test_worker_image_builds_the_cpu_kernels_outside_the_data_volume() -> None:
    # A pod (read-only root filesystem, maybe an empty /data volume) loads what the image build compiled.
    lines = stage_lineage(dockerfile_stages(), "worker")
    env = " ".join(line for line in lines if line.startswith(("ENV", "TORCH_EXTENSIONS_DIR")))
    folder = re.search(r"TORCH_EXTENSIONS_DIR=(\S+)", env)
    assert folder and not folder.group(1).startswith("/data"), env
    build = next(i for i, line in enumerate(lines) if "python -m conveyor.kernels.prebuild" in line)
    assert "AVX2" in lines[build] and "AVX512" in lines[build]
    install = max(i for i, line in enumerate(lines) if re.search(r"pip install (-e )?'\.\[engine", line))
    user = next(i for i, line in enumerate(lines) if line.startswith("USER"))
    assert install < build < user
