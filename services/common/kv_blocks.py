"""The chained KV block hash: the one contract between a replica's prefix cache and the router.

Hash *i* of a prompt's chain covers its tokens ``[0, (i + 1) * block_size)``: it is XXH3-64 of
block *i*'s token ids (little-endian uint32) seeded with hash *i - 1* (seed 0 for the first
block). Equal hashes mean equal prefixes (up to a 2^-64 collision, which the replica's block
manager rules out by comparing the stored tokens). Python's ``hash()`` it replaces is salted per
process for str and free to change between versions; XXH3 is a fixed, documented algorithm, so a
router and a replica on different machines and Python versions compute the same numbers.

A *salted* chain (``GenerateStart.cache_salt``, vLLM's ``cache_salt``) seeds its first block
with ``salt_seed(salt)`` instead of 0: XXH3-64 of the salt's UTF-8 bytes, seeded with
``SALT_DOMAIN``. Every hash of the chain then differs from the unsalted one and from any other
salt's, so a replica reuses a cached block only for a prompt with the same salt, and a router
hashing the same prompt with the same salt finds the same numbers in the replica's events.

Why xxhash: a 2,150-token prompt (135 blocks of 16) hashes in 0.077 ms p50 on a 2-vCPU VM against
0.141 ms for ``hashlib.blake2b(digest_size=8)`` (docs/benchmarks.md, *Prefix hashes*).
Pure: no torch, no grpc.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

#: The seed of a chain's first block (it has no parent).
ROOT = 0
#: The seed of a salt's hash, so a salt's seed is not the hash of any block's token bytes.
SALT_DOMAIN = 0x6C6C6D2D73616C74  # b"llm-salt"
#: The longest salt a replica takes (the router's tenant plus a client's salt fit well within).
MAX_SALT_BYTES = 1024
_MAX_TOKEN = 2**32


def _le_uint32(token_ids: Sequence[int]) -> bytes:
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN})") from exc
    if packed.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte "I"
        packed = array("L", token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def salt_seed(salt: str) -> int | None:
    """The parent to start a ``salt``-ed chain from; None (the unsalted root) for no salt."""
    if not salt:
        return None
    return xxh3_64_intdigest(salt.encode("utf-8"), SALT_DOMAIN)


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of one full block given its predecessor's hash (None for the first block)."""
    return xxh3_64_intdigest(_le_uint32(tokens), ROOT if parent is None else parent)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chain's hashes of every full block of ``token_ids`` (a partial last block has none).

    ``parent`` continues a chain whose earlier blocks were hashed already.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    data = memoryview(_le_uint32(token_ids))
    width = 4 * block_size
    hashes: list[int] = []
    h = ROOT if parent is None else parent
    for start in range(0, len(token_ids) // block_size * width, width):
        h = xxh3_64_intdigest(data[start : start + width], h)
        hashes.append(h)
    return hashes
