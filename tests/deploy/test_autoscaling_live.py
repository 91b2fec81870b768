"""The autoscaling queries, evaluated by a real Prometheus scraping a live server (a tiny model,
`--metrics-prefix vllm`) through deploy/kubernetes/prometheus.yml's own relabeling, fed the labels
Kubernetes pod discovery would attach: prometheus-adapter's rule, rendered as the adapter renders
it for one pod, and KEDA's query. While requests queue they report them; before, they report 0 for
the pod (a series, not nothing). Skipped where Prometheus is not installed."""

from __future__ import annotations

import threading

import httpx
import pytest
import yaml

from tests.deploy.test_kubernetes import KUBE, in_cluster_prometheus_config, one, values
from tests.servers import prometheus_query, running_prometheus, running_server, wait_until

POD = "specserve-7d9f-abcde"
NAMESPACE = "default"
CLIENTS = 16


@pytest.fixture(scope="module")
def queued_server(tiny_chat_model_folder):
    args = ["--model", str(tiny_chat_model_folder), "--served-model-name", "tiny",
            "--metrics-prefix", "vllm",
            "--max-num-seqs", "1", "--speculative-method", "none", "--drain-timeout", "1"]
    with running_server(args, "tiny", metrics_prefix="vllm") as server:
        yield server


@pytest.fixture
def prometheus(queued_server, tmp_path):
    target = queued_server.base_url.removeprefix("http://")
    discovered = {"__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": POD,
                  "__meta_kubernetes_pod_label_app": "specserve",
                  "__meta_kubernetes_pod_container_port_name": "http"}
    config = in_cluster_prometheus_config([{"targets": [target], "labels": discovered}])
    config["global"]["scrape_interval"] = "1s"
    with running_prometheus(yaml.safe_dump(config), tmp_path,
                            "autoscaling queries not evaluated") as url:
        yield url


def adapter_query() -> str:
    """prometheus-adapter's metricsQuery for `GET .../namespaces/default/pods/*/<metric>`."""
    (rule,) = values("prometheus-adapter-values.yaml")["rules"]["custom"]
    series = rule["seriesQuery"].split("{")[0]
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
            .replace("<<.GroupBy>>", "pod"))


def keda_query() -> str:
    (trigger,) = one("ScaledObject", "keda-scaledobject.yaml")["spec"]["triggers"]
    return trigger["metadata"]["query"]


def _stream(base_url: str, stop: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "Tell me a long story.", "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():
            if stop.is_set():
                return


def _only_value(prometheus: str, query: str) -> float:
    (series,) = prometheus_query(prometheus, query)
    return float(series["value"][1])


def test_hpa_and_keda_queries_see_the_waiting_requests(queued_server, prometheus):
    assert (KUBE / "hpa.yaml").is_file()
    wait_until(lambda: prometheus_query(prometheus, adapter_query()), 30,
               "a series from the adapter's query", every=0.5)
    (idle,) = prometheus_query(prometheus, adapter_query())
    assert idle["metric"] == {"pod": POD} and float(idle["value"][1]) == 0.0
    (idle,) = prometheus_query(prometheus, keda_query())
    assert float(idle["value"][1]) == 0.0

    stop = threading.Event()
    # One runs (--max-num-seqs 1), the rest wait, each for the whole of the ones before it:
    # seconds of queue, several scrapes.
    clients = [threading.Thread(target=_stream, args=(queued_server.base_url, stop))
               for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    try:
        wait_until(lambda: all(_only_value(prometheus, query) > 0
                               for query in (adapter_query(), keda_query())),
                   30, "the adapter's and KEDA's queries to see waiting requests", every=0.5)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=60)
    queued_server.wait_until_idle(timeout=30)
