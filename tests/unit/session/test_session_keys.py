"""Why Redis Cluster needs no change: one session's keys share a hash tag, hence one slot."""

from __future__ import annotations

from redis.crc import key_slot

from services.session import keys


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_all_keys_of_one_session_map_to_one_cluster_slot() -> None:
    for session_id in ("a", "chat-1", "user:42.chat_7-b", "0" * 128):
        assert slot(keys.meta_key(session_id)) == slot(keys.turns_key(session_id))


def test_sessions_spread_over_slots_and_the_key_layout_is_stable() -> None:
    assert len({slot(keys.meta_key(f"s{i}")) for i in range(100)}) > 90
    assert keys.meta_key("abc") == "llm:session:{abc}:meta"
    assert keys.turns_key("abc") == "llm:session:{abc}:turns"
    assert keys.owner_index_key("acme") == "llm:owner:{acme}:sessions"
