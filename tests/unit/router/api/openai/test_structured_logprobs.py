"""OpenAI's logprobs from the replica's: ``bytes`` are each token's own (``token_bytes``), and the
legacy completions' dicts of alternatives keep every distinct token (OpenAI's ``bytes:\\xNN``)."""

from __future__ import annotations

from services.gen.llmmesh.v1 import common_pb2
from services.router.api.openai.structured import chat_logprobs, echo_logprobs, legacy_token, text_logprobs

#: "🌊 水" as SmolLM2 splits it: no token but the space's holds a whole character.
WAVE = [b"\xf0\x9f", b"\x8c", b"\x8a", b" \xe6", b"\xb0", b"\xb4"]


def token(raw: bytes, logprob: float, top: list[tuple[bytes, float]] = ()) -> common_pb2.TokenLogprobs:  # type: ignore[assignment]
    return common_pb2.TokenLogprobs(
        text=raw.decode("utf-8", "replace"),
        token_bytes=raw,
        logprob=logprob,
        top=[
            common_pb2.TokenLogprob(token_id=i, text=r.decode("utf-8", "replace"), token_bytes=r, logprob=lp)
            for i, (r, lp) in enumerate(top)
        ],
    )


def test_chat_bytes_are_each_tokens_own_so_they_join_into_the_answer() -> None:
    tokens = [token(raw, -0.1, [(raw, -0.1), (b"\x8d", -3.0)]) for raw in WAVE]
    content = chat_logprobs(tokens)["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == "🌊 水".encode()
    assert [entry["token"] for entry in content] == [t.text for t in tokens]  # the text as it was
    assert content[0]["token"] == "\ufffd" and content[0]["bytes"] == [0xF0, 0x9F]
    assert [a["bytes"] for a in content[1]["top_logprobs"]] == [[0x8C], [0x8D]]


def test_chat_bytes_without_the_replicas_bytes_are_the_texts_as_before() -> None:
    older = common_pb2.TokenLogprobs(
        text="Hi", logprob=-0.5, top=[common_pb2.TokenLogprob(text="Hey", logprob=-1.0)]
    )
    (entry,) = chat_logprobs([older])["content"]
    assert entry["bytes"] == list(b"Hi") and entry["top_logprobs"][0]["bytes"] == list(b"Hey")


def test_legacy_alternatives_that_are_pieces_of_characters_keep_their_own_keys() -> None:
    # Five byte tokens, all "\ufffd" as text: the dict kept one of them (logprobs 5 gave 1).
    pieces = [b"\x8c", b"\x8d", b"\x8e", b"\x8f", b"\x90"]
    sampled = token(b"\x8c", -0.25, [(raw, -0.25 - i) for i, raw in enumerate(pieces)])
    body = text_logprobs([sampled])
    (top,) = body["top_logprobs"]
    assert list(top) == ["bytes:\\x8c", "bytes:\\x8d", "bytes:\\x8e", "bytes:\\x8f", "bytes:\\x90"]
    assert body["tokens"] == ["bytes:\\x8c"]
    # The chosen token's entry is found under its `tokens` spelling, as clients look it up.
    assert top[body["tokens"][0]] == body["token_logprobs"][0] == -0.25


def test_legacy_tokens_are_named_as_openai_names_them() -> None:
    assert legacy_token("\ufffd", b"\xe9\x80") == "bytes:\\xe9\\x80"  # OpenAI's "bytes:\\xe9\\x80"
    assert legacy_token(" \ufffd", b" \xe6") == "bytes:\\x20\\xe6"
    assert legacy_token("合", "合".encode()) == "合"  # a whole character is its text
    assert legacy_token("\ufffd", "\ufffd".encode()) == "\ufffd"  # U+FFFD itself is a character
    assert legacy_token(" world", b"") == " world"  # a replica older than token_bytes


def test_an_echoed_prompt_of_split_characters_names_each_piece_by_its_bytes() -> None:
    prompt = [token(raw, -1.0, [(raw, -1.0)]) for raw in WAVE[:3]]
    answer = [token(b"!", -0.5, [(b"!", -0.5), (b"?", -1.5)])]
    body = echo_logprobs(prompt, answer)
    assert body["tokens"] == ["bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\x8a", "!"]
    assert body["top_logprobs"][0] is None and body["top_logprobs"][1] == {"bytes:\\x8c": -1.0}
    assert body["top_logprobs"][3] == {"!": -0.5, "?": -1.5}
    # The pieces read back ("bytes:" + \xNN each) are the prompt's UTF-8.
    spelled = b"".join(
        bytes.fromhex(t.removeprefix("bytes:").replace("\\x", "")) if t.startswith("bytes:") else t.encode()
        for t in body["tokens"]
    )
    assert spelled == "🌊!".encode()
