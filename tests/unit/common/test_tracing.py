"""Trace propagation across two in-process gRPC servers, and stage spans rebuilt from final timings."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing, tracing_export
from services.common.tracing_server import ServerTracingInterceptor
from services.gen.llmmesh.v1 import common_pb2, inference_pb2


@pytest.fixture()
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup("test", exporter=exporter)
    yield exporter
    tracing.shutdown()


def _generate_handler(behavior: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "llmmesh.v1.Inference",
        {
            "Generate": grpc.stream_stream_rpc_method_handler(
                behavior,
                request_deserializer=inference_pb2.GenerateRequest.FromString,
                response_serializer=inference_pb2.GenerateResponse.SerializeToString,
            )
        },
    )


async def _start(handler: grpc.GenericRpcHandler, name: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[ServerTracingInterceptor(name)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_one_trace_spans_caller_callee_and_generation_stages(spans: InMemorySpanExporter) -> None:
    finished = inference_pb2.GenerateResponse(
        finished=inference_pb2.GenerationFinished(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            timings=common_pb2.Timings(queue_ms=2.0, prefill_ms=5.0, decode_ms=20.0, ttft_ms=8.0),
        )
    )

    async def replica(requests: Any, context: Any) -> AsyncIterator[inference_pb2.GenerateResponse]:
        async for _ in requests:
            yield inference_pb2.GenerateResponse(chunk=inference_pb2.TokenChunk(text="hi"))
            yield finished
            return

    back, back_addr = await _start(_generate_handler(replica), "inference")

    async def router(requests: Any, context: Any) -> AsyncIterator[inference_pb2.GenerateResponse]:
        # The front server relays to the back one over a plain channel: no interceptor passed by hand.
        async with grpc.aio.insecure_channel(back_addr) as channel:
            call = channel.stream_stream(
                "/llmmesh.v1.Inference/Generate",
                request_serializer=inference_pb2.GenerateRequest.SerializeToString,
                response_deserializer=inference_pb2.GenerateResponse.FromString,
            )
            async for request in requests:
                async for reply in call(iter([request])):
                    yield reply
                return

    front, front_addr = await _start(_generate_handler(router), "router")
    try:
        async with grpc.aio.insecure_channel(front_addr) as channel:
            call = channel.stream_stream(
                "/llmmesh.v1.Inference/Generate",
                request_serializer=inference_pb2.GenerateRequest.SerializeToString,
                response_deserializer=inference_pb2.GenerateResponse.FromString,
            )
            start = inference_pb2.GenerateRequest(start=inference_pb2.GenerateStart(prompt="hello"))
            replies = [reply async for reply in call(iter([start]))]
        assert replies[-1].finished.timings.decode_ms == 20.0
    finally:
        await front.stop(0)
        await back.stop(0)

    finished_spans = spans.get_finished_spans()
    servers = [s for s in finished_spans if s.name == "llmmesh.v1.Inference/Generate"]
    assert len(servers) == 2
    outer = next(s for s in servers if s.attributes and s.attributes["llmmesh.service"] == "router")
    inner = next(s for s in servers if s.attributes and s.attributes["llmmesh.service"] == "inference")
    assert inner.context.trace_id == outer.context.trace_id
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id

    stages = {s.name: s for s in finished_spans if s.parent and s.parent.span_id == inner.context.span_id}
    assert set(stages) == {"queue wait", "prefill", "decode"}
    decode = stages["decode"]
    assert decode.end_time is not None and decode.start_time is not None
    assert decode.end_time - decode.start_time == 20_000_000
    assert stages["queue wait"].end_time == stages["prefill"].start_time


def test_traceparent_round_trips_through_metadata(spans: InMemorySpanExporter) -> None:
    with tracing.stage("outer") as span:
        metadata = tracing.inject_metadata([("x-llmmesh-tenant", "t1"), ("traceparent", "stale")])
    assert ("x-llmmesh-tenant", "t1") in metadata
    assert [k for k, _ in metadata].count("traceparent") == 1
    context = tracing.extract_context(metadata)
    from opentelemetry import trace

    assert trace.get_current_span(context).get_span_context().span_id == span.get_span_context().span_id


def _clear_trace_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        tracing_export.OTLP_ENDPOINT_ENV,
        tracing_export.TRACE_FILE_ENV,
        tracing_export.TRACE_CONSOLE_ENV,
    ):
        monkeypatch.delenv(var, raising=False)


def test_without_an_exporter_tracing_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_trace_env(monkeypatch)
    tracing.shutdown()
    assert tracing.setup("test") is None
    assert not tracing.enabled()
    with tracing.stage("unseen"):
        # Nothing is traced, so nothing is added to outgoing calls either.
        assert tracing.inject_metadata([("x-llmmesh-tenant", "t1")]) == [("x-llmmesh-tenant", "t1")]


def test_trace_file_gets_one_json_span_per_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _clear_trace_env(monkeypatch)
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv(tracing_export.TRACE_FILE_ENV, str(path))
    tracing.setup("router")
    try:
        with tracing.stage("cache lookup", layer="exact") as outer, tracing.stage("retrieval"):
            pass
    finally:
        tracing.shutdown()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["name"] for r in records] == ["retrieval", "cache lookup"]
    inner, parent = records
    assert parent["service"] == "llm-mesh-router"
    assert parent["attributes"] == {"layer": "exact"}
    assert inner["parent_span_id"] == parent["span_id"] == format(outer.get_span_context().span_id, "016x")
    assert inner["trace_id"] == parent["trace_id"]
