"""The suffix proposer's global cache as Prometheus series, read at scrape time: its size (requests,
trie nodes, estimated bytes, tenant partitions) and the requests it evicted."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GAUGES = (
    ("num_requests", "suffix_cache_requests", "Finished requests held by the suffix cache"),
    ("num_nodes", "suffix_cache_nodes", "Nodes of the suffix cache's tries"),
    ("num_bytes", "suffix_cache_bytes", "Estimated bytes of the suffix cache"),
    ("num_partitions", "suffix_cache_partitions", "Tenant partitions of the suffix cache"),
)


class SuffixCacheCollector(Collector):
    def __init__(self, model_name: str, prefix: str, read_stats: Callable[[], object]):
        """`read_stats()` -> a SuffixCacheStats (engine/spec_decode/suffix_cache.py); each of
        its fields is one read of a counter the engine thread keeps, safe under the GIL."""
        self.model_name, self.prefix, self.read_stats = model_name, prefix, read_stats

    def collect(self):
        stats = self.read_stats()
        for field, name, documentation in GAUGES:
            gauge = GaugeMetricFamily(f"{self.prefix}:{name}", documentation,
                                      labels=["model_name"])
            gauge.add_metric([self.model_name], getattr(stats, field))
            yield gauge
        evictions = CounterMetricFamily(f"{self.prefix}:suffix_cache_evictions",
                                        "Requests evicted from the suffix cache (oldest first)",
                                        labels=["model_name"])
        evictions.add_metric([self.model_name], stats.num_evictions)
        yield evictions
