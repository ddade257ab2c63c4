"""The Grafana dashboard: importable JSON whose queries use only metrics the services export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.unit.deploy.metric_names import exported_metric_names

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "llm-mesh.json"
METRIC_RE = re.compile(r"\bllmmesh_[a-z0-9_]+")
# Suffixes Prometheus adds to a histogram's or counter's series.
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queried_metric_names() -> set[str]:
    found: set[str] = set()
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in METRIC_RE.findall(target["expr"]):
                for suffix in SERIES_SUFFIXES:
                    if name.endswith(suffix):
                        name = name.removesuffix(suffix)
                        break
                found.add(name)
    return found


def test_dashboard_is_importable_as_is() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] == "llm-mesh"
    # The datasource is a variable: no import-time input to fill in, no hard-coded uid.
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"


def test_four_golden_signals_for_every_service() -> None:
    panels = dashboard()["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    for service in ("router", "inference", "retriever", "session"):
        start = next(i for i in rows if panels[i]["title"].startswith(service))
        following = panels[start + 1 : start + 5]
        titles = [p["title"].split(" ")[0] for p in following]
        assert titles == ["Traffic", "Errors", "Latency", "Saturation"], service
        exprs = " ".join(t["expr"] for p in following[:3] for t in p["targets"])
        assert f'service="{service}"' in exprs


def test_every_queried_metric_is_exported_by_a_service() -> None:
    queried = queried_metric_names()
    exported = exported_metric_names()
    assert "llmmesh_requests_total" in queried and "llmmesh_queue_depth" in queried
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics no service defines: {missing}"


def test_golden_signals_count_work_not_health_probes() -> None:
    """The inference row counted the router's Check and GetLoad polls (292 each against one
    GenerateMany stream that carries every generation): its traffic and latency were the health
    polling's. RPC panels now leave probes out, and the inference row reads generations."""
    panels = dashboard()["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    for service in ("router", "inference", "retriever", "session"):
        start = next(i for i in rows if panels[i]["title"].startswith(service))
        for panel in panels[start + 1 : start + 4]:
            for target in panel["targets"]:
                for series in re.findall(
                    r"llmmesh_request(?:s_total|_duration_seconds_bucket)\{[^}]*\}", target["expr"]
                ):
                    assert 'method!~"Check|Watch|ServerReflectionInfo|GetLoad|WatchKvEvents"' in series, (
                        series
                    )
    start = next(i for i in rows if panels[i]["title"].startswith("inference"))
    traffic, errors, latency = panels[start + 1 : start + 4]
    assert "llmmesh_inference_requests_total" in traffic["targets"][0]["expr"]
    assert 'finish_reason="error"' in errors["targets"][0]["expr"]
    assert all("llmmesh_e2e_request_latency_seconds_bucket" in t["expr"] for t in latency["targets"])
