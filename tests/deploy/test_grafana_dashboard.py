"""deploy/grafana/flotilla-dashboard.json: a Grafana dashboard in Grafana's JSON model whose
every PromQL expression names only ``flotilla:`` series that ``GET /metrics`` really
exposes. The oracle for the names is a live exposition: the ingress app's ``/metrics``
(its own HTTP metrics merged with an engine replica's :class:`EngineMetrics`, elastic EP
series included), read back with prometheus_client's parser. (Prometheus itself parsed every expression
once, with ``promtool check rules``, when the dashboard was written; CI has no Prometheus.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from flotilla.serve.ingress import create_app
from flotilla.serve.metrics import EngineMetrics
from flotilla.serve.types import ServeOptions

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "flotilla-dashboard.json"
GRID_COLUMNS = 24
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}
# A metric name in PromQL: the flotilla: prefix, then name characters.
FLOTILLA_NAME = re.compile(r"flotilla:[A-Za-z0-9_:]+")


class _Engine:
    """An engine client that is healthy and whose metrics are one replica's, every family present."""

    def __init__(self, text: str):
        self.text = text

    async def is_healthy(self) -> bool:
        return True

    async def metrics_text(self) -> str:
        return self.text


def _engine_exposition() -> str:
    """An engine replica's exposition with a sample in every family (labelled series that
    exist only once used: a finished reason, a DP rank's count)."""
    metrics = EngineMetrics("replica-0", "decode")
    metrics.record_finished("stop")
    metrics.enable_elastic_ep(lambda: 2)
    metrics.enable_dp_rank_requests(lambda: [3, 1])
    return metrics.exposition()


@pytest.fixture(scope="module")
def exposed() -> dict[str, set[str]]:
    """What ``GET /metrics`` serves: {family name: its sample names}, flotilla: ones only."""
    app = create_app(_Engine(_engine_exposition()), None, ServeOptions(), SimpleNamespace(page_size=None), echo_request_id=False)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200  # NOTE: gives the HTTP metrics a sample
        response = client.get("/metrics")
    assert response.status_code == 200
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.text):
        if family.name.startswith("flotilla:"):
            out[family.name] = {s.name for s in family.samples}
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those nested in collapsed rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every query: panel targets, variable queries, annotations."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['id']} ({panel['title']}) {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", query))
    for note in dashboard["annotations"]["list"]:
        if "expr" in note:
            out.append((f"annotation {note['name']}", note["expr"]))
    return out


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable(dashboard):
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("time", dict)):
        assert isinstance(dashboard.get(key), kind), f"dashboard.{key} must be a {kind.__name__}"
    assert 0 < len(dashboard["uid"]) <= 40  # NOTE: Grafana's limit on a uid
    assert "id" not in dashboard or dashboard["id"] is None  # NOTE: an id would clash on import
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, var["name"]


def test_panel_ids_are_unique_and_every_panel_fits_the_grid_without_overlap(dashboard):
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    cells: dict[tuple[int, int], int] = {}
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, f"panel {panel['id']}: type {panel['type']!r}"
        assert panel.get("title"), f"panel {panel['id']} has no title"
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("h", "w", "x", "y")), panel["id"]
        assert pos["h"] > 0 and pos["w"] > 0 and pos["x"] >= 0 and pos["y"] >= 0, panel["id"]
        assert pos["x"] + pos["w"] <= GRID_COLUMNS, f"panel {panel['id']} is wider than the grid"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {panel['id']} overlap at {(x, y)}"
                cells[(x, y)] = panel["id"]


def test_every_query_panel_uses_the_datasource_variable_and_unique_ref_ids(dashboard):
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            assert not panel.get("targets"), f"row {panel['id']} has queries"
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["id"]
        targets = panel["targets"]
        assert targets, f"panel {panel['id']} ({panel['title']}) has no query"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"panel {panel['id']}: refIds {ref_ids}"
        for target in targets:
            assert target["datasource"] == panel["datasource"], (panel["id"], target["refId"])
            assert target["expr"].strip(), (panel["id"], target["refId"])


def test_every_flotilla_name_in_a_query_is_a_series_that_metrics_exposes(dashboard, exposed):
    samples = set().union(*exposed.values())
    found = 0
    for where, expr in expressions(dashboard):
        names = FLOTILLA_NAME.findall(expr)
        assert names, f"{where}: no flotilla: metric in {expr!r}"
        for name in names:
            found += 1
            assert name in samples, (
                f"{where}: {name} is not exposed by GET /metrics; exposed: {sorted(samples)}"
            )
    assert found >= len(exposed)


def test_every_exposed_flotilla_family_has_a_panel(dashboard, exposed):
    used = {name for _, expr in expressions(dashboard) for name in FLOTILLA_NAME.findall(expr)}
    # NOTE: the text format carries a counter's or histogram's creation time as a gauge of its
    # own (``..._created``); nobody charts it.
    families = {family: names for family, names in exposed.items() if not family.endswith("_created")}
    missing = sorted(family for family, names in families.items() if not names & used)
    assert not missing, f"metrics families without a panel in {DASHBOARD.name}: {missing}"


def test_histogram_quantiles_read_buckets_summed_by_le(dashboard):
    quantile = re.compile(r"histogram_quantile\(\s*[0-9.]+\s*,\s*sum by \(([^)]*)\)\s*\(rate\((flotilla:[A-Za-z0-9_:]+)")
    seen = 0
    for where, expr in expressions(dashboard):
        matches = quantile.findall(expr)
        assert len(matches) == expr.count("histogram_quantile"), f"{where}: an unexpected quantile shape: {expr!r}"
        for group, name in matches:
            seen += 1
            assert "le" in [g.strip() for g in group.split(",")], f"{where}: sum by ({group}) drops le"
            assert name.endswith("_bucket"), f"{where}: histogram_quantile over {name}"
    assert seen >= 4  # NOTE: TTFT, ITL, e2e and queue time at least
