"""The Grafana dashboards: generated, wired to the provisioned datasource, one model at a time,
exposed metric names only, guarded ratios, and valid PromQL (per promtool)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.deploy.conftest import readme_section, run_promtool
from tests.deploy.dashboards import (
    DASHBOARD_DIR,
    DEFAULT_MODEL_NAME,
    MODEL_VARIABLE,
    dashboard_expressions,
    dashboard_generator,
    dashboard_targets,
    data_panels,
    load_dashboards,
    provisioned_datasource_uid,
    substitute_model,
)

MODEL_SELECTOR = f'model_name="{MODEL_VARIABLE}"'
# What prometheus_client exposes for the metric schema: counters gain `_total`, histograms
# `_bucket` / `_sum` / `_count` (`iteration_tokens_total` is a histogram despite its name).
COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
            "spec_decode_num_emitted_tokens", "num_preemptions", "prefix_cache_queries",
            "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
            "http_requests"]
GAUGES = ["spec_decode_current_k", "num_requests_running", "num_requests_waiting",
          "kv_cache_usage_perc"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "engine_step_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "iteration_tokens_total"]
SERVER_HISTOGRAMS = ["event_loop_lag_seconds"]  # server/loop_lag.py's
EXPOSED_NAMES = ({f"{name}_total" for name in COUNTERS} | set(GAUGES)
                 | {f"{name}{suffix}" for name in HISTOGRAMS + SERVER_HISTOGRAMS
                    for suffix in ("_bucket", "_sum", "_count")})
# The server's own, not the engine's: no model_name label.
SERVER_METRICS = {"http_requests_total"} | {f"{name}{suffix}" for name in SERVER_HISTOGRAMS
                                            for suffix in ("_bucket", "_sum", "_count")}
METRIC = re.compile(r"\b(specserve|vllm):([a-zA-Z_][a-zA-Z0-9_]*)")
VECTOR_MATCHING = re.compile(
    r"\s*(?:(?:ignoring|on)\s*\([^)]*\)\s*)?(?:group_(?:left|right)\s*(?:\([^)]*\))?\s*)?")


def balanced_group(text: str) -> str | None:
    """The parenthesised group `text` starts with, without its outer parentheses."""
    if not text.startswith("("):
        return None
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[1:index]
    return None


def denominators(expr: str) -> list[str | None]:
    """What each `/` divides by, when it is a parenthesised group (None when it is not)."""
    found = []
    for slash in re.finditer("/", expr):
        rest = expr[slash.end():]
        rest = rest[VECTOR_MATCHING.match(rest).end():]
        found.append(balanced_group(rest))
    return found


def test_dashboard_folder_holds_exactly_the_generated_set():
    generator = dashboard_generator()
    expected = {f"specserve-{name}.json": generator.render(build("specserve"))
                for name, build in (("overview", generator.overview),
                                    ("speculative", generator.speculative))}
    assert sorted(path.name for path in DASHBOARD_DIR.iterdir()) == sorted(expected)
    for name, text in expected.items():
        assert (DASHBOARD_DIR / name).read_text() == text, (
            f"{name} is stale: run `python deploy/grafana/generate_dashboards.py`")


def all_datasource_refs(node) -> list:
    if isinstance(node, dict):
        refs = [node["datasource"]] if "datasource" in node else []
        return refs + [ref for value in node.values() for ref in all_datasource_refs(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in all_datasource_refs(item)]
    return []


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_dashboard_uses_the_provisioned_datasource_and_model_variable(name):
    dashboard = load_dashboards()[name]
    uid = provisioned_datasource_uid()
    refs = all_datasource_refs(dashboard)
    assert refs and all(ref == {"type": "prometheus", "uid": uid} for ref in refs), refs
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    assert variable["type"] == "query" and not variable["multi"] and not variable["includeAll"]
    assert variable["query"]["query"] == "label_values(specserve:num_requests_running, model_name)"
    assert dashboard["uid"] == name.removesuffix(".json")
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])


def test_every_panel_has_targets_that_select_one_model():
    for dashboard in load_dashboards().values():
        for panel in data_panels(dashboard):
            assert panel.get("targets"), f"{dashboard['uid']}: {panel['title']!r} has no targets"
            for target in panel["targets"]:
                expr = target.get("expr", "")
                metrics = METRIC.findall(expr)
                assert metrics, f"{panel['title']!r}: no metric in {expr!r}"
                # Every selector, numerator and denominator alike, is filtered by the variable.
                for match in METRIC.finditer(expr):
                    if match.group(2) in SERVER_METRICS:
                        continue
                    assert expr[match.end():].startswith("{" + MODEL_SELECTOR), (
                        f"{panel['title']!r}: {match.group(0)} without {MODEL_SELECTOR}: {expr}")


def test_expressions_name_exposed_metrics_and_no_other_variables():
    for target in dashboard_targets():
        for prefix, name in METRIC.findall(target.expr):
            assert prefix == "specserve", target
            assert name in EXPOSED_NAMES, f"{target.panel!r}: {name} is not exposed"
        assert "$" not in substitute_model(target.expr, "m"), (
            f"{target.panel!r}: a Grafana variable other than $model_name: {target.expr}")


def test_every_ratio_guards_its_denominator():
    for target in dashboard_targets():
        for denominator in denominators(target.expr):
            assert denominator is not None and re.search(r"\s>\s*0$", denominator), (
                f"{target.panel!r}: a denominator without `> 0`: {target.expr}")


def test_denominator_scanner_catches_unguarded_ratios():
    assert denominators("a / (b > 0)") == ["b > 0"]
    assert denominators("a / ignoring(position) group_left() (sum(b) > 0)") == ["sum(b) > 0"]
    assert denominators("sum(a) / sum(b)") == [None]


def test_readme_promql_is_the_dashboards_and_describes_every_panel():
    section = readme_section("Monitoring")
    blocks = re.findall(r"```promql\n(.*?)```", section, re.S)
    readme_exprs = [line for block in blocks for line in block.splitlines()
                    if line.strip() and not line.startswith("#")]
    assert len(readme_exprs) >= 2
    by_panel = {t.panel: t.expr for t in dashboard_targets()}
    assert by_panel["Acceptance rate"] in readme_exprs
    assert by_panel["Mean acceptance length"] in readme_exprs
    assert set(readme_exprs) <= {t.expr for t in dashboard_targets()}
    words = " ".join(section.split())  # a panel title may wrap across lines
    for target in dashboard_targets():
        assert f"**{target.panel}**" in words, f"README Monitoring misses panel {target.panel!r}"


def test_speculative_dashboard_shows_what_the_issue_asks_for():
    exprs = "\n".join(t.expr for t in dashboard_targets() if t.dashboard == "specserve-speculative")
    for name in ("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_per_pos_total",
                 "spec_decode_current_k", "generation_tokens_total"):
        assert f"specserve:{name}" in exprs


def test_expressions_substitute_the_model_name():
    expressions = dashboard_expressions('we"ird\\name')
    assert expressions and len(expressions) == len(set(expressions))
    assert all(MODEL_VARIABLE not in expr for expr in expressions)
    assert any('model_name="we\\"ird\\\\name"' in expr for expr in expressions)


def test_schema_metrics_are_the_ones_the_engine_exposes():
    from prometheus_client import CollectorRegistry

    from engine.metrics.prometheus import PrometheusMetrics

    registry = CollectorRegistry()
    PrometheusMetrics("m", registry, prefix="specserve")
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exposed = {family.name.removeprefix("specserve:") + suffix
               for family in registry.collect() for suffix in suffixes.get(family.type, ())}
    assert EXPOSED_NAMES - SERVER_METRICS <= exposed, sorted(EXPOSED_NAMES - exposed)


def test_default_model_name_is_the_engines():
    from engine.models.loader import DEFAULT_MODEL_NAME as engine_default

    assert DEFAULT_MODEL_NAME == engine_default


def test_vllm_set_differs_only_in_prefix_and_uids(tmp_path):
    generator = dashboard_generator()
    written = generator.write_all("vllm", tmp_path)
    assert sorted(p.name for p in written) == ["vllm-overview.json", "vllm-speculative.json"]
    for path in written:
        vllm_text = path.read_text()
        assert "specserve:" not in vllm_text
        specserve_text = (DASHBOARD_DIR / path.name.replace("vllm-", "specserve-")).read_text()
        assert vllm_text == (specserve_text.replace("specserve:", "vllm:")
                             .replace('"specserve-overview"', '"vllm-overview"')
                             .replace('"specserve-speculative"', '"vllm-speculative"')
                             .replace('"specserve / ', '"vllm / '))


def test_every_expression_is_valid_promql(promtool, tmp_path):
    generator = dashboard_generator()
    generator.write_all("vllm", tmp_path / "vllm")
    exprs = dashboard_expressions()
    exprs += [substitute_model(t["expr"], DEFAULT_MODEL_NAME)
              for path in sorted((tmp_path / "vllm").glob("*.json"))
              for panel in data_panels(json.loads(path.read_text()))
              for t in panel["targets"]]
    variable_queries = [v["query"]["query"] for d in load_dashboards().values()
                        for v in d["templating"]["list"]]
    metric_names = {m.group(1) for q in variable_queries
                    for m in [re.match(r"label_values\((\S+), model_name\)$", q)] if m}
    exprs += sorted(metric_names)  # the variable's metric must itself be a valid selector
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:expression_{index}", "expr": expr}
        for index, expr in enumerate(exprs)]}]}
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules, width=10_000))
    result = run_promtool(promtool, "check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout
