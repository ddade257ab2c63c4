"""Whose cached prompt blocks a turn may reuse: the salt the router puts on every generation.

A replica's prefix cache is a timing side channel: a prompt whose first blocks are cached gets
its first token sooner, so a client that can time its own requests learns whether someone sent
that prefix before (a system prompt, a document, a question) — published as prompt-leaking
attacks on shared KV caches, and the reason vLLM added ``cache_salt``. The router closes it
between tenants by salting every generation's block hashes with its tenant (``tenant``, the
default scope): blocks are reused within a tenant, never across. ``shared`` keeps one cache for
every tenant (a single-tenant deployment, or tenants that trust each other, gain the reuse of a
common system prompt across them). A client may narrow its own scope further with
``ChatRequest.cache_salt`` (per end user, say); it never widens it. Placement sees the same salted
hashes the replicas report (``prompt_hashes.py`` hashes the salted chain), so prefix-aware
placement keeps working within each scope.
"""

from __future__ import annotations

from typing import Final

TENANT: Final = "tenant"
SHARED: Final = "shared"
SCOPES: Final = (TENANT, SHARED)

#: The longest ``ChatRequest.cache_salt`` a client may send (the replica takes 1,024 bytes, which
#: a 256-character tenant and this salt fit within with their framing).
MAX_CLIENT_SALT_BYTES: Final = 256


def generation_salt(scope: str, tenant: str, client_salt: str) -> str:
    """The ``GenerateStart.cache_salt`` for a turn of ``tenant`` asking for ``client_salt``.

    Length-prefixed, so no tenant and client salt can together spell another pair's salt
    (tenant ``a`` with salt ``b:c`` against tenant ``a:b`` with salt ``c``).
    """
    if scope == SHARED:
        return client_salt
    return f"{len(tenant)}:{tenant}:{client_salt}"
