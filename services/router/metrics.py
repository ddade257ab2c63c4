"""Prometheus metrics of the router (names fixed by the router issue)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS

# Inter-token gaps are short: finer buckets at the low end.
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

TTFT = Histogram(
    "llmmesh_router_ttft_seconds",
    "Time from a turn's arrival at the router to its first token leaving it.",
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN = Histogram(
    "llmmesh_router_inter_token_latency_seconds",
    "Gap between consecutive token messages relayed to a client.",
    buckets=ITL_BUCKETS,
)
E2E = Histogram(
    "llmmesh_router_e2e_latency_seconds",
    "Time from a turn's arrival to its TurnEnd.",
    buckets=LATENCY_BUCKETS,
)
RETRIES = Counter(
    "llmmesh_router_retries_total", "Attempts retried on another replica before the first token."
)
FAILOVERS = Counter(
    "llmmesh_router_failovers_total", "Streams resumed on another replica after tokens had flowed."
)
EJECTIONS = Counter("llmmesh_router_replica_ejections_total", "Replicas ejected by outlier detection.")
CACHE_HITS = Counter("llmmesh_router_cache_hits_total", "Turns answered from a response cache.", ["layer"])
SEMANTIC_REJECTIONS = Counter(
    "llmmesh_router_semantic_rejections_total",
    "Semantic-cache candidates not served, by the check that refused (or confidence).",
    ["reason"],
)
SEMANTIC_REFRESHES = Counter(
    "llmmesh_router_semantic_refreshes_total",
    "Semantic candidates answered fresh and compared: did the fresh answer agree with the cached one.",
    ["outcome"],
)
SEMANTIC_SKIPPED = Counter(
    "llmmesh_router_semantic_skipped_total",
    "Turns that asked for the semantic cache and could not use it.",
    ["reason"],
)
# llmmesh_router_rate_limited_total{reason} lives in admission/ratelimit.py, next to the limiter that counts it.
TOKENS = Counter(
    "llmmesh_router_tokens_total", "Tokens through the router: prompt in, completion out.", ["direction"]
)
# Bound once: ``labels()`` looks its child up under a lock, on every turn's end path otherwise.
PROMPT_TOKENS = TOKENS.labels(direction="prompt")
COMPLETION_TOKENS = TOKENS.labels(direction="completion")
IN_FLIGHT = Gauge("llmmesh_router_in_flight", "Turns this router is serving now.")
# Prefix index, per replica address (placement/kv_events.py): removed when the replica leaves.
KV_INDEX_BLOCKS = Gauge(
    "llmmesh_router_kv_index_blocks", "Prefix blocks the router's index holds per replica.", ["replica"]
)
KV_EVENT_LAG = Gauge(
    "llmmesh_router_kv_event_lag_seconds",
    "Age of the newest KV event applied per replica when it arrived (replica clock to router clock).",
    ["replica"],
)
KV_RESYNCS = Counter(
    "llmmesh_router_kv_resyncs_total",
    "KV event streams restarted from a snapshot: gap, stream broken or ended, overflow (more blocks than the replica holds) or invalid (a message the index cannot take).",
    ["reason"],
)
PLACEMENTS = Counter(
    "llmmesh_router_placements_total",
    "Replica choices by why they were made: pin, ring, prefix, load, fallback (placement/pipeline.py).",
    ["reason"],
)
# Both counted by the relay's picker (streams/relay.py ``count_placement``).
# Prompt lengths run to a few thousand tokens; a hit is some number of whole KV blocks of them.
PREFIX_HIT_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFIX_HIT_TOKENS = Histogram(
    "llmmesh_router_prefix_hit_tokens",
    "Leading prompt tokens the chosen replica holds per the prefix index, per placement of a hashed prompt.",
    buckets=PREFIX_HIT_BUCKETS,
)
PREFIX_TOKENIZER_LOADED = Gauge(
    "llmmesh_router_prefix_tokenizer_loaded",
    "1 once --tokenizer is loaded and prompts get prefix hashes; 0 before (placement treats prompts as uncached).",
)
PREFIX_PROMPT_TOKENS = Counter(
    "llmmesh_router_prefix_prompt_tokens_total",
    "Prompt tokens of the placements counted in llmmesh_router_prefix_hit_tokens: the hit rate's denominator.",
)
PREFIX_HASH_TIMEOUTS = Counter(
    "llmmesh_router_prefix_hash_timeouts_total",
    "Turns placed without prefix hashes because hashing their prompt took longer than its 250 ms wait "
    "(the worker was busy with a long prompt).",
)
