"""The OpenAI front's llm-mesh extras and stream resume, over a real mesh: Redis, the session service,
a retriever (Milvus Lite), a real replica (SmolLM2 on CPU, fp32) and two routers sharing them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from services.common.metadata import AUTHORIZATION_KEY, TENANT_KEY
from services.gen.llmmesh.v1 import common_pb2, router_pb2, session_pb2, session_pb2_grpc
from tests.support.openai_front import http_base, keys_file
from tests.support.processes import ROOT, ServiceProcess
from tests.support.redis import RedisServer
from tests.support.router_mesh import router_stub

KEY = "sk-mesh-tenant-a"
OTHER = "sk-mesh-tenant-b"
DOC = (
    "# Lighthouse keeping\n\nThe Skerry Point lighthouse is painted with red and white bands."
    " Its keeper, Morag, winds the clockwork every four hours.\n"
)


@dataclass
class Mesh:
    replica: ServiceProcess
    routers: list[ServiceProcess]
    bases: list[str]
    model: str
    spans: Path
    session: ServiceProcess

    def client(self, router: int = 0, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.bases[router]}/v1", api_key=key, max_retries=0)

    def post(self, body: object, router: int = 0, key: str = KEY, **headers: str) -> httpx.Response:
        sent = {"authorization": f"Bearer {key}", **{k.replace("_", "-"): v for k, v in headers.items()}}
        return httpx.post(f"{self.bases[router]}/v1/chat/completions", json=body, headers=sent, timeout=60)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, shared_replica: ServiceProcess) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("openai-mesh")
    keys = keys_file(tmp / "keys.yaml", {KEY: {"tenant": "a"}, OTHER: {"tenant": "b"}})
    spans = tmp / "spans.jsonl"
    redis = RedisServer(tmp / "redis").start()
    started: list[ServiceProcess] = []
    try:
        session = ServiceProcess("services.session", ["--redis-url", redis.url])
        retriever = ServiceProcess("services.retriever", ["--milvus-uri", str(tmp / "milvus.db")])
        replica = shared_replica  # the session's real replica (SmolLM2, fp32), not stopped here
        for service in (session, retriever):
            started.append(service.start(240))
        common = [
            "--replicas", replica.address, "--redis-url", redis.url, "--session-addr", session.address,
            "--retriever-addr", retriever.address, "--api-keys-file", str(keys), "--health-interval-s", "0.3",
            "--probe-interval-s", "0", "--http-port", "0",
        ]  # fmt: skip
        routers = [
            ServiceProcess("services.router", common, env={"LLMMESH_TRACE_FILE": str(spans)}),
            ServiceProcess("services.router", common),
        ]
        for router in routers:
            started.append(router.start())
        bases = [http_base(r) for r in routers]
        doc = tmp / "lighthouse.md"
        doc.write_text(DOC)
        ingest = subprocess.run(
            [sys.executable, "-m", "services.cli", "ingest", str(doc), "--router", routers[0].address,
             "--api-key", KEY],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert ingest.returncode == 0, ingest.stdout + ingest.stderr
        models = httpx.get(f"{bases[0]}/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
        yield Mesh(replica, routers, bases, models["data"][0]["id"], spans, session)
    finally:
        for service in reversed(started):
            service.stop()
        redis.kill()


def chat(mesh: Mesh, text: str, max_tokens: int = 8, **fields: object) -> dict[str, object]:
    return {
        "model": mesh.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **fields,
    }


# -- Last-Event-ID resume


def read_events(response: httpx.Response, count: int | None = None) -> list[tuple[str, str]]:
    """(id, data) of each event, up to ``count`` of them; keep-alive comment lines skipped."""
    events: list[tuple[str, str]] = []
    event_id = ""
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            event_id = ""
            if count is not None and len(events) == count:
                break
    return events


def tokens(events: list[tuple[str, str]]) -> str:
    chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def stream(mesh: Mesh, body: dict[str, object], router: int, **headers: str) -> httpx.Response:
    client = httpx.Client(timeout=60)
    request = client.build_request(
        "POST",
        f"{mesh.bases[router]}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}", **headers},
    )
    return client.send(request, stream=True)


def test_last_event_id_resumes_on_another_router_without_a_lost_or_repeated_token(mesh: Mesh) -> None:
    # Bypassing the response cache: the resumed part must come from a generation that ran on.
    body = chat(mesh, "Write a short poem about the sea.", 40, stream=True, resumable=True, cache="bypass")
    expected = mesh.post({**body, "stream": False, "resumable": None}).json()["choices"][0]["message"]
    first = stream(mesh, body, 0)
    assert first.status_code == 200
    received = read_events(first, 5)
    first.close()  # the connection is dropped mid-answer: the turn runs on into the replay buffer
    time.sleep(0.3)
    again = stream(mesh, body, 1, **{"last-event-id": received[-1][0]})  # the other router
    assert again.status_code == 200, again.read()
    resumed = read_events(again)
    again.close()
    ids = [i for i, _ in received + resumed if i]
    assert len(ids) == len(set(ids))  # none twice
    completion_id = received[0][0].rsplit("-", 1)[0]
    assert ids == [f"{completion_id}-{k}" for k in range(1, len(ids) + 1)]  # none lost
    assert resumed[-1][1] == "[DONE]"
    assert tokens(received + resumed) == expected["content"]  # fp32 greedy: the uninterrupted answer


def test_a_stream_not_marked_resumable_is_cancelled_on_leaving_and_resume_says_so(mesh: Mesh) -> None:
    body = chat(mesh, "Count slowly to one hundred.", 200, stream=True, ignore_eos=True)
    first = stream(mesh, body, 0)
    received = read_events(first, 3)
    first.close()
    # Not resumable: its events carry no ids (as OpenAI's); the client names the third itself.
    assert [event_id for event_id, _ in received] == ["", "", ""]
    last_event_id = f"chatcmpl-{first.headers['x-request-id']}-3"
    again = stream(mesh, body, 1, **{"last-event-id": last_event_id})
    resumed = read_events(again)
    again.close()
    # What was generated before the cancel comes back, then the stream says it was cut short.
    error = json.loads(resumed[-2][1])["error"]
    assert error["type"] == "service_unavailable_error" and "cancelled" in error["message"]
    assert resumed[-1][1] == "[DONE]"


def test_resume_errors_are_openai_shaped(mesh: Mesh) -> None:
    body = chat(mesh, "Say hi.", 4, stream=True, resumable=True)
    owned = stream(mesh, body, 0)
    last = read_events(owned)[-2][0]
    owned.close()
    # Another tenant's stream: 404, as one never buffered (an id is the tenant's own: another
    # tenant's is not theirs to know of); a malformed id or one for another number of choices:
    # 400 naming the header.
    foreign = httpx.post(
        f"{mesh.bases[1]}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {OTHER}", "last-event-id": last},
    )
    assert foreign.status_code == 404 and foreign.json()["error"]["type"] == "not_found_error"
    missing = mesh.post(body, 1, last_event_id="chatcmpl-never-ran-3")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    for bad in ("nonsense", "cmpl-abc-1", last.rsplit("-", 1)[0] + "-1.2"):
        refused = mesh.post(body, 1, last_event_id=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "Last-Event-ID", bad
    not_streamed = mesh.post({**body, "stream": False}, 1)
    assert not_streamed.status_code == 400 and not_streamed.json()["error"]["param"] == "resumable"


# -- extras through the SDK: extra_body and extra_headers


def test_a_full_session_is_refused_429_before_any_answer(mesh: Mesh) -> None:
    """A turn whose save the session's turn limit (1,000 by default) would refuse is refused before
    the replica works on it: streamed, it was a 200 whose answer ended in an error event, and each
    such request cost a whole answer the client could not keep."""
    tenant = ((TENANT_KEY, "a"),)
    with grpc.insecure_channel(mesh.session.address) as channel:
        stub = session_pb2_grpc.SessionStub(channel)
        stub.CreateSession(
            session_pb2.CreateSessionRequest(session_id="sdk-full"), metadata=tenant, timeout=10
        )
        filler = [session_pb2.Turn(role="user", content=f"turn {i}") for i in range(999)]
        stub.AppendTurns(
            session_pb2.AppendTurnsRequest(session_id="sdk-full", turns=filler), metadata=tenant, timeout=10
        )
        # 999 held; a turn adds its question and its answer.
        refused = mesh.post(chat(mesh, "One more?", stream=True, session_id="sdk-full"))
        assert refused.status_code == 429, refused.text
        assert refused.headers["x-should-retry"] == "false"
        error = refused.json()["error"]
        assert error["code"] == "insufficient_quota" and "limit of 1000" in error["message"], error
        held = stub.GetSession(
            session_pb2.GetSessionRequest(session_id="sdk-full"), metadata=tenant, timeout=10
        )
        assert held.info.turn_count == 999 and held.info.max_turns == 1000


def test_session_id_keeps_the_conversation_and_another_tenants_id_is_its_own(mesh: Mesh) -> None:
    client = mesh.client()
    first = client.chat.completions.create(
        model=mesh.model,
        messages=[{"role": "user", "content": "My name is Ada."}],
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": "sdk-session-1"},
    )
    second = client.chat.completions.create(
        model=mesh.model,
        messages=[{"role": "user", "content": "What is my name?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": "sdk-session-1"},
    )
    alone = client.chat.completions.create(
        model=mesh.model,
        messages=[{"role": "user", "content": "What is my name?"}],
        max_tokens=4,
        temperature=0,
    )
    extras = [first.model_extra["llm_mesh"], second.model_extra["llm_mesh"]]  # type: ignore[index]
    assert [e["session_id"] for e in extras] == ["sdk-session-1"] * 2
    assert [e["session_version"] for e in extras] == [1, 2]
    assert first.usage and second.usage and alone.usage
    # The router put the first exchange before the second question: the prompt is longer by it.
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 5
    # Another tenant's "sdk-session-1" is its own (docs/session.md, Tenants): a new conversation,
    # without the first exchange in its prompt. Until 2026-12-07 it was refused, 403.
    other = mesh.client(key=OTHER).chat.completions.create(
        model=mesh.model,
        messages=[{"role": "user", "content": "What is my name?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": "sdk-session-1"},
    )
    assert other.model_extra is not None and other.model_extra["llm_mesh"]["session_version"] == 1
    assert other.usage and other.usage.prompt_tokens == alone.usage.prompt_tokens
    # The Responses API continues the same conversation, streamed too; its end says so.
    third = client.responses.create(
        model=mesh.model,
        input="And my name again?",
        max_output_tokens=4,
        temperature=0,
        extra_body={"session_id": "sdk-session-1"},
    )
    assert third.model_extra is not None and third.model_extra["llm_mesh"]["session_version"] == 3
    assert third.usage is not None and third.usage.input_tokens > second.usage.prompt_tokens
    with client.responses.stream(
        model=mesh.model, input="Thanks.", max_output_tokens=2, extra_body={"session_id": "sdk-session-1"}
    ) as stream:
        last = list(stream)[-1]
    assert last.response.model_extra["llm_mesh"]["session_version"] == 4  # type: ignore[union-attr,index]


def test_session_must_exist_refuses_an_unknown_id_and_creates_nothing(mesh: Mesh) -> None:
    assert mesh.post(chat(mesh, "Remember the number 7.", 2, session_id="kept-1")).status_code == 200
    kept = mesh.post(chat(mesh, "Which number?", 2, session_id="kept-1", session_must_exist=True))
    assert kept.status_code == 200, kept.text
    assert kept.json()["llm_mesh"]["session_version"] == 2
    for _ in range(2):  # the refusal created nothing: the same mistyped id is refused again
        typo = mesh.post(chat(mesh, "Which number?", 2, session_id="kept-l", session_must_exist=True))
        assert typo.status_code == 404, typo.text
        assert "session_id" in typo.json()["error"]["message"]
    assert mesh.post(chat(mesh, "Hi", 2, session_must_exist=True)).json()["error"]["param"] == (
        "session_must_exist"
    )
    # The same over gRPC and from the CLI, whose --session-must-exist sets it.
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Which number?")],
        session_id="kept-l",
        session_must_exist=True,
    )
    with pytest.raises(grpc.RpcError) as refused:
        router_stub(mesh.routers[1]).Complete(request, metadata=((AUTHORIZATION_KEY, f"Bearer {KEY}"),))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    asked = subprocess.run(
        [sys.executable, "-m", "services.cli", "ask", "--router", mesh.routers[0].address, "--api-key", KEY,
         "--session", "kept-l", "--session-must-exist", "Which number?"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert asked.returncode == 1 and "NOT_FOUND" in asked.stderr and "kept-l" in asked.stderr, asked.stderr


def test_rag_answers_carry_citations_whole_and_streamed(mesh: Mesh) -> None:
    client = mesh.client()
    question: list[Any] = [{"role": "user", "content": "Who keeps the Skerry Point lighthouse?"}]
    answer = client.chat.completions.create(
        model=mesh.model, messages=question, max_tokens=8, temperature=0, extra_body={"rag": {"top_k": 2}}
    )
    citations = answer.model_extra["llm_mesh"]["citations"]  # type: ignore[index]
    assert citations and citations[0]["title"] and "Morag" in citations[0]["snippet"]
    chunks = list(
        client.chat.completions.create(
            model=mesh.model,
            messages=question,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"rag": True},
        )
    )
    finishing: list[Any] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing[0].model_extra["llm_mesh"]["citations"][0]["document_id"] == citations[0]["document_id"]  # type: ignore[index]
    filtered = client.chat.completions.create(
        model=mesh.model,
        messages=question,
        max_tokens=2,
        extra_body={"rag": {"filter": {"no-such-key": "x"}}},
    )
    assert filtered.model_extra["llm_mesh"]["citations"] == []  # type: ignore[index]
    bad = mesh.post(chat(mesh, "x", rag={"topk": 2}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rag.topk"


def test_cache_policy_maps_to_the_routers_response_cache(mesh: Mesh) -> None:
    client = mesh.client()

    def layer(mode: str) -> object:
        answer = client.chat.completions.create(
            model=mesh.model,
            messages=[{"role": "user", "content": "Name a fruit."}],
            max_tokens=4,
            temperature=0,
            extra_body={"cache": {"mode": mode}},
        )
        return answer.model_extra["llm_mesh"]["cache_layer"]  # type: ignore[index]

    assert layer("refresh") is None  # computed afresh, and stored
    time.sleep(0.5)  # the fill is bookkeeping after the answer
    assert layer("default") == "exact"
    assert layer("bypass") is None


def test_x_request_id_names_the_request_and_comes_back(mesh: Mesh) -> None:
    raw = mesh.client().chat.completions.with_raw_response.create(
        model=mesh.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_headers={"x-request-id": "sdk-req-1"},
    )
    assert raw.headers["x-request-id"] == "sdk-req-1"
    assert raw.parse().id == "chatcmpl-sdk-req-1"
    reused = mesh.post(chat(mesh, "Hi", 2), x_request_id="sdk-req-1")
    assert reused.status_code == 409 and reused.json()["error"]["param"] == "x-request-id"
    assert reused.headers["x-request-id"] == "sdk-req-1"  # errors echo it too
    bad = mesh.post(chat(mesh, "Hi", 2), x_request_id="{no braces}")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"
    generated = mesh.post(chat(mesh, "Hi", 2))
    assert generated.json()["id"] == "chatcmpl-" + generated.headers["x-request-id"]
    # The Responses API names its response by the same id, and refuses a reused one the same way.
    response = mesh.client().responses.with_raw_response.create(
        model=mesh.model, input="Hi", max_output_tokens=2, extra_headers={"x-request-id": "sdk-resp-1"}
    )
    assert response.headers["x-request-id"] == "sdk-resp-1" and response.parse().id == "resp_sdk-resp-1"
    with pytest.raises(openai.ConflictError) as reused_response:
        mesh.client().responses.create(
            model=mesh.model, input="Hi", max_output_tokens=2, extra_headers={"x-request-id": "sdk-resp-1"}
        )
    assert reused_response.value.body["param"] == "x-request-id"  # type: ignore[index]


# -- the retriever's embedding model in /v1/models


def test_the_retrievers_embedding_model_is_listed_and_retrievable(mesh: Mesh) -> None:
    """OpenAI lists its embedding models with the others; the model /v1/embeddings serves was in
    no list, so a client choosing from ``models.list()`` could not find it (nor ``retrieve`` it)."""
    client = mesh.client()
    listed = list(client.models.list())
    # The chat model first (clients that take the first entry still chat with it), then the
    # retriever's model under the name its embeddings answer with.
    assert len(listed) == 2 and listed[0].id == mesh.model, listed
    embedder = listed[1]
    assert (embedder.object, embedder.owned_by) == ("model", "llm-mesh")
    assert client.embeddings.create(model=embedder.id, input="a lighthouse").model == embedder.id
    assert client.models.retrieve(embedder.id).id == embedder.id
    # Over HTTP with the name's slash as is, too (the SDK quotes it).
    got = httpx.get(
        f"{mesh.bases[1]}/v1/models/{embedder.id}", headers={"authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert got.status_code == 200 and got.json()["id"] == embedder.id, got.text


# -- traces


def test_an_http_request_is_one_server_span_over_the_turns_spans(mesh: Mesh) -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    answered = mesh.post(chat(mesh, "Hello there", 2, session_id="traced-1"), traceparent=parent)
    assert answered.status_code == 200
    deadline = time.monotonic() + 10
    while True:
        spans = (
            [json.loads(line) for line in mesh.spans.read_text().splitlines()] if mesh.spans.exists() else []
        )
        mine = [s for s in spans if s["trace_id"] == "0af7651916cd43dd8448eb211c80319c"]
        http = [s for s in mine if s["name"] == "POST /v1/chat/completions"]
        if http or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert http and http[0]["kind"] == "SERVER" and http[0]["parent_span_id"] == "b7ad6b7169203331"
    assert http[0]["attributes"]["http.response.status_code"] == 200
    # The turn's downstream calls are in the same trace: the session history it loaded, for one.
    assert "session history" in {s["name"] for s in mine}, mine
