"""Grafana dashboard JSON from a few plain values: PromQL helpers, panels, rows, a dashboard.

Every query selects one model through the dashboard variable `$model_name` and reads a rate over a
fixed one-minute window (twelve scrapes at the 5 s scrape interval), so an expression means the same
thing in Grafana and when evaluated directly against Prometheus. Every ratio's denominator is
filtered with `> 0`: an idle server shows no value instead of dividing by zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DATASOURCE = {"type": "prometheus", "uid": "specserve-prometheus"}
RATE_WINDOW = "1m"
MODEL_SELECTOR = 'model_name="$model_name"'
GRID_WIDTH = 24


@dataclass(frozen=True)
class PromQL:
    """Builds expressions over the metrics of one prefix (`specserve` or `vllm`)."""

    prefix: str

    def series(self, name: str, matchers: str = "") -> str:
        extra = f", {matchers}" if matchers else ""
        return f"{self.prefix}:{name}{{{MODEL_SELECTOR}{extra}}}"

    def rate(self, name: str, by: str = "") -> str:
        grouping = f" by ({by}) " if by else ""
        return f"sum{grouping}(rate({self.series(name)}[{RATE_WINDOW}]))"

    def server_rate(self, name: str, by: str) -> str:
        """For the server's own metrics (HTTP), which carry no model_name label."""
        return f"sum by ({by}) (rate({self.prefix}:{name}[{RATE_WINDOW}]))"

    def quantile(self, q: float, histogram: str) -> str:
        buckets = f"rate({self.series(histogram + '_bucket')}[{RATE_WINDOW}])"
        return f"histogram_quantile({q}, sum by (le) ({buckets}))"

    def mean(self, histogram: str) -> str:
        return ratio(self.rate(histogram + "_sum"), self.rate(histogram + "_count"))


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / ({denominator} > 0)"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    min: float | None = 0
    max: float | None = None
    decimals: int | None = None


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def latency_panel(q: PromQL, title: str, histogram: str, description: str) -> Panel:
    """p50 / p90 / p99 and the mean of a latency histogram, in seconds."""
    return Panel(title, description, (
        Target(q.quantile(0.5, histogram), "p50"),
        Target(q.quantile(0.9, histogram), "p90"),
        Target(q.quantile(0.99, histogram), "p99"),
        Target(q.mean(histogram), "mean"),
    ), unit="s")


def dashboard(uid: str, title: str, description: str, prefix: str, rows: list[Row]) -> dict:
    """The dashboard document: the `model_name` variable, then the rows laid out top to bottom."""
    variable_query = f"label_values({prefix}:num_requests_running, model_name)"
    panels: list[dict] = []
    next_id, y = 1, 0
    for row in rows:
        panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
        next_id, y, x, line_height = next_id + 1, y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            grid = {"h": panel.height, "w": panel.width, "x": x, "y": y}
            panels.append(panel_json(panel, next_id, grid))
            next_id, x, line_height = next_id + 1, x + panel.width, max(line_height, panel.height)
        y += line_height
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["specserve"],
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair lines up latency with load across panels
        "timezone": "browser",
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["specserve"], "title": "specserve dashboards",
                   "asDropdown": False, "includeVars": True, "keepTime": True}],
        "templating": {"list": [{
            "name": "model_name",
            "label": "model",
            "type": "query",
            "datasource": DATASOURCE,
            "definition": variable_query,
            "query": {"query": variable_query, "refId": "StandardVariableQuery"},
            "refresh": 2,  # on time range change: a newly served model appears without a reload
            "includeAll": False,
            "multi": False,
            "sort": 1,
            "current": {},
            "options": [],
        }]},
        "panels": panels,
    }


def panel_json(panel: Panel, panel_id: int, grid: dict) -> dict:
    defaults: dict = {"unit": panel.unit, "color": {"mode": "palette-classic"}}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.decimals is not None:
        defaults["decimals"] = panel.decimals
    if panel.kind == "stat":
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "blue", "value": None}]}
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto",
                   "justifyMode": "auto", "orientation": "auto"}
    else:
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": False}
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "none"}}
    targets = [{"datasource": DATASOURCE, "refId": chr(ord("A") + index), "expr": target.expr,
                "legendFormat": target.legend, "range": True}
               for index, target in enumerate(panel.targets)]
    return {"id": panel_id, "type": panel.kind, "title": panel.title,
            "description": panel.description, "datasource": DATASOURCE, "gridPos": grid,
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
            "targets": targets}
