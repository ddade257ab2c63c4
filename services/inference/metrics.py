"""Prometheus metrics of the inference service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS

# Inter-token gaps are short: finer buckets at the low end.
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter(
    "llmmesh_inference_requests_total", "Generations finished, by finish reason.", ["finish_reason"]
)
TIME_TO_FIRST_TOKEN = Histogram(
    "llmmesh_time_to_first_token_seconds",
    "From arrival to the first generated token.",
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "llmmesh_inter_token_latency_seconds",
    "Gap between consecutive generated tokens.",
    buckets=TOKEN_GAP_BUCKETS,
)
E2E_LATENCY = Histogram(
    "llmmesh_e2e_request_latency_seconds", "From arrival to the final message.", buckets=LATENCY_BUCKETS
)
QUEUE_DEPTH = Gauge("llmmesh_queue_depth", "Requests admitted but not yet running.")
RUNNING_BATCH = Gauge("llmmesh_running_batch_size", "Sequences in the running batch.")
PARKED = Gauge(
    "llmmesh_parked_sequences", "Sequences held out of the batch because their readers stopped taking tokens."
)
KV_CACHE_USAGE = Gauge("llmmesh_kv_cache_usage_ratio", "Share of KV-cache blocks held by sequences.")
PREFIX_CACHE_HIT_TOKENS = Counter(
    "llmmesh_prefix_cache_hit_tokens_total", "Prompt tokens whose KV came from the prefix cache."
)
PROMPT_TOKENS = Counter("llmmesh_prompt_tokens_total", "Prompt tokens of finished generations.")
GENERATION_TOKENS = Counter("llmmesh_generation_tokens_total", "Tokens generated.")
PREEMPTIONS = Counter(
    "llmmesh_preemptions_total", "Sequences whose KV was dropped for lack of blocks (recomputed later)."
)
