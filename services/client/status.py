"""`llm-mesh status`: the replica pool as the router sees it, plus cache hit rates, as a table."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from llm_mesh_client import MeshError
from llm_mesh_client.pb import router_pb2
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

from services.client.connection import (
    add_connection_arguments,
    describe_error,
    open_client,
    output_console,
)

ROOT = Path(__file__).resolve().parents[2]
HEALTH_NAMES = {
    router_pb2.REPLICA_HEALTH_UNSPECIFIED: "unchecked",
    router_pb2.REPLICA_HEALTH_SERVING: "serving",
    router_pb2.REPLICA_HEALTH_NOT_SERVING: "not serving",
    router_pb2.REPLICA_HEALTH_DRAINING: "draining",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=ROOT / "data",
        help="where `llm-mesh up` records its metrics endpoints (for cache hit rates)",
    )
    parser.add_argument(
        "--router-metrics",
        default=None,
        help="router Prometheus URL (default: from the running `llm-mesh up`)",
    )


def scrape(url: str) -> dict[str, float]:
    """Sum of every sample by name (labels folded), from Prometheus text."""
    with urllib.request.urlopen(url, timeout=2.0) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def launcher_metrics(data_dir: Path) -> dict[str, str]:
    """name -> host:port of each service's metrics, as the running launcher recorded them."""
    try:
        record: Any = json.loads((data_dir / "llm-mesh.lock").read_text() or "{}")
    except (OSError, ValueError):
        return {}
    metrics = record.get("metrics", {}) if isinstance(record, dict) else {}
    return {str(k): str(v) for k, v in metrics.items()}


def ratio(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "–"


def cache_summary(metrics_urls: dict[str, str]) -> list[tuple[str, str]]:
    """(label, value) rows: response-cache hit rate at the router, prefix-cache hit rate at the replicas."""
    rows: list[tuple[str, str]] = []
    router_url = metrics_urls.get("router")
    if router_url:
        try:
            router = scrape(router_url)
            turns = router.get("llmmesh_router_e2e_latency_seconds_count", 0.0)
            rows.append(
                ("response cache hits", ratio(router.get("llmmesh_router_cache_hits_total", 0.0), turns))
            )
        except (OSError, ValueError) as exc:  # ValueError: a page that is no Prometheus text
            rows.append(("response cache hits", f"router metrics unreadable ({exc})"))
    hit_tokens = prompt_tokens = 0.0
    for name, url in metrics_urls.items():
        if not name.startswith("inference"):
            continue
        try:
            replica = scrape(url)
        except (OSError, ValueError):
            continue
        hit_tokens += replica.get("llmmesh_prefix_cache_hit_tokens_total", 0.0)
        prompt_tokens += replica.get("llmmesh_prompt_tokens_total", 0.0)
    if prompt_tokens:
        rows.append(("prefix cache hits (prompt tokens)", ratio(hit_tokens, prompt_tokens)))
    return rows


def prefix_blocks(r: router_pb2.ReplicaStatus) -> str:
    """Blocks the router's prefix index holds for a replica and their share of its KV cache;
    "~": approximate (what this router sent there; the replica sends no KV events)."""
    share = ratio(r.indexed_blocks, r.last_load.kv_blocks_total)
    return f"{'' if r.kv_events else '~'}{r.indexed_blocks} ({share})"


def replica_table(reply: router_pb2.ListReplicasResponse) -> Table:
    models = sorted({r.model for r in reply.replicas if r.model})
    title = f"replicas · policy {reply.policy or '?'} · model {', '.join(models) or '?'}"
    table = Table(title=title)
    table.add_column("replica", no_wrap=True)
    table.add_column("health", no_wrap=True)
    for column in ("in flight", "queued", "running", "KV", "prefix blocks", "tok/s", "TTFT ms", "ITL ms"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in reply.replicas:
        load = r.last_load
        health = HEALTH_NAMES.get(r.health, "?")
        if r.ejected:
            health += f" (ejected ×{r.ejection_count})"
        table.add_row(
            r.address,
            health,
            str(r.in_flight),
            str(load.waiting),
            str(load.running),
            ratio(load.kv_blocks_used, load.kv_blocks_total),
            prefix_blocks(r),
            f"{load.tokens_per_second:.1f}",
            f"{r.ewma_ttft_ms:.0f}",
            f"{r.ewma_itl_ms:.0f}",
        )
    return table


def run(args: argparse.Namespace) -> int:
    console = output_console()
    client = open_client(args)
    try:
        reply = client.list_replicas(timeout=5)
    except MeshError as error:
        print(describe_error(error, args.router), file=sys.stderr)
        return 1
    finally:
        client.close()
    console.print(replica_table(reply))
    urls = {name: f"http://{hostport}/metrics" for name, hostport in launcher_metrics(args.data_dir).items()}
    if args.router_metrics:
        urls["router"] = args.router_metrics
    summary = cache_summary(urls)
    if summary:
        caches = Table(title="caches")
        caches.add_column("cache")
        caches.add_column("hit rate", justify="right")
        for label, value in summary:
            caches.add_row(label, value)
        console.print(caches)
    return 0
