"""`llm-mesh ask`: what a person (footer) and a script (`--json`) see at the end of an answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from llm_mesh_client import SyncMeshClient

from services import cli
from services.client import ask
from services.gen.llmmesh.v1 import common_pb2, router_pb2


class FakeCall:
    """A server-streaming call: iterable, and cancellable as the client does on leaving."""

    def __init__(self, replies: Iterator[router_pb2.ChatResponse]) -> None:
        self.replies = replies

    def __iter__(self) -> Iterator[router_pb2.ChatResponse]:
        return self.replies

    def cancel(self) -> None:
        pass


class FakeRouter:
    """Answers ChatStream with the given text in two deltas, then ``end``; keeps the request."""

    def __init__(self, text: str, end: router_pb2.TurnEnd) -> None:
        self.text = text
        self.end = end
        self.requests: list[router_pb2.ChatRequest] = []

    def ChatStream(self, request: router_pb2.ChatRequest, **_: Any) -> FakeCall:
        self.requests.append(request)
        return FakeCall(self.replies())

    def replies(self) -> Iterator[router_pb2.ChatResponse]:
        half = len(self.text) // 2
        for piece in (self.text[:half], self.text[half:]):
            yield router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text=piece))
        yield router_pb2.ChatResponse(end=self.end)


def client_of(router: FakeRouter) -> SyncMeshClient:
    """The CLI's real client (llm_mesh_client) with the fake behind it instead of a channel's stub."""
    client = SyncMeshClient("127.0.0.1:1")
    client.stub = router  # type: ignore[assignment]
    return client


def run_ask(monkeypatch: pytest.MonkeyPatch, router: FakeRouter, *argv: str) -> int:
    monkeypatch.setattr(ask, "open_client", lambda args: client_of(router))
    return cli.main(["ask", *argv])


def cut_end(tokens: int) -> router_pb2.TurnEnd:
    return router_pb2.TurnEnd(
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=30, completion_tokens=tokens),
        model="SmolLM2-135M-Instruct",
        replica="127.0.0.1:50061",
    )


def test_an_answer_cut_at_max_tokens_says_so_on_its_last_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_ask(monkeypatch, FakeRouter("Paris is the cap", cut_end(5)), "capital of France?") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["Paris is the cap", "[length: 5 tokens]"]


def test_a_natural_stop_has_no_footer_and_degraded_answers_name_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_STOP)
    assert run_ask(monkeypatch, FakeRouter("Paris.", stopped), "capital of France?") == 0
    assert capsys.readouterr().out.splitlines() == ["Paris."]
    degraded = router_pb2.TurnEnd(
        finish_reason=common_pb2.FINISH_REASON_STOP,
        degraded=True,
        degraded_reasons=["history: session unavailable"],
    )
    assert run_ask(monkeypatch, FakeRouter("Paris.", degraded), "capital of France?") == 0
    assert capsys.readouterr().out.splitlines() == ["Paris.", "[degraded: history: session unavailable]"]


def test_json_prints_one_object_with_the_text_and_why_it_ended(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    end = cut_end(7)
    end.citations.add(document_id="guide.md", title="Guide", position=2, score=0.8123456, snippet="…")
    assert run_ask(monkeypatch, FakeRouter("Lighthouses guide ships", end), "--json", "what?") == 0
    out = capsys.readouterr().out
    answer = json.loads(out)  # the whole of stdout is the one object: no streamed text around it
    assert answer["text"] == "Lighthouses guide ships"
    assert answer["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 30, "completion_tokens": 7, "cached_prompt_tokens": 0}
    assert (answer["model"], answer["replica"]) == ("SmolLM2-135M-Instruct", "127.0.0.1:50061")
    assert answer["citations"] == [
        {"document_id": "guide.md", "title": "Guide", "chunk": 2, "score": 0.8123, "snippet": "…"}
    ]
    failed = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_ERROR, error_message="replica lost")
    assert run_ask(monkeypatch, FakeRouter("Light", failed), "--json", "what?") == 1
    assert json.loads(capsys.readouterr().out)["error"] == "replica lost"


def test_the_cli_asks_greedy_unless_told_and_passes_session_must_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router = FakeRouter("ok", router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_STOP))
    run_ask(monkeypatch, router, "--session", "s1", "--session-must-exist", "hi")
    run_ask(monkeypatch, router, "--temperature", "0.7", "hi")
    first, second = router.requests
    assert first.sampling.HasField("temperature") and first.sampling.temperature == 0.0
    assert (first.session_id, first.session_must_exist) == ("s1", True)
    assert second.sampling.temperature == pytest.approx(0.7)


def test_rag_flags_set_the_minimum_score_and_mode_and_sources_show_their_scores(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cited = router_pb2.Citation(document_id="kovari", title="Kovari", position=2, score=0.734)
    end = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_STOP, citations=[cited])
    router = FakeRouter("Red soil.", end)
    run_ask(monkeypatch, router, "--rag", "--rag-min-score", "0.4", "--rag-mode", "keyword", "soil?")
    run_ask(monkeypatch, router, "--rag", "soil?")
    strict, plain = router.requests
    assert strict.rag.enabled and strict.rag.min_score == pytest.approx(0.4)
    assert strict.rag.mode == 2  # SEARCH_MODE_KEYWORD
    assert plain.rag.enabled and not plain.rag.HasField("min_score") and plain.rag.mode == 0
    assert "[1] Kovari (kovari, chunk 2, score 0.73)" in capsys.readouterr().out


def test_session_must_exist_without_a_session_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    router = FakeRouter("never", router_pb2.TurnEnd())
    assert run_ask(monkeypatch, router, "--session-must-exist", "hi") == 2
    assert "--session-must-exist needs --session" in capsys.readouterr().err
    assert router.requests == []


def test_json_schema_regex_and_choice_flags_constrain_the_turn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "person.json"
    schema.write_text('{"type": "object"}')
    stop = router_pb2.TurnEnd(finish_reason=common_pb2.FINISH_REASON_STOP)
    router = FakeRouter('{"a": 1}', stop)
    assert run_ask(monkeypatch, router, "--json-schema", str(schema), "Who?") == 0
    assert router.requests[-1].sampling.json_schema == '{"type": "object"}'
    assert run_ask(monkeypatch, router, "--regex", "[0-9]+", "How many?") == 0
    assert router.requests[-1].sampling.regex == "[0-9]+"
    assert run_ask(monkeypatch, router, "--choice", "yes", "--choice", "no", "Well?") == 0
    assert list(router.requests[-1].sampling.choice.values) == ["yes", "no"]
    assert run_ask(monkeypatch, router, "--json-schema", str(tmp_path / "missing.json"), "Who?") == 2
    assert "--json-schema: cannot read" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"description": "café"}'.encode("latin-1"))
    assert run_ask(monkeypatch, router, "--json-schema", str(latin1), "Who?") == 2  # usage, no traceback
    assert "is not UTF-8 text" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one constraint at most: argparse refuses two
        run_ask(monkeypatch, router, "--regex", "a", "--choice", "b", "Both?")


class InterruptedRouter(FakeRouter):
    """Ctrl-C after the first delta."""

    def replies(self) -> Iterator[router_pb2.ChatResponse]:
        yield router_pb2.ChatResponse(delta=router_pb2.TokenDelta(text="Light"))
        raise KeyboardInterrupt


def test_ctrl_c_with_json_leaves_stdout_empty_for_the_script_reading_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    router = InterruptedRouter("", cut_end(1))
    assert run_ask(monkeypatch, router, "--json", "what?") == 130
    out, err = capsys.readouterr()
    assert out == "" and "[interrupted]" in err  # "[interrupted]" on stdout read as a broken JSON answer
