"""``POST /v1/embeddings``: texts to the retriever's embedding model, vectors back in OpenAI's shape."""

from __future__ import annotations

import base64
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from services.gen.llmmesh.v1 import retriever_pb2
from services.router.api.openai.errors import ApiError, bad_request, unsupported
from services.router.api.openai.extras import MAX_USER_CHARS

MAX_INPUTS = 256


@dataclass(frozen=True)
class EmbeddingRequest:
    texts: tuple[str, ...]
    model: str
    encoding: Literal["float", "base64"]
    dimensions: int | None


def embedding_request(body: Any) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object", "invalid_request_body")
    raw = body.get("input")
    texts: list[str]
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        texts = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(t, (int, list)) for t in raw):
        # Token ids are a tokenizer's (tiktoken's, for OpenAI's clients): not the retriever model's.
        raise unsupported(
            "input",
            "token-id input is not supported; send text (LangChain's OpenAIEmbeddings sends "
            "tiktoken ids unless check_embedding_ctx_length=False)",
        )
    else:
        raise bad_request("input", "input: required, a string or a non-empty list of strings")
    if len(texts) > MAX_INPUTS:
        raise bad_request("input", f"input: at most {MAX_INPUTS} texts per request")
    for i, text in enumerate(texts):
        if not text:
            # OpenAI refuses it too: an empty text has no meaning to embed (the model would embed
            # only its special tokens).
            raise bad_request("input", f"input[{i}]: must not be empty")
        try:
            text.encode()
        except UnicodeEncodeError:
            raise bad_request("input", f"input[{i}]: must be valid Unicode text") from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model", "model: must be a string")
    raw_encoding = body.get("encoding_format") or "float"
    if raw_encoding not in ("float", "base64"):
        raise bad_request("encoding_format", "encoding_format: must be 'float' or 'base64'")
    encoding: Literal["float", "base64"] = "base64" if raw_encoding == "base64" else "float"
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise bad_request("dimensions", "dimensions: must be an integer")
    if dimensions is not None and dimensions < 1:
        # Refused before the retriever embeds anything, as OpenAI refuses it.
        raise bad_request("dimensions", f"dimensions: must be at least 1, got {dimensions}")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        # Unused here, but checked as on chat: a client sending a number means something else.
        raise bad_request("user", f"user: a string of at most {MAX_USER_CHARS} characters")
    return EmbeddingRequest(tuple(texts), model or "", encoding, dimensions)


_TEXT_FIELD = re.compile(r"texts(\[\d+\])")


def input_error(error: ApiError) -> ApiError:
    """The retriever's refusal of ``texts[i]`` (too long) as this request names it: ``input[i]``."""
    named = _TEXT_FIELD.fullmatch(error.param or "")
    if named is None:
        return error
    field = "input" + named.group(1)
    message = error.message.removeprefix(str(error.param))
    return dataclasses.replace(error, param="input", message=field + message)


def check_model(requested: str, served: str) -> None:
    """The retriever has one model: its full name or its last part ("all-MiniLM-L6-v2"), or none at all."""
    if requested and requested not in (served, served.rsplit("/", 1)[-1]):
        raise ApiError(
            404,
            f"embedding model {requested!r} not found; this router embeds with: {served}",
            "invalid_request_error",
            "model_not_found",
            "model",
        )


def embedding_body(request: EmbeddingRequest, reply: retriever_pb2.EmbedResponse) -> dict[str, Any]:
    native = len(reply.embeddings[0].values) if reply.embeddings else 0
    if request.dimensions is not None and request.dimensions != native:
        # Truncating a model not trained for it (MiniLM is not Matryoshka) would give poor vectors.
        raise unsupported("dimensions", f"only the model's own {native} dimensions are served")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(e.values, request.encoding)}
        for i, e in enumerate(reply.embeddings)
    ]
    usage = {"prompt_tokens": reply.tokens, "total_tokens": reply.tokens}
    return {"object": "list", "data": data, "model": reply.model, "usage": usage}


def _encoded(values: Sequence[float], encoding: str) -> Any:
    if encoding == "base64":
        # What the OpenAI SDKs ask for by default: little-endian float32, base64.
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
    return list(values)
