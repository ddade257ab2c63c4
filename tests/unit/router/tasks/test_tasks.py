"""Async tasks in real Redis with a fake turn pipeline: lifecycle, watching, cancelling, tenants, take-over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.admission.auth import Principal
from services.router.api.task_api import TaskApi
from services.router.tasks.record import STATUS_FIELDS
from services.router.tasks.settings import TaskSettings
from services.router.turns.checkpoints import OnAdmitted, OnCheckpoint, OnStopped, ResumePoint, TurnCheckpoint
from tests.support.redis import RedisServer
from tests.support.redis_cluster import RedisClusterServers

ACME = Principal("acme", "acme-1")
GLOBEX = Principal("globex", "globex-1")
WORDS = ["The ", "quick ", "brown ", "fox"]


class FakeRunTurn:
    """Stands in for the router's turn pipeline: streams fixed words with a pause, then a TurnEnd."""

    def __init__(self, delay_s: float = 0.0, fail_with: Exception | None = None) -> None:
        self.delay_s = delay_s
        self.fail_with = fail_with
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.resumed: list[ResumePoint | None] = []

    async def __call__(
        self,
        principal: Principal,
        request: router_pb2.ChatRequest,
        deadline: float | None = None,
        *,
        resume: ResumePoint | None = None,
        on_checkpoint: OnCheckpoint | None = None,
        on_stopped: OnStopped | None = None,
        replayable: bool = True,
        admitted: bool = False,
        on_admitted: OnAdmitted | None = None,
    ) -> AsyncGenerator[router_pb2.ChatResponse, None]:
        assert not replayable, "a task's turn must not go to the Resume buffer"
        self.started.append(request.request_id)
        self.resumed.append(resume)
        # Like the pipeline: the checkpoint is saved before the first token; a resumed answer
        # continues after the tokens it was given.
        first = len(resume.token_ids) if resume is not None else 0
        try:
            for i, word in enumerate(WORDS):
                if i < first:
                    continue
                await asyncio.sleep(self.delay_s)
                if i == first and resume is None and on_checkpoint is not None:
                    await on_checkpoint(TurnCheckpoint(start=b"prompt", model="served"))
                if self.fail_with is not None and i == 2:
                    raise self.fail_with
                yield router_pb2.ChatResponse(
                    request_id=request.request_id,
                    seq=i + 1,
                    delta=router_pb2.TokenDelta(text=word, token_ids=[i], index=i),
                )
            end = router_pb2.TurnEnd(
                finish_reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=len(WORDS)),
                model=f"served-for-{principal.tenant}",
            )
            yield router_pb2.ChatResponse(request_id=request.request_id, seq=len(WORDS) + 1, end=end)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


def submit_request(text: str = "Write four words.", key: str = "") -> router_pb2.SubmitTaskRequest:
    chat = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=text)])
    return router_pb2.SubmitTaskRequest(request=chat, idempotency_key=key)


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def redis_backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer | RedisClusterServers]:
    """One Redis primary, or a 3-node Redis Cluster (the router's ``--redis-cluster``), for the module.

    A cluster takes ~2 s to converge; started once, it is emptied before each test instead.
    """
    data = tmp_path_factory.mktemp("redis")
    server: RedisServer | RedisClusterServers
    if request.param == "redis":
        server = RedisServer(data)
        server.start()
    else:
        server = RedisClusterServers(data).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def redis_client(redis_backend: RedisServer | RedisClusterServers) -> AsyncIterator[Any]:
    """A client of the module's Redis, emptied first: every test starts from no tasks."""
    client: Any
    if isinstance(redis_backend, RedisServer):
        client = aioredis.from_url(redis_backend.url, socket_timeout=5, socket_connect_timeout=2)
    else:
        client = RedisCluster.from_url(redis_backend.url, socket_timeout=5, socket_connect_timeout=2)
    await client.flushall()
    yield client
    await client.aclose()


async def wait_for_state(
    api: TaskApi, task_id: str, state: int, timeout: float = 5.0, principal: Principal = ACME
) -> router_pb2.Task:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        task = await api.GetTask(principal, router_pb2.GetTaskRequest(task_id=task_id))
        if task.state == state or asyncio.get_running_loop().time() > deadline:
            return task
        await asyncio.sleep(0.05)


async def test_submitted_task_runs_and_keeps_its_result_with_a_ttl(redis_client: Any) -> None:
    api = TaskApi(redis_client, FakeRunTurn(), "r1", TaskSettings(result_ttl_s=120, block_ms=100))
    await api.start()
    try:
        task = await api.SubmitTask(ACME, submit_request())
        assert task.state == router_pb2.TASK_STATE_QUEUED and task.task_id
        done = await wait_for_state(api, task.task_id, router_pb2.TASK_STATE_SUCCEEDED)
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED
        assert done.text == "The quick brown fox"
        assert done.end.usage.completion_tokens == 4 and done.end.model == "served-for-acme"
        assert done.result_ttl_seconds == 120
        assert 0 < await redis_client.ttl(api.store.keys.task(task.task_id)) <= 120
        # Acknowledged and removed from the work queue.
        assert await redis_client.xlen(api.store.keys.stream) == 0
    finally:
        await api.stop()


async def test_watch_streams_state_then_every_token_once_then_the_end(redis_client: Any) -> None:
    api = TaskApi(redis_client, FakeRunTurn(delay_s=0.05), "r1", TaskSettings(block_ms=100))
    task = await api.SubmitTask(ACME, submit_request())
    events: list[router_pb2.TaskEvent] = []

    async def watch() -> None:
        async for event in api.WatchTask(ACME, router_pb2.WatchTaskRequest(task_id=task.task_id)):
            events.append(event)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.1)
    await api.start()
    try:
        await asyncio.wait_for(watcher, 10)
    finally:
        await api.stop()
    states = [e.task.state for e in events if e.HasField("task")]
    assert states == [
        router_pb2.TASK_STATE_QUEUED,
        router_pb2.TASK_STATE_RUNNING,
        router_pb2.TASK_STATE_SUCCEEDED,
    ]
    assert "".join(e.delta.text for e in events if e.HasField("delta")) == "The quick brown fox"
    assert events[-1].task.text == "The quick brown fox"
    # Watching a finished task gives its final state at once.
    late = [e async for e in api.WatchTask(ACME, router_pb2.WatchTaskRequest(task_id=task.task_id))]
    assert len(late) == 1 and late[0].task.state == router_pb2.TASK_STATE_SUCCEEDED


async def test_cancel_stops_a_running_generation(redis_client: Any) -> None:
    run_turn = FakeRunTurn(delay_s=0.3)
    api = TaskApi(redis_client, run_turn, "r1", TaskSettings(block_ms=100))
    await api.start()
    try:
        task = await api.SubmitTask(ACME, submit_request())
        await wait_for_state(api, task.task_id, router_pb2.TASK_STATE_RUNNING)
        cancelled = await api.CancelTask(ACME, router_pb2.CancelTaskRequest(task_id=task.task_id))
        assert cancelled.state == router_pb2.TASK_STATE_CANCELLED
        assert run_turn.cancelled == [f"task-{task.task_id}"]
        assert len(cancelled.text) < len("The quick brown fox")
    finally:
        await api.stop()


async def test_cancel_of_a_queued_task_is_immediate_and_it_never_runs(redis_client: Any) -> None:
    run_turn = FakeRunTurn()
    api = TaskApi(redis_client, run_turn, "r1", TaskSettings(block_ms=100))
    task = await api.SubmitTask(ACME, submit_request())
    cancelled = await api.CancelTask(ACME, router_pb2.CancelTaskRequest(task_id=task.task_id))
    assert cancelled.state == router_pb2.TASK_STATE_CANCELLED
    await api.start()
    try:
        await asyncio.sleep(0.3)
        assert run_turn.started == []
        assert await redis_client.xlen(api.store.keys.stream) == 0
    finally:
        await api.stop()


async def test_failure_is_recorded_with_its_reason(redis_client: Any) -> None:
    api = TaskApi(
        redis_client,
        FakeRunTurn(fail_with=errors.DependencyUnavailable("no replica can serve")),
        "r1",
        TaskSettings(block_ms=100),
    )
    await api.start()
    try:
        task = await api.SubmitTask(ACME, submit_request())
        failed = await wait_for_state(api, task.task_id, router_pb2.TASK_STATE_FAILED)
        assert failed.state == router_pb2.TASK_STATE_FAILED
        assert failed.error_message == "UNAVAILABLE: no replica can serve"
    finally:
        await api.stop()


async def test_another_tenant_cannot_see_watch_or_cancel_a_task(redis_client: Any) -> None:
    api = TaskApi(redis_client, FakeRunTurn(), "r1")
    task = await api.SubmitTask(ACME, submit_request())
    with pytest.raises(errors.PermissionDenied, match="belongs to another tenant"):
        await api.GetTask(GLOBEX, router_pb2.GetTaskRequest(task_id=task.task_id))
    with pytest.raises(errors.PermissionDenied):
        await api.CancelTask(GLOBEX, router_pb2.CancelTaskRequest(task_id=task.task_id))
    with pytest.raises(errors.PermissionDenied):
        async for _ in api.WatchTask(GLOBEX, router_pb2.WatchTaskRequest(task_id=task.task_id)):
            pass
    with pytest.raises(errors.NotFound, match="unknown or expired"):
        await api.GetTask(ACME, router_pb2.GetTaskRequest(task_id="0" * 32))


async def test_bad_submissions_name_the_field(redis_client: Any) -> None:
    api = TaskApi(redis_client, FakeRunTurn(), "r1")
    with pytest.raises(errors.InvalidArgument, match=r"request\.messages"):
        await api.SubmitTask(ACME, router_pb2.SubmitTaskRequest())
    bad_role = router_pb2.SubmitTaskRequest(
        request=router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="wizard", content="hi")])
    )
    with pytest.raises(errors.InvalidArgument, match=r"request\.messages\[0\]\.role"):
        await api.SubmitTask(ACME, bad_role)
    assert (
        await redis_client.xlen(api.store.keys.stream) == 0
    )  # nothing queued for a turn that would only fail
    with pytest.raises(errors.InvalidArgument, match="idempotency_key"):
        await api.SubmitTask(ACME, submit_request(key="k" * 300))
    with pytest.raises(errors.InvalidArgument, match="task_id"):
        await api.GetTask(ACME, router_pb2.GetTaskRequest())


async def test_same_idempotency_key_returns_the_same_task_per_tenant(redis_client: Any) -> None:
    api = TaskApi(redis_client, FakeRunTurn(), "r1")
    first = await api.SubmitTask(ACME, submit_request(key="order-42"))
    again = await api.SubmitTask(ACME, submit_request(key="order-42"))
    other_tenant = await api.SubmitTask(GLOBEX, submit_request(key="order-42"))
    assert again.task_id == first.task_id
    assert other_tenant.task_id != first.task_id


async def test_concurrent_submits_of_one_idempotency_key_make_one_task(redis_client: Any) -> None:
    # A client whose first call timed out retries while that call is still in flight, here
    # through another router: both submits meet in Redis.
    run_turn = FakeRunTurn()
    routers = [TaskApi(redis_client, run_turn, f"r{i}", TaskSettings(block_ms=100)) for i in range(2)]
    for api in routers:
        await api.start()
    try:
        for attempt in range(4):
            request = submit_request(key=f"order-{attempt}")
            first, second = await asyncio.gather(*(api.SubmitTask(ACME, request) for api in routers))
            assert first.task_id == second.task_id
            await wait_for_state(routers[0], first.task_id, router_pb2.TASK_STATE_SUCCEEDED)
    finally:
        for api in routers:
            await api.stop()
    assert len(run_turn.started) == 4


async def test_task_of_a_router_that_died_mid_run_is_taken_over(redis_client: Any) -> None:
    settings = TaskSettings(visibility_timeout_s=0.6, block_ms=100)
    dead = TaskApi(redis_client, FakeRunTurn(), "dead-router", settings)
    task = await dead.SubmitTask(ACME, submit_request())
    # A router takes the task, starts it, and dies (kill -9): no acknowledgement, no heartbeat.
    await dead.store.ensure_group()
    taken = await dead.store.take_new("dead-router", 1, 100)
    assert [t for _, t in taken] == [task.task_id]
    record = await dead.store.get(task.task_id)
    assert record is not None
    await dead.store.transition(record, {router_pb2.TASK_STATE_QUEUED}, router_pb2.TASK_STATE_RUNNING)
    await dead.store.append_delta(task.task_id, router_pb2.TokenDelta(text="The qu"))

    survivor = TaskApi(redis_client, FakeRunTurn(), "survivor", settings)
    await survivor.start()
    try:
        done = await wait_for_state(survivor, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=10)
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED
        assert done.text == "The quick brown fox"  # the new attempt's text only, not the old one's prefix
    finally:
        await survivor.stop()


async def test_a_task_taken_over_after_its_first_words_continues_after_them(
    redis_client: Any,
) -> None:
    settings = TaskSettings(visibility_timeout_s=0.6, block_ms=100)
    dead = TaskApi(redis_client, FakeRunTurn(), "dead-router", settings)
    task = await dead.SubmitTask(ACME, submit_request())
    # A router takes the task, saves its checkpoint, delivers two words and dies (kill -9).
    await dead.store.ensure_group()
    await dead.store.take_new("dead-router", 1, 100)
    record = await dead.store.get(task.task_id)
    assert record is not None
    await dead.store.transition(record, {router_pb2.TASK_STATE_QUEUED}, router_pb2.TASK_STATE_RUNNING)
    checkpoint = TurnCheckpoint(
        start=b"prompt", model="served", citations=(b"c1",), degraded=("rag: down",), cited=(("doc-1", 3),)
    )
    await dead.store.save_checkpoint(task.task_id, checkpoint.to_json())
    for i, word in enumerate(WORDS[:2]):
        await dead.store.append_delta(task.task_id, router_pb2.TokenDelta(text=word, token_ids=[i], index=i))

    turn = FakeRunTurn()
    survivor = TaskApi(redis_client, turn, "survivor", settings)
    await survivor.start()
    try:
        done = await wait_for_state(survivor, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=10)
    finally:
        await survivor.stop()
    assert done.state == router_pb2.TASK_STATE_SUCCEEDED
    assert done.text == "The quick brown fox"
    # The survivor was handed the checkpoint and the two words, and made only the other two.
    assert turn.resumed == [ResumePoint(checkpoint, (0, 1), "The quick ")]
    # A watcher following the task saw every word once, in order: the answer did not start again.
    events = await redis_client.xrange(survivor.store.keys.events(task.task_id))
    indexes = [
        router_pb2.TokenDelta.FromString(fields[b"p"]).index
        for _, fields in events
        if fields[b"k"] == b"delta"
    ]
    assert indexes == [0, 1, 2, 3]


async def test_a_client_reading_a_task_gets_its_status_but_not_the_request_or_running_prompt(
    redis_client: Any,
) -> None:
    api = TaskApi(redis_client, FakeRunTurn(), "r1", TaskSettings(block_ms=100))
    task = await api.SubmitTask(ACME, submit_request())
    record = await api.store.get(task.task_id)
    assert record is not None
    await api.store.transition(
        record, {router_pb2.TASK_STATE_QUEUED}, router_pb2.TASK_STATE_RUNNING, extra={"attempts": 1}
    )
    prompt = TurnCheckpoint(start=b"a long prompt with the history and the retrieved chunks", model="served")
    await api.store.save_checkpoint(task.task_id, prompt.to_json())
    await api.store.append_delta(task.task_id, router_pb2.TokenDelta(text="The ", token_ids=[7], index=0))
    await api.store.request_cancel(task.task_id)

    # Every field the router keeps in the task's hash is either read for clients or is the checkpoint:
    # a field added later cannot silently go missing from GetTask.
    stored = {k.decode() for k in await redis_client.hkeys(api.store.keys.task(task.task_id))}
    assert stored == set(STATUS_FIELDS) - {"end", "error"} | {"request", "checkpoint"}
    seen = await api.store.get(task.task_id)
    resumable = await api.store.get(task.task_id, with_resume_state=True)
    assert seen is not None and resumable is not None
    # GetTask and WatchTask see the task whole (state, owner, attempts, the cancel, the text so far) ...
    assert (seen.state, seen.tenant, seen.key_id, seen.attempts, seen.cancel_requested, seen.text) == (
        router_pb2.TASK_STATE_RUNNING,
        "acme",
        "acme-1",
        1,
        True,
        "The ",
    )
    assert seen.created_ms == resumable.created_ms > 0
    snapshot, cursor = await api.store.snapshot(task.task_id)
    assert snapshot is not None and snapshot.text == "The " and cursor != "0-0"
    # ... without reading the request, the prompt or the token ids, which only the worker running the
    # task or taking it over needs.
    assert (seen.request, seen.checkpoint, seen.token_ids) == (b"", "", ())
    assert (snapshot.request, snapshot.checkpoint) == (b"", "")
    assert router_pb2.ChatRequest.FromString(resumable.request).messages == submit_request().request.messages
    assert (TurnCheckpoint.from_json(resumable.checkpoint), resumable.token_ids) == (prompt, (7,))
    assert await api.store.get("no-such-task") is None
    assert (await api.store.snapshot("no-such-task"))[0] is None


async def test_a_long_running_task_is_not_stolen_from_a_live_router(redis_client: Any) -> None:
    settings = TaskSettings(visibility_timeout_s=0.6, block_ms=100)
    slow = FakeRunTurn(delay_s=0.4)  # 1.6 s in all: well past the visibility timeout
    owner = TaskApi(redis_client, slow, "owner", settings)
    other_turn = FakeRunTurn()
    other = TaskApi(redis_client, other_turn, "other", settings)
    await owner.start()
    task = await owner.SubmitTask(ACME, submit_request())
    await wait_for_state(owner, task.task_id, router_pb2.TASK_STATE_RUNNING)
    await other.start()
    try:
        done = await wait_for_state(owner, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=10)
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED
        assert other_turn.started == []
    finally:
        await owner.stop()
        await other.stop()


class FakeRateLimitedRunTurn(FakeRunTurn):
    """Stands in for the turn pipeline of a key over its rate limit: refuses the first calls."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def __call__(
        self, principal: Principal, request: router_pb2.ChatRequest, *args: Any, **options: Any
    ) -> AsyncGenerator[router_pb2.ChatResponse, None]:
        if self.refusals > 0:
            self.refusals -= 1
            raise errors.Overloaded("rate limit exceeded for API key acme-1", retry_after_s=0.1)
        async for response in super().__call__(principal, request, *args, **options):
            yield response


class FakeAdmittingRunTurn(FakeRunTurn):
    """The turn pipeline of a key that may start one request: admitted, the first call finds the
    replicas busy, the second finds none reachable (UNAVAILABLE before any token), the third
    answers. A call that admits the task a second time is refused for the key's rate."""

    def __init__(self) -> None:
        super().__init__()
        self.admissions: list[bool] = []  # each call's `admitted`

    async def __call__(
        self, principal: Principal, request: router_pb2.ChatRequest, *args: Any, **options: Any
    ) -> AsyncGenerator[router_pb2.ChatResponse, None]:
        call = len(self.admissions)
        self.admissions.append(options["admitted"])
        if not options["admitted"]:
            if call > 0:
                raise errors.Overloaded("rate limit exceeded for API key acme-1", retry_after_s=60)
            await options["on_admitted"]()
        if call == 0:
            raise errors.Overloaded("every replica is busy", retry_after_s=0.05)
        if call == 1:
            raise errors.DependencyUnavailable("no healthy replica of model m")
        async for response in super().__call__(principal, request, *args, **options):
            yield response


async def test_a_task_is_admitted_once_for_all_its_attempts(redis_client: Any) -> None:
    run_turn = FakeAdmittingRunTurn()
    api = TaskApi(
        redis_client, run_turn, "r1", TaskSettings(block_ms=100, visibility_timeout_s=0.5, overload_wait_s=1)
    )
    await api.start()
    try:
        task = await api.SubmitTask(ACME, submit_request())
        done = await wait_for_state(api, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=10)
        assert done.text == "The quick brown fox"
    finally:
        await api.stop()
    # The retry after busy replicas, and the redelivered attempt (read back from Redis), were
    # not admitted again.
    assert run_turn.admissions == [False, True, True]


async def test_a_rate_limited_task_waits_for_its_turn_instead_of_failing(
    redis_client: Any,
) -> None:
    run_turn = FakeRateLimitedRunTurn(refusals=2)
    api = TaskApi(redis_client, run_turn, "r1", TaskSettings(block_ms=100))
    await api.start()
    try:
        task = await api.SubmitTask(ACME, submit_request())
        done = await wait_for_state(api, task.task_id, router_pb2.TASK_STATE_SUCCEEDED)
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED and done.text == "The quick brown fox"
        assert run_turn.refusals == 0
    finally:
        await api.stop()
    impatient = TaskApi(
        redis_client,
        FakeRateLimitedRunTurn(refusals=100),
        "r2",
        TaskSettings(block_ms=100, overload_wait_s=0.3),
    )
    await impatient.start()
    try:
        task = await impatient.SubmitTask(ACME, submit_request())
        failed = await wait_for_state(impatient, task.task_id, router_pb2.TASK_STATE_FAILED)
        assert failed.state == router_pb2.TASK_STATE_FAILED
        assert failed.error_message.startswith("RESOURCE_EXHAUSTED: rate limit exceeded")
    finally:
        await impatient.stop()


async def test_a_tenant_at_its_cap_of_unfinished_tasks_is_refused_until_one_ends(
    redis_client: Any,
) -> None:
    run_turn = FakeRunTurn()
    api = TaskApi(redis_client, run_turn, "r1", TaskSettings(block_ms=100, max_per_tenant=2))
    first = await api.SubmitTask(ACME, submit_request("one"))
    second = await api.SubmitTask(ACME, submit_request("two", key="order-2"))
    with pytest.raises(errors.Overloaded, match=r"tenant 'acme' has 2 unfinished tasks \(max 2\)") as refused:
        await api.SubmitTask(ACME, submit_request("three", key="order-3"))
    assert refused.value.retry_after_s > 0  # RESOURCE_EXHAUSTED with RetryInfo
    # Refused means nothing stored: two tasks on the queue, the refused key not taken.
    assert await redis_client.xlen(api.store.keys.stream) == 2
    assert await redis_client.get(api.store.keys.idempotency("acme", "order-3")) is None
    # A retry of a task already accepted is not a new task: it gets its task back, not a refusal.
    again = await api.SubmitTask(ACME, submit_request("two", key="order-2"))
    assert again.task_id == second.task_id
    # Another tenant is not held back by acme's backlog.
    other = await api.SubmitTask(GLOBEX, submit_request("four"))
    # A task that ends (here: cancelled while queued) frees its place at once.
    await api.CancelTask(ACME, router_pb2.CancelTaskRequest(task_id=first.task_id))
    third = await api.SubmitTask(ACME, submit_request("three", key="order-3"))
    assert await api.store.open_tasks("acme") == 2
    await api.start()
    try:
        for task_id in (second.task_id, third.task_id):
            done = await wait_for_state(api, task_id, router_pb2.TASK_STATE_SUCCEEDED)
            assert done.state == router_pb2.TASK_STATE_SUCCEEDED
    finally:
        await api.stop()
    # Finished tasks no longer count: the tenant may fill its cap again.
    assert await api.store.open_tasks("acme") == 0
    assert await api.store.open_tasks("globex") == 0
    assert sorted(run_turn.started) == sorted(
        f"task-{t}" for t in (second.task_id, third.task_id, other.task_id)
    )


async def test_a_full_queue_refuses_new_tasks_and_never_drops_an_accepted_one(
    redis_client: Any,
) -> None:
    run_turn = FakeRunTurn()
    api = TaskApi(redis_client, run_turn, "r1", TaskSettings(block_ms=100, max_queued=3))
    tenants = [Principal(f"tenant-{i}", f"key-{i}") for i in range(5)]
    accepted: list[tuple[Principal, router_pb2.Task]] = []
    for principal in tenants:
        try:
            accepted.append((principal, await api.SubmitTask(principal, submit_request(principal.tenant))))
        except errors.Overloaded as exc:
            assert "task queue full: 3 tasks queued or running (max 3)" in str(exc)
    assert [p for p, _ in accepted] == tenants[:3]
    await api.start()
    try:
        for principal, task in accepted:
            done = await wait_for_state(
                api, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, principal=principal
            )
            assert done.state == router_pb2.TASK_STATE_SUCCEEDED and done.text == "The quick brown fox"
        # Once the queue has drained, submissions are accepted again.
        late = await api.SubmitTask(tenants[4], submit_request("late"))
        done = await wait_for_state(api, late.task_id, router_pb2.TASK_STATE_SUCCEEDED, principal=tenants[4])
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED
    finally:
        await api.stop()
    assert len(run_turn.started) == 4


def test_task_caps_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="--task-max-per-tenant"):
        TaskSettings(max_per_tenant=-1)
    with pytest.raises(ValueError, match="--task-max-queued"):
        TaskSettings(max_queued=-1)
    with pytest.raises(ValueError, match="--task-max-bytes-per-tenant"):
        TaskSettings(max_bytes_per_tenant=-1)


async def test_a_tenant_whose_unfinished_requests_hold_its_bytes_is_refused_until_one_ends(
    redis_client: Any,
) -> None:
    """The count cap alone let one tenant keep 1,000 tasks of up to 4 MiB each in Redis."""
    api = TaskApi(redis_client, FakeRunTurn(), "r1", TaskSettings(block_ms=100, max_bytes_per_tenant=5000))
    prompt = "x" * 2000  # each request a little over 2,000 bytes
    first = await api.SubmitTask(ACME, submit_request(prompt))
    await api.SubmitTask(ACME, submit_request(prompt))
    with pytest.raises(errors.Overloaded, match=r"bytes of unfinished task requests") as refused:
        await api.SubmitTask(ACME, submit_request(prompt))
    assert refused.value.retry_after_s > 0
    assert await redis_client.xlen(api.store.keys.stream) == 2  # nothing stored for the refused one
    await api.SubmitTask(GLOBEX, submit_request(prompt))  # another tenant has its own budget
    await api.SubmitTask(ACME, submit_request("short"))  # a small one still fits beside them
    # A task that ends frees its bytes at once.
    await api.CancelTask(ACME, router_pb2.CancelTaskRequest(task_id=first.task_id))
    await api.SubmitTask(ACME, submit_request(prompt))


async def test_a_router_paused_past_the_visibility_timeout_writes_nothing_into_its_taken_over_task(
    redis_client: Any,
) -> None:
    """A router whose heartbeats stop (a VM pause, a blocked loop) has its task taken over; when it
    goes on, its words went into the task beside the new run's: the answer interleaved, reported
    SUCCEEDED, and still growing after."""
    settings = TaskSettings(visibility_timeout_s=0.6, block_ms=100)
    paused = TaskApi(redis_client, FakeRunTurn(delay_s=0.5), "paused", settings)

    async def paused_loop(*args: Any) -> list[Any]:
        return []  # its loop is "paused" (no heartbeat, no reclaim) while the run itself goes on

    paused.store.heartbeat = paused_loop  # type: ignore[method-assign]
    paused.store.reclaim = paused_loop  # type: ignore[method-assign]
    await paused.start()
    survivor = TaskApi(redis_client, FakeRunTurn(), "survivor", settings)
    try:
        task = await paused.SubmitTask(ACME, submit_request())
        await wait_for_state(paused, task.task_id, router_pb2.TASK_STATE_RUNNING)
        await survivor.start()
        done = await wait_for_state(survivor, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=10)
        assert done.state == router_pb2.TASK_STATE_SUCCEEDED
        await asyncio.sleep(2.2)  # the paused run's every remaining word would have come by now
        after = await survivor.GetTask(ACME, router_pb2.GetTaskRequest(task_id=task.task_id))
        assert (after.state, after.text) == (router_pb2.TASK_STATE_SUCCEEDED, "The quick brown fox")
        deltas = await redis_client.xrange(survivor.store.keys.events(task.task_id))
        indexes = [router_pb2.TokenDelta.FromString(f[b"p"]).index for _, f in deltas if f[b"k"] == b"delta"]
        assert indexes == [0, 1, 2, 3]  # every word once
    finally:
        await paused.stop(grace_s=0.1)
        await survivor.stop()


async def test_a_stopping_router_hands_its_task_back_for_another_at_once_uncounted(redis_client: Any) -> None:
    """A rolling restart stops routers one after another: each stop counted as a failed attempt,
    so three of them failed a healthy task, and each left it for the 30 s visibility timeout."""
    settings = TaskSettings(visibility_timeout_s=30, block_ms=100, max_attempts=3)
    task_id = ""
    for i in range(3):
        # Words far slower than a stop takes, even on a loaded machine: the run is always stopped
        # mid-answer (at 0.5 s a word, a slow stop once let the run end first).
        api = TaskApi(redis_client, FakeRunTurn(delay_s=10.0), f"rolling-{i}", settings)
        if not task_id:
            task_id = (await api.SubmitTask(ACME, submit_request())).task_id
        await api.start()
        try:
            running = await wait_for_state(api, task_id, router_pb2.TASK_STATE_RUNNING, timeout=3)
            assert running.state == router_pb2.TASK_STATE_RUNNING, f"router {i} did not start it at once"
            await asyncio.sleep(0.3)
        finally:
            await api.stop(grace_s=0.1)
        queued = await api.GetTask(ACME, router_pb2.GetTaskRequest(task_id=task_id))
        assert queued.state == router_pb2.TASK_STATE_QUEUED, queued
    last = TaskApi(redis_client, FakeRunTurn(), "rolling-last", settings)
    await last.start()
    try:
        done = await wait_for_state(last, task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=3)
    finally:
        await last.stop()
    assert (done.state, done.text) == (router_pb2.TASK_STATE_SUCCEEDED, "The quick brown fox")
    attempts = await redis_client.hget(last.store.keys.task(task_id), "attempts")
    assert int(attempts) == 1  # the stops were hand-overs, not failures
    # A watcher saw each hand-back: submitted, then (running, queued again) three times, then the end.
    events = await redis_client.xrange(last.store.keys.events(task_id))
    states = [router_pb2.Task.FromString(f[b"p"]).state for _, f in events if f[b"k"] == b"task"]
    queued, running = router_pb2.TASK_STATE_QUEUED, router_pb2.TASK_STATE_RUNNING
    assert states == [queued, *[running, queued] * 3, running, router_pb2.TASK_STATE_SUCCEEDED]


class SwallowsFirstCancel(FakeRunTurn):
    """A turn whose first cancellation is lost, as one landing inside a Redis client's own timeout
    handling can be: it goes on as if nothing happened."""

    async def __call__(self, *args: Any, **kwargs: Any) -> AsyncGenerator[router_pb2.ChatResponse, None]:  # type: ignore[override]
        swallowed = False
        inner = super().__call__(*args, **kwargs)
        while True:
            try:
                response = await inner.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True
                inner = FakeRunTurn(self.delay_s).__call__(*args, **kwargs)  # on as if uncancelled
                continue
            yield response


async def test_a_stop_whose_cancellation_is_lost_cancels_again_instead_of_waiting_for_the_answer(
    redis_client: Any,
) -> None:
    """A lost cancellation let the run go on to its end (four words at 10 s: 40 s) while the
    stopping router waited for it, which held a rolling restart that long."""
    settings = TaskSettings(visibility_timeout_s=30, block_ms=100, max_attempts=3)
    api = TaskApi(redis_client, SwallowsFirstCancel(delay_s=10.0), "swallowing", settings)
    task_id = (await api.SubmitTask(ACME, submit_request())).task_id
    await api.start()
    running = await wait_for_state(api, task_id, router_pb2.TASK_STATE_RUNNING, timeout=3)
    assert running.state == router_pb2.TASK_STATE_RUNNING
    loop = asyncio.get_running_loop()
    began = loop.time()
    await api.stop(grace_s=0.1)
    assert loop.time() - began < 15, "the stop waited for the run's answer"
    queued = await api.GetTask(ACME, router_pb2.GetTaskRequest(task_id=task_id))
    assert queued.state == router_pb2.TASK_STATE_QUEUED, queued


async def test_a_running_task_outlives_the_unfinished_ttl_and_its_end_keeps_no_request(
    redis_client: Any,
) -> None:
    """The unfinished TTL ran from the submission: a run longer than it lost the task mid-way
    (NOT_FOUND), leaving its events stream in Redis with no TTL. And an ended task kept its request
    (up to 4 MiB) for its whole result TTL, read by nobody."""
    api = TaskApi(
        redis_client, FakeRunTurn(delay_s=0.6), "r1", TaskSettings(visibility_timeout_s=0.6, block_ms=100)
    )
    api.store.unfinished_ttl_s = 1  # the run takes 2.4 s
    await api.start()
    try:
        task = await api.SubmitTask(ACME, submit_request())
        done = await wait_for_state(api, task.task_id, router_pb2.TASK_STATE_SUCCEEDED, timeout=10)
    finally:
        await api.stop()
    assert (done.state, done.text) == (router_pb2.TASK_STATE_SUCCEEDED, "The quick brown fox")
    stored = {k.decode() for k in await redis_client.hkeys(api.store.keys.task(task.task_id))}
    assert not stored & {"request", "checkpoint", "run"} and "state" in stored


async def test_idempotency_keys_of_two_tenants_never_meet(redis_client: Any) -> None:
    api = TaskApi(redis_client, FakeRunTurn(), "r1", TaskSettings(block_ms=100))
    first = await api.SubmitTask(Principal("a", "a-1"), submit_request(key="b:c"))
    # Tenant "a:b" with key "c" was the same Redis key: PERMISSION_DENIED naming tenant a's task.
    second = await api.SubmitTask(Principal("a:b", "ab-1"), submit_request(key="c"))
    assert second.task_id != first.task_id and second.state == router_pb2.TASK_STATE_QUEUED
