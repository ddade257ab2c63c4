"""Client helpers for tests that talk to a real inference replica over gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc


@dataclass
class Generation:
    """Everything one Generate stream returned."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    indices: list[int] = field(default_factory=list)
    #: Each chunk's text, in order (``text`` is their concatenation).
    pieces: list[str] = field(default_factory=list)
    #: Each chunk's ``prompt_tokens`` (the first's is the prompt's size, the others' 0).
    prompt_tokens: list[int] = field(default_factory=list)
    finished: inference_pb2.GenerationFinished | None = None

    @property
    def finish_reason(self) -> int:
        assert self.finished is not None, "stream ended without a final message"
        return self.finished.finish_reason


def greedy(max_tokens: int, **kwargs: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]


async def generate(
    stub: inference_pb2_grpc.InferenceStub,
    start: inference_pb2.GenerateStart,
    cancel_after_tokens: int | None = None,
    timeout: float = 120.0,
) -> Generation:
    """Run one Generate stream to its end; optionally send `cancel` after some tokens."""
    call = stub.Generate(timeout=timeout)
    await call.write(inference_pb2.GenerateRequest(start=start))
    result = Generation()
    cancelled = False
    while True:
        response = await call.read()
        if response is grpc.aio.EOF:
            break
        if response.HasField("chunk"):
            result.token_ids.extend(response.chunk.token_ids)
            result.text += response.chunk.text
            result.pieces.append(response.chunk.text)
            result.indices.append(response.chunk.index)
            result.prompt_tokens.append(response.chunk.prompt_tokens)
            if (
                cancel_after_tokens is not None
                and not cancelled
                and len(result.token_ids) >= cancel_after_tokens
            ):
                await call.write(
                    inference_pb2.GenerateRequest(cancel=inference_pb2.CancelGeneration(reason="test"))
                )
                cancelled = True
        else:
            result.finished = response.finished
    await call.done_writing()
    return result
