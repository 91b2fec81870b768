"""The provisioned Grafana dashboards as data, for tests: their panels, targets and PromQL.

`dashboard_expressions(model_name)` gives every expression of every dashboard, ready to send to
Prometheus' HTTP API (`/api/v1/query`): the only Grafana variable the dashboards use, `$model_name`,
is replaced by a PromQL-quoted model name.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD_DIR = GRAFANA_DIR / "dashboards"
DATASOURCE_FILE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
PROVIDER_FILE = GRAFANA_DIR / "provisioning" / "dashboards" / "dashboards.yml"
MODEL_VARIABLE = "$model_name"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # engine.models.loader.DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class DashboardTarget:
    dashboard: str  # the dashboard's uid
    panel: str  # the panel's title
    legend: str
    expr: str  # as written in the JSON, with $model_name


def load_dashboards() -> dict[str, dict]:
    """File name -> parsed dashboard, for every JSON file in deploy/grafana/dashboards."""
    paths = sorted(DASHBOARD_DIR.glob("*.json"))
    return {path.name: json.loads(path.read_text()) for path in paths}


def data_panels(dashboard: dict) -> list[dict]:
    """Every panel that queries data: rows are left out, panels inside collapsed rows included."""
    panels = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def dashboard_targets() -> list[DashboardTarget]:
    return [DashboardTarget(dashboard["uid"], panel["title"], target.get("legendFormat", ""),
                            target.get("expr", ""))
            for dashboard in load_dashboards().values()
            for panel in data_panels(dashboard)
            for target in panel.get("targets", [])]


def substitute_model(expr: str, model_name: str) -> str:
    """Replaces `$model_name` (always inside a double-quoted label value) by `model_name`."""
    quoted = model_name.replace("\\", "\\\\").replace('"', '\\"')
    return expr.replace(MODEL_VARIABLE, quoted)


def dashboard_expressions(model_name: str = DEFAULT_MODEL_NAME) -> list[str]:
    """Every distinct PromQL expression of every dashboard, in dashboard order, for `model_name`."""
    expressions = [substitute_model(target.expr, model_name) for target in dashboard_targets()]
    return list(dict.fromkeys(expressions))


def provisioned_datasource_uid() -> str:
    import yaml

    (datasource,) = yaml.safe_load(DATASOURCE_FILE.read_text())["datasources"]
    return datasource["uid"]


def dashboard_generator():
    """The module that writes the dashboards (deploy/grafana/generate_dashboards.py)."""
    if str(GRAFANA_DIR) not in sys.path:
        sys.path.insert(0, str(GRAFANA_DIR))
    return importlib.import_module("generate_dashboards")
