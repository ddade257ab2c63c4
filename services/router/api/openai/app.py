"""The routes of the OpenAI front: auth, body limits, and each endpoint handed to the turn pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Route

from services.common import errors
from services.gen.llmmesh.v1 import retriever_pb2, router_pb2
from services.router.admission.auth import Authenticator, Principal, downstream_metadata
from services.router.api.openai.body import decoded, parsed, too_large
from services.router.api.openai.choices import ChoiceAnswer, ChoiceEvent, ChoiceStreams
from services.router.api.openai.embeddings import check_model, embedding_body, embedding_request, input_error
from services.router.api.openai.errors import ApiError, api_error, bad_request
from services.router.api.openai.extras import REQUEST_ID_RE, request_id_header, response_extras
from services.router.api.openai.framing import Framer, Kind
from services.router.api.openai.metrics import HttpMetrics
from services.router.api.openai.params import Generation, chat_generation, completion_generation
from services.router.api.openai.response_events import ResponseFramer
from services.router.api.openai.responses import ResponseRequest, response_generation
from services.router.api.openai.streaming import (
    NO_EVENT_YET,
    NoEventYet,
    SseResponse,
    parse_event_id,
    sse_body,
    until_disconnected,
)
from services.router.streams.replay import ReplayBuffer
from services.router.turns.pipeline import TurnPipeline

log = logging.getLogger("llmmesh.router.openai")

# Deadline headers, in seconds: ours, a whole turn's, streamed or not.
REQUEST_TIMEOUT = "x-request-timeout"
# What the OpenAI Node SDK sends with a per-request `timeout` (whole seconds, truncated: 0 for one
# under a second). Its timer runs until the response's headers, so it bounds a whole answer only
# when that answer comes whole; a stream's headers come with its first event (or a keep-alive), and
# the SDK then reads on without limit. As a turn's deadline it cut every longer stream (a 3 s
# timeout ended a 5 s stream with a 504 event the SDK itself would have read to its end).
SDK_TIMEOUT = "x-stainless-timeout"
OWNER = "llm-mesh"
CLIENT_GONE = object()
# The router is told its retriever's embedding model only in an Embed reply (``EmbedResponse.model``,
# what /v1/embeddings answers with): /v1/models embeds this one word to learn it, and keeps the name
# this long (every /v1/embeddings reply renews it), so a retriever restarted on another model shows.
EMBEDDING_PROBE_TEXT = "llm-mesh"
EMBEDDING_NAME_TTL_S = 60.0
# A retriever that did not answer is asked again after this long, each ask bounded by the timeout:
# a retriever that is down must not hold every model list for long.
EMBEDDING_RETRY_S = 5.0
EMBEDDING_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Deadlines:
    """A request's deadlines from its headers (monotonic seconds; None: none given)."""

    #: X-Request-Timeout: the whole turn.
    request: float | None = None
    #: X-Stainless-Timeout: a whole answer, not a stream.
    sdk: float | None = None

    def of(self, stream: bool) -> float | None:
        given = [d for d in (self.request, None if stream else self.sdk) if d is not None]
        return min(given) if given else None


@dataclass(frozen=True)
class FrontLimits:
    """How the HTTP front bounds a request."""

    max_body_bytes: int = 4 * 1024 * 1024
    #: Seconds without an event before a stream sends ``: keep-alive`` (and before a queued
    #: stream starts its response rather than wait for a first token that decides its status).
    keepalive_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("--http-max-body-bytes must be >= 1")
        if not self.keepalive_s > 0:
            raise ValueError("--http-keepalive-s must be > 0")


class OpenAiFront:
    """The endpoints, over the router's own pipeline, authenticator and pool."""

    def __init__(
        self,
        pipeline: TurnPipeline,
        authenticator: Authenticator,
        limits: FrontLimits = FrontLimits(),
        clock: Callable[[], float] = time.monotonic,
        retriever: Callable[[], Any] = lambda: None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.pipeline = pipeline
        #: The router is shutting down (its gRPC health says NOT_SERVING): /health says so too.
        self._draining = draining
        self.authenticator = authenticator
        # Looked up per request: the router dials the retriever only once it has started.
        self._retriever = retriever
        self.limits = limits
        self._clock = clock
        # Resumable streams whose client has gone, still generating into the replay buffer.
        self._detached: set[ChoiceStreams] = set()
        # The retriever's embedding model as last learned (None: unknown), when, and the ask in flight.
        self._embedding_name: str | None = None
        self._embedding_at = -math.inf
        self._embedding_ask: asyncio.Future[str | None] | None = None

    def app(self) -> Any:
        routes = [
            Route("/health", self._endpoint(self.health), methods=["GET"]),
            Route("/v1/models", self._endpoint(self.list_models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint(self.get_model), methods=["GET"]),
            Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/embeddings", self._endpoint(self.embeddings), methods=["POST"]),
            Route("/v1/responses", self._endpoint(self.responses), methods=["POST"]),
            Route(
                "/v1/responses/{response_id:path}",
                self._endpoint(self.stored_response),
                methods=["GET", "DELETE"],
            ),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
        # No 307 to the path without its trailing slash (OneTrailingSlash answers that in place): a
        # path that is still unknown is a 404 in OpenAI's shape, never an empty redirect.
        app.router.redirect_slashes = False
        # Outside the metrics: a route's requests count under its label with or without the slash.
        return OneTrailingSlash(HttpMetrics(app), routes)

    def _endpoint(self, handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
        """Every failure leaves as an OpenAI-shaped error with the table's status, never a traceback."""

        async def run(request: Request) -> Any:
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                response = error_response(api_error(exc, request.url.path))
            # A caller's own id comes back on every answer, errors included, for its logs to match ours.
            echo = request.headers.get("x-request-id")
            if echo is not None and REQUEST_ID_RE.fullmatch(echo) and isinstance(response, Response):
                response.headers.setdefault("x-request-id", echo)
            return response

        return run

    # -- endpoints

    async def health(self, request: Request) -> Response:
        """200 while a turn can be placed; 503 while none can, or the router is draining.

        What an HTTP load balancer or probe reads. It said "ok" while the only replica was dead
        (its model stays known) and through the whole drain window, so a balancer checking it
        kept sending turns that failed, and never saw the drain coming.
        """
        if self._draining():
            raise ApiError(503, "the router is shutting down", "service_unavailable_error", "draining")
        models = sorted({r.model for r in self.pipeline.s.pool.replicas.values() if r.model and r.eligible})
        if not models:
            raise ApiError(503, "no inference replica is serving", "service_unavailable_error", "no_replica")
        return JSONResponse({"status": "ok", "models": models})

    async def list_models(self, request: Request) -> Response:
        principal = self._principal(request)
        listed = sorted(self._listed())
        # After the chat models: clients that take the list's first entry as the model to chat with
        # (some do) still get one.
        embedding = await self._embedding_model(principal)
        if embedding is not None and embedding not in listed:
            listed.append(embedding)
        return JSONResponse({"object": "list", "data": [self._model(m) for m in listed]})

    async def get_model(self, request: Request) -> Response:
        principal = self._principal(request)
        name = request.path_params["model"]
        known = self._listed()
        if name not in known and (embedding := await self._embedding_model(principal)) is not None:
            known.add(embedding)  # asked only for a name no chat model has
        if name not in known:
            served = ", ".join(sorted(known)) or "none yet"
            raise ApiError(
                404,
                f"model {name!r} not found; this router serves: {served}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return JSONResponse(self._model(name))

    async def chat(self, request: Request) -> Any:
        return await self._generate(request, "chat", chat_generation, "chatcmpl-")

    async def completions(self, request: Request) -> Any:
        return await self._generate(request, "text", completion_generation, "cmpl-")

    async def embeddings(self, request: Request) -> Response:
        principal = self._principal(request)
        deadline = self._deadlines(request).of(stream=False)
        wanted = embedding_request(await self._json(request))
        stub = self._retriever()
        if stub is None:
            raise errors.FailedPrecondition("embeddings need --retriever-addr: this router has no retriever")
        if (limiter := self.pipeline.s.rate_limiter) is not None:
            await limiter.admit_request(principal)  # an embedding request is a request like a turn
        timeout = None if deadline is None else max(0.001, deadline - self._clock())
        # One of the router's in-flight places, as a turn holds one: --max-in-flight bounds the
        # embeddings waiting on the retriever too (they took none, so a flood of them queued there).
        inflight = self.pipeline.s.inflight
        slot = inflight.slot() if inflight is not None else contextlib.nullcontext()
        try:
            with slot:
                # Refused when over-long, as OpenAI and vLLM refuse it: a cut text's vector would
                # silently say nothing of its end.
                reply = await stub.Embed(
                    retriever_pb2.EmbedRequest(texts=wanted.texts, truncate=False),
                    metadata=downstream_metadata(principal),
                    timeout=timeout,
                )
        except grpc.aio.AioRpcError as exc:
            raise input_error(api_error(exc, request.url.path)) from None
        self._learned_embedding_model(reply.model or None)
        check_model(wanted.model, reply.model)
        return JSONResponse(embedding_body(wanted, reply))

    # -- the one generation path

    async def _generate(
        self, request: Request, kind: Kind, parse: Callable[[Any, str], Generation], prefix: str
    ) -> Any:
        principal = self._principal(request)
        deadlines = self._deadlines(request)
        body = await self._json(request)
        given_id = request_id_header(request.headers.get("x-request-id"))
        resume_from = request.headers.get("last-event-id")
        request_id = given_id or uuid.uuid4().hex
        seen: list[int] | None = None
        if resume_from is not None:
            # The ids of the stream being resumed come from its event id, not from this request.
            choices = parse(body, request_id).turns
            request_id, seen = parse_event_id(resume_from, prefix, len(choices))
        generation = parse(body, request_id)
        completion_id = prefix + request_id
        headers = {"x-request-id": request_id}
        framer = Framer(
            kind,
            completion_id,
            int(time.time()),
            self._model_name(generation.model),
            generation.per_prompt,
            generation.tool,
            generation.constraint,
            generation.echo,
            generation.score_only,
            generation.max_tokens_field,
        )
        try:
            return await self._answer(
                request,
                generation,
                framer,
                principal,
                deadlines.of(generation.stream),
                given_id,
                seen,
                headers,
            )
        except Exception as exc:
            raise framer.error(exc, request.url.path) from None

    async def _answer(
        self,
        request: Request,
        generation: Generation,
        framer: Framer,
        principal: Principal,
        deadline: float | None,
        given_id: str | None,
        seen: list[int] | None,
        headers: dict[str, str],
    ) -> Any:
        """The answer to a parsed generation request: whole, or an SSE stream. Its errors leave
        through ``framer.error`` (the caller), naming fields as the request named them."""
        replay = self.pipeline.s.replay
        if (seen is not None or generation.extras.resumable) and replay is None:
            param = "Last-Event-ID" if seen is not None else "resumable"
            raise bad_request(
                param,
                f"{param}: resuming a stream needs the replay buffer (--redis-url)",
                "failed_precondition",
            )
        if seen is not None:
            assert replay is not None
            if not generation.stream:
                raise bad_request(
                    "Last-Event-ID", "header Last-Event-ID: only a stream (stream: true) resumes"
                )
            streams = ChoiceStreams.of_replay(
                replay, principal.tenant, [t.request_id for t in generation.turns]
            )
        else:
            await self._refuse_reused_id(given_id, generation, principal.tenant)
            admitted = await self._admit_choices(principal, generation)
            streams = ChoiceStreams.of_turns(self.pipeline, principal, generation.turns, deadline, admitted)
        with_extras = generation.extras.any
        if not generation.stream:
            answers = await _whole_answers(streams, request)
            if isinstance(answers, Response):
                return answers
            whole = framer.whole(answers)
            if with_extras and answers and answers[0].end is not None:
                whole["llm_mesh"] = response_extras(answers[0].end)
            return JSONResponse(whole, headers=headers)
        # A resumable stream's turns outlive its connection; any other's end with it, and so does a
        # resumed one's reading of the replay buffer (the turns it reads run on their own).
        on_gone = self._detach if generation.extras.resumable and seen is None else _close
        first = await self._first_event(streams, request, on_gone)
        if isinstance(first, Response):
            return first
        body_iter = sse_body(
            streams,
            framer,
            first,
            generation.include_usage,
            self.limits.keepalive_s,
            seen,
            with_extras,
            with_ids=generation.extras.resumable or seen is not None,
            continuous_usage=generation.continuous_usage,
        )
        return SseResponse(body_iter, lambda: on_gone(streams), headers)

    async def _refuse_reused_id(self, given_id: str | None, generation: Generation, tenant: str) -> None:
        """A 409 for a caller's request id the replay buffer already holds a turn by: its turn's
        messages would not be buffered (those seqs are taken), and a resume (HTTP or gRPC
        ``Resume``) would replay the earlier answer. Refused rather than mixed."""
        replay = self.pipeline.s.replay
        if (
            given_id is not None
            and replay is not None
            and await _buffered(replay, generation.turns[0], tenant)
        ):
            raise ApiError(
                409,
                f"x-request-id {given_id!r} was used by a recent request; send a new one",
                "conflict_error",
                "request_id_reused",
                "x-request-id",
                # The SDKs retry a 409 with the same headers, so the same id: refused again each
                # time, a timed-out call's retries turned into a ConflictError after all of them.
                retryable=False,
            )

    async def _first_event(
        self,
        streams: ChoiceStreams,
        request: Request,
        on_gone: Callable[[ChoiceStreams], Awaitable[None]],
    ) -> ChoiceEvent | NoEventYet | Response:
        """A stream's first message, before its response starts; a 499 if the client left first.

        Admission, rate limits, an unknown model, no replica: all decided before the first token,
        so waiting for it lets those answer with their own status, not a 200 stream. A stream
        still queued after the keep-alive period starts without it (``NO_EVENT_YET``)."""
        first: ChoiceEvent | NoEventYet | None
        try:
            first = await _unless_gone(streams.next(self.limits.keepalive_s), request)
        except TimeoutError:
            first = NO_EVENT_YET
        except BaseException:
            await streams.close()
            raise
        if first is CLIENT_GONE:
            await on_gone(streams)
            return Response(status_code=499)
        if first is None:
            # Cannot happen (every turn yields its TurnEnd) but must not hang.
            await streams.close()
            raise ApiError(500, "the turn ended without an answer", "server_error", "internal_error")
        return first

    # -- the Responses API (responses.py, response_events.py)

    async def responses(self, request: Request) -> Any:
        principal = self._principal(request)
        deadlines = self._deadlines(request)
        body = await self._json(request)
        given_id = request_id_header(request.headers.get("x-request-id"))
        request_id = given_id or uuid.uuid4().hex
        wanted = response_generation(body, request_id)
        deadline = deadlines.of(wanted.generation.stream)
        framer = ResponseFramer(
            wanted, "resp_" + request_id, int(time.time()), self._model_name(wanted.generation.model)
        )
        await self._refuse_reused_id(given_id, wanted.generation, principal.tenant)
        try:
            return await self._respond(
                request, wanted, framer, principal, deadline, {"x-request-id": request_id}
            )
        except Exception as exc:
            raise framer.error(exc, request.url.path) from None

    async def _respond(
        self,
        request: Request,
        wanted: ResponseRequest,
        framer: ResponseFramer,
        principal: Principal,
        deadline: float | None,
        headers: dict[str, str],
    ) -> Any:
        generation = wanted.generation
        admitted = await self._admit_choices(principal, generation)
        streams = ChoiceStreams.of_turns(self.pipeline, principal, generation.turns, deadline, admitted)
        if not generation.stream:
            answers = await _whole_answers(streams, request)
            if isinstance(answers, Response):
                return answers
            return JSONResponse(framer.whole(answers[0]), headers=headers)
        first = await self._first_event(streams, request, _close)
        if isinstance(first, Response):
            return first
        return SseResponse(
            framer.events(streams, first, self.limits.keepalive_s), lambda: _close(streams), headers
        )

    async def stored_response(self, request: Request) -> Response:
        self._principal(request)
        raise ApiError(
            404,
            f"response {request.path_params['response_id']!r} not found: this server does not store "
            "responses (store is accepted and ignored); keep the response you were sent",
            "invalid_request_error",
            "response_not_found",
            "response_id",
        )

    async def _detach(self, streams: ChoiceStreams) -> None:
        """The client left a resumable stream: its turns run to their end, held here until then."""
        finished = streams.detach()
        self._detached.add(streams)
        finished.add_done_callback(lambda _: self._detached.discard(streams))

    async def close(self) -> None:
        """Router shutdown: the resumable turns nobody is reading are cancelled (their replay
        buffers end CANCELLED, so a client resuming later is told)."""
        detached, self._detached = self._detached, set()
        await asyncio.gather(*(s.close() for s in detached), return_exceptions=True)

    # -- helpers

    def _principal(self, request: Request) -> Principal:
        header = request.headers.get("authorization")
        if header is None and not self.authenticator.is_open:
            # The authenticator speaks gRPC ("send metadata …"); an HTTP client sends a header.
            raise errors.Unauthenticated("missing API key: send the header 'Authorization: Bearer <api key>'")
        return self.authenticator.authenticate([("authorization", header)] if header is not None else [])

    def _deadlines(self, request: Request) -> Deadlines:
        now = self._clock()

        def read(name: str, zero_is_none: bool) -> float | None:
            raw = request.headers.get(name)
            if raw is None:
                return None
            try:
                value = float(raw)
            except ValueError:
                value = float("nan")
            if value == 0 and zero_is_none:
                return None  # the SDK's timeout was under a second; it gives up by itself
            if not value > 0 or value == float("inf"):
                raise bad_request(name, f"header {name}: must be a positive number of seconds")
            return now + value

        return Deadlines(read(REQUEST_TIMEOUT, False), read(SDK_TIMEOUT, True))

    async def _json(self, request: Request) -> Any:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # a chunked body has no length to check up front
                raise too_large(limit)
            chunks.append(chunk)
        return parsed(decoded(b"".join(chunks), request.headers.get("content-encoding"), limit))

    async def _admit_choices(self, principal: Principal, generation: Generation) -> bool:
        """Takes the key's requests for every choice at once, all or none; False for one choice,
        which its turn admits itself. Choice by choice, ``n`` past the key's burst was a 429
        forever, each try spending the requests its first choices got."""
        limiter = self.pipeline.s.rate_limiter
        count = len(generation.turns)
        if limiter is None or count <= 1:
            return False
        field = "n" if generation.per_prompt > 1 else "prompt"
        await limiter.admit_request(principal, requests=count, field=field)
        return True

    def _known(self) -> set[str]:
        return self.pipeline.s.pool.models()

    async def _embedding_model(self, principal: Principal) -> str | None:
        """The retriever's embedding model as /v1/embeddings names it (OpenAI lists embedding models
        with the others); None without a retriever, or while it does not answer, as a chat model is
        listed only while a replica serves it."""
        stub = self._retriever()
        if stub is None:
            return None
        kept_for = EMBEDDING_NAME_TTL_S if self._embedding_name is not None else EMBEDDING_RETRY_S
        if self._clock() - self._embedding_at < kept_for:
            return self._embedding_name
        if self._embedding_ask is None or self._embedding_ask.done():
            # One ask at a time, whoever lists the models meanwhile waits for the same answer.
            self._embedding_ask = asyncio.ensure_future(self._ask_embedding_model(stub, principal))
        # Shielded: a client that leaves does not cancel the answer other callers wait for.
        return await asyncio.shield(self._embedding_ask)

    async def _ask_embedding_model(self, stub: Any, principal: Principal) -> str | None:
        try:
            reply = await stub.Embed(
                retriever_pb2.EmbedRequest(texts=[EMBEDDING_PROBE_TEXT]),
                metadata=downstream_metadata(principal),
                timeout=EMBEDDING_PROBE_TIMEOUT_S,
            )
            name: str | None = reply.model or None
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "the retriever did not name its embedding model (%s: %s); /v1/models leaves it out",
                exc.code().name,
                exc.details(),
            )
            name = None
        self._learned_embedding_model(name)
        return name

    def _learned_embedding_model(self, name: str | None) -> None:
        self._embedding_name, self._embedding_at = name, self._clock()

    def _listed(self) -> set[str]:
        """The served models and every ``--model-aliases`` name a served model answers, as vLLM lists
        each served name: model pickers (Open WebUI) offer only what the list holds, and
        ``models.retrieve`` checks were a 404 for a name the chat endpoint takes."""
        known = self._known()
        catalog = self.pipeline.s.catalog
        listed = set(known)
        for alias in catalog.aliases:
            try:
                if any(m in known for m in catalog.plan(alias, known)):
                    listed.add(alias)
            except errors.MeshError:
                pass  # its model is not served now
        return listed

    def _model_name(self, requested: str) -> str:
        """What chunks name as the model before the TurnEnd says which answered: the alias resolved."""
        catalog = self.pipeline.s.catalog
        try:
            return catalog.plan(requested, self._known())[0]
        except Exception:
            return requested  # the turn itself will say what is wrong with it

    @staticmethod
    def _model(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": OWNER}


async def _buffered(replay: ReplayBuffer, turn: router_pb2.ChatRequest, tenant: str) -> bool:
    """Whether the replay buffer already holds a turn by this id; False when Redis cannot say, since
    the buffer is best effort (a Redis outage never fails an answer, as in the replay writer)."""
    try:
        return await replay.holds(turn.request_id, tenant)
    except Exception as exc:
        log.warning("could not check request id %s against the replay buffer: %s", turn.request_id, exc)
        return False


async def _whole_answers(streams: ChoiceStreams, request: Request) -> list[ChoiceAnswer] | Response:
    """Every choice whole, the turns then closed; a 499 if the client left first (they are cancelled)."""
    try:
        answers = await _unless_gone(streams.answers(), request)
    finally:
        await streams.close()
    return Response(status_code=499) if answers is CLIENT_GONE else answers


async def _close(streams: ChoiceStreams) -> None:
    await streams.close()


async def _unless_gone(work: Awaitable[Any], request: Request) -> Any:
    """``work``'s result, or cancel it when the client disconnects first (no one would read the answer)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(until_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return CLIENT_GONE  # nobody reads it; counted as 499, as nginx names a client that left
    return task.result()


class OneTrailingSlash:
    """ASGI middleware: a path that is a route's with one slash more (``/v1/chat/completions/``) is
    answered as that route, in place.

    Starlette answered it with a 307 to the path without the slash and an empty body: clients that
    follow a redirect of a POST may resend it without its body, and those that do not follow saw an
    empty answer. vLLM and OpenAI take the path either way. A path unknown either way keeps its
    slash, so its 404 names the path as the client sent it.
    """

    def __init__(self, app: Any, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            trimmed = {**scope, "path": path[:-1]}
            if any(route.matches(trimmed)[0] != Match.NONE for route in self.routes):
                raw = scope.get("raw_path")
                if isinstance(raw, bytes) and raw.endswith(b"/"):
                    trimmed["raw_path"] = raw[:-1]
                scope = trimmed
        await self.app(scope, receive, send)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Unknown paths and wrong methods, in the same error shape as everything else."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    # OpenAI's own answer to an unknown URL is an invalid_request_error.
    kinds = {
        404: ("invalid_request_error", "unknown_url"),
        405: ("invalid_request_error", "method_not_allowed"),
    }
    kind, code = kinds.get(status, ("invalid_request_error", "bad_request"))
    message = f"{request.method} {request.url.path}: {exc.detail if isinstance(exc, HTTPException) else exc}"
    response = error_response(ApiError(status, message, kind, code))
    if isinstance(exc, HTTPException) and exc.headers:
        response.headers.update(exc.headers)  # a 405's Allow: which methods the route takes (RFC 9110)
    return response
