"""Builds the router from its settings and plugs it into the shared server bootstrap."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis.exceptions

from services.common.generate_many.client import ReplicaMultiplexer
from services.common.redact import masked_url
from services.common.server import HealthReporter
from services.common.settings import flag
from services.gen.llmmesh.v1 import retriever_pb2_grpc, router_pb2_grpc, session_pb2_grpc
from services.router.admission.auth import Authenticator
from services.router.admission.ratelimit import InflightLimiter, RateLimiter
from services.router.admission.tls import DialTls, dial
from services.router.api.openai.app import OpenAiFront
from services.router.api.openai.listener import HttpListener, HttpSettings
from services.router.api.servicer import RouterServicer, TaskBackend
from services.router.api.task_api import TaskApi
from services.router.placement import cache_scope
from services.router.placement.discovery import ReplicaDiscovery, parse_address_list
from services.router.placement.health import ActiveHealthChecker
from services.router.placement.kv_events import KvEventsConsumer
from services.router.placement.models import ModelCatalog
from services.router.placement.outliers import EjectionConfig
from services.router.placement.pins import AffinityPins
from services.router.placement.policies import POLICY_NAMES, PrefixSettings, make_policy
from services.router.placement.pool import ReplicaPool
from services.router.placement.prefix_index import PrefixIndex
from services.router.placement.prewarm import SessionMover
from services.router.placement.prompt_hashes import PromptHasher, common_block_size
from services.router.placement.ring import DEFAULT_EPSILON
from services.router.streams.relay import Relay, RelayConfig
from services.router.streams.replay import ReplayBuffer
from services.router.tasks.settings import TaskSettings
from services.router.turns.context import ConversationContext
from services.router.turns.dependencies import TurnServices
from services.router.turns.pipeline import TurnPipeline
from services.router.turns.response_cache import ExactCache, SemanticCache
from services.router.turns.semantic_confidence import (
    DEFAULT_ERROR_BUDGET,
    DEFAULT_REFRESH_RATE,
    EntryConfidence,
)
from services.router.turns.semantic_text import known_words
from services.router.turns.semantic_verify import DEFAULT_CANDIDATE_THRESHOLD
from services.router.turns.warm_history import warm_messages

log = logging.getLogger("llmmesh.router")
SERVICE_NAME = "llmmesh.v1.Router"


@dataclass(frozen=True)
class RouterSettings:
    """Everything the router is configured with; its ``flag()`` fields are the router's flags (cli.py)."""

    # From --replicas, a comma-separated list (the CLI parses it).
    replicas: Sequence[str] = ()
    replicas_dns: str | None = flag(None, help="NAME:PORT resolved periodically (headless Service)")
    replicas_file: str | None = flag(None, help="file of host:port lines, re-read when it changes")
    session_addr: str | None = flag(None, help="session service host:port")
    retriever_addr: str | None = flag(None, help="retriever service host:port")
    redis_url: str | None = flag(None, help="Redis for pins, rate limits, caches, tasks and Resume")
    # --redis-url names a node of a Redis Cluster: the task keys share one hash tag.
    redis_cluster: bool = flag(False, help="--redis-url names a node of a Redis Cluster")
    api_keys_file: str | None = flag(None, help="API keys (hashed); unset = open, one tenant")
    policy: str = flag("auto", choices=POLICY_NAMES, help="balancing policy")
    epsilon: float = flag(DEFAULT_EPSILON, help="bounded-load slack for affinity")
    prefix_prefill_weight: float = flag(
        PrefixSettings.prefill_weight, help="--policy prefix: weight of uncached-prefill seconds"
    )
    prefix_load_weight: float = flag(
        PrefixSettings.load_weight,
        help="--policy prefix: weight of queued-and-running seconds and of other prompts' queued prefill",
    )
    prefix_epsilon: float = flag(
        PrefixSettings.epsilon, help="--policy prefix: bounded-load slack on max(in-flight, reported load)"
    )
    prefix_bound_floor: int = flag(
        PrefixSettings.bound_floor,
        help="--policy prefix: below this load no replica is over the bound",
    )
    prefix_approximate_ttl_s: float = flag(
        PrefixSettings.approximate_ttl_s, help="--policy prefix: how long a sent prompt counts as cached"
    )
    prefix_cache_scope: str = flag(
        cache_scope.TENANT,
        choices=cache_scope.SCOPES,
        help="whose cached prompt blocks a turn may reuse: its tenant's, or every tenant's (shared)",
    )
    max_in_flight: int = flag(2048, help="turns in flight before shedding load")
    relay: RelayConfig = field(default_factory=RelayConfig)
    ejection: EjectionConfig = field(default_factory=EjectionConfig)
    model_aliases: str = flag("", help="alias=model pairs, e.g. fast=M1,quality=M2")
    model_fallbacks: str = flag("", help="model:fallback pairs, tried in order, e.g. M1:M2")
    canary: str = flag("", help="MODEL=NEW:SHARE, e.g. m=m-v2:0.1")
    default_model: str | None = flag(None, help="model for requests that name none")
    health_interval_s: float = flag(1.0, help="active health and load polling period")
    probe_interval_s: float = flag(30.0, help="one-token generation probe period (0 = off)")
    cache_ttl_seconds: int = flag(3600, help="exact-cache entry lifetime")
    # The replicas' model directory or .gguf file; `llm-mesh up` passes its --model. Read only
    # under --policy prefix; unset (or another policy): no prefix hashes, no transformers import.
    tokenizer: str | None = flag(None, help="model dir or .gguf whose tokenizer hashes prompt prefixes")
    semantic_cache_threshold: float = flag(
        DEFAULT_CANDIDATE_THRESHOLD, help="cosine a semantic candidate must reach before it is verified"
    )
    semantic_cache_error_budget: float = flag(
        DEFAULT_ERROR_BUDGET, help="expected false-hit rate each semantic entry's confidence must stay within"
    )
    semantic_cache_refresh_rate: float = flag(
        DEFAULT_REFRESH_RATE, help="share of semantic hits answered fresh to check the cached answer"
    )
    tasks: TaskSettings | None = None
    #: How replicas, the session service and the retriever are dialled: None = plaintext.
    replica_tls: DialTls | None = None
    session_tls: DialTls | None = None
    retriever_tls: DialTls | None = None
    #: The OpenAI-compatible HTTP front; None = off.
    http: HttpSettings | None = None

    def __post_init__(self) -> None:
        if not (self.replicas or self.replicas_dns or self.replicas_file):
            raise ValueError("--replicas, --replicas-dns or --replicas-file: at least one is required")
        if self.health_interval_s <= 0:
            raise ValueError("--health-interval-s must be > 0")
        if not 0.0 < self.semantic_cache_threshold <= 1.0:
            # As a request's own cache.semantic_threshold (router.proto): a cosine of 0 or less
            # would send every stored question to the verifier as a candidate. NaN fails this too.
            raise ValueError(
                f"--semantic-cache-threshold must be in (0, 1], got {self.semantic_cache_threshold}"
            )
        self.prefix_settings()  # its flags are checked at start, whichever policy runs
        for peer, address, tls in (
            ("session", self.session_addr, self.session_tls),
            ("retriever", self.retriever_addr, self.retriever_tls),
        ):
            if tls is not None and not address:
                raise ValueError(f"--{peer}-tls-* without --{peer}-addr: nothing to dial with them")

    def prefix_settings(self) -> PrefixSettings:
        """The ``--prefix-*`` flags as the prefix policy's settings."""
        return PrefixSettings(
            self.prefix_prefill_weight,
            self.prefix_load_weight,
            self.prefix_epsilon,
            self.prefix_bound_floor,
            self.prefix_approximate_ttl_s,
        )


class RouterRuntime:
    """The router as the bootstrap sees it: objects built here, network parts opened in ``start``."""

    service_names: Sequence[str] = (SERVICE_NAME,)

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.redis = self._redis(settings.redis_url, settings.redis_cluster)
        # Each replica's generations share one GenerateMany stream: the pool is handed its maker.
        self.pool = ReplicaPool(ReplicaMultiplexer, settings.ejection, tls=settings.replica_tls)
        self.discovery = ReplicaDiscovery(
            self.pool, settings.replicas, settings.replicas_dns, settings.replicas_file
        )
        self.health = ActiveHealthChecker(self.pool, settings.health_interval_s, settings.probe_interval_s)
        rng = random.Random()
        prefix = settings.prefix_settings()
        #: Which prefix blocks each replica holds: what ``--policy prefix`` scores against. Fed by
        #: every replica's KV events (the consumer) or, for a replica without them, by what this
        #: router sent there (the policy); ListReplicas reports its size per replica.
        self.prefix_index = PrefixIndex(approximate_ttl_s=prefix.approximate_ttl_s)
        self.pool.indexed_blocks = self.prefix_index.block_count
        self.kv_events = KvEventsConsumer(self.pool, self.prefix_index)
        #: The prompt's block hashes with the replicas' tokenizer (--tokenizer), hashed with the
        #: block size the model's replicas report.
        self.prompt_hasher = PromptHasher(
            block_size=lambda model: common_block_size(
                r.kv_block_size for r in self.pool.replicas.values() if r.model == model or not model
            )
        )
        policy = make_policy(settings.policy, rng, settings.epsilon, prefix, self.prefix_index)
        self.replay = ReplayBuffer(self.redis) if self.redis is not None else None
        self.services = TurnServices(
            pool=self.pool,
            relay=Relay(self.pool, policy, settings.relay, rng),
            catalog=ModelCatalog.from_flags(
                settings.model_aliases, settings.model_fallbacks, settings.canary, settings.default_model
            ),
            pins=AffinityPins(self.redis),
            rate_limiter=RateLimiter(self.redis),
            inflight=InflightLimiter(settings.max_in_flight),
            exact_cache=ExactCache(self.redis, settings.cache_ttl_seconds)
            if self.redis is not None
            else None,
            replay=self.replay,
            semantic_confidence=EntryConfidence(
                settings.semantic_cache_error_budget, settings.semantic_cache_refresh_rate, redis=self.redis
            ),
            semantic_threshold=settings.semantic_cache_threshold,
            prefix_cache_scope=settings.prefix_cache_scope,
        )
        if self.uses_prompt_prefix:
            # Only the prefix policy scores prefixes: other policies never tokenize a prompt.
            self.services.prompt_prefix = self.prompt_hasher.prefix
        self.pipeline = TurnPipeline(self.services)
        known_words()  # the semantic verifier's vocabulary, read now rather than on the first lookup
        if settings.api_keys_file:
            self.authenticator = Authenticator.from_file(settings.api_keys_file, redis=self.redis)
        elif self.redis is not None:
            # Keys kept in Redis (`keys add --redis-url`) are required as soon as it holds any:
            # open only while it holds none, and never again once it has (auth.py).
            self.authenticator = Authenticator.from_redis(self.redis, open_tenant_while_empty="default")
        else:
            self.authenticator = Authenticator.open()
        self.tasks: Any = None
        self.servicer = RouterServicer(
            self.pipeline, self.authenticator, self.pool, settings.policy, self.replay, None, None
        )
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references
        self.mover: SessionMover | None = None
        self.http: HttpListener | None = None
        self._health_reporter: HealthReporter | None = None  # the server's, once started
        if settings.http is not None:
            front = OpenAiFront(
                self.pipeline,
                self.authenticator,
                settings.http.limits,
                retriever=lambda: self.servicer.retriever,
                draining=lambda: self._health_reporter is not None and self._health_reporter.stopping,
            )
            self.http = HttpListener(front, settings.http)

    @property
    def uses_prompt_prefix(self) -> bool:
        return self.settings.policy == "prefix"

    @staticmethod
    def _redis(url: str | None, cluster: bool) -> Any:
        if not url:
            log.warning("no --redis-url: pins and rate limits are per router; tasks and Resume are off")
            return None
        import redis.asyncio
        from redis.asyncio.cluster import RedisCluster

        if cluster:
            return RedisCluster.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        return redis.asyncio.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

    def register(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, server)

    async def start(self, health: HealthReporter) -> None:
        self._health_reporter = health
        s = self.settings
        session = retriever = None
        if s.session_addr:
            channel = dial(s.session_addr, s.session_tls)
            self._channels.append(channel)
            session = session_pb2_grpc.SessionStub(channel)
        if s.retriever_addr:
            channel = dial(s.retriever_addr, s.retriever_tls)
            self._channels.append(channel)
            retriever = retriever_pb2_grpc.RetrieverStub(channel)
            self.services.semantic_cache = SemanticCache(retriever)  # type: ignore[arg-type]
            self.servicer.retriever = retriever  # type: ignore[assignment]
        if session is not None or retriever is not None:
            self.services.context = ConversationContext(session, retriever)  # type: ignore[arg-type]
        self.mover = SessionMover(
            self.pool,
            self.services.relay.picker.pick,
            self.services.pins,
            warm_messages(self.services.context),
        )
        self.services.on_session_served = self.mover.note
        self.tasks = self._task_api()
        if self.tasks is not None:
            self.servicer.tasks = self.tasks
        await self.discovery.start()
        self.kv_events.start()
        if self.uses_prompt_prefix and s.tokenizer:
            self._tasks.add(asyncio.get_running_loop().create_task(self.prompt_hasher.load(s.tokenizer)))
        await self.health.check_all()  # know the pool before admitting the first request
        self.pool.mark_started()  # turns that came in meanwhile waited for this (turns/pipeline.py)
        self.health.start()
        await self.authenticator.start()  # logs where keys come from; Redis's read now, then every 5 s
        if self.tasks is not None:
            # Only now: a task taken over from a dead router would otherwise run against an empty pool.
            try:
                await self.tasks.start()
            except (OSError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                raise RuntimeError(
                    f"Redis at {masked_url(self.settings.redis_url or '')} is unreachable ({exc}): start it, or fix "
                    "--redis-url (LLMMESH_REDIS_URL)"
                ) from None
        if self.http is not None:
            await self.http.start()  # in this loop: an HTTP turn is a call into the same pipeline
        await health.set_serving(True)

    def _task_api(self) -> TaskBackend | None:
        if self.redis is None:
            return None  # tasks answer FAILED_PRECONDITION "needs --redis-url"
        # On a Redis Cluster client the task keys take their one-slot layout (tasks/store.py).
        api: TaskBackend = TaskApi(
            self.redis, self.pipeline.run_turn, settings=self.settings.tasks, check_model=self._check_model
        )
        return api

    def _check_model(self, requested: str) -> None:
        """Refuses a model name that no replica known now serves, as a turn would; with no replica
        known yet (a new router, an outage) anything is accepted and waits for one."""
        known = self.pool.models()
        if known:
            self.services.catalog.plan(requested, known)

    async def drain(self) -> None:
        if self.http is not None:
            self.http.begin_shutdown()  # no new connections; open streams finish before close()
        if self.tasks is not None:
            await self.tasks.stop()

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()  # its streams still need the pool, closed below
        if self.mover is not None:
            await self.mover.stop()
        await self.health.stop()
        await self.kv_events.stop()
        self.prompt_hasher.close()
        for task in self._tasks:
            task.cancel()
        await self.discovery.stop()
        await self.pool.close()
        for channel in self._channels:
            await channel.close(None)
        await self.authenticator.close()
        if self.redis is not None:
            await self.redis.aclose()


def static_replicas(raw: str | None) -> list[str]:
    return parse_address_list(raw or "")
