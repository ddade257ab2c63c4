"""After traffic through the router, every service's metrics endpoint shows the issue's metrics with
non-zero values, and one trace spans router, session, retriever and inference with parent links."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.launched_mesh import LaunchedMesh

# Non-zero after the traffic below.
DRIVEN = {
    "router": [
        "llmmesh_router_ttft_seconds_count",
        "llmmesh_router_inter_token_latency_seconds_count",
        "llmmesh_router_e2e_latency_seconds_count",
        "llmmesh_router_tokens_total",
        "llmmesh_router_cache_hits_total",
    ],
    "inference-0": [
        "llmmesh_time_to_first_token_seconds_count",
        "llmmesh_inter_token_latency_seconds_count",
        "llmmesh_prompt_tokens_total",
        "llmmesh_generation_tokens_total",
        "llmmesh_prefix_cache_hit_tokens_total",
    ],
}
# Exported (HELP/TYPE) but only non-zero under faults or overload this test does not cause.
DECLARED = {
    "router": [
        "llmmesh_router_retries",
        "llmmesh_router_failovers",
        "llmmesh_router_replica_ejections",
        "llmmesh_router_rate_limited",
    ],
    "inference-0": ["llmmesh_queue_depth"],
}
# Gauges: non-zero while a generation runs.
BUSY = {
    "router": ["llmmesh_router_in_flight"],
    "inference-0": ["llmmesh_running_batch_size", "llmmesh_kv_cache_usage_ratio"],
}
SERVICE_LABEL = {
    "router": "router",
    "inference-0": "inference",
    "session": "session",
    "retriever": "retriever",
}


def scrape(address: str) -> tuple[dict[str, float], set[str]]:
    """Sum of samples by name (labels folded) and the declared family names."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals, families


def requests_by_service(address: str, service: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "llmmesh_requests_total"
        and sample.labels.get("service") == service
        and sample.labels.get("method") not in ("Check", "Watch")
    )


def complete(stub: router_pb2_grpc.RouterStub, text: str, **fields: Any) -> router_pb2.CompleteResponse:
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0),
        **fields,
    )
    reply: router_pb2.CompleteResponse = stub.Complete(request, timeout=180)
    return reply


def drive_traffic(mesh: LaunchedMesh) -> str:
    """A RAG turn in a session (every service takes part), then one prompt twice (a cache hit).

    Returns the request id of the RAG turn.
    """
    with grpc.insecure_channel(mesh.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        rag_turn = complete(
            stub,
            "Which port does the router listen on?",
            session_id=f"e2e-{uuid.uuid4().hex[:8]}",
            rag=router_pb2.RagOptions(enabled=True, top_k=2),
            cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
        )
        assert rag_turn.end.session_version >= 1
        prompt = f"Repeat after me: observability {uuid.uuid4().hex[:6]}"
        # Both cache layers are consulted: exact (Redis) and semantic (the retriever's CacheLookup).
        both_caches = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_DEFAULT, semantic=True)
        first = complete(stub, prompt, cache=both_caches)
        second = complete(stub, prompt, cache=both_caches)
    # The first may already be a semantic hit on an earlier run's near-identical prompt;
    # the second is answered from a cache either way.
    assert first.end.cache_layer != router_pb2.CACHE_LAYER_EXACT
    assert second.end.cache_layer in (router_pb2.CACHE_LAYER_EXACT, router_pb2.CACHE_LAYER_SEMANTIC)
    assert second.text == first.text
    return rag_turn.request_id


def scrape_mid_generation(mesh: LaunchedMesh) -> dict[str, dict[str, float]]:
    """Router and replica metrics scraped while an answer is still streaming."""
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Count slowly from one to fifty.")],
        sampling=common_pb2.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
        cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
    )
    with grpc.insecure_channel(mesh.router) as channel:
        replies = router_pb2_grpc.RouterStub(channel).ChatStream(request, timeout=180)
        for reply in replies:
            if reply.HasField("delta") and reply.delta.index >= 2:
                break
        busy = {name: scrape(mesh.metrics[name])[0] for name in BUSY}
        replies.cancel()
    return busy


def test_every_service_exports_the_golden_metrics_after_traffic(mesh: LaunchedMesh) -> None:
    busy = scrape_mid_generation(mesh)
    for name, gauges in BUSY.items():
        for gauge in gauges:
            assert busy[name].get(gauge, 0.0) > 0, (
                f"{name}: {gauge} is {busy[name].get(gauge)} mid-generation"
            )
    drive_traffic(mesh)
    for name, address in mesh.metrics.items():
        assert requests_by_service(address, SERVICE_LABEL[name]) > 0, f"{name}: no llmmesh_requests_total"
        totals, families = scrape(address)
        for metric in DRIVEN.get(name, []):
            assert totals.get(metric, 0.0) > 0, f"{name}: {metric} is {totals.get(metric)}"
        for family in DECLARED.get(name, []):
            assert family in families, f"{name}: {family} not exported"
    router, _ = scrape(mesh.metrics["router"])
    assert router["llmmesh_router_e2e_latency_seconds_count"] >= 3


def read_spans(mesh: LaunchedMesh) -> list[dict[str, Any]]:
    if not mesh.trace_file.exists():
        return []
    with open(mesh.trace_file) as f:
        return [json.loads(line) for line in f if line.strip()]


def find_rag_trace(mesh: LaunchedMesh, timeout: float = 20.0) -> tuple[str, list[dict[str, Any]]]:
    """The trace of a router turn that reached the retriever and a replica (spans end a little late)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = read_spans(mesh)
        by_trace: dict[str, list[dict[str, Any]]] = {}
        for span in spans:
            by_trace.setdefault(span["trace_id"], []).append(span)
        for trace_id, members in by_trace.items():
            names = {s["name"] for s in members}
            if {"llmmesh.v1.Router/Complete", "llmmesh.v1.Inference/Generate", "retrieval"} <= names:
                return trace_id, members
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no RAG trace among {len(spans)} spans: {sorted({s['name'] for s in spans})}"
            )
        time.sleep(0.5)


def test_one_trace_spans_router_session_retriever_and_inference(mesh: LaunchedMesh) -> None:
    drive_traffic(mesh)
    _, spans = find_rag_trace(mesh)
    by_id = {s["span_id"]: s for s in spans}

    def ancestors(span: dict[str, Any]) -> list[dict[str, Any]]:
        chain = []
        while span["parent_span_id"] in by_id:
            span = by_id[span["parent_span_id"]]
            chain.append(span)
        return chain

    (root,) = [s for s in spans if s["parent_span_id"] is None]
    assert root["name"] == "llmmesh.v1.Router/Complete" and root["service"] == "llm-mesh-router"
    # Every span of the trace hangs off the router's span: no orphans from lost traceparents.
    for span in spans:
        if span is not root:
            assert root in ancestors(span), f"{span['name']} ({span['service']}) is not under the router span"

    services = {s["service"] for s in spans}
    assert {"llm-mesh-router", "llm-mesh-inference", "llm-mesh-retriever", "llm-mesh-session"} <= services
    generate = next(s for s in spans if s["name"] == "llmmesh.v1.Inference/Generate")
    assert generate["service"] == "llm-mesh-inference"
    stages = {s["name"]: s for s in spans if s["parent_span_id"] == generate["span_id"]}
    assert {"queue wait", "prefill", "decode"} <= set(stages)
    assert stages["prefill"]["end_ns"] <= stages["decode"]["start_ns"] + 1
    search = next(s for s in spans if s["name"] == "llmmesh.v1.Retriever/Search")
    assert by_id[search["parent_span_id"]]["name"] == "retrieval"


def test_cache_lookup_has_its_own_span_in_the_trace(mesh: LaunchedMesh) -> None:
    drive_traffic(mesh)
    spans = read_spans(mesh)
    by_id = {s["span_id"]: s for s in spans}
    lookups = [s for s in spans if s["name"] == "llmmesh.v1.Retriever/CacheLookup"]
    assert lookups, sorted({s["name"] for s in spans})
    lookup = lookups[-1]
    client = by_id[lookup["parent_span_id"]]
    assert client["name"] == "semantic cache lookup" and client["service"] == "llm-mesh-router"
    assert by_id[client["parent_span_id"]]["name"] == "llmmesh.v1.Router/Complete"
    assert client["trace_id"] == lookup["trace_id"]
