"""The client package (clients/python, `llm_mesh_client`) against a real router: the real model behind
it, Redis for tasks, a retriever for ingest; and the package installed by pip, away from the repo."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from llm_mesh_client import (
    Conversation,
    DeadlineExceeded,
    Delta,
    End,
    InvalidArgument,
    MeshClient,
    MeshError,
    NotFound,
    SyncMeshClient,
    Unavailable,
)
from llm_mesh_client.pb import router_pb2

from services.launcher.readiness import free_port
from tests.support.processes import ROOT, ServiceProcess
from tests.support.redis import RedisServer
from tests.support.router_mesh import router_process, running_sequences, synthetic_replica

pytestmark = pytest.mark.timeout(300)

CLIENT_DIR = ROOT / "clients" / "python"


@dataclass
class Mesh:
    router: ServiceProcess
    replica: ServiceProcess


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Redis and a retriever beside the session's shared real replica; then a router in front of them."""
    data = tmp_path_factory.mktemp("client-mesh")
    redis = RedisServer(data / "redis").start()
    retriever = ServiceProcess(
        "services.retriever", ["--milvus-uri", str(data / "milvus.db"), "--metrics-port", "0"]
    )
    router: ServiceProcess | None = None
    try:
        # The retriever loads its embedding model while the shared replica starts (when this
        # file is the first of its worker to ask for one), as the two did side by side before.
        retriever.start(wait_serving=False)
        replica: ServiceProcess = request.getfixturevalue("shared_replica")
        retriever.wait_serving()
        router = ServiceProcess(
            "services.router",
            [
                *("--replicas", replica.address, "--retriever-addr", retriever.address),
                *("--redis-url", redis.url, "--probe-interval-s", "0", "--metrics-port", "0"),
            ],
        ).start(timeout=120)
        yield Mesh(router, replica)
    finally:
        if router is not None:
            router.stop()
        retriever.stop()
        redis.kill()


async def wait_idle(replica: ServiceProcess, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_sequences(replica) == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_chat_streams_deltas_then_its_end_and_complete_gives_the_same_greedy_answer(mesh: Mesh) -> None:
    async with MeshClient(mesh.router.address) as client:
        events = [e async for e in client.chat("Name three colours.", max_tokens=12, temperature=0)]
        completion = await client.complete([("user", "Name three colours.")], max_tokens=12, temperature=0)
    deltas = [e for e in events if isinstance(e, Delta)]
    end = events[-1]
    assert isinstance(end, End) and all(isinstance(e, Delta) for e in events[:-1])
    assert deltas and [e.seq for e in events] == list(range(1, len(events) + 1))
    streamed = "".join(d.text for d in deltas)
    assert streamed.strip()
    assert end.finish_reason in ("stop", "length")
    assert end.turn.usage.completion_tokens == sum(len(d.token_ids) for d in deltas) <= 12
    assert completion.text == streamed
    assert completion.end.usage.completion_tokens == end.turn.usage.completion_tokens


async def test_cancel_ends_the_turn_as_cancelled_and_leaving_the_loop_stops_the_generation(
    mesh: Mesh,
) -> None:
    async with MeshClient(mesh.router.address) as client:
        turn = client.chat("Count to one thousand.", max_tokens=400, ignore_eos=True, temperature=0)
        events = []
        async for event in turn:
            events.append(event)
            if len(events) == 1:
                await turn.cancel()
        end = events[-1]
        assert isinstance(end, End) and end.finish_reason == "cancelled"
        assert end.turn.usage.completion_tokens < 400
        assert await wait_idle(mesh.replica)

        async with client.chat("Count to one thousand.", max_tokens=400, ignore_eos=True) as left:
            async for event in left:
                assert isinstance(event, Delta)
                break
        # The router cancelled the replica's sequence: nothing runs on, nobody reads it.
        assert await wait_idle(mesh.replica)


async def test_a_task_is_queued_watched_to_its_end_and_read_back(mesh: Mesh) -> None:
    async with MeshClient(mesh.router.address) as client:
        task = await client.submit_task("Say hello.", max_tokens=6, temperature=0)
        assert task.task_id
        states = [e.task.state async for e in client.watch_task(task.task_id) if e.HasField("task")]
        done = await client.get_task(task.task_id)
        direct = await client.complete("Say hello.", max_tokens=6, temperature=0)
        with pytest.raises(NotFound) as missing:
            await client.get_task("no-such-task")
    assert states[-1] == router_pb2.TASK_STATE_SUCCEEDED
    assert done.state == router_pb2.TASK_STATE_SUCCEEDED and done.text == direct.text
    assert missing.value.code == grpc.StatusCode.NOT_FOUND and missing.value.message


async def test_ingest_takes_a_path_or_bytes_and_a_rag_answer_cites_them(mesh: Mesh, tmp_path: Path) -> None:
    notes = tmp_path / "lighthouse.md"
    notes.write_text("# Keepers\n\nThe Fresnel lens of the Korrigan lighthouse was ground in 1887 in Lyon.\n")

    async with MeshClient(mesh.router.address) as client:
        first = await client.ingest(notes)
        again = await client.ingest(notes)
        raw = await client.ingest(
            b"Korrigan keepers log the weather every four hours.", document_id="log", filename="log.txt"
        )
        answer = await client.chat(
            "Where was the Korrigan lighthouse lens ground?", max_tokens=4, rag=True
        ).collect()
        with pytest.raises(ValueError, match="document_id"):
            await client.ingest(b"no id", filename="x.txt")
    assert first.document_id == "lighthouse.md" and first.chunks >= 1 and not first.unchanged
    assert again.unchanged
    assert raw.document_id == "log" and raw.chunks >= 1
    assert "lighthouse.md" in {c.document_id for c in answer.end.citations}


async def test_resume_replays_a_turn_after_the_last_seq_seen(mesh: Mesh) -> None:
    request_id = f"client-resume-{uuid.uuid4().hex[:8]}"

    async with MeshClient(mesh.router.address) as client:
        turn = client.chat("Name a fruit.", max_tokens=6, temperature=0, request_id=request_id)
        original = [e async for e in turn]
        assert turn.request_id == request_id and turn.last_seq == len(original)
        deadline = time.monotonic() + 5
        while True:  # the replay buffer is written off the hot path
            replayed = [e async for e in client.resume(request_id, last_seq=2)]
            if isinstance(replayed[-1], End) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert [e.seq for e in replayed] == [e.seq for e in original[2:]]
    assert [getattr(e, "text", None) for e in replayed] == [getattr(e, "text", None) for e in original[2:]]


async def test_bad_input_and_no_router_raise_typed_errors_with_code_and_message(mesh: Mesh) -> None:
    async with MeshClient(mesh.router.address) as client:
        with pytest.raises(InvalidArgument) as bad:
            await client.complete("hi", temperature=-1.0)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.value.message
    async with MeshClient(f"127.0.0.1:{free_port()}") as nowhere:
        with pytest.raises(Unavailable):
            await nowhere.wait_ready(timeout=1.0)
        with pytest.raises(MeshError) as down:
            await nowhere.complete("hi", timeout=2.0)
    assert down.value.code == grpc.StatusCode.UNAVAILABLE

    with SyncMeshClient(mesh.router.address) as sync:
        assert sync.complete("Say hi.", max_tokens=3, temperature=0).text
        assert [r.address for r in sync.list_replicas().replicas] == [mesh.replica.address]


def test_pip_installs_the_package_away_from_the_repo_and_it_talks_to_the_router(
    mesh: Mesh, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    # No build isolation and no deps: this venv already has grpcio, protobuf and grpcio-tools;
    # the wheel is still built from clients/python by its own build hook (stubs from protos/).
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(CLIENT_DIR)],
        check=True, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert (target / "llm_mesh_client" / "_gen" / "llmmesh" / "v1" / "router_pb2_grpc.py").exists()
    script = textwrap.dedent(f"""
        import asyncio, llm_mesh_client
        from llm_mesh_client import MeshClient
        async def main():
            async with MeshClient({mesh.router.address!r}) as client:
                answer = await client.complete("Say hi.", max_tokens=3, temperature=0)
            print(llm_mesh_client.__file__)
            print(answer.finish_reason, answer.end.usage.completion_tokens)
        asyncio.run(main())
    """)
    # Away from the repository: only the installed copy can be imported.
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    where, outcome = done.stdout.splitlines()
    assert where.startswith(str(target))
    assert outcome.split()[0] in ("stop", "length") and 1 <= int(outcome.split()[1]) <= 3


def read_turn(conversation: Conversation) -> tuple[str, End]:
    parts = []
    while isinstance(event := conversation.next_event(), Delta):
        parts.append(event.text)
    return "".join(parts), event


def test_a_conversation_carries_several_turns_and_a_cancel_keeps_it_open(mesh: Mesh) -> None:
    """What `llm-mesh chat` rests on: one Router.Chat call, Ctrl-C ends just the answer."""
    with SyncMeshClient(mesh.router.address) as client:
        conversation = client.conversation()
        try:
            conversation.send("Count to one thousand.", max_tokens=400, ignore_eos=True)
            assert isinstance(conversation.next_event(), Delta)
            conversation.cancel()
            _, cut = read_turn(conversation)
            conversation.send("Say hi.", max_tokens=3, temperature=0)
            text, end = read_turn(conversation)
        finally:
            conversation.close()
    assert cut.finish_reason == "cancelled" and cut.turn.usage.completion_tokens < 400
    assert text and end.finish_reason in ("stop", "length")
    assert end.request_id != cut.request_id


# The turn mechanics below run against the synthetic token source (deterministic tokens, no model),
# paced at 200 tokens/s so a long turn is still running when a test leaves it.


@pytest.fixture(scope="module")
def synthetic_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A router with Redis (the Resume buffer) in front of one synthetic replica."""
    redis = RedisServer(tmp_path_factory.mktemp("client-synthetic") / "redis").start()
    replica = synthetic_replica("--tokens-per-second", "200")
    router: ServiceProcess | None = None
    try:
        replica.start()
        router = router_process([replica], "--redis-url", redis.url).start()
        yield Mesh(router, replica)
    finally:
        for process in (router, replica):
            if process is not None:
                process.stop()
        redis.kill()


async def resumed(client: MeshClient, request_id: str, last_seq: int) -> list[Delta | End]:
    """Resume, again until the replay buffer (written off the hot path) holds the turn's end."""
    deadline = time.monotonic() + 5
    while True:
        events = [e async for e in client.resume(request_id, last_seq)]
        if (events and isinstance(events[-1], End)) or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.1)


async def test_reading_a_turn_again_goes_on_where_it_stopped_and_asks_nothing_twice(
    synthetic_mesh: Mesh,
) -> None:
    async with MeshClient(synthetic_mesh.router.address) as client:
        whole = await client.complete("Read me twice.", max_tokens=8)
        turn = client.chat("Read me twice.", max_tokens=8, request_id=f"twice-{uuid.uuid4().hex[:8]}")
        events = turn.__aiter__()
        first = await events.__anext__()
        assert isinstance(first, Delta)
        collected = await turn.collect()
        # The whole answer, the Delta read before collect() included, from one generation.
        assert collected.text == whole.text and first.text and collected.text.startswith(first.text)
        assert collected.token_ids == whole.token_ids
        assert collected.end.usage.completion_tokens == 8 and collected.finish_reason == "length"
        again = [e async for e in turn]  # read to its end: nothing more, nothing asked again
        assert await turn.collect() == collected
    assert again == []
    assert await wait_idle(synthetic_mesh.replica)


async def test_a_turn_knows_its_resume_position_before_its_first_message(synthetic_mesh: Mesh) -> None:
    request_id = f"position-{uuid.uuid4().hex[:8]}"
    async with MeshClient(synthetic_mesh.router.address) as client:
        turn = client.chat("Where am I?", max_tokens=6, request_id=request_id)
        assert (turn.request_id, turn.last_seq) == (request_id, 0)
        original = [e async for e in turn]
        # The docs' recipe, from a resumed stream that has read nothing yet:
        later = client.resume(request_id, 2)
        assert (later.request_id, later.last_seq) == (request_id, 2)
        replayed = await resumed(client, later.request_id, later.last_seq)
    assert [e.seq for e in replayed] == [e.seq for e in original[2:]]
    assert "".join(e.text for e in replayed if isinstance(e, Delta)) == "".join(
        e.text for e in original[2:] if isinstance(e, Delta)
    )


async def test_after_the_client_leaves_resume_replays_the_rest_then_a_cancelled_end(
    synthetic_mesh: Mesh,
) -> None:
    """What docs/clients.md says of a dropped connection: the router cancels the turn whose client
    left; Resume returns what was generated until then, then the cancelled End."""
    request_id = f"left-{uuid.uuid4().hex[:8]}"
    async with MeshClient(synthetic_mesh.router.address) as client:
        turn = client.chat("Count on and on.", max_tokens=2000, ignore_eos=True, request_id=request_id)
        events = turn.__aiter__()
        seen = [await events.__anext__() for _ in range(3)]
        turn.close()  # the connection is gone: no cancel message reaches the router
        rest = await resumed(client, turn.request_id, turn.last_seq)
    end = rest[-1]
    assert isinstance(end, End) and end.finish_reason == "cancelled"
    assert [e.seq for e in seen + rest] == list(range(1, len(seen) + len(rest) + 1))
    assert end.turn.usage.completion_tokens == len(seen) + len(rest) - 1 < 2000
    assert await wait_idle(synthetic_mesh.replica)


async def test_breaking_out_of_the_loop_still_cancels_the_turn(synthetic_mesh: Mesh) -> None:
    """A turn keeps its place between reads, but leaving an `async for` early still ends the call."""
    async with MeshClient(synthetic_mesh.router.address) as client:
        # 8,000 tokens at 200/s (40 s): still running long after wait_idle() gives up, unless cancelled.
        turn = client.chat("Count on and on.", max_tokens=8000, ignore_eos=True)
        async for event in turn:
            assert isinstance(event, Delta)
            break
        assert await wait_idle(synthetic_mesh.replica)
    assert turn.end is None


def test_a_client_made_outside_the_event_loop_works_inside_it(synthetic_mesh: Mesh) -> None:
    """MeshClient built at module level, then used under asyncio.run() (twice: two loops)."""
    script = textwrap.dedent(f"""
        import asyncio
        from llm_mesh_client import MeshClient
        mesh = MeshClient({synthetic_mesh.router.address!r})
        async def main():
            done = await asyncio.wait_for(mesh.complete("outside", max_tokens=2), 20)
            turn = await asyncio.wait_for(mesh.chat("outside chat", max_tokens=2).collect(), 20)
            print(done.end.usage.completion_tokens, turn.end.usage.completion_tokens)
        asyncio.run(main())
        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "2", "2"]


def test_a_conversation_keeps_the_clients_timeout(synthetic_mesh: Mesh) -> None:
    with SyncMeshClient(synthetic_mesh.router.address, timeout=0.5) as client:
        conversation = client.conversation()  # 2000 tokens at 200/s: 10 s, past the deadline
        try:
            conversation.send("Count on and on.", max_tokens=2000, ignore_eos=True)
            with pytest.raises(DeadlineExceeded):
                read_turn(conversation)
        finally:
            conversation.close()
    deadline = time.monotonic() + 10  # the router cancelled the replica's sequence
    while running_sequences(synthetic_mesh.replica) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_sequences(synthetic_mesh.replica) == 0
