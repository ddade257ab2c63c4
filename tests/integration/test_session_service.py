"""The session service as a real process on a real Redis: the same suite on one node and on a 3-node Cluster."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from services.common.metadata import SESSION_VERSION_KEY, TENANT_KEY
from services.gen.llmmesh.v1 import session_pb2 as pb
from tests.support.processes import ROOT, ServiceProcess
from tests.support.redis import RedisServer
from tests.support.redis_cluster import RedisClusterServers
from tests.support.session_client import SessionClient, new_owner, rpc_error, turn

MAX_TURNS = 60
MAX_TURN_BYTES = 2048
MAX_SESSIONS = 5
LIMIT_FLAGS = [
    "--max-turns-per-session",
    str(MAX_TURNS),
    "--max-turn-bytes",
    str(MAX_TURN_BYTES),
    "--max-sessions-per-owner",
    str(MAX_SESSIONS),
    "--max-ttl-seconds",
    "86400",
]


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def session_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """One service per backend, shared by the module; tests isolate themselves by owner."""
    data = tmp_path_factory.mktemp(request.param)
    backend: RedisServer | RedisClusterServers
    if request.param == "redis":
        backend = RedisServer(data).start()
        flags = ["--redis-url", backend.url]
    else:
        backend = RedisClusterServers(data).start()
        flags = ["--redis-url", backend.url, "--redis-cluster"]
    service = ServiceProcess("services.session", [*flags, *LIMIT_FLAGS, "--metrics-port", "0"])
    try:
        service.start(timeout=60)
        yield service
        assert service.stop() == 0, "SIGTERM must drain and exit cleanly:\n" + service.output()
    finally:
        service.kill()
        if isinstance(backend, RedisServer):
            backend.kill()
        else:
            backend.stop()


@pytest.fixture()
async def channel(session_service: ServiceProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(session_service.address) as ch:
        yield ch


async def test_create_get_append_list_delete_round_trip(channel: grpc.aio.Channel) -> None:
    alice = SessionClient(channel, new_owner())
    created = await alice.create(
        "chat-1", system_prompt="Be brief.", metadata={"app": "demo"}, ttl_seconds=600
    )
    assert (created.session_id, created.owner, created.version, created.turn_count) == (
        "chat-1",
        alice.owner,
        0,
        0,
    )
    assert created.ttl_seconds == 600 and created.metadata["app"] == "demo" and created.created_at_ms > 0

    appended = await alice.append(
        "chat-1",
        [turn("What is 2+2?"), turn("4", role="assistant", token_count=1, metadata={"replica": "r1"})],
        expected_version=0,
    )
    assert appended.version == 1 and appended.info.turn_count == 2
    await alice.append("chat-1", [turn("Thanks ✓")])  # no expected_version: last writer wins

    state = await alice.get("chat-1")
    assert state.info.version == 2 and state.info.system_prompt == "Be brief." and state.omitted_turns == 0
    assert [(t.role, t.content) for t in state.turns] == [
        ("user", "What is 2+2?"),
        ("assistant", "4"),
        ("user", "Thanks ✓"),
    ]
    assert state.turns[1].token_count == 1 and not state.turns[0].HasField("token_count")
    assert state.turns[1].metadata["replica"] == "r1" and state.turns[0].created_at_ms > 0

    generated = await alice.create(system_prompt="other")
    assert len(generated.session_id) == 32
    listed = await alice.list()
    assert [s.session_id for s in listed.sessions] == ["chat-1", generated.session_id]
    assert listed.sessions[0].turn_count == 3 and listed.next_page_token == ""

    assert (await alice.delete("chat-1")).deleted
    assert (await rpc_error(alice.get("chat-1"))).code() == grpc.StatusCode.NOT_FOUND
    assert (await rpc_error(alice.delete("chat-1"))).code() == grpc.StatusCode.NOT_FOUND
    assert [s.session_id for s in (await alice.list()).sessions] == [generated.session_id]
    assert (await rpc_error(alice.create(generated.session_id))).code() == grpc.StatusCode.ALREADY_EXISTS


async def test_ttl_expires_idle_sessions_and_every_use_slides_it(channel: grpc.aio.Channel) -> None:
    bob = SessionClient(channel, new_owner())
    await bob.create("idle", ttl_seconds=2)
    await bob.create("busy", ttl_seconds=2)
    started = time.monotonic()
    uses = [bob.get("busy"), bob.touch("busy"), bob.append("busy", [turn("still here")]), bob.get("busy")]
    for use in uses:  # 4 uses 0.9 s apart: the session outlives its 2 s TTL by far
        await asyncio.sleep(0.9)
        await use
    assert time.monotonic() - started > 3.5
    assert (await rpc_error(bob.get("idle"))).code() == grpc.StatusCode.NOT_FOUND
    state = await bob.get("busy")
    assert [t.content for t in state.turns] == ["still here"]
    assert [s.session_id for s in (await bob.list()).sessions] == ["busy"]
    await asyncio.sleep(2.6)
    assert (await rpc_error(bob.touch("busy"))).code() == grpc.StatusCode.NOT_FOUND


async def test_window_keeps_newest_turns_within_token_budget_and_the_system_prompt(
    channel: grpc.aio.Channel,
) -> None:
    carol = SessionClient(channel, new_owner())
    await carol.create("w", system_prompt="s" * 40)  # estimated ceil(40 / 3) = 14 tokens
    # Each turn costs its tokens plus the chat template's 5 around it.
    turns = [turn(f"turn {i}", token_count=10) for i in range(5)]
    turns.append(turn("x" * 21))  # no count: estimated 21 / 3 = 7 tokens
    await carol.append("w", turns)

    state = await carol.get("w", token_budget=56)  # 14 system + 12 + 15 + 15 = 56
    assert [t.content for t in state.turns] == ["turn 3", "turn 4", "x" * 21]
    assert state.omitted_turns == 3 and state.info.turn_count == 6
    assert [t.content for t in (await carol.get("w", token_budget=55)).turns] == ["turn 4", "x" * 21]

    tiny = await carol.get("w", token_budget=5)  # the system prompt alone is over budget: still kept
    assert tiny.info.system_prompt == "s" * 40 and list(tiny.turns) == [] and tiny.omitted_turns == 6

    last_two = await carol.get("w", max_turns=2, token_budget=1000)
    assert [t.content for t in last_two.turns] == ["turn 4", "x" * 21] and last_two.omitted_turns == 4


async def test_a_retried_append_is_stored_once_and_a_retry_sees_the_history_before_it(
    channel: grpc.aio.Channel,
) -> None:
    erin = SessionClient(channel, new_owner())
    await erin.create("retry")
    first = await erin.append("retry", [turn("Hi, I'm Ada."), turn("Hello Ada.", "assistant")], 0, "req-1")
    second = await erin.append("retry", [turn("My name?"), turn("Ada.", "assistant")], 1, "req-2")
    assert (first.version, second.version, first.duplicate, second.duplicate) == (1, 2, False, False)

    # The reply of req-2 was lost; its retry comes with the version it saw and another answer.
    again = await erin.append("retry", [turn("My name?"), turn("Ada!", "assistant")], 1, "req-2")
    assert again.duplicate and again.version == 2 and again.info.turn_count == 4
    # Without expected_version too, and after later appends: a request id is stored once.
    await erin.append("retry", [turn("Bye."), turn("Bye!", "assistant")], request_id="req-3")
    assert (
        await erin.append("retry", [turn("Hi, I'm Ada."), turn("Hey.", "assistant")], request_id="req-1")
    ).duplicate
    # The id with another question is another request: refused, naming the id, nothing stored.
    reused = await rpc_error(
        erin.append("retry", [turn("Who are you?"), turn("A bot.", "assistant")], 3, "req-1")
    )
    assert reused.code() == grpc.StatusCode.ALREADY_EXISTS
    assert (reused.details() or "").startswith("request_id: 'req-1' already appended other turns")
    state = await erin.get("retry")
    assert [t.content for t in state.turns] == [
        "Hi, I'm Ada.",
        "Hello Ada.",
        "My name?",
        "Ada.",
        "Bye.",
        "Bye!",
    ]
    assert [t.request_id for t in state.turns] == ["req-1"] * 2 + ["req-2"] * 2 + ["req-3"] * 2

    # What a retry of req-2 is shown: the history its first try saw, windowed the same way.
    before = await erin.get("retry", before_request_id="req-2")
    assert [t.content for t in before.turns] == ["Hi, I'm Ada.", "Hello Ada."] and before.omitted_turns == 0
    assert before.holds_request and before.info.max_turns == MAX_TURNS
    assert [(t.role, t.content) for t in before.request_turns] == [
        ("user", "My name?"),
        ("assistant", "Ada."),
    ]
    newest = await erin.get("retry", before_request_id="req-3", max_turns=2)
    assert [t.content for t in newest.turns] == ["My name?", "Ada."] and newest.omitted_turns == 2
    # One turn would be an answer without its question: a window left short starts at a user turn.
    assert list((await erin.get("retry", before_request_id="req-3", max_turns=1)).turns) == []
    unknown = await erin.get("retry", before_request_id="req-9")
    assert len(unknown.turns) == 6 and unknown.info.version == 3 and not unknown.holds_request

    # A new session under the id (this one deleted) remembers none of the old request ids.
    await erin.delete("retry")
    await erin.create("retry")
    fresh = await erin.append("retry", [turn("Hi again.")], request_id="req-1")
    assert not fresh.duplicate and fresh.info.turn_count == 1


async def test_a_version_read_from_a_deleted_session_does_not_append_to_its_successor(
    channel: grpc.aio.Channel,
) -> None:
    """Versions start at 0 in every session created under an id: a writer holding version 1 of a
    deleted conversation appended its follow-up into the new one at version 1."""
    fay = SessionClient(channel, new_owner())
    old = await fay.create("reused", system_prompt="You are A")
    await fay.append("reused", [turn("A1"), turn("A1 answer", "assistant")], 0)
    await fay.delete("reused")
    await fay.create("reused", system_prompt="You are B")
    await fay.append("reused", [turn("B1"), turn("B1 answer", "assistant")], 0)

    def follow_up(created_at_ms: int) -> pb.AppendTurnsRequest:
        return pb.AppendTurnsRequest(
            session_id="reused",
            turns=[turn("A2, after A1")],
            expected_version=1,
            expected_created_at_ms=created_at_ms,
        )

    stale = await rpc_error(fay.stub.AppendTurns(follow_up(old.created_at_ms), **fay._kw()))
    assert stale.code() == grpc.StatusCode.ABORTED and "created again" in (stale.details() or "")
    state = await fay.get("reused")
    assert [t.content for t in state.turns] == ["B1", "B1 answer"]
    current = await fay.stub.AppendTurns(follow_up(state.info.created_at_ms), **fay._kw())
    assert current.version == 2


async def test_the_same_id_in_two_tenants_is_two_independent_sessions(channel: grpc.aio.Channel) -> None:
    """Session ids were one namespace for all tenants: once globex had used "demo", acme was
    PERMISSION_DENIED on it for good (a 403 through the router). Each tenant has its own now."""
    globex, acme = SessionClient(channel, new_owner()), SessionClient(channel, new_owner())
    await globex.create("demo", system_prompt="You are Globex's bot.", metadata={"app": "g"})
    await globex.append("demo", [turn("globex secret: 42"), turn("noted", "assistant")], 0, "req-1")

    # acme has no "demo" of its own: not found, however it asks, and nothing of globex's leaks.
    for call in (
        lambda: acme.get("demo"),
        lambda: acme.touch("demo"),
        lambda: acme.append("demo", [turn("hi")]),
        lambda: acme.delete("demo"),
    ):
        error = await rpc_error(call())
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        assert str(globex.owner) not in (error.details() or "") and "42" not in (error.details() or "")
    assert list((await acme.list()).sessions) == []

    # acme's "demo" is a new session, at version 0, with none of globex's state.
    mine = await acme.create("demo", system_prompt="You are Acme's bot.")
    assert (mine.owner, mine.version, mine.turn_count, dict(mine.metadata)) == (acme.owner, 0, 0, {})
    assert mine.system_prompt == "You are Acme's bot."
    # The same request id, with other turns, is acme's own first request: not a reuse of globex's.
    first = await acme.append("demo", [turn("acme question"), turn("acme answer", "assistant")], 0, "req-1")
    assert (first.version, first.duplicate, first.info.turn_count) == (1, False, 2)
    assert (await rpc_error(acme.create("demo"))).code() == grpc.StatusCode.ALREADY_EXISTS  # acme's own

    theirs, ours = await globex.get("demo"), await acme.get("demo")
    assert [t.content for t in theirs.turns] == ["globex secret: 42", "noted"]
    assert theirs.info.system_prompt == "You are Globex's bot." and theirs.info.version == 1
    assert [t.content for t in ours.turns] == ["acme question", "acme answer"]
    assert ours.info.owner == acme.owner and ours.info.version == 1
    # Versions move apart: a write to one is no conflict for the other.
    await globex.append("demo", [turn("globex again")], 1)
    assert (await acme.append("demo", [turn("acme again")], 1)).version == 2
    assert [s.session_id for s in (await acme.list()).sessions] == ["demo"]
    assert [(s.session_id, s.turn_count) for s in (await globex.list()).sessions] == [("demo", 3)]

    # Deleting one leaves the other; the id is free again in acme's namespace only.
    assert (await acme.delete("demo")).deleted
    assert (await rpc_error(acme.get("demo"))).code() == grpc.StatusCode.NOT_FOUND
    assert [t.content for t in (await globex.get("demo")).turns][-1] == "globex again"
    assert (await acme.create("demo")).version == 0
    assert (await rpc_error(globex.create("demo"))).code() == grpc.StatusCode.ALREADY_EXISTS


async def test_what_a_tenant_is_told_never_depends_on_another_tenants_ids(channel: grpc.aio.Channel) -> None:
    """With PERMISSION_DENIED for a taken id and NOT_FOUND for a free one, any tenant could probe
    which ids the others used (the router's session_must_exist asks exactly that)."""
    other = SessionClient(channel, new_owner())
    await other.create("used-elsewhere")
    await other.append("used-elsewhere", [turn("x")])
    prober = SessionClient(channel, new_owner())

    async def answers(session_id: str) -> list[tuple[grpc.StatusCode, str]]:
        seen = []
        for call in (
            lambda: prober.get(session_id),
            lambda: prober.touch(session_id),
            lambda: prober.append(session_id, [turn("probe")], 0),
            lambda: prober.delete(session_id),
        ):
            error = await rpc_error(call())
            seen.append((error.code(), (error.details() or "").replace(session_id, "ID")))
        return seen

    used, unused = await answers("used-elsewhere"), await answers("never-used-by-anyone")
    assert used == unused and {code for code, _ in used} == {grpc.StatusCode.NOT_FOUND}
    # Taking either id is the same too, and the other tenant's session is untouched by it.
    for session_id in ("used-elsewhere", "never-used-by-anyone"):
        created = await prober.create(session_id)
        assert (created.version, created.turn_count, created.owner) == (0, 0, prober.owner)
    assert [t.content for t in (await other.get("used-elsewhere")).turns] == ["x"]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.get("bad id!"), "session_id"),
        (lambda c: c.create("x" * 129), "session_id"),
        (lambda c: c.create("{tag}"), "session_id"),
        (lambda c: c.create("ok", ttl_seconds=86401), "ttl_seconds"),
        (lambda c: c.create("ok", system_prompt="p" * (MAX_TURN_BYTES + 1)), "system_prompt"),
        (lambda c: c.append("ok", [turn("é" * (MAX_TURN_BYTES // 2 + 1))]), "turns[0].content"),
        (lambda c: c.append("ok", [turn("fine"), turn("hi", role="robot")]), "turns[1].role"),
        (lambda c: c.append("ok", []), "turns"),
        (lambda c: c.append("ok", [turn("fine")], request_id="has space"), "request_id"),
        (lambda c: c.append("ok", [turn("fine")], request_id="r" * 129), "request_id"),
        (lambda c: c.get("ok", before_request_id="a\nb"), "before_request_id"),
        (lambda c: c.list(page_size=1001), "page_size"),
        (lambda c: c.list(page_token="not-a-token"), "page_token"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    channel: grpc.aio.Channel, call, field: str
) -> None:  # type: ignore[no-untyped-def]
    error = await rpc_error(call(SessionClient(channel, new_owner())))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith(f"{field}:"), error.details()


async def test_missing_tenant_and_invalid_utf8_are_invalid_argument(channel: grpc.aio.Channel) -> None:
    error = await rpc_error(SessionClient(channel, None).list())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and TENANT_KEY in (error.details() or "")

    # A well-behaved client cannot even encode this; send the raw bytes another client might.
    raw = pb.AppendTurnsRequest(session_id="s", turns=[turn("ok"), turn("Z")]).SerializeToString()
    append_raw = channel.unary_unary("/llmmesh.v1.Session/AppendTurns")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await append_raw(raw.replace(b"\x01Z", b"\x01\xff"), metadata=((TENANT_KEY, new_owner()),), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "turns[1].content: is not valid UTF-8"


async def test_turn_and_session_limits_are_resource_exhausted(channel: grpc.aio.Channel) -> None:
    dave = SessionClient(channel, new_owner())
    await dave.create("full")
    await dave.append("full", [turn(f"t{i}") for i in range(MAX_TURNS - 1)])
    error = await rpc_error(dave.append("full", [turn("a"), turn("b")]))  # all or none
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit of {MAX_TURNS}" in (
        error.details() or ""
    )
    assert (await dave.append("full", [turn("last")])).info.turn_count == MAX_TURNS

    for i in range(MAX_SESSIONS - 1):
        await dave.create(f"extra-{i}")
    error = await rpc_error(dave.create("one-too-many"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"maximum of {MAX_SESSIONS}" in (
        error.details() or ""
    )
    await SessionClient(channel, new_owner()).create("one-too-many")  # the limit is per owner
    await dave.delete("extra-0")
    await dave.create("one-too-many-2")  # deleting frees a place


async def test_list_pages_through_an_owners_sessions_in_creation_order(channel: grpc.aio.Channel) -> None:
    erin = SessionClient(channel, new_owner())
    ids = [f"page-{i}" for i in range(MAX_SESSIONS)]
    for session_id in ids:
        await erin.create(session_id)
    await SessionClient(channel, new_owner()).create("someone-elses")
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await erin.list(page_size=2, page_token=token)
        seen += [s.session_id for s in page.sessions]
        pages += 1
        token = page.next_page_token
        if not token:
            break
        # A create of a live id (the router tries one for every first turn) must not move it:
        # re-scored, page-0 came again at the end.
        assert (await rpc_error(erin.create(ids[0]))).code() == grpc.StatusCode.ALREADY_EXISTS
    assert seen == ids and pages == 3


async def test_fifty_concurrent_appends_keep_every_winner_once_and_abort_the_losers(
    session_service: ServiceProcess, channel: grpc.aio.Channel
) -> None:
    frank = SessionClient(channel, new_owner(), timeout=30)
    await frank.create("race")
    conflicts_before = ops_count(session_service, "append", "conflict")

    async def writer(n: int) -> tuple[str, list[int]]:
        """Appends once, retrying on ABORTED with the version the server reported."""
        expected = (await frank.get("race", max_turns=1)).info.version
        aborted: list[int] = []
        while True:
            try:
                done = await frank.append(
                    "race", [turn(f"writer {n}", metadata={"writer": str(n)})], expected
                )
                return f"writer {n}@{done.version}", aborted
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.ABORTED, error
                current = dict(error.trailing_metadata() or ())[SESSION_VERSION_KEY]
                aborted.append(expected)
                expected = int(current)

    results = await asyncio.gather(*(writer(n) for n in range(50)))
    state = await frank.get("race")
    total_aborts = sum(len(aborted) for _, aborted in results)
    assert state.info.version == 50 == len(state.turns)  # one version per successful append
    assert sorted(t.content for t in state.turns) == sorted(f"writer {n}" for n in range(50))
    # Each writer's success reported the version at which its turn sits in the history.
    positions = {t.content: i + 1 for i, t in enumerate(state.turns)}
    assert all(positions[label.split("@")[0]] == int(label.split("@")[1]) for label, _ in results)
    assert total_aborts > 0  # 50 writers that all start at version 0 cannot all win at once
    assert ops_count(session_service, "append", "conflict") - conflicts_before == total_aborts


def ops_count(service: ServiceProcess, op: str, result: str) -> float:
    """llmmesh_session_ops_total{op,result} scraped from the service's metrics endpoint."""
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
    )
    assert "llmmesh_session_redis_latency_seconds_bucket" in body
    prefix = f'llmmesh_session_ops_total{{op="{op}",result="{result}"}} '
    return next((float(line[len(prefix) :]) for line in body.splitlines() if line.startswith(prefix)), 0.0)


def test_invalid_limit_flags_stop_the_service_at_startup_with_the_flag_named() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.session", "--port", "0", "--max-turns-per-session", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "max_turns_per_session must be a positive integer" in done.stderr
