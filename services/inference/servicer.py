"""The gRPC face of the inference engine: protobuf in, dataclasses to the engine, protobuf out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.errors import AlreadyExists, ContextTooLong, DependencyUnavailable, InvalidArgument
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


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: each of the 256 characters a byte-level BPE
    vocabulary (SmolLM2's, GPT-2's, Llama 3's, Qwen's) spells a byte with → that byte. Printable
    Latin-1 bytes stand for themselves; the others (controls, space, 0x7f-0xa0, 0xad) for the
    characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = 256 + extra
            extra += 1
    return {chr(char): b for b, char in spelled.items()}


#: A byte-fallback vocabulary's token for one raw byte (SentencePiece's, Llama 2's, Mistral's).
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_specs(tokenizer: Any) -> list[dict[str, Any]]:
    """The steps of a fast tokenizer's decoder (a ``Sequence`` unrolled), as its JSON has them;
    empty for a tokenizer without one (a slow tokenizer, or one whose decoder cannot be read)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return []
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # a tokenizers release that pickles decoders otherwise: read the whole JSON
        try:
            spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        except Exception:
            return []
    steps: list[dict[str, Any]] = []

    def unroll(step: dict[str, Any]) -> None:
        if step.get("type") == "Sequence":
            for inner in step.get("decoders") or []:
                unroll(inner)
        else:
            steps.append(step)

    unroll(spec)
    return steps


class TokenBytes:
    """Each token id's own bytes, as the tokenizer's vocabulary spells the token: what
    ``TokenLogprob.token_bytes`` carries, a piece of a multi-byte character being its raw bytes
    (the token's text has it replaced by U+FFFD, so the texts cannot be joined back into the
    answer; the bytes can).

    Made once per model (the servicer keeps one per tokenizer) and filled per id on first use,
    from ``convert_ids_to_tokens``: a byte-level BPE's token is spelled in GPT-2's byte alphabet
    (``gpt2_byte_decoder``), a character outside it standing for its own UTF-8 (the tokenizers
    library's ``ByteLevel`` decoder's rule); a byte-fallback vocabulary's ``<0xNN>`` token is byte
    NN, its other tokens their text with the decoder's replacements (``▁`` → space; the leading
    space of a whole text, which such a decoder strips, is kept: a token's bytes are its bytes
    anywhere in a text). An added token (``<|im_end|>``) is its content's UTF-8.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._added: dict[int, str] = {
            int(i): str(getattr(t, "content", t))
            for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        }
        steps = _decoder_specs(tokenizer)
        kinds = {step.get("type") for step in steps}
        slow_byte_decoder = getattr(tokenizer, "byte_decoder", None)  # transformers' slow GPT-2 tokenizer
        self._byte_level: dict[str, int] | None = None
        if "ByteLevel" in kinds:
            self._byte_level = gpt2_byte_decoder()
        elif not steps and isinstance(slow_byte_decoder, dict):
            self._byte_level = {str(c): int(b) for c, b in slow_byte_decoder.items()}
        #: ``<0xNN>`` tokens are raw bytes: the decoder says so, or a slow SentencePiece tokenizer.
        self._byte_fallback = "ByteFallback" in kinds or not steps
        #: The decoder's string replacements, in order (``▁`` → space), a Metaspace decoder's too.
        self._replacements: list[tuple[str, str]] = []
        for step in steps:
            pattern = (step.get("pattern") or {}).get("String") if step.get("type") == "Replace" else None
            if isinstance(pattern, str) and pattern:
                self._replacements.append((pattern, str(step.get("content", ""))))
            elif step.get("type") == "Metaspace":
                self._replacements.append((str(step.get("replacement", "\u2581")), " "))
        if not steps and self._byte_level is None:
            self._replacements.append(("\u2581", " "))  # a slow SentencePiece tokenizer

    def __call__(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._spell(token_id)
        return raw

    def _spell(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""  # past the tokenizer's vocabulary (a model's padded rows): no text either
        if self._byte_level is not None:
            decoder = self._byte_level
            if all(char in decoder for char in piece):
                return bytes(decoder[char] for char in piece)
            return piece.encode("utf-8")
        if self._byte_fallback and (byte := _BYTE_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        for pattern, content in self._replacements:
            piece = piece.replace(pattern, content)
        return piece.encode("utf-8")


def _no_bytes(token_id: int) -> bytes:
    return b""


def logprobs_pb(
    tokens: tuple[SampledToken, ...],
    text_of: Callable[[int], str],
    bytes_of: Callable[[int], bytes] = _no_bytes,
) -> list[common_pb2.TokenLogprobs]:
    """The engine's per-token logprobs as the proto's, each alternative with its own text and
    bytes (``bytes_of``: a token id's raw bytes, ``TokenBytes``)."""
    return [
        common_pb2.TokenLogprobs(
            logprob=t.logprob,
            text=text_of(t.token),
            token_bytes=bytes_of(t.token),
            top=[
                common_pb2.TokenLogprob(token_id=i, text=text_of(i), token_bytes=bytes_of(i), logprob=lp)
                for i, lp in t.top
            ],
        )
        for t in tokens
    ]


def chunk_and_finished(
    out: RequestOutput,
    text_of: Callable[[int], str] = str,
    decode: Callable[[list[int]], str] = lambda ids: "",
    bytes_of: Callable[[int], bytes] = _no_bytes,
) -> tuple[inference_pb2.TokenChunk | None, inference_pb2.GenerationFinished | None]:
    """A chunk for new tokens or text, and the final message when the request ended
    (``text_of``: a token id's text, for the logprobs' alternatives; ``decode``: token ids as one
    text, for a scored prompt's ``prompt_text``; ``bytes_of``: a token id's raw bytes)."""
    chunk = None
    if out.new_token_ids or out.text:
        chunk = inference_pb2.TokenChunk(
            text=out.text, token_ids=out.new_token_ids, index=out.index, prompt_tokens=out.prompt_tokens
        )
        if out.logprobs:
            chunk.logprobs.extend(logprobs_pb(out.logprobs, text_of, bytes_of))
        if out.prompt_logprobs:
            chunk.prompt_logprobs.extend(logprobs_pb(out.prompt_logprobs, text_of, bytes_of))
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


@dataclass(eq=False)
class LiveGeneration:
    """One generation on this servicer, from its start until its stream is closed: what a
    ``cancel`` of its request id marks, whatever stage it is in. Its own object, never shared:
    only it removes itself from the servicer's table."""

    request_id: str
    #: A cancel came. Before the engine knows the id (its prompt being tokenized) this is the only
    #: trace of it: the generation then ends CANCELLED without reaching the engine.
    cancelled: bool = False


async def start_generation(
    engine: AsyncEngine, start: inference_pb2.GenerateStart, live: LiveGeneration | None = None
) -> AsyncGenerator[RequestOutput, None]:
    """The engine request for ``start``: its outputs (validated when first iterated).

    Its id is the one ``start`` carries (the router's, or minted by the server half for a
    direct client that sent none): never minted again on the way to the engine.
    ``live``: the generation's own handle, which the servicer's ``cancel`` marks; one marked
    while its prompt was being tokenized (not yet known to the engine, whose abort of an id it
    does not know is lost) ends CANCELLED without reaching the engine.
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
    if live is not None and live.cancelled:
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
        #: request id → the one generation running under it on this servicer, from its start until
        #: its stream is closed (tokenizing, queued or in the engine). One at most: a second start
        #: with the id meanwhile is ALREADY_EXISTS (docs/inference.md, *Request ids*), so a
        #: cancel by id reaches the generation it was sent for and no other.
        self._live: dict[str, LiveGeneration] = {}
        #: Each token id's raw bytes for logprobs (``TokenBytes``): one per model, filled as ids come.
        self._token_bytes: TokenBytes | None = None

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
        request_id = start.request_id
        if request_id in self._live:
            # A second live generation under one id would leave a cancel by that id (all that
            # GenerateMany's and Generate's cancel carry) to reach whichever came first: one
            # client's cancel ended the other's generation. The engine refuses it too, later.
            raise AlreadyExists(
                f"request_id: {request_id!r} names a generation still running on this replica; "
                "a request id must be unique among running generations"
            )
        live = self._live[request_id] = LiveGeneration(request_id)
        stream = start_generation(engine, start, live)
        tokenizer = engine.engine.tokenizer
        bytes_of = self._bytes_of(tokenizer)

        # Once per token id for the whole generation: prompt_logprobs on a long prompt asks for
        # ~170,000 alternatives' texts, which took 0.75 s of the event loop one decode at a time.
        @functools.lru_cache(maxsize=65536)
        def text_of(token_id: int) -> str:
            return str(tokenizer.decode([token_id]))

        def decode(token_ids: list[int]) -> str:
            return str(tokenizer.decode(token_ids))

        try:
            async for out in stream:
                chunk, finished = chunk_and_finished(out, text_of, decode, bytes_of)
                if chunk is not None:
                    yield inference_pb2.GenerationEvent(chunk=chunk)
                if finished is not None:
                    yield inference_pb2.GenerationEvent(finished=finished)
        finally:
            try:
                await stream.aclose()  # aborts it in the engine when it did not finish
            finally:
                if self._live.get(request_id) is live:
                    del self._live[request_id]

    def _bytes_of(self, tokenizer: Any) -> TokenBytes:
        """The model's ``TokenBytes``, made on first use (once per model, not per request)."""
        table = self._token_bytes
        if table is None or table.tokenizer is not tokenizer:
            table = self._token_bytes = TokenBytes(tokenizer)
        return table

    def cancel(self, request_id: str) -> None:
        """``GenerationBackend``: a `cancel` on either RPC, for the one generation running under
        ``request_id`` on this servicer (``generate`` keeps a second from starting)."""
        live = self._live.get(request_id)
        if live is not None:
            live.cancelled = True  # seen after its prompt is tokenized, if the engine did not know it yet
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
