"""Where finished spans go: OTLP, a JSON-lines file or the console, as the environment asks."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult

TRACE_FILE_ENV = "LLMMESH_TRACE_FILE"
TRACE_CONSOLE_ENV = "LLMMESH_TRACE_CONSOLE"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (debugging, and tests across processes)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(span)) + "\n" for span in spans]
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.writelines(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A span as plain JSON: ids in the W3C hex form, so records from different processes join."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": format(ctx.trace_id, "032x") if ctx else None,
        "span_id": format(ctx.span_id, "016x") if ctx else None,
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
    }


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def exporter_from_env() -> tuple[SpanExporter, bool] | None:
    """The exporter the environment asks for, and whether to batch; None means export nothing."""
    if os.environ.get(OTLP_ENDPOINT_ENV):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # The exporter reads the endpoint, headers and TLS settings from the OTEL_* variables itself.
        return OTLPSpanExporter(), True
    trace_file = os.environ.get(TRACE_FILE_ENV)
    if trace_file:
        # Unbatched: a debugging file should hold a span as soon as it ends, even if the process is killed.
        return JsonLinesSpanExporter(trace_file), False
    if os.environ.get(TRACE_CONSOLE_ENV, "").lower() in ("1", "true", "yes", "on"):
        return ConsoleSpanExporter(), False
    return None
