"""Bounds on a request's sampling settings that the engine enforces and the fronts say first."""

from __future__ import annotations

#: Stop strings a request may set, and their length. Every new token is searched for each of
#: them on the engine thread that steps every sequence: 300,000 short stop strings (2.4 MB, under
#: gRPC's message limit) made another client's 32-token answer 67 % slower. OpenAI allows 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
#: Alternatives of a ``choice`` constraint. 10,000 compile in 0.17 s; 100,000 held the replica's
#: grammar compiler for 29 s before llguidance refused them (its grammars hold < 65,535 symbols).
MAX_CHOICES = 10_000
#: Stop token ids a request may set (each drawn token is looked up in them).
MAX_STOP_TOKEN_IDS = 64
#: Ids of an ``allowed_token_ids`` list: the router hashes the list into cache keys on its event
#: loop (16,384 ids: 2 ms) and the engine indexes it at every step.
MAX_ALLOWED_TOKEN_IDS = 16_384
#: Words of a ``bad_words`` list (each is looked for at the end of the output at every step).
MAX_BAD_WORDS = 64
#: Entries of a ``logit_bias``: OpenAI's own bound. Every entry is added to its row at every step.
MAX_LOGIT_BIAS = 300
#: OpenAI's bounds on ``logit_bias`` values (-100 bans a token in practice, 100 forces it) and on
#: ``presence_penalty`` / ``frequency_penalty``.
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_ADDITIVE_PENALTY = 2.0
