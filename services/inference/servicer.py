"""The gRPC face of the inference engine: protobuf in, dataclasses to the engine, protobuf out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from services.common.errors import ContextTooLong, DependencyUnavailable, InvalidArgument
from services.common.generate_many.server import serve_many, serve_one
from services.common.kv_blocks import MAX_SALT_BYTES
from services.common.prompts import Message, prompt_token_ids
from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.async_engine import AsyncEngine
from services.inference.engine import RequestOutput
from services.inference.kv_events import KvDelta, KvSnapshot
from services.inference.kv_watch import watch_kv_events
from services.inference.outputs import SampledToken
from services.inference.sampling import Constraint, ConstraintKind, SamplingParams
from services.inference.sequence import FinishReason

DEFAULT_MAX_TOKENS = 256

FINISH_REASONS_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sampling_from_pb(pb: common_pb2.SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """Proto sampling fields to ``SamplingParams``; unset optional fields take the defaults."""
    if pb.HasField("max_tokens"):
        max_tokens = pb.max_tokens
    elif pb.max_tokens_to_context:
        max_tokens = max(1, max_model_len - prompt_len)
    else:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, max_model_len - prompt_len))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k if pb.HasField("top_k") else 0,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        ignore_eos=pb.ignore_eos,
        constraint=constraint_from_pb(pb),
        logprobs=pb.logprobs,
        top_logprobs=pb.top_logprobs,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        presence_penalty=pb.presence_penalty if pb.HasField("presence_penalty") else 0.0,
        frequency_penalty=pb.frequency_penalty if pb.HasField("frequency_penalty") else 0.0,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids),
        min_p=pb.min_p if pb.HasField("min_p") else 0.0,
        include_stop_str_in_output=pb.include_stop_str_in_output,
        allowed_token_ids=tuple(pb.allowed_token_ids),
        bad_words=tuple(pb.bad_words),
    )


def constraint_from_pb(pb: common_pb2.SamplingParams) -> Constraint | None:
    """The proto's ``constraint`` oneof as a ``Constraint`` (None when unset, or json_object false)."""
    which = pb.WhichOneof("constraint")
    if which is None or (which == "json_object" and not pb.json_object):
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, choices=tuple(pb.choice.values))
    return Constraint(kind, "" if kind is ConstraintKind.JSON_OBJECT else str(getattr(pb, which)))


def logprobs_pb(
    tokens: tuple[SampledToken, ...], text_of: Callable[[int], str]
) -> list[common_pb2.TokenLogprobs]:
    """The engine's per-token logprobs as the proto's, each alternative with its own text."""
    return [
        common_pb2.TokenLogprobs(
            logprob=t.logprob,
            text=text_of(t.token),
            top=[common_pb2.TokenLogprob(token_id=i, text=text_of(i), logprob=lp) for i, lp in t.top],
        )
        for t in tokens
    ]


def chunk_and_finished(
    out: RequestOutput,
    text_of: Callable[[int], str] = str,
    decode: Callable[[list[int]], str] = lambda ids: "",
) -> tuple[inference_pb2.TokenChunk | None, inference_pb2.GenerationFinished | None]:
    """A chunk for new tokens or text, and the final message when the request ended
    (``text_of``: a token id's text, for the logprobs' alternatives; ``decode``: token ids as one
    text, for a scored prompt's ``prompt_text``)."""
    chunk = None
    if out.new_token_ids or out.text:
        chunk = inference_pb2.TokenChunk(
            text=out.text, token_ids=out.new_token_ids, index=out.index, prompt_tokens=out.prompt_tokens
        )
        if out.logprobs:
            chunk.logprobs.extend(logprobs_pb(out.logprobs, text_of))
        if out.prompt_logprobs:
            chunk.prompt_logprobs.extend(logprobs_pb(out.prompt_logprobs, text_of))
            # Decoded as one: token by token, a character split across tokens would come out
            # as replacement characters (and a SentencePiece tokenizer's spaces would be lost).
            chunk.prompt_text = decode([t.token for t in out.prompt_logprobs])
    if not out.finished:
        return chunk, None
    usage = out.usage
    timings = out.timings
    finished = inference_pb2.GenerationFinished(
        finish_reason=FINISH_REASONS_PB[out.finish_reason or FinishReason.ERROR],
        usage=common_pb2.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        )
        if usage
        else None,
        timings=common_pb2.Timings(
            queue_ms=timings.queue_ms,
            prefill_ms=timings.prefill_ms,
            decode_ms=timings.decode_ms,
            ttft_ms=timings.ttft_ms,
            total_ms=timings.total_ms,
        )
        if timings
        else None,
        error_message=out.error,
        matched_stop=out.matched_stop,
    )
    return chunk, finished


#: Characters a token of the prompt is allowed before the prompt is refused untokenized (above).
MAX_CHARS_PER_TOKEN = 128


#: The one thread that renders chat templates and tokenizes prompts: off the event loop, where
#: every stream of the replica waited for it (a 1 MB prompt held them 1.5-1.8 s, 500,000 empty
#: messages 21.7 s, health checks included), and one at a time (a Hugging Face tokenizer is not
#: safe on several threads at once; the router's prompt hashes do the same, prompt_hashes.py).
_TOKENIZER_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")


async def start_generation(
    engine: AsyncEngine, start: inference_pb2.GenerateStart, preparing: dict[str, bool] | None = None
) -> AsyncGenerator[RequestOutput, None]:
    """The engine request for ``start``: its outputs (validated when first iterated).

    Its id is the one ``start`` carries (the router's, or minted by the server half for a
    direct client that sent none): never minted again on the way to the engine.
    ``preparing``: ids whose prompt is being tokenized, not yet known to the engine, and
    whether a cancel came meanwhile (the servicer's ``cancel`` marks it): such a request ends
    CANCELLED without reaching the engine, whose abort of an id it does not know is lost.
    """
    # Text past what the context could hold at even MAX_CHARS_PER_TOKEN characters a token
    # (SmolLM2's longest is 80 bytes) is refused without reading it, and so are more messages
    # than it has tokens (each takes one at least): a 3 MB prompt took 4.4 s to be refused.
    context = engine.engine.max_model_len
    chars = len(start.prompt) + sum(len(m.content) for m in start.messages)
    if chars > context * MAX_CHARS_PER_TOKEN:
        field = "prompt" if start.prompt else "messages"
        raise ContextTooLong(field, f"{chars:,} characters are more than fit in", context)
    if len(start.messages) > context:
        raise ContextTooLong("messages", f"{len(start.messages):,} messages are more than fit in", context)
    if len(start.cache_salt.encode("utf-8")) > MAX_SALT_BYTES:
        raise InvalidArgument("cache_salt", f"at most {MAX_SALT_BYTES:,} bytes")
    messages = [Message(m.role, m.content) for m in start.messages]
    request_id = start.request_id
    if preparing is not None:
        preparing[request_id] = False
    try:
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            _TOKENIZER_THREAD,
            functools.partial(
                prompt_token_ids,
                engine.engine.tokenizer,
                messages,
                start.prompt,
                token_ids=start.prompt_token_ids,
            ),
        )
    finally:
        cancelled = preparing.pop(request_id, False) if preparing is not None else False
    if cancelled:
        yield RequestOutput(request_id, [], "", 0, finished=True, finish_reason=FinishReason.CANCELLED)
        return
    params = sampling_from_pb(start.sampling, len(prompt_ids), context)
    # No await between the check above and the engine knowing the id (generate registers it
    # before its first await): a cancel from here on reaches the engine.
    given = "prompt_token_ids" if start.prompt_token_ids else "prompt" if start.prompt else "messages"
    resumed = list(start.resume_token_ids)
    async for out in engine.generate(request_id, prompt_ids, params, resumed, given, start.cache_salt):
        yield out


def kv_events_pb(snapshot: KvSnapshot | None, deltas: list[KvDelta]) -> inference_pb2.KvEvents:
    message = inference_pb2.KvEvents(
        deltas=[
            inference_pb2.KvDelta(sequence=d.sequence, stored=d.stored, evicted=d.evicted) for d in deltas
        ],
        published_unix_ms=int((deltas[-1].published_at if deltas else time.time()) * 1000),
    )
    if snapshot is not None:
        message.snapshot.CopyFrom(
            inference_pb2.KvSnapshot(
                incarnation=snapshot.incarnation,
                sequence=snapshot.sequence,
                block_size=snapshot.block_size,
                block_hashes=snapshot.block_hashes,
            )
        )
    return message


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Streams generations from the engine; the engine is set once the model is loaded."""

    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None
        #: Set when the replica drains: GenerateMany streams end once their generations have.
        self.stopping = asyncio.Event()
        #: Generations whose prompt is being tokenized, and whether a cancel came meanwhile.
        self._preparing: dict[str, bool] = {}

    def drain(self) -> None:
        """Refuse new generations; let the running ones finish, then end the shared streams."""
        if self.engine is not None:
            self.engine.draining = True
        self.stopping.set()

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise DependencyUnavailable("model is still loading")
        return self.engine

    async def Generate(
        self,
        request_iterator: AsyncIterator[inference_pb2.GenerateRequest],
        context: grpc.aio.ServicerContext[inference_pb2.GenerateRequest, inference_pb2.GenerateResponse],
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self._engine()  # UNAVAILABLE while the model loads, before the first message is read
        # The same backend call as a GenerateMany generation: one conversion path for both RPCs.
        async for response in serve_one(self, request_iterator, context):
            yield response

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[inference_pb2.GenerateManyRequest],
        context: grpc.aio.ServicerContext[
            inference_pb2.GenerateManyRequest, inference_pb2.GenerateManyResponse
        ],
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        self._engine()  # UNAVAILABLE for the whole stream while the model loads
        async for response in serve_many(self, request_iterator, self.stopping):
            yield response

    async def generate(
        self, start: inference_pb2.GenerateStart, timeout_s: float
    ) -> AsyncGenerator[inference_pb2.GenerationEvent, None]:
        """One generation, on a GenerateMany stream or a Generate call (``GenerationBackend``)."""
        engine = self._engine()
        stream = start_generation(engine, start, self._preparing)
        tokenizer = engine.engine.tokenizer

        # Once per token id for the whole generation: prompt_logprobs on a long prompt asks for
        # ~170,000 alternatives' texts, which took 0.75 s of the event loop one decode at a time.
        @functools.lru_cache(maxsize=65536)
        def text_of(token_id: int) -> str:
            return str(tokenizer.decode([token_id]))

        def decode(token_ids: list[int]) -> str:
            return str(tokenizer.decode(token_ids))

        try:
            async for out in stream:
                chunk, finished = chunk_and_finished(out, text_of, decode)
                if chunk is not None:
                    yield inference_pb2.GenerationEvent(chunk=chunk)
                if finished is not None:
                    yield inference_pb2.GenerationEvent(finished=finished)
        finally:
            await stream.aclose()

    def cancel(self, request_id: str) -> None:
        """``GenerationBackend``: a `cancel` on either RPC."""
        if request_id in self._preparing:
            self._preparing[request_id] = True  # its prompt is being tokenized
        if self.engine is not None:
            self.engine.abort(request_id)

    async def GetLoad(
        self,
        request: inference_pb2.GetLoadRequest,
        context: grpc.aio.ServicerContext[inference_pb2.GetLoadRequest, inference_pb2.LoadReport],
    ) -> inference_pb2.LoadReport:
        engine = self._engine()
        load = engine.load()
        return inference_pb2.LoadReport(
            waiting=load.waiting,
            running=load.running,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_cached=load.kv_blocks_cached,
            tokens_per_second=load.tokens_per_second,
            max_queued_requests=engine.engine.config.max_queued_requests,
            draining=engine.draining,
        )

    async def WatchKvEvents(
        self,
        request: inference_pb2.WatchKvEventsRequest,
        context: grpc.aio.ServicerContext[inference_pb2.WatchKvEventsRequest, inference_pb2.KvEvents],
    ) -> AsyncIterator[inference_pb2.KvEvents]:
        # A stream of its own, not GenerateMany's: see docs/inference.md, *KV events*.
        events = self._engine().engine.block_manager.events
        async for snapshot, deltas in watch_kv_events(events, self.stopping):
            yield kv_events_pb(snapshot, deltas)

    async def GetModelInfo(
        self,
        request: inference_pb2.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[inference_pb2.GetModelInfoRequest, inference_pb2.ModelInfo],
    ) -> inference_pb2.ModelInfo:
        core = self._engine().engine
        runner = core.runner
        return inference_pb2.ModelInfo(
            model_id=core.model_id,
            max_context_tokens=core.max_model_len,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            kv_block_size=runner.block_size,
            kv_blocks_total=runner.num_blocks,
            vocab_size=runner.vocab_size,
        )


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
