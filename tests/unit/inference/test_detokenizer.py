"""Incremental detokenizer: whole characters only, stop strings across token boundaries, resume priming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.common.errors import InvalidArgument
from services.common.sampling_limits import MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.inference.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from services.inference.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_path))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    pieces: list[str] = []
    for t in ids:
        update = detok.add(t)
        pieces.append(update.text)
        if update.matched_stop is not None:
            return pieces, update.matched_stop
    pieces.append(detok.flush())
    return pieces, None


def test_multibyte_characters_split_across_tokens_are_never_emitted_half_way(tokenizer: Any) -> None:
    text = "Café 🤖🎨 naïve 日本語"
    ids = tokenizer.encode(text)
    # The emoji and CJK characters span several byte-level tokens each.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    pieces, _ = stream(IncrementalDetokenizer(tokenizer), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_spanning_tokens_ends_the_text_before_it(tokenizer: Any) -> None:
    text = "The robot painted a sunset. THE END of the story."
    ids = tokenizer.encode(text)
    stop = "E END"  # starts inside "THE" and runs into the next token
    pieces, matched = stream(IncrementalDetokenizer(tokenizer, stop=(stop,)), ids)
    assert matched == stop
    assert "".join(pieces) == "The robot painted a sunset. TH"
    assert all(stop not in p for p in pieces)


def test_min_tokens_lets_only_a_stop_string_written_after_it_end_the_text(tokenizer: Any) -> None:
    text = "one, two, three, four, five, six."
    ids = tokenizer.encode(text)
    first_comma = next(i for i, t in enumerate(ids) if "," in tokenizer.decode([t]))
    # Without min_tokens the first comma ends it; with min_tokens past it, the first comma written
    # once min_tokens tokens are out does (vLLM's rule), and the text before it is all released.
    _, matched = stream(IncrementalDetokenizer(tokenizer, stop=(",",)), ids)
    assert matched == ","
    pieces, matched = stream(IncrementalDetokenizer(tokenizer, stop=(",",), min_tokens=first_comma + 2), ids)
    out = "".join(pieces)
    assert matched == "," and out.startswith("one, two") and "," in out and not out.endswith(",")
    assert len(tokenizer.encode(out)) >= first_comma + 1
    # Resumed tokens count toward min_tokens: primed with the whole prefix, the next comma ends it.
    primed = IncrementalDetokenizer(
        tokenizer, stop=(",",), prime=ids[: first_comma + 2], min_tokens=first_comma + 2
    )
    _, matched = stream(primed, ids[first_comma + 2 :])
    assert matched == ","


def test_a_stop_string_asked_to_be_kept_ends_the_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("The robot painted a sunset. THE END of the story.")
    pieces, matched = stream(IncrementalDetokenizer(tokenizer, stop=("E END",), include_stop=True), ids)
    assert matched == "E END"
    assert "".join(pieces) == "The robot painted a sunset. THE END"


def test_text_that_might_start_a_stop_string_is_held_then_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("a cat and a dog")
    detok = IncrementalDetokenizer(tokenizer, stop=("catastrophe",))
    pieces, matched = stream(detok, ids)
    assert matched is None
    assert "".join(pieces) == "a cat and a dog"
    # Nothing of " cat…" may leave before we know it is not "catastrophe".
    assert pieces[1] == ""


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three four")
    pieces, matched = stream(IncrementalDetokenizer(tokenizer, stop=("four", "two")), ids)
    assert matched == "two"
    assert "".join(pieces) == "one "


def test_primed_tokens_are_not_re_emitted_and_spacing_continues(tokenizer: Any) -> None:
    ids = tokenizer.encode("Once upon a time there was a robot")
    detok = IncrementalDetokenizer(tokenizer, prime=ids[:4])
    pieces, _ = stream(detok, ids[4:])
    assert "".join(pieces) == tokenizer.decode(ids[4:])


def released(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], int | None]:
    """The text each token released (a final flush in the last), and after how many a stop matched."""
    pieces: list[str] = []
    for n, t in enumerate(ids, 1):
        update = detok.add(t)
        pieces.append(update.text)
        if update.matched_stop is not None:
            return pieces, n
    pieces[-1] += detok.flush()
    return pieces, None


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("The robot painted a sunset. THE END of the story.", {"stop": ("E END",)}),
        ("The robot painted a sunset. THE END of the story.", {"stop": ("E END",), "include_stop": True}),
        ("Café 🤖🎨 naïve 日本語, the end", {}),  # characters cut between tokens
        ("Café 🤖🎨 naïve 日本語, the end", {"stop": ("🎨 na", "語, t")}),
        ("one, two, three, four, five", {"stop": (", t",), "min_tokens": 5}),
        (
            "a long stop string is held back: the last characters are released only at the end",
            {"stop": ("x" * 40,)},
        ),
    ],
)
def test_a_stream_resumed_after_any_token_continues_the_originals_text_exactly(
    tokenizer: Any, text: str, options: dict[str, Any]
) -> None:
    """Failover: a replica streams the text of some tokens and fails; another is primed with those
    tokens. What the client then has must be the text an unbroken stream gives: the first replica's
    held-back characters (a cut character, a possible stop string's start) come from the second."""
    ids = tokenizer.encode(text)
    whole, stopped_after = released(IncrementalDetokenizer(tokenizer, **options), ids)
    for cut in range(1, stopped_after or len(ids)):
        resumed = IncrementalDetokenizer(tokenizer, prime=ids[:cut], **options)
        assert resumed.primed_stop is None
        rest, _ = released(resumed, ids[cut:])
        assert "".join(whole[:cut]) + "".join(rest) == "".join(whole), f"resumed after {cut} tokens"
    if stopped_after is not None:
        # Resumed after the token that ended it: the stop string is found, nothing more comes out.
        ended = IncrementalDetokenizer(tokenizer, prime=ids[:stopped_after], **options)
        assert ended.primed_stop in options["stop"]
        assert ended.flush() == ""


def test_stop_strings_are_bounded_in_number_and_length() -> None:
    """Each new token is searched for every stop string on the engine thread all sequences share:
    300,000 of them once slowed another client's answer by 67 %."""
    at_the_bounds = SamplingParams(stop=tuple(f"{i:0{MAX_STOP_CHARS}d}" for i in range(MAX_STOP_STRINGS)))
    assert len(at_the_bounds.stop) == MAX_STOP_STRINGS
    for too_many in (
        tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1)),
        ("x" * (MAX_STOP_CHARS + 1),),
    ):
        with pytest.raises(InvalidArgument) as caught:
            SamplingParams(stop=too_many)
        assert caught.value.field == "stop"


def test_the_rust_decoder_streams_exactly_the_tokenizers_own_text(tokenizer: Any) -> None:
    from services.inference.detokenizer import BackendDecoder, fast_decoder

    decoder = fast_decoder(tokenizer)
    assert isinstance(decoder, BackendDecoder)  # SmolLM2's tokenizer cleans no spaces up
    text = 'Café 🤖 naïve 日本語 — "quotes" , spaces before punctuation ! <|im_end|> and\n\nnew lines.'
    ids = tokenizer.encode(text)
    for stop in ((), ("punctuation",)):
        fast = stream(IncrementalDetokenizer(decoder, stop), ids)
        wrapped = stream(IncrementalDetokenizer(tokenizer, stop), ids)
        assert fast == wrapped


def test_a_tokenizer_that_cleans_up_spaces_or_decodes_its_own_way_keeps_its_decode(tokenizer: Any) -> None:
    from services.inference.detokenizer import fast_decoder

    class CleaningUp:
        backend_tokenizer = tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

    cleaning = CleaningUp()
    assert fast_decoder(cleaning) is cleaning

    class OwnDecode(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return "its own"

    own = OwnDecode.__new__(OwnDecode)
    own.__dict__.update(tokenizer.__dict__)
    assert fast_decoder(own) is own  # a class that decodes its own way keeps it


def test_tokens_that_never_complete_a_character_do_not_grow_the_decode_window(tokenizer: Any) -> None:
    """A stray UTF-8 lead byte decodes to U+FFFD and waits for the rest of its character; a run
    of them never completes one. The wait is bounded, so each token's decode stays short (a
    client's resume_token_ids of such tokens made every decode span the whole resume)."""
    stray = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd")
    longest = 0

    class Counting:
        def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> Any:
            nonlocal longest
            longest = max(longest, len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(Counting(), prime=[stray] * 500)
    words = tokenizer.encode(" and then words")
    pieces, _ = stream(detok, [stray] * 20 + words)
    assert longest <= 2 * MAX_PENDING_TOKENS
    # The stray bytes come out as what they are, and the words after them whole.
    assert "".join(pieces).endswith("\ufffd and then words")
    assert "".join(pieces).count("\ufffd") >= 20 - MAX_PENDING_TOKENS
