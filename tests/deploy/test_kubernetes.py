"""The Kubernetes manifests in deploy/kubernetes/, offline: core objects validate strictly against
the Kubernetes schemas that `kubernetes-validate` ships (one old and the newest release it knows);
custom resources (ServiceMonitor, ScaledObject, InferencePool, HTTPRoute), which it has no schema
for, are skipped there explicitly and checked here field by field, for the fields we rely on. The
objects must also agree with each other and with specserve's own flags."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
import yaml

from server.cli import build_parser
from server.lifecycle import ABORT_GRACE_S
from tests.deploy.conftest import ROOT, readme_section, run_promtool

KUBE = ROOT / "deploy" / "kubernetes"
OLDEST_KUBERNETES = "1.29.0"
CUSTOM_KINDS = {"ServiceMonitor", "ScaledObject", "InferencePool", "HTTPRoute"}
NOT_OBJECTS = {"prometheus.yml", "prometheus-adapter-values.yaml", "epp-values.yaml",
               "kustomization.yaml"}  # Prometheus config, Helm values, kustomize's own file


def manifests() -> dict[str, list[dict]]:
    """Objects of every manifest file, by path relative to deploy/kubernetes."""
    return {str(path.relative_to(KUBE)): list(yaml.safe_load_all(path.read_text()))
            for path in sorted(KUBE.rglob("*.y*ml")) if path.name not in NOT_OBJECTS}


def one(kind: str, file: str) -> dict:
    (obj,) = [o for o in manifests()[file] if o["kind"] == kind]
    return obj


def values(file: str) -> dict:
    return yaml.safe_load((KUBE / file).read_text())


def container(deployment: dict) -> dict:
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    return main


def serve_args(deployment: dict):
    """The container's flags as `specserve serve` parses them (the image's entrypoint first)."""
    return build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "8000",
                                      *container(deployment)["args"]])


CORE = [(file, obj) for file, objs in manifests().items() for obj in objs
        if obj["kind"] not in CUSTOM_KINDS]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("file,obj", CORE, ids=[f"{f}:{o['kind']}" for f, o in CORE])
def test_core_objects_validate_strictly(file, obj, version):
    kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_what_it_should():
    """Strict mode catches a misspelled field: the test above is not vacuous."""
    broken = one("Deployment", "deployment.yaml")
    container(broken)["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, OLDEST_KUBERNETES, strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(one("ServiceMonitor", "servicemonitor.yaml"),
                                     OLDEST_KUBERNETES, strict=True)


def test_every_file_is_known_and_kustomize_applies_the_core():
    kinds = {obj["kind"] for objs in manifests().values() for obj in objs}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                     *CUSTOM_KINDS}
    kustomization = values("kustomization.yaml")
    assert kustomization["resources"] == ["deployment.yaml", "service.yaml", "pdb.yaml"]


@pytest.mark.parametrize("file", ["deployment.yaml", "deployment-gpu.yaml",
                                  "deployment-multi-gpu.yaml"])
def test_probes_drain_and_flags(file):
    deployment = one("Deployment", file)
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    (port,) = main["ports"]
    assert (port["name"], port["containerPort"]) == ("http", 8000)
    probes = {name: main[name]["httpGet"] for name in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {name: probe["path"] for name, probe in probes.items()} == {
        "startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    assert all(probe["port"] == "http" for probe in probes.values())
    args = serve_args(deployment)
    assert args.metrics_prefix == "vllm"  # the endpoint picker and the HPA read vLLM's names
    # The kubelet waits for preStop, then the drain; the pod must not be killed in between.
    pre_stop = main["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = int(pre_stop[1]) + args.drain_timeout + 2 * ABORT_GRACE_S
    assert pod["terminationGracePeriodSeconds"] > needed
    # A wedged step fails liveness only after --engine-step-timeout; the startup probe covers
    # loading, so liveness need not allow for it.
    assert main["startupProbe"]["periodSeconds"] * main["startupProbe"]["failureThreshold"] >= 240
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_gpu_variant_differs_only_where_it_must():
    cpu, gpu = one("Deployment", "deployment.yaml"), one("Deployment", "deployment-gpu.yaml")
    assert gpu["spec"]["template"]["spec"].pop("tolerations")[0]["key"] == "nvidia.com/gpu"
    cpu_main, gpu_main = container(cpu), container(gpu)
    assert gpu_main["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_main["image"].endswith(":cuda") and cpu_main["image"].endswith(":cpu")
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    for main in (cpu_main, gpu_main):
        for key in ("image", "args", "resources", "env"):
            main.pop(key, None)
    assert cpu == gpu
    assert serve_args(one("Deployment", "deployment-gpu.yaml")).kv_cache_memory is None


def test_memory_limit_covers_the_measured_peak():
    """The CPU pod's limit holds the largest RSS the soak benchmark saw, with 25% to spare,
    and the KV cache it was sized for."""
    deployment = one("Deployment", "deployment.yaml")
    limit = _bytes(container(deployment)["resources"]["limits"]["memory"])
    (soak,) = sorted((ROOT / "benchmarks" / "results").glob("soak_cpu_*.json"))[-1:]
    result = json.loads(soak.read_text())["runs"][0]["results"][0]["server_state"]
    samples = [result["before"], *result["during"], result["after_idle"]]
    peak = max(sample["rss_bytes"] for sample in samples)
    assert limit >= 1.25 * peak, (limit, peak)
    assert limit >= serve_args(deployment).kv_cache_memory * 2**30 + 460e6


def _bytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) * {"Mi": 2**20, "Gi": 2**30}[unit]


def test_service_pdb_and_servicemonitor_select_the_pods():
    pod_labels = one("Deployment", "deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    service = one("Service", "service.yaml")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("http", 8000, "http")
    pdb = one("PodDisruptionBudget", "pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    monitor = one("ServiceMonitor", "servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


def test_hpa_metric_is_what_the_adapter_serves():
    hpa = one("HorizontalPodAutoscaler", "hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "specserve"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    (rule,) = values("prometheus-adapter-values.yaml")["rules"]["custom"]
    series = rule["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting"
    served_as = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"),
                       series)
    assert metric["pods"]["metric"]["name"] == served_as == "vllm_num_requests_waiting"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert hpa["spec"]["minReplicas"] >= 2  # the PDB's maxUnavailable 1 leaves one serving


def test_keda_alternative_matches_the_hpa():
    hpa = one("HorizontalPodAutoscaler", "hpa.yaml")
    scaled = one("ScaledObject", "keda-scaledobject.yaml")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == hpa["spec"]["scaleTargetRef"]["name"]
    assert scaled["spec"]["minReplicaCount"] == hpa["spec"]["minReplicas"]
    assert scaled["spec"]["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["threshold"] == hpa["spec"]["metrics"][0]["pods"]["target"][
        "averageValue"]
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]


def test_inference_pool_route_and_picker_values_point_at_the_pods():
    pod_labels = one("Deployment", "deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    pool = one("InferencePool", "inference-gateway/inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"]
    route = one("HTTPRoute", "inference-gateway/httproute.yaml")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": pool["metadata"]["name"]}
    picker = values("inference-gateway/epp-values.yaml")["inferencePool"]
    assert picker["modelServerType"] == "vllm" and picker["targetPortNumber"] == 8000
    assert picker["modelServers"]["matchLabels"] == pool["spec"]["selector"]["matchLabels"]


def in_cluster_prometheus_config(targets: list[dict]) -> dict:
    """deploy/kubernetes/prometheus.yml with its pod discovery replaced by `targets` (static
    configs whose `__meta_kubernetes_*` labels stand in for what discovery would attach): Debian's
    Prometheus is built without Kubernetes discovery, and no cluster is here anyway."""
    config = values("prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["static_configs"] = targets
    return config


def test_in_cluster_prometheus_config_is_valid(promtool, tmp_path):
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(in_cluster_prometheus_config([{"targets": ["pod:8000"]}])))
    result = run_promtool(promtool, "check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_gpu_variant_asks_for_as_many_gpus_as_ranks():
    """One pod, N GPUs, --tensor-parallel-size N (issue 73), NCCL's shared memory mounted;
    otherwise the GPU variant."""
    single, multi = one("Deployment", "deployment-gpu.yaml"), \
        one("Deployment", "deployment-multi-gpu.yaml")
    main = container(multi)
    gpus = main["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == main["resources"]["requests"]["nvidia.com/gpu"] > 1
    assert serve_args(multi).tensor_parallel_size == gpus
    assert serve_args(single).tensor_parallel_size == 1
    (mount,) = main.pop("volumeMounts")
    (volume,) = multi["spec"]["template"]["spec"].pop("volumes")
    assert mount == {"name": volume["name"], "mountPath": "/dev/shm"}
    assert volume["emptyDir"]["medium"] == "Memory"
    multi_args = [a for a in main.pop("args") if not a.startswith("--tensor-parallel-size")]
    assert multi_args == container(single).pop("args")
    for deployment in (single, multi):
        container(deployment).pop("resources")
        deployment["spec"].pop("replicas")
    assert single == multi


def test_readme_walks_through_every_file():
    section = readme_section("Deploying on Kubernetes")
    files = [str(p.relative_to(KUBE)) for p in sorted(KUBE.rglob("*.y*ml"))]
    missing = [file for file in files if file.rsplit("/", 1)[-1] not in section]
    assert not missing, f"README's Kubernetes section does not mention {missing}"
    for flag in ("--drain-timeout", "--max-queue", "--max-request-bytes", "/ready", "/health"):
        assert flag in section, flag
