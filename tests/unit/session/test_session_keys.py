"""The key layout: one namespace per owner, and every key of one session id in one cluster slot."""

from __future__ import annotations

from redis.crc import key_slot

from services.session import keys


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_all_keys_of_one_session_id_map_to_one_cluster_slot_whatever_the_owner() -> None:
    """The scripts take a session's keys and its old-layout keys at once (to move the one into the
    other atomically): on Redis Cluster that is one slot, or CROSSSLOT."""
    for session_id in ("a", "chat-1", "user:42.chat_7-b", "0" * 128):
        for owner in ("acme", "globex", "a{b}c", "x:y", "é" * 256):
            assert len({slot(key) for key in keys.script_keys(owner, session_id)}) == 1
        assert slot(keys.meta_key("acme", session_id)) == slot(keys.meta_key("globex", session_id))


def test_the_same_id_of_two_owners_has_keys_of_its_own() -> None:
    ids = ("demo", "a", "0" * 128)
    owners = ("acme", "globex", "acme ", "a{b}c", "a:b", "a", "ab")
    every = [keys.script_keys(owner, session_id) for owner in owners for session_id in ids]
    own = [key for session in every for key in session[:3]]
    assert len(own) == len(set(own)) == 3 * len(owners) * len(ids)
    # None of them is a key of the old layout, which the scripts only read (and move).
    assert not set(own) & {key for session in every for key in session[3:]}
    # An owner's characters cannot reach the hash tag or the key's shape.
    assert keys.meta_key("a}{b", "s").startswith("llm:session:{s}:")
    assert len(keys.meta_key("x" * 256, "s")) == len(keys.meta_key("y", "s"))


def test_sessions_spread_over_slots_and_the_key_layout_is_stable() -> None:
    assert len({slot(keys.meta_key("acme", f"s{i}")) for i in range(100)}) > 90
    tag = keys.owner_tag("acme")
    assert len(tag) == 32 and int(tag, 16) >= 0
    assert keys.meta_key("acme", "abc") == f"llm:session:{{abc}}:{tag}:meta"
    assert keys.turns_key("acme", "abc") == f"llm:session:{{abc}}:{tag}:turns"
    assert keys.requests_key("acme", "abc") == f"llm:session:{{abc}}:{tag}:requests"
    # Data stored before sessions were keyed by owner is found where it always was.
    assert keys.legacy_meta_key("abc") == "llm:session:{abc}:meta"
    assert keys.legacy_turns_key("abc") == "llm:session:{abc}:turns"
    assert keys.legacy_requests_key("abc") == "llm:session:{abc}:requests"
    assert keys.owner_index_key("acme") == "llm:owner:{acme}:sessions"
