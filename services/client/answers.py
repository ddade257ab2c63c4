"""How the terminal clients show an answer's end: the footer line and the `--json` object."""

from __future__ import annotations

from typing import Any

from llm_mesh_client.pb import common_pb2, router_pb2

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def citation_record(c: router_pb2.Citation) -> dict[str, object]:
    return {
        "document_id": c.document_id,
        "title": c.title,
        "chunk": c.position,
        "score": round(c.score, 4),
        "snippet": c.snippet,
    }


def footer(end: router_pb2.TurnEnd) -> str | None:
    """The last line of an answer that did not stop by itself, or None."""
    notes = []
    if end.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        notes.append(f"[length: {end.usage.completion_tokens} tokens]")
    elif end.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
        notes.append("[cancelled]")
    if end.degraded:
        notes.append(f"[degraded: {'; '.join(end.degraded_reasons) or 'unspecified'}]")
    return " ".join(notes) or None


def json_answer(text: str, end: router_pb2.TurnEnd) -> dict[str, Any]:
    """What `--json` prints: the answer and the parts of its TurnEnd a script acts on."""
    return {
        "text": text,
        "finish_reason": FINISH_NAMES.get(end.finish_reason, "unspecified"),
        "usage": {
            "prompt_tokens": end.usage.prompt_tokens,
            "completion_tokens": end.usage.completion_tokens,
            "cached_prompt_tokens": end.usage.cached_prompt_tokens,
        },
        "model": end.model,
        "replica": end.replica,
        "session_id": end.session_id,
        "cache": router_pb2.CacheLayer.Name(end.cache_layer).removeprefix("CACHE_LAYER_").lower(),
        "degraded": list(end.degraded_reasons) if end.degraded else [],
        "citations": [citation_record(c) for c in end.citations],
        "error": end.error_message or None,
    }
