"""The mesh-wide chained block hash: stable values, chaining, full blocks only."""

from __future__ import annotations

import struct

import pytest
import xxhash

from services.common.kv_blocks import SALT_DOMAIN, block_hashes, chain_hash, salt_seed


def test_values_are_a_fixed_contract_across_processes_and_versions() -> None:
    # XXH3-64 of little-endian uint32 token ids seeded with the parent: these numbers must
    # never change, or routers and replicas of different versions stop agreeing.
    first = chain_hash(None, [1, 2, 3, 4])
    assert first == xxhash.xxh3_64_intdigest(struct.pack("<4I", 1, 2, 3, 4), seed=0)
    assert first == chain_hash(0, [1, 2, 3, 4])
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [first, chain_hash(first, [5, 6, 7, 8])]
    assert first == 0x6FC1EBD4F4D6EA31


def test_hash_i_covers_the_whole_prefix_up_to_block_i() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different first: different chain
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4) == a  # a partial block has no hash
    assert all(0 <= h < 2**64 for h in a)


def test_a_chain_can_be_continued_from_a_parent() -> None:
    whole = block_hashes(list(range(12)), 4)
    assert block_hashes(list(range(4, 12)), 4, parent=whole[0]) == whole[1:]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1, 2], 2)


def test_a_salted_chain_shares_no_hash_with_the_unsalted_one_or_another_salt() -> None:
    tokens = list(range(16))
    plain = block_hashes(tokens, 4)
    alice = block_hashes(tokens, 4, salt_seed("alice"))
    bob = block_hashes(tokens, 4, salt_seed("bob"))
    assert not set(alice) & set(plain) and not set(alice) & set(bob)
    assert block_hashes(tokens, 4, salt_seed("alice")) == alice  # the same salt, the same chain
    # A fixed contract too: the salt's XXH3-64 under the salt domain is the first block's seed.
    assert salt_seed("alice") == xxhash.xxh3_64_intdigest(b"alice", seed=SALT_DOMAIN)
    assert alice[0] == chain_hash(salt_seed("alice"), tokens[:4])
    assert salt_seed("") is None and block_hashes(tokens, 4, salt_seed("")) == plain
