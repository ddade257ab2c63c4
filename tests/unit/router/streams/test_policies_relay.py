"""Relay helpers without servers: merged chunks as one message, address parsing, config checks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.common.generate_many.client import ReplicaMultiplexer
from services.gen.llmmesh.v1 import inference_pb2
from services.router.placement.discovery import parse_address, parse_address_list
from services.router.placement.pool import ReplicaPool
from services.router.streams.relay import RelayConfig
from services.router.turns.turn_end import token_message


def chunk(index: int) -> inference_pb2.TokenChunk:
    return inference_pb2.TokenChunk(text=f" t{index}", token_ids=[index], index=index)


def test_a_batch_of_chunks_is_one_message_numbered_from_its_first_token() -> None:
    batch = [chunk(i) for i in range(3, 7)]
    message = token_message("r1", 2, batch)
    assert (message.request_id, message.seq) == ("r1", 2)
    delta = message.delta
    assert delta.index == 3
    assert list(delta.token_ids) == [3, 4, 5, 6]
    assert delta.text == " t3 t4 t5 t6"
    single = token_message("r1", 1, [chunk(0)]).delta
    assert (single.text, list(single.token_ids), single.index) == (" t0", [0], 0)


def test_a_scored_prompts_decoded_text_rides_with_its_logprobs_merged_or_not() -> None:
    scored = chunk(0)
    scored.prompt_logprobs.add(text="\ufffd")
    scored.prompt_text = "世"  # one character, two tokens: its tokens' texts are U+FFFD each
    assert token_message("r1", 1, [scored]).delta.prompt_text == "世"
    merged = token_message("r1", 1, [scored, chunk(1), chunk(2)]).delta
    assert merged.prompt_text == "世" and len(merged.prompt_logprobs) == 1


def test_addresses_are_validated() -> None:
    assert parse_address_list("a:1, b:2\n# comment\nc:3 # trailing") == ["a:1", "b:2", "c:3"]
    assert parse_address("[::1]:50052") == "[::1]:50052"
    for bad in ["nohost", "host:", "host:99999", ":80"]:
        with pytest.raises(ValueError, match="host:port"):
            parse_address(bad)


def test_relay_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="--max-attempts"):
        RelayConfig(max_attempts=0)


async def test_pick_refuses_when_the_predicted_queue_wait_exceeds_the_deadline() -> None:
    from services.common import errors
    from services.router.placement.policies import AffinityPolicy, LeastOutstandingPolicy
    from services.router.placement.pool import ReplicaPool
    from services.router.streams.relay import Relay

    pool = ReplicaPool(ReplicaMultiplexer)
    # Channels connect lazily: no server is needed to build the pool.
    pool.set_addresses(["127.0.0.1:1", "127.0.0.1:2"])
    try:
        for replica in pool.replicas.values():
            replica.model, replica.serving = "m", True
            replica.ttft.observe(0.5)
            replica.last_load.waiting = 10  # ≈ 5 s before a new request would start
        relay = Relay(pool, AffinityPolicy(LeastOutstandingPolicy()), clock=lambda: 0.0)
        with pytest.raises(errors.DeadlineExceeded, match="predicted queue wait"):
            relay.picker.pick(["m"], None, set(), deadline=1.0)
        picked = relay.picker.pick(["m"], None, set(), deadline=60.0)
        assert picked is not None and picked[1] == "m"
        # A pinned replica keeps its session while it is within the load bound …
        assert relay.picker.pick(["m"], "s", set(), None, preferred="127.0.0.1:2")[0].address == "127.0.0.1:2"  # type: ignore[index]
        # … and an excluded (failed) one is never picked again for this turn.
        again = relay.picker.pick(["m"], "s", {"127.0.0.1:2"}, None, preferred="127.0.0.1:2")
        assert again is not None and again[0].address == "127.0.0.1:1"
    finally:
        await pool.close()


async def test_discovery_follows_the_replicas_file_and_dns(tmp_path: Path) -> None:
    import os

    from services.router.placement.discovery import ReplicaDiscovery
    from services.router.placement.pool import ReplicaPool

    path = tmp_path / "replicas.txt"
    path.write_text("127.0.0.1:7001\n127.0.0.1:7002  # second\n")
    pool = ReplicaPool(ReplicaMultiplexer)
    discovery = ReplicaDiscovery(pool, static=["127.0.0.1:7000"], dns="localhost:7100", file=str(path))
    try:
        await discovery.start()
        assert {"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"} <= set(pool.replicas)
        assert any(a.endswith(":7100") for a in pool.replicas)  # localhost resolved
        path.write_text("127.0.0.1:7003\n")
        os.utime(path, (1, 1))  # a new mtime, whatever the file system's resolution
        assert discovery.read_file()
        discovery._apply()
        assert "127.0.0.1:7003" in pool.replicas and "127.0.0.1:7001" not in pool.replicas
        path.write_text("not an address\n")
        os.utime(path, (2, 2))
        assert not discovery.read_file()  # a broken file keeps the last good list
        # Rewritten within one mtime tick: its size tells (only the mtime was compared).
        path.write_text("127.0.0.1:7004\n127.0.0.1:7005\n")
        os.utime(path, (2, 2))
        assert discovery.read_file()
        assert discovery._file_addresses == {"127.0.0.1:7004", "127.0.0.1:7005"}
        # Caught half-way through a rewrite in place (truncated): one empty read empties nothing;
        # still empty at the next read, it is the operator's list.
        path.write_text("")
        assert not discovery.read_file()
        assert discovery._file_addresses == {"127.0.0.1:7004", "127.0.0.1:7005"}
        assert discovery.read_file()
        assert discovery._file_addresses == set()
    finally:
        await discovery.stop()
        await pool.close()


async def test_a_turn_at_startup_waits_for_the_first_health_checks_not_longer() -> None:
    pool = ReplicaPool(ReplicaMultiplexer)
    assert pool.discovering()  # started, no replica yet: the router is still starting
    pool.set_addresses(["127.0.0.1:1", "127.0.0.1:2"])
    a, b = pool.replicas.values()
    try:
        assert pool.discovering()

        async def first_check_answers() -> None:
            await asyncio.sleep(0.05)
            pool.mark_checked(a)  # down: no model from it
            await asyncio.sleep(0.05)
            b.model = "m"
            pool.mark_checked(b)
            pool.models_changed()
            pool.mark_started()

        started = time.monotonic()
        _, known = await asyncio.gather(first_check_answers(), pool.wait_for_models(5.0))
        assert known == {"m"}
        assert time.monotonic() - started < 1.0
        assert not pool.discovering()

        # Every replica checked and none serves a model: no waiting at all.
        b.model = None
        started = time.monotonic()
        assert await pool.wait_for_models(5.0) == set()
        assert time.monotonic() - started < 0.05

        # A replica added later is waited for, but only as long as the caller allows.
        pool.set_addresses(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
        assert pool.discovering()
        started = time.monotonic()
        assert await pool.wait_for_models(0.2) == set()
        assert 0.15 < time.monotonic() - started < 1.0
    finally:
        await pool.close()
