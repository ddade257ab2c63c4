"""Look-alike questions the verifier must refuse (the second audit's kinds), on questions outside
the bench's pair sets, each beside rewordings of the same question that must still be served."""

from __future__ import annotations

import pytest

from services.router.turns.semantic_text import Question, is_known, is_roman, same_word, typo_edit
from services.router.turns.semantic_verify import (
    check_asks,
    check_direction,
    check_only,
    check_tense,
    refusal,
)


def served(cached: str, query: str) -> bool:
    return refusal(query, cached) is None


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("Is the library open?", "Was the library open?", False),
        ("Does the hotel have a gym?", "Did the hotel have a gym?", False),
        ("Did the Celtics win the final?", "Will the Celtics win the final?", False),
        ("What's the entry fee?", "What was the entry fee?", False),  # "what's": "what is"
        ("Are the roads icy?", "Were the roads icy?", False),
        ("Who is the mayor of Leeds?", "Who was the mayor of Leeds?", False),
        # The same tense, or one side without an auxiliary: served.
        ("Will it snow in Denver?", "Is it going to snow in Denver?", True),
        ("We'll need a visa for Chile?", "Will we need a visa for Chile?", True),
        ("Who founded Tesla?", "Tesla was founded by who?", True),
        ("What's the entry fee?", "What is the entry fee?", True),
    ],
)
def test_the_tense_must_agree(a: str, b: str, same: bool) -> None:
    assert served(a, b) is same
    if not same:
        assert check_tense(Question(b), Question(a)) is False


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("How do I move my blog to WordPress?", "How do I move my blog from WordPress?", False),
        ("Is there a ferry to Helsinki?", "Is there a ferry from Helsinki?", False),
        ("How do I sync photos into the shared album?", "How do I sync photos from the shared album?", False),
        # The same directions, said in another order: served.
        ("How do I get from the station to the hotel?", "How do I get to the hotel from the station?", True),
        ("To Helsinki, is there a ferry?", "Is there a ferry to Helsinki?", True),
    ],
)
def test_a_direction_word_must_agree(a: str, b: str, same: bool) -> None:
    assert served(a, b) is same
    assert check_direction(Question(b), Question(a)) is same


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("Is every cube a cuboid?", "Is every cuboid a cube?", False),
        ("What share of nurses are men?", "What share of men are nurses?", False),
        ("Are all poets writers?", "Are all writers poets?", False),  # nothing between, all else equal
        # "and" / "or" between, a clause moved, a verb's object moved, a compound: served.
        ("Should I buy a laptop or a tablet?", "Should I buy a tablet or a laptop?", True),
        (
            "What is the difference between a lake and a pond?",
            "What is the difference between a pond and a lake?",
            True,
        ),
        ("Which phones support the charger?", "Which phones does the charger support?", True),
        ("In Rome, what is the weather?", "What is the weather in Rome?", True),
        ("Divide 20 by 4", "What is 20 divided by 4?", True),
    ],
)
def test_two_shared_words_swapped_with_nothing_else_between_refuse(a: str, b: str, same: bool) -> None:
    assert served(a, b) is same
    assert check_direction(Question(b), Question(a)) is same


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("Is French the only language taught here?", "Is French a language taught here?", False),
        ("Do you only accept cash?", "Do you accept cash?", False),
        ("Do you only accept cash?", "Do you accept only cash?", True),
    ],
)
def test_only_must_agree(a: str, b: str, same: bool) -> None:
    assert served(a, b) is same
    assert check_only(Question(b), Question(a)) is same


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("What is the cube root of -8?", "What is the cube root of 8?", False),
        ("Is −20 °F colder than −20 °C?", "Is 20 °F colder than −20 °C?", False),  # a Unicode minus
        ("Is the freezer at -18 degrees?", "Is the freezer at 18 degrees?", False),
        ("What is the cube root of -8?", "What is the cube root of minus 8?", True),
        ("What is 7 - 2?", "What is 7 minus 2?", True),  # between numbers: the operator
        ("Is covid-19 airborne?", "is covid-19 airborne", True),  # a hyphen in a word is no sign
    ],
)
def test_the_sign_of_a_number_must_agree(a: str, b: str, same: bool) -> None:
    assert served(a, b) is same


def test_a_minus_sign_is_kept_with_its_number() -> None:
    assert Question("Set it to -40 °C").numbers == {"-40": 1}
    assert Question("Set it to −40 °C").numbers == {"-40": 1}
    assert Question("What is 10 - 4?").tokens[-3:] == ("10", "-", "4")
    assert Question("Is minus 3 odd?").numbers == {"-3": 1}


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("prednisone", "prednisolone"),  # both outside the vocabulary: two drugs as likely as a typo
        ("mysql", "mssql"),
        ("nginx", "ngnix"),
        ("chlorite", "chloride"),  # one known, but "t" for "d" is no slip of the finger
        ("sulfite", "sulfate"),  # a vowel changed outside a like-sounding ending
        ("methanol", "ethanol"),  # the first letter
        ("xlix", "xliv"),  # Roman numerals
        ("lviii", "lvii"),
    ],
)
def test_near_spellings_that_are_not_typos(a: str, b: str) -> None:
    assert not same_word(a, b)
    assert not same_word(b, a)


@pytest.mark.parametrize(
    ("typo", "word"),
    [
        ("recieve", "receive"),  # two letters swapped
        ("adress", "address"),  # a doubled letter dropped
        ("chnage", "change"),
        ("dependancy", "dependency"),  # a like-sounding ending
        ("compatable", "compatible"),
        ("uninstal", "uninstall"),  # "uninstall": a prefix and a vocabulary word
        ("chekout", "checkout"),  # "checkout": a word and a particle
        ("configre", "configure"),  # "configure": a base of "configured"
        ("torronto", "toronto"),
        ("opne", "open"),
    ],
)
def test_plausible_typos_of_known_words_still_count(typo: str, word: str) -> None:
    assert is_known(word) and not is_known(typo)
    assert same_word(typo, word) and same_word(word, typo)


@pytest.mark.parametrize(
    ("a", "b"),
    [("colour", "color"), ("organise", "organize"), ("hypokalaemia", "hypokalemia"), ("centre", "center")],
)
def test_two_spellings_of_one_word_are_one_word(a: str, b: str) -> None:
    assert same_word(a, b)


def test_a_capitalised_word_is_a_name_and_no_typo_of_another() -> None:
    assert not served("What is the dose of Humalog?", "What is the dose of Humulin?")
    assert not served("Is Zyrtec safe for children?", "Is Zyrtek safe for children?")
    assert not served("Is Michael at home?", "Is Michel at home?")
    assert served("Is the Kindle sold in Toronto?", "is the kindle sold in torronto?")
    assert Question("Is Zyrtek safe for children?").names == {"is", "zyrtek"}


def test_typo_edit_and_roman_numerals() -> None:
    assert typo_edit("helo", "hello") and typo_edit("hwllo", "hello")  # "w" is next to "e"
    assert not typo_edit("hallo", "hello")  # "a" is not, and no like-sounding ending
    assert not typo_edit("jello", "hello")  # the first letter
    assert is_roman("xliv") and is_roman("mmxxiv") and not is_roman("mild") and not is_roman("civil")


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("How did Napoleon die?", "When did Napoleon die?", False),
        ("How do bees make honey?", "Why do bees make honey?", False),
        ("How was the dam built?", "Where was the dam built?", False),
        ("How come the train is late?", "Why is the train late?", True),  # "how come" is "why"
        ("How did Napoleon die?", "how did napoleon die", True),
    ],
)
def test_how_asks_for_the_manner_not_the_time_or_the_place(a: str, b: str, same: bool) -> None:
    assert served(a, b) is same
    assert check_asks(Question(b), Question(a)) is same


def test_how_soon_asks_when() -> None:
    assert check_asks(Question("How soon can you deliver?"), Question("When can you deliver?"))
    assert not check_asks(Question("How can you deliver?"), Question("When can you deliver?"))
