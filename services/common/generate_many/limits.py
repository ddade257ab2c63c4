"""The flow limits of a GenerateMany generation, from the engine to the router's client, in one place.

A slow reader is held back at each hop by one of these, and they are sized
against each other: the engine parks a sequence long before the router would
pause it, the router merges what waits long before it pauses, and no message
outgrows gRPC's limit. Pure constants: the engine imports them, so nothing here
may pull in grpc, protobuf or asyncio.
"""

from __future__ import annotations

#: Outputs (about one token each) waiting for a replica's reader before the engine parks the
#: sequence (async_engine.py). A reader merely busy with its last write lags a few steps; this many
#: steps behind, it is not reading, so the engine stops computing it and gives its seat and KV
#: blocks to others instead of running it to max_tokens into a queue nobody reads.
PARK_AFTER_OUTPUTS = 64

#: The largest ``GenerateStart`` a generation may open with on a shared GenerateMany stream: gRPC's
#: 4 MiB message limit less room for the request's other fields. A bigger one ended the whole
#: stream (RESOURCE_EXHAUSTED) for every generation on it, then did the same on the next replica.
MAX_START_BYTES = (4 << 20) - (64 << 10)

#: A message's share of the 4 MiB gRPC limit: a step's events beyond it go in the next message
#: (server half). A single event is bounded by its generation's max_tokens, far below the limit.
MESSAGE_BUDGET_BYTES = 1 << 20

#: Events a generation holds for a consumer that is not taking them, before they are merged into
#: one chunk (client half): a client that falls behind costs the router token ids and text (about
#: 9 bytes a token), not a protobuf message per token.
MERGE_PENDING_AFTER = 32

#: Tokens a generation holds for its consumer before the client half asks the replica to ``pause``
#: it (``resume`` once the consumer takes them). A client that stops reading then costs the router
#: about this many tokens, and the router's CPU nothing more, instead of its whole answer relayed
#: into memory: the shared stream's HTTP/2 flow control cannot hold back one generation alone.
PAUSE_AFTER_TOKENS = 1024

#: Events a GenerateMany stream holds for a router that takes its messages slower than its
#: generations make them (server half) before those generations wait to put more in. The shared
#: stream's HTTP/2 flow control holds back the writer, not the generations: without this bound a
#: replica kept making answers into its outbox, and a router that asked to ``pause`` a slow reader's
#: generation could get the rest of that answer anyway. Row 6 (100 slow readers of 64,000-token
#: answers from unpaced synthetic replicas) alone, 2026-12-06: without a bound 2 bad runs in 7
#: (quiet after 8.5 and 19 s, router RSS +80 and +157 MiB; normally 1 s and +12-24 MiB); bounded
#: at 65,536, 2 in 11; at 4,096, none in 20. The price is paid only when the router is behind:
#: with unpaced sources (64 streams × 4,096 tokens, interleaved rounds) its relay made 0.83-0.96×
#: the tokens/s of no bound by the medians of two runs (rounds 0.66-1.04×; smaller messages,
#: less merging). An engine step of 256 rows is 256 events, so a router that keeps up never meets
#: it; a waiting engine generation is parked after ``PARK_AFTER_OUTPUTS``.
OUTBOX_EVENTS = 4096

#: The HTTP/2 window of the channel a GenerateMany stream runs on (the router's replica channels).
#: One stream carries every generation on the replica. A small fixed window (no BDP probing to grow
#: it) is backpressure that batches: when the router falls behind, the replica's writer waits and
#: its next message carries everything that piled up. Measured A/B (bench/router.py loads, same run
#: each): tokens per router CPU-second with unpaced sources 151k at 8 KiB vs 34k at 4 MiB, 131k vs
#: 106k at 64 KiB; with engine-like steps 8 KiB was as good or better. A slow client costs merged
#: tokens in the router (``MERGE_PENDING_AFTER``), never a stalled replica stream.
STREAM_WINDOW_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 8192),
]
