"""SSE framing under slow tokens: pure router logic, so the token source is the synthetic replica
(a paced load-test fake), not the engine."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.openai_front import http_base
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, synthetic_replica


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # Two tokens a second and a keep-alive every 0.2 s: keep-alives fall between the tokens.
    replica = synthetic_replica("--tokens-per-second", "2").start()
    router: ServiceProcess = router_process([replica], "--http-port", "0", "--http-keepalive-s", "0.2")
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


def test_keepalives_fall_between_slow_tokens(base: str) -> None:
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=BODY, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    data = [i for i, line in enumerate(lines) if line.startswith("data: {")]
    between = lines[data[1] : data[-1]]
    assert ": keep-alive" in between, lines


def test_the_openai_sdk_reads_a_stream_with_keepalives_between_tokens(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused-on-an-open-router", max_retries=0)
    chunks = list(client.chat.completions.create(**BODY))  # type: ignore[call-overload]
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) == 3
    assert chunks[-1].choices[0].finish_reason == "length"


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
