"""Each token's raw bytes for logprobs (``servicer.TokenBytes``): a piece of a character split across
tokens is its own bytes, not U+FFFD's, so an answer's tokens' bytes join into its UTF-8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.gen.llmmesh.v1 import common_pb2
from services.inference.engine import RequestOutput
from services.inference.outputs import SampledToken
from services.inference.servicer import TokenBytes, chunk_and_finished, gpt2_byte_decoder


@pytest.fixture(scope="module")
def smollm2(model_path: Path) -> Any:
    from services.inference.model_loading import load_tokenizer

    return load_tokenizer(str(model_path))


def test_the_byte_alphabet_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert gpt2_byte_decoder() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_every_token_of_smollm2_is_its_text_or_the_bytes_its_replaced_text_stood_for(smollm2: Any) -> None:
    table = TokenBytes(smollm2)
    raws = [table(i) for i in range(len(smollm2))]
    split = 0
    for token_id, raw in enumerate(raws):
        text = smollm2.decode([token_id])
        try:
            assert raw.decode("utf-8") == text, token_id
        except UnicodeDecodeError:
            split += 1  # a piece of a character: its text is U+FFFD, its bytes are the piece
            assert "\ufffd" in text and raw.decode("utf-8", "replace") == text, token_id
    assert split > 100  # SmolLM2 has hundreds of such byte tokens (313)
    assert len(set(raws)) == len(raws)  # no two tokens share their bytes: nothing collapses
    assert table(2) == b"<|im_end|>"  # an added token: its content


@pytest.mark.parametrize("text", ["🌊🌊 水色", "会话状态保存在 Redis 中 🌍", "naïve — “quoted” ✓"])
def test_the_bytes_of_a_texts_tokens_join_into_its_utf8(smollm2: Any, text: str) -> None:
    table = TokenBytes(smollm2)
    ids = smollm2.encode(text)
    assert "".join(smollm2.decode([i]) for i in ids) != text  # characters split across tokens
    assert b"".join(table(i) for i in ids) == text.encode("utf-8")


def test_each_id_is_spelled_once_per_table_not_once_per_request(smollm2: Any) -> None:
    calls: list[int] = []

    class Counting:
        added_tokens_decoder = smollm2.added_tokens_decoder
        backend_tokenizer = smollm2.backend_tokenizer

        def convert_ids_to_tokens(self, token_id: int) -> object:
            calls.append(token_id)
            return smollm2.convert_ids_to_tokens(token_id)

    table = TokenBytes(Counting())
    ids = smollm2.encode("🌊🌊🌊🌊")
    for _ in range(3):
        assert b"".join(table(i) for i in ids) == "🌊🌊🌊🌊".encode()
    assert sorted(calls) == sorted(set(ids))


def byte_fallback_tokenizer() -> Any:
    """A SentencePiece-style BPE with byte fallback (Llama 2's, Mistral's decoder): characters
    outside its vocabulary are spelled as ``<0xNN>`` tokens, a space as ``▁``."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ("▁", "h", "i", "▁h", "▁hi", "é"):
        vocab[piece] = len(vocab)
    model = models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_a_byte_fallback_vocabularys_byte_tokens_are_their_bytes() -> None:
    tokenizer = byte_fallback_tokenizer()
    table = TokenBytes(tokenizer)
    ids = tokenizer.encode("hi 水é", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces == ["▁hi", "▁", "<0xE6>", "<0xB0>", "<0xB4>", "é"]
    assert [table(i) for i in ids] == [b" hi", b" ", b"\xe6", b"\xb0", b"\xb4", "é".encode()]
    # Joined, the text as the vocabulary spells it (the decoder strips the whole text's first space).
    assert b"".join(table(i) for i in ids) == " hi 水é".encode()
    assert tokenizer.decode(ids) == "hi 水é"
    assert table(tokenizer.convert_tokens_to_ids("</s>")) == b"</s>"


def test_the_replicas_logprobs_carry_each_tokens_bytes_the_sampled_the_alternatives_and_the_prompts(
    smollm2: Any,
) -> None:
    table = TokenBytes(smollm2)
    wave = smollm2.encode("🌊")  # three tokens, none a whole character
    out = RequestOutput(
        "r",
        [wave[0]],
        "",
        0,
        logprobs=(SampledToken(wave[0], -0.1, ((wave[0], -0.1), (wave[1], -2.0), (wave[2], -3.0))),),
        prompt_logprobs=(
            SampledToken(wave[1], float("nan")),
            SampledToken(wave[2], -1.0, ((wave[0], -0.5),)),
        ),
    )
    chunk, _ = chunk_and_finished(out, lambda i: str(smollm2.decode([i])), lambda ids: "", table)
    assert chunk is not None
    (sampled,) = chunk.logprobs
    assert sampled.text == "\ufffd" and sampled.token_bytes == table(wave[0]) == "🌊".encode()[:2]
    assert [a.token_bytes for a in sampled.top] == [table(i) for i in wave]
    assert [a.text for a in sampled.top] == ["\ufffd"] * 3  # text fields as they were
    assert [p.token_bytes for p in chunk.prompt_logprobs] == [table(wave[1]), table(wave[2])]
    assert chunk.prompt_logprobs[1].top[0].token_bytes == table(wave[0])
    # A caller that gives no table (an older path) sends none: the field stays empty.
    bare, _ = chunk_and_finished(out, lambda i: "x")
    assert bare is not None and bare.logprobs[0].token_bytes == b""
    assert isinstance(bare.logprobs[0], common_pb2.TokenLogprobs)
