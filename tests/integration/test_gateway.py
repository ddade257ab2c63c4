"""REST through the grpc-gateway sidecar, with the real router and a real inference replica behind it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.api import annotations_pb2
from openapi_spec_validator import validate
from openapi_spec_validator.validation import OpenAPIV2SpecValidator
from prometheus_client.parser import text_string_to_metric_families

from services.gen.llmmesh.v1 import router_pb2
from services.router.admission.auth import KeyLimits
from services.router.admission.keys import add_key
from tests.support.gateway import GATEWAY_DIR, GatewayProcess, ensure_gateway_built
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

# Generous: the first test also waits for a cold `make gateway` (apt, Go build) and the model load.
pytestmark = pytest.mark.timeout(900)

# A question the small model answers at length; greedy, so runs are comparable.
PROMPT = [{"role": "user", "content": "Count from one to one hundred in words."}]


def chat_body(max_tokens: int, *, ignore_eos: bool = False) -> dict[str, Any]:
    """A ChatRequest as JSON; the response cache is bypassed so every call generates."""
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        sampling["ignore_eos"] = True
    return {"messages": PROMPT, "sampling": sampling, "cache": {"mode": "CACHE_MODE_BYPASS"}}


@pytest.fixture(scope="session")
def gateway_binary() -> Path:
    """Builds the sidecar (`make gateway`) once per session when missing or stale."""
    return ensure_gateway_built()


@pytest.fixture(scope="module")
def api_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A keys file in the router's format: one unlimited key, one allowed a single request."""
    path = tmp_path_factory.mktemp("gateway-keys") / "keys.json"
    user_key, _ = add_key(path, "rest-tenant", "rest-user")
    limited_key, _ = add_key(
        path, "rest-tenant", "rest-limited", KeyLimits(requests_per_second=0.01, burst=1)
    )
    return path, user_key, limited_key


@pytest.fixture(scope="module")
def replica(shared_replica: ServiceProcess) -> ServiceProcess:
    """The session's shared replica: its cancel counter is read before and after, and no other
    file uses it while this one runs (``tests/conftest.py``)."""
    return shared_replica


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Redis for the router's async tasks and shared rate-limit buckets."""
    server = RedisServer(tmp_path_factory.mktemp("gateway-redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def router(
    replica: ServiceProcess, api_keys: tuple[Path, str, str], redis: RedisServer
) -> Iterator[ServiceProcess]:
    args = ["--replicas", replica.address, "--api-keys-file", str(api_keys[0]), "--redis-url", redis.url]
    proc = ServiceProcess("services.router", [*args, "--metrics-port", "0"]).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(gateway_binary: Path, router: ServiceProcess) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(router.address).start()
    yield proc
    proc.stop()


@pytest.fixture()
def client(gateway: GatewayProcess, api_keys: tuple[Path, str, str]) -> Iterator[httpx.Client]:
    """An HTTP client of the gateway that authenticates with the unlimited key."""
    headers = {"Authorization": f"Bearer {api_keys[1]}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=120) as c:
        yield c


def scrape(process: ServiceProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A service's Prometheus samples: (name, sorted labels) → value."""
    text = httpx.get(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


#: The replica's count of generations it ended because their client went away or gave up.
CANCELLED = ("llmmesh_inference_requests_total", (("finish_reason", "cancelled"),))


def replica_holding(replica: ServiceProcess, seen: list[dict[str, float]]) -> float:
    """Sequences the replica holds: running, queued, or parked because their reader is behind.

    Every reading is appended to ``seen`` so that a failure can say what the replica reported.
    """
    samples = scrape(replica)
    names = ("llmmesh_running_batch_size", "llmmesh_queue_depth", "llmmesh_parked_sequences")
    reading = {name: samples[(name, ())] for name in names}
    reading["cancelled"] = samples.get(CANCELLED, 0.0)
    seen.append(reading)
    return sum(reading[name] for name in names)


def replica_cancelled(replica: ServiceProcess) -> float:
    """Generations the replica ended because their client went away or gave up."""
    return scrape(replica).get(CANCELLED, 0.0)


def wait_for(condition: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> float:
    """Seconds until ``condition()`` holds; fails naming ``what`` (or what it returns then) after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what if isinstance(what, str) else what()}: not true after {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - start


def wait_replica_idle(replica: ServiceProcess, timeout: float) -> float:
    """Seconds until the replica runs, queues and parks nothing."""
    seen: list[dict[str, float]] = []
    return wait_for(
        lambda: replica_holding(replica, seen) == 0, timeout, lambda: f"replica idle (saw {seen[-3:]})"
    )


def router_requests(router: ServiceProcess, method: str) -> float:
    """The router's own count of ``method`` RPCs it handled (any status)."""
    return sum(
        value
        for (name, labels), value in scrape(router).items()
        if name == "llmmesh_requests_total" and dict(labels).get("method", "").endswith(method)
    )


def assert_error_body(response: httpx.Response, grpc_code: grpc.StatusCode, *needles: str) -> dict[str, Any]:
    """The JSON error body: the gRPC code and the router's message, which names the problem."""
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    assert set(body) == {"error", "message", "code", "details"}, body
    assert body["code"] == grpc_code.value[0], body
    assert body["message"], body
    for needle in needles:
        assert needle in body["message"].lower(), body
    return body


def assert_no_grpc_trailers(response: httpx.Response) -> None:
    """No gRPC transport trailer reaches an HTTP client, announced or sent as a header."""
    leaked = [name for name in response.headers if name == "trailer" or name.startswith("grpc-trailer-")]
    assert not leaked, dict(response.headers)


# --- done when 1: answers as JSON, streams as generated, cancels on disconnect ---


def test_complete_answers_as_json(client: httpx.Client) -> None:
    response = client.post("/v1/complete", json=chat_body(12, ignore_eos=True))

    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    answer = response.json()
    assert answer["text"].strip()
    assert len(answer["token_ids"]) == 12
    assert answer["end"]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert answer["end"]["usage"]["completion_tokens"] == 12
    assert answer["request_id"]


def test_chat_stream_sends_ndjson_chunks_as_they_are_generated(client: httpx.Client) -> None:
    arrivals: list[tuple[float, dict[str, Any]]] = []
    start = time.monotonic()
    with client.stream("POST", "/v1/chat:stream", json=chat_body(40, ignore_eos=True)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.strip():
                arrivals.append((time.monotonic() - start, json.loads(line)))

    messages = [m["result"] for _, m in arrivals]
    deltas = [(t, m["result"]["delta"]) for t, m in arrivals if "delta" in m["result"]]
    end_at, last = arrivals[-1]
    assert "end" in last["result"], last
    assert last["result"]["end"]["usage"]["completion_tokens"] == 40
    assert sum(len(d["token_ids"]) for _, d in deltas) == 40
    assert [int(m["seq"]) for m in messages] == list(range(1, len(messages) + 1))
    # Flushed per chunk, not buffered until the end: the first tokens reach the
    # client while most of the answer is still to be generated, and the rest
    # trickle in over the generation rather than in one burst.
    first_at = deltas[0][0]
    assert first_at < 0.5 * end_at, (first_at, end_at)
    assert len({round(t, 2) for t, _ in deltas}) >= 10, deltas


def test_client_disconnect_cancels_generation_on_replica(
    gateway: GatewayProcess, api_keys: tuple[Path, str, str], replica: ServiceProcess
) -> None:
    wait_replica_idle(replica, 30)
    cancelled_before = replica_cancelled(replica)
    print(f"cancelled before: {cancelled_before}")
    headers = {"Authorization": f"Bearer {api_keys[1]}"}
    # 2,000 tokens take minutes on CPU: only a cancel ends the generation in seconds.
    with (
        httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as c,
        c.stream("POST", "/v1/chat:stream", json=chat_body(2000, ignore_eos=True)) as response,
    ):
        assert response.status_code == 200
        # Kept referenced until the block ends: a line iterator dropped after its first line is
        # finalised at once, and httpcore closes the connection when its stream is closed early,
        # so the client would hang up here, before the replica could be seen holding the
        # generation (how this test failed under load in CI, 2026-12-02 and 2026-12-04).
        lines = response.iter_lines()
        first = json.loads(next(lines))
        assert "delta" in first["result"]
        # This client reads no further, so the stream backs up to the replica, which parks the
        # sequence once its reader is 64 tokens behind: parked still counts as held there.
        seen: list[dict[str, float]] = []
        wait_for(
            lambda: replica_holding(replica, seen) == 1,
            20,
            lambda: (
                f"generation held by the replica ({len(seen)} readings, first {seen[:3]}, last {seen[-3:]})"
            ),
        )
        # Leaving the block closes the connection mid-stream.

    wait_for(lambda: replica_cancelled(replica) == cancelled_before + 1, 15, "generation cancelled")
    wait_replica_idle(replica, 5)


def test_tasks_are_submitted_read_and_cancelled_over_rest(client: httpx.Client) -> None:
    short = client.post("/v1/tasks", json={"request": chat_body(6, ignore_eos=True)})
    long = client.post("/v1/tasks", json={"request": chat_body(2000, ignore_eos=True)})
    assert short.status_code == long.status_code == 200, (short.text, long.text)
    short_id, long_id = short.json()["task_id"], long.json()["task_id"]

    def state(task_id: str) -> str:
        response = client.get(f"/v1/tasks/{task_id}")
        assert response.status_code == 200, response.text
        return str(response.json()["state"])

    wait_for(lambda: state(short_id) == "TASK_STATE_SUCCEEDED", 60, "short task succeeded")
    # curl -d '' (a form body) to the task, or a method override: never a cancel. grpc-gateway
    # routed such a POST at random (a Go map), and honoured the override.
    for headers in (
        {"content-type": "application/x-www-form-urlencoded"},
        {"x-http-method-override": "DELETE"},
    ):
        for _ in range(15):
            assert client.post(f"/v1/tasks/{long_id}", content=b"", headers=headers).status_code == 405
    assert state(long_id) != "TASK_STATE_CANCELLED"
    cancelled = client.delete(f"/v1/tasks/{long_id}")
    missing = client.get("/v1/tasks/no-such-task")

    assert cancelled.status_code == 200
    wait_for(lambda: state(long_id) == "TASK_STATE_CANCELLED", 30, "long task cancelled")
    assert client.get(f"/v1/tasks/{short_id}").json()["end"]["usage"]["completion_tokens"] == 6
    assert missing.status_code == 404
    assert_error_body(missing, grpc.StatusCode.NOT_FOUND)


# --- done when 2: errors map to the HTTP statuses a REST user expects ---


def test_missing_or_wrong_api_key_is_401(gateway: GatewayProcess) -> None:
    anonymous = httpx.post(f"{gateway.url}/v1/complete", json=chat_body(4), timeout=30)
    wrong = httpx.post(
        f"{gateway.url}/v1/complete",
        json=chat_body(4),
        headers={"Authorization": "Bearer llmk_not-a-key"},
        timeout=30,
    )

    assert anonymous.status_code == 401
    assert_error_body(anonymous, grpc.StatusCode.UNAUTHENTICATED)
    assert wrong.status_code == 401
    assert_error_body(wrong, grpc.StatusCode.UNAUTHENTICATED)


def test_invalid_argument_is_400_naming_the_field(client: httpx.Client) -> None:
    # Rejected by the router/replica: the message names the field.
    body = chat_body(4)
    body["sampling"]["temperature"] = -1
    bad_temperature = client.post("/v1/complete", json=body)
    # Rejected by the gateway itself: a misspelt field is not silently ignored.
    misspelt = client.post("/v1/complete", json={"messages": PROMPT, "sampling": {"max_token": 4}})

    assert bad_temperature.status_code == 400
    assert_error_body(bad_temperature, grpc.StatusCode.INVALID_ARGUMENT, "temperature")
    assert misspelt.status_code == 400
    assert_error_body(misspelt, grpc.StatusCode.INVALID_ARGUMENT, "max_token")


def test_a_field_of_the_wrong_type_is_400_naming_its_path(
    client: httpx.Client, router: ServiceProcess
) -> None:
    before = router_requests(router, "Complete")
    not_a_list = client.post("/v1/complete", json={"messages": 5})
    not_a_number = client.post("/v1/complete", json={"messages": PROMPT, "sampling": {"max_tokens": "x"}})
    deep = client.post("/v1/complete", json={"messages": [*PROMPT, {"role": "user", "content": 7}]})

    # Until 2026-12-07 these said only "cannot unmarshal number into Go value of type
    # []json.RawMessage" or "invalid character 'x' looking for beginning of value".
    assert not_a_list.status_code == not_a_number.status_code == deep.status_code == 400
    assert assert_error_body(not_a_list, grpc.StatusCode.INVALID_ARGUMENT)["message"].startswith("messages: ")
    body = assert_error_body(not_a_number, grpc.StatusCode.INVALID_ARGUMENT)
    assert body["message"] == 'sampling.max_tokens: invalid value "x", want an integer', body
    assert assert_error_body(deep, grpc.StatusCode.INVALID_ARGUMENT)["message"].startswith(
        "messages[1].content: "
    )
    assert router_requests(router, "Complete") == before


def test_rate_limited_key_gets_429_with_retry_after(
    gateway: GatewayProcess, api_keys: tuple[Path, str, str]
) -> None:
    headers = {"Authorization": f"Bearer {api_keys[2]}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as c:
        first = c.post("/v1/complete", json=chat_body(2))
        second = c.post("/v1/complete", json=chat_body(2))
        streamed = c.post("/v1/chat:stream", json=chat_body(2))

    assert first.status_code == 200, first.text
    assert second.status_code == 429
    assert_error_body(second, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit")
    # The router's RetryInfo becomes the header HTTP clients already honour.
    assert int(second.headers["retry-after"]) >= 1
    # The refusal came trailers-only; its gRPC content-type trailer was relayed (until 2026-12-07).
    assert_no_grpc_trailers(second)
    # A stream refused before its first token is answered the same way, not as a stream's last
    # line {"error": {…}} without Retry-After (until 2026-12-07).
    assert streamed.status_code == 429
    assert_error_body(streamed, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit")
    assert int(streamed.headers["retry-after"]) >= 1
    assert_no_grpc_trailers(streamed)


def test_grpc_timeout_header_is_honoured_as_504(client: httpx.Client, replica: ServiceProcess) -> None:
    started = time.monotonic()
    response = client.post(
        "/v1/complete", json=chat_body(2000, ignore_eos=True), headers={"Grpc-Timeout": "500m"}
    )
    elapsed = time.monotonic() - started

    assert response.status_code == 504
    assert_error_body(response, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed < 10
    # The deadline reached the replica too: the generation stops there.
    wait_replica_idle(replica, 15)


def test_a_malformed_or_out_of_range_grpc_timeout_is_400_naming_the_header(
    client: httpx.Client, router: ServiceProcess
) -> None:
    before = router_requests(router, "Complete")
    # Negative, or past time.Duration: a deadline already gone, 504 (until 2026-12-07); zero: no
    # deadline at all; nine digits: more than gRPC allows.
    for value in ("-5S", "99999999H", "0S", "100000000S", "1.5S"):
        response = client.post("/v1/complete", json=chat_body(2), headers={"Grpc-Timeout": value})
        assert response.status_code == 400, (value, response.text)
        assert assert_error_body(response, grpc.StatusCode.INVALID_ARGUMENT)["message"].startswith(
            "Grpc-Timeout: "
        )
    assert router_requests(router, "Complete") == before


def test_a_stream_cut_by_its_deadline_ends_with_a_whole_error_line(
    client: httpx.Client, replica: ServiceProcess
) -> None:
    # 2,000 tokens take minutes on CPU; the first comes well within the 5 s, so the error is a last line.
    response = client.post(
        "/v1/chat:stream", json=chat_body(2000, ignore_eos=True), headers={"Grpc-Timeout": "5S"}
    )

    assert response.status_code == 200
    lines = response.content.split(b"\n")
    # Newline-delimited JSON: the error line too ends with "\n" (it did not until 2026-12-07).
    assert lines[-1] == b"", response.content[-200:]
    messages = [json.loads(line) for line in lines[:-1]]
    assert "delta" in messages[0]["result"]
    assert messages[-1]["error"]["grpc_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], messages[-1]
    wait_replica_idle(replica, 15)


def test_router_without_reachable_replica_is_503(
    gateway_binary: Path, api_keys: tuple[Path, str, str]
) -> None:
    # Port 9 (discard) on loopback: nothing listens, connections are refused.
    args = ["--replicas", "127.0.0.1:9", "--api-keys-file", str(api_keys[0])]
    with ServiceProcess("services.router", args) as lonely_router:
        sidecar = GatewayProcess(lonely_router.address).start()
        try:
            response = httpx.post(
                f"{sidecar.url}/v1/complete",
                json=chat_body(4),
                headers={"Authorization": f"Bearer {api_keys[1]}"},
                timeout=60,
            )
        finally:
            sidecar.stop()

    assert response.status_code == 503
    assert_error_body(response, grpc.StatusCode.UNAVAILABLE)


def test_oversized_body_is_413_and_never_reaches_router(client: httpx.Client, router: ServiceProcess) -> None:
    before = router_requests(router, "Complete")
    huge = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    with_length = client.post("/v1/complete", json=huge)
    # Chunked, no Content-Length: the limit is enforced on the bytes read.
    chunked = client.post("/v1/complete", content=iter([json.dumps(huge).encode()]))

    assert with_length.status_code == 413
    assert "larger than" in with_length.json()["message"]
    assert chunked.status_code == 413
    # The one request the router saw is the small one sent after them.
    assert client.post("/v1/complete", json=chat_body(1)).status_code == 200
    assert router_requests(router, "Complete") == before + 1


# --- done when 3: the OpenAPI spec ---


def annotated_routes() -> dict[tuple[str, str], str]:
    """(HTTP verb, path) → RPC name, read from router.proto's google.api.http options."""
    routes = {}
    for method in router_pb2.DESCRIPTOR.services_by_name["Router"].methods:
        options = method.GetOptions()
        if options.HasExtension(annotations_pb2.http):
            rule = options.Extensions[annotations_pb2.http]
            verb = rule.WhichOneof("pattern")
            routes[(verb, getattr(rule, verb))] = method.name
    return routes


def test_openapi_json_is_valid_swagger_describing_every_route(gateway: GatewayProcess) -> None:
    response = httpx.get(f"{gateway.url}/openapi.json", timeout=10)

    assert response.status_code == 200
    spec = response.json()
    validate(spec, cls=OpenAPIV2SpecValidator)
    assert spec["swagger"] == "2.0"
    described = {
        (verb, path): op["operationId"] for path, ops in spec["paths"].items() for verb, op in ops.items()
    }
    assert described == annotated_routes()
    assert set(annotated_routes().values()) == {
        "Complete",
        "ChatStream",
        "SubmitTask",
        "GetTask",
        "CancelTask",
        "ListReplicas",
    }
    # The served document is the committed one (the build regenerates both together).
    assert spec == json.loads((GATEWAY_DIR / "openapi.json").read_text())


# --- the sidecar itself ---


def test_healthz_follows_router_health(gateway: GatewayProcess, gateway_binary: Path) -> None:
    healthy = httpx.get(f"{gateway.url}/healthz", timeout=10)
    orphan = GatewayProcess("127.0.0.1:9").start()
    try:
        unhealthy = httpx.get(f"{orphan.url}/healthz", timeout=10)
    finally:
        orphan.stop()

    assert healthy.status_code == 200
    assert healthy.json()["status"] == "SERVING"
    assert unhealthy.status_code == 503
    assert unhealthy.json()["status"] != "SERVING"


def test_sigterm_lets_a_stream_in_flight_finish(
    gateway_binary: Path, router: ServiceProcess, api_keys: tuple[Path, str, str]
) -> None:
    sidecar = GatewayProcess(router.address).start()
    headers = {"Authorization": f"Bearer {api_keys[1]}"}
    try:
        with (
            httpx.Client(base_url=sidecar.url, headers=headers, timeout=60) as c,
            c.stream("POST", "/v1/chat:stream", json=chat_body(24, ignore_eos=True)) as response,
        ):
            lines = response.iter_lines()
            first = json.loads(next(lines))
            sidecar.terminate()
            rest = [json.loads(line) for line in lines if line.strip()]
        exit_code = sidecar.wait(30)
    finally:
        sidecar.kill()

    assert "delta" in first["result"]
    assert rest[-1]["result"]["end"]["usage"]["completion_tokens"] == 24
    assert exit_code == 0
