"""SSE framing under slow tokens, and hostile or unusual request bodies: pure router logic, so the
token source is the synthetic replica (a paced load-test fake), not the engine."""

from __future__ import annotations

import gzip
import json
import socket
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.openai_front import http_base, load_tool_texts
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, synthetic_replica

APP_ORIGIN = "http://app.example:3000"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # Two tokens a second and a keep-alive every 0.2 s: keep-alives fall between the tokens.
    replica = synthetic_replica("--tokens-per-second", "2").start()
    router: ServiceProcess = router_process(
        [replica],
        "--http-port",
        "0",
        "--http-keepalive-s",
        "0.2",
        "--http-cors-origin",
        APP_ORIGIN,
        "--model-aliases",
        "gpt-4o-mini=synthetic,retired=no-such-model",
    )
    try:
        router.start()
        yield http_base(router)
    finally:
        router.stop()
        replica.stop()


BODY = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "stream": True,
}


def test_keepalives_fall_between_slow_tokens_and_load_tools_read_past_them(base: str) -> None:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=BODY, timeout=30) as response:
        raw = response.read()
    # A keep-alive is a blank line more after an event's own: a third newline in a row.
    first, last = raw.index(b"data: {"), raw.rindex(b"data: {")
    assert b"\n\n\n" in raw[first:last], raw
    assert len(load_tool_texts(raw).split()) == 3, raw


def test_the_openai_sdk_reads_a_stream_with_keepalives_between_tokens(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    chunks = list(client.chat.completions.create(**BODY))  # type: ignore[call-overload]
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) == 3
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_sdk_reads_a_responses_stream_with_keepalives_between_tokens(base: str) -> None:
    asked = {"model": "synthetic", "input": "hi", "max_output_tokens": 3}
    with httpx.stream("POST", f"{base}/v1/responses", json={**asked, "stream": True}, timeout=30) as response:
        raw = response.read()
    assert b"\n\n\n" in raw[raw.index(b"data: {") :], raw  # a keep-alive between events
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    events = list(client.responses.create(**asked, stream=True))  # type: ignore[call-overload]
    assert len([e for e in events if e.type == "response.output_text.delta"]) == 3
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3


def _preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(
        f"{base}/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
        },
        timeout=10,
    )


def test_a_browser_page_on_an_allowed_origin_may_call_the_front(base: str) -> None:
    preflight = _preflight(base, APP_ORIGIN)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert {"authorization", "content-type", "x-stainless-lang"} <= {h.strip() for h in allowed.split(",")}
    body = {**BODY, "stream": False, "max_tokens": 1}
    answer = httpx.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers={"Origin": APP_ORIGIN, "x-request-id": "cors-check-1"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == APP_ORIGIN
    # The page's script may read the id it can quote in a bug report.
    assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()


def test_a_page_on_another_origin_is_refused_its_preflight(base: str) -> None:
    refused = _preflight(base, "http://evil.example")
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_cors_origins_are_checked_when_the_router_starts() -> None:
    from services.router.api.openai.listener import HttpSettings

    assert HttpSettings(cors_origins=("*", "https://a.example:8443")).cors_origins[0] == "*"
    for bad in ("app.example", "https://app.example/", "https://app.example/path"):
        with pytest.raises(ValueError, match="--http-cors-origin"):
            HttpSettings(cors_origins=(bad,))


@pytest.mark.parametrize("off", [["--no-http"], ["--http-port", "-1"]])
def test_the_http_front_can_be_turned_off(off: list[str]) -> None:
    replica = synthetic_replica().start()
    router = router_process([replica], *off)
    try:
        router.start()  # SERVING: the HTTP front would have printed its line before this
        assert not any(" http on " in line for line in router.lines), router.output()
    finally:
        router.stop()
        replica.stop()


# -- hostile and unusual bodies: refused before any token, so the slow token source costs nothing


def _error(
    response: httpx.Response, status: int, param: str | None, code: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def _raw(base: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=body, headers=headers, timeout=30)


USER_X = b'"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Was a 500 with no JSON body (the error message echoed the key, which UTF-8 cannot hold).
        ("/v1/chat/completions", b'{"rag": {"\\ud800": 1}, ' + USER_X + b"}", "rag.\\ud800"),
        ("/v1/chat/completions", b'{"cache": {"mode\\udfff": 1}, ' + USER_X + b"}", "cache.mode\\udfff"),
        # Were 400s with no param and Python's codec message.
        ("/v1/completions", b'{"prompt": ["ok", "a\\ud800"]}', "prompt[1]"),
        ("/v1/chat/completions", b'{"guided_choice": ["\\ud800"], ' + USER_X + b"}", "guided_choice[0]"),
        ("/v1/chat/completions", b'{"guided_regex": "\\udc00+", ' + USER_X + b"}", "guided_regex"),
        ("/v1/chat/completions", b'{"rag": {"filter": {"k": "\\ud800"}}, ' + USER_X + b"}", "rag.filter.k"),
        (
            "/v1/chat/completions",
            b'{"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "\\ud800"}}], '
            + USER_X
            + b"}",
            "tools[0].function.name",
        ),
        # Raw surrogate bytes (json.loads decodes bodies with surrogatepass) are caught the same way.
        ("/v1/embeddings", b'{"input": "a", "model": "\xed\xa0\x80"}', "model"),
        # A field that is otherwise ignored still may not carry text no UTF-8 log line can hold.
        ("/v1/chat/completions", b'{"user": "\\ud800", ' + USER_X + b"}", "user"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(
    base: str, path: str, body: bytes, param: str
) -> None:
    error = _error(_raw(base, path, body), 400, param, "invalid_value")
    assert "surrogate" in error["message"] and "codec" not in error["message"]


def _nested(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize(
    ("field", "depth"),
    [
        # 967 levels parsed, then json.dumps of the schema ran out of stack: a 500 RecursionError.
        ("guided_json", 967),
        ("guided_json", 500),  # was accepted and sent on to the replica's grammar compiler
        ("metadata", 200),
    ],
)
def test_json_nested_deeper_than_any_client_needs_is_a_400_naming_the_field(
    base: str, field: str, depth: int
) -> None:
    body = b'{"%s": ' % field.encode() + _nested(depth) + b", " + USER_X + b"}"
    response = _raw(base, "/v1/chat/completions", body)
    assert response.status_code != 500, response.text
    if response.json()["error"]["code"] == "invalid_json":
        return  # deeper than json.loads itself takes on this stack: refused while parsing, also a 400
    error = _error(response, 400, field, "invalid_value")
    assert "nested" in error["message"]


def test_a_tool_schema_nested_past_the_stack_is_a_400_not_a_500(base: str) -> None:
    for depth in range(955, 972):  # where json.loads still succeeds but json.dumps did not
        tools = b'[{"type": "function", "function": {"name": "f", "parameters": ' + _nested(depth) + b"}}]"
        body = b'{"tool_choice": "required", "tools": ' + tools + b", " + USER_X + b"}"
        response = _raw(base, "/v1/chat/completions", body)
        assert response.status_code == 400, (depth, response.text)
        assert response.json()["error"]["param"] in ("tools", None), response.text


GZIP_BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients send it
        ("GZIP", gzip.compress),
    ],
)
def test_a_compressed_body_is_read_as_its_content_encoding_says(
    base: str, encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    # Was a 400 "not valid JSON: 'utf-8' codec can't decode byte 0x8b": OpenAI's API takes compressed bodies.
    response = _raw(base, "/v1/chat/completions", compress(GZIP_BODY), **{"content-encoding": encoding})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_an_unknown_or_broken_content_encoding_is_refused_naming_the_header(base: str) -> None:
    # "br" was ignored: the bytes parsed as JSON only because they were not compressed at all.
    _error(
        _raw(base, "/v1/chat/completions", GZIP_BODY, **{"content-encoding": "br"}), 415, "Content-Encoding"
    )
    broken = gzip.compress(GZIP_BODY)[:-8]  # cut short
    _error(
        _raw(base, "/v1/chat/completions", broken, **{"content-encoding": "gzip"}),
        400,
        "Content-Encoding",
        "invalid_body_encoding",
    )


def test_a_compressed_body_over_the_limit_once_inflated_is_a_413(base: str) -> None:
    bomb = gzip.compress(b'{"messages": "' + b" " * (5 * 1024 * 1024) + b'"}')  # 5 MiB in ~5 KiB
    assert len(bomb) < 64 * 1024
    _error(_raw(base, "/v1/embeddings", bomb, **{"content-encoding": "gzip"}), 413, None, "request_too_large")


def test_405_says_which_method_the_route_allows(base: str) -> None:
    for method in ("GET", "PUT", "DELETE", "OPTIONS"):
        response = httpx.request(method, f"{base}/v1/chat/completions", timeout=10)
        error = _error(response, 405, None, "method_not_allowed")
        assert response.headers.get("allow") == "POST", (method, response.headers, error)
    allowed = httpx.post(f"{base}/v1/models", timeout=10).headers.get("allow", "")
    assert {m.strip() for m in allowed.split(",")} == {"GET", "HEAD"}
    # An unknown URL is OpenAI's invalid_request_error too (it was a not_found_error).
    error = _error(httpx.post(f"{base}/v1/chat/complete", json={}, timeout=10), 404, None, "unknown_url")
    assert "/v1/chat/complete" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # Each was sent on to the retriever (here: a 400 that it is missing, param null) before a check.
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": -3}, "dimensions"),
        # `user` is a string on every endpoint, as on chat (where it keys personal cache entries).
        ({"input": "a", "user": 7}, "user"),
        ({"input": "a", "user": "u" * 100_000}, "user"),
    ],
)
def test_embedding_inputs_openai_refuses_are_refused_before_the_retriever(
    base: str, body: dict[str, object], param: str
) -> None:
    _error(httpx.post(f"{base}/v1/embeddings", json=body, timeout=10), 400, param, "invalid_value")


def test_the_node_sdks_timeout_header_bounds_a_whole_answer_not_a_stream(base: str) -> None:
    """openai-node sends `X-Stainless-Timeout` (whole seconds, truncated) with a per-request timeout
    whose timer ends at the response's headers: a stream it reads on without limit. Taken as the
    turn's deadline, a 1 s timeout cut this 1.5 s stream with a 504 event, and a 0.5 s one (sent
    as 0) was a 400."""
    sdk_1s = {"x-stainless-timeout": "1"}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=BODY, headers=sdk_1s, timeout=30
    ) as response:
        streamed = response.read()
    assert response.status_code == 200 and len(load_tool_texts(streamed).split()) == 3, streamed
    whole = httpx.post(
        f"{base}/v1/chat/completions", json={**BODY, "stream": False}, headers=sdk_1s, timeout=30
    )
    assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout", whole.text
    sub_second = {"x-stainless-timeout": "0"}
    whole = httpx.post(
        f"{base}/v1/chat/completions", json={**BODY, "stream": False}, headers=sub_second, timeout=30
    )
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 3, whole.text
    # Our own header bounds the whole turn, streamed too: the answer ends in an in-band timeout.
    ours = {"x-request-timeout": "1"}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=BODY, headers=ours, timeout=30) as response:
        cut = response.read().decode()
    assert '"code":"timeout"' in cut and cut.endswith("data: [DONE]\n\n"), cut


def test_an_alias_a_served_model_answers_is_listed_and_retrievable(base: str) -> None:
    """Model pickers offer what /v1/models lists, and clients check a name with models.retrieve:
    an alias the chat endpoint takes was in neither (404)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    assert sorted(m.id for m in client.models.list()) == ["gpt-4o-mini", "synthetic"]
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("retired")  # an alias of a model no replica serves
    answer = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert answer.model == "synthetic"


def test_embeddings_hold_an_in_flight_place_like_turns() -> None:
    """--max-in-flight bounds what a router has waiting downstream; embeddings took no place, so
    a flood of them queued on the retriever past the cap."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"  # closed: the retriever is unreachable
    replica = synthetic_replica("--tokens-per-second", "4").start()
    router = router_process(
        [replica], "--http-port", "0", "--max-in-flight", "1", "--retriever-addr", nowhere
    )
    try:
        v1 = f"{http_base(router.start())}/v1"
        embed = {"input": "a cat sat on the mat"}
        with httpx.stream(
            "POST", f"{v1}/chat/completions", json={**BODY, "max_tokens": 8}, timeout=30
        ) as turn:
            lines = turn.iter_lines()
            next(lines)  # the turn holds the router's one place while it streams
            busy = httpx.post(f"{v1}/embeddings", json=embed, timeout=10)
            assert "[DONE]" in "".join(lines)
        assert busy.status_code == 429 and "in flight" in busy.json()["error"]["message"], busy.text
        # With the place free, the embedding goes on to the retriever (unreachable here).
        assert httpx.post(f"{v1}/embeddings", json=embed, timeout=30).status_code == 503
    finally:
        router.stop()
        replica.stop()


# -- one trailing slash: the route itself, never a redirect


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions/", {**BODY, "max_tokens": 1, "stream": False}),
        ("POST", "/v1/chat/completions/", {**BODY, "max_tokens": 1}),
        ("POST", "/v1/completions/", {"model": "synthetic", "prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/responses/", {"model": "synthetic", "input": "hi", "max_output_tokens": 1}),
        ("GET", "/v1/models/", None),
        ("GET", "/v1/models/gpt-4o-mini/", None),
        ("GET", "/health/", None),
    ],
)
def test_a_path_with_one_trailing_slash_is_answered_by_its_route(
    base: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    """A POST to ``/v1/chat/completions/`` was a 307 to the path without the slash, with an empty
    body, which clients that do not follow redirects (httpx's default, curl's) read as nothing, and
    ``/v1/models/`` a 404 for the model ''."""
    response = httpx.request(method, f"{base}{path}", json=body, timeout=30, follow_redirects=False)
    assert response.status_code == 200, (response.status_code, response.headers, response.text)
    if response.headers["content-type"].startswith("text/event-stream"):
        assert load_tool_texts(response.content) and response.text.endswith("data: [DONE]\n\n")
        return
    answer = response.json()
    if path.startswith("/v1/models/"):
        # The slash-less answers: the list, the one model.
        assert answer == httpx.get(f"{base}{path[:-1]}", timeout=10).json()
    elif path == "/health/":
        assert answer["status"] == "ok"
    else:
        assert answer.get("usage"), answer


def test_the_sdk_reaches_a_route_through_a_trailing_slash(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    # The SDK's own client follows a 307 by resending the body, but never has to now.
    raw = client.chat.completions.with_raw_response.create(**chat)  # type: ignore[call-overload]
    slashed = client.post("/chat/completions/", body=chat, cast_to=openai.types.chat.ChatCompletion)
    assert slashed.usage is not None and slashed.usage.completion_tokens == 1
    assert slashed.model == raw.parse().model == "synthetic"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions//"),  # one slash more is the route; two are not (was a 307)
        ("POST", "/v1/chat/completion/"),
        ("GET", "/v1/"),
        ("GET", "/"),
    ],
)
def test_an_unknown_path_is_a_404_in_openai_shape_naming_it(base: str, method: str, path: str) -> None:
    response = httpx.request(method, f"{base}{path}", json={}, timeout=10, follow_redirects=False)
    error = _error(response, 404, None, "unknown_url")
    assert error["message"] == f"{method} {path}: Not Found"


# -- stream_options.continuous_usage_stats (vLLM's): the usage so far in every chunk


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chat_chunk(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    chunks = list(client.chat.completions.create(**BODY, stream_options=CONTINUOUS))  # type: ignore[call-overload]
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == 3
    tokens = 0
    for chunk in chunks[:-1]:
        # Was null in all but the last chunk: the role chunk, each token's, the finishing one.
        assert chunk.usage is not None, chunk
        if chunk.choices[0].delta.content:
            tokens += 1  # the synthetic replica sends one token a chunk
            # The prompt's count from the first token on, as vLLM: the replica sends it with it.
            assert chunk.usage.prompt_tokens == final.usage.prompt_tokens > 0, chunk
        assert chunk.usage.completion_tokens == tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    finishing = chunks[-2]
    assert finishing.choices[0].finish_reason == "length"
    assert (finishing.usage.prompt_tokens, finishing.usage.total_tokens) == (  # type: ignore[union-attr]
        final.usage.prompt_tokens,
        final.usage.total_tokens,
    )


def test_continuous_usage_stats_counts_the_whole_request_with_n_choices(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    chunks = list(
        client.completions.create(
            model="synthetic",
            prompt="hi there",
            max_tokens=2,
            n=2,
            stream=True,
            stream_options=CONTINUOUS,  # type: ignore[arg-type]
        )
    )
    final = chunks[-1].usage
    assert final is not None and final.completion_tokens == 4  # 2 choices × 2 tokens
    running = [c.usage for c in chunks[:-1]]
    assert all(u is not None for u in running), chunks
    completions = [u.completion_tokens for u in running if u is not None]
    # Both choices' tokens, in the order they arrived: each chunk counts one more.
    assert completions == sorted(completions) and completions[-1] == 4 and completions[0] >= 1
    last = running[-1]
    assert last is not None and (last.prompt_tokens, last.total_tokens) == (
        final.prompt_tokens,
        final.total_tokens,
    )


@pytest.mark.parametrize("value", ["true", 1, {}])
def test_a_continuous_usage_stats_that_is_no_boolean_is_a_400_naming_it(base: str, value: object) -> None:
    options = {"include_usage": True, "continuous_usage_stats": value}
    for path, body in (("/v1/chat/completions", BODY), ("/v1/completions", {"prompt": "hi", "stream": True})):
        response = httpx.post(f"{base}{path}", json={**body, "stream_options": options}, timeout=10)
        _error(response, 400, "stream_options.continuous_usage_stats", "invalid_value")
