"""The semantic scope: everything but the last user message, and who asked a personal question."""

from __future__ import annotations

import pytest

from services.common import errors
from services.gen.llmmesh.v1 import common_pb2, router_pb2
from services.router.turns.semantic_scope import is_personal, scope_fingerprint
from services.router.turns.validation import validate

QUESTION = ("user", "What does the premium plan include?")


@pytest.mark.parametrize(
    ("text", "personal"),
    [
        ("Where is my parcel?", True),
        ("Has our invoice been paid?", True),
        ("Is there anything on file for me?", True),
        ("Repeat after me: hello", False),
        ("Show me how to sort a list in Go", False),
        ("Which plan am I on?", True),
        ("How many vouchers do I have left?", True),
        ("What does the premium plan include?", False),
        ("How do I cancel a subscription?", False),
        ("Can I pay in instalments?", False),
    ],
)
def test_questions_about_the_asker_are_personal(text: str, personal: bool) -> None:
    assert is_personal(text) is personal


def test_everything_before_the_last_user_message_changes_the_scope() -> None:
    base = scope_fingerprint("fp", [QUESTION])
    assert scope_fingerprint("fp", [QUESTION]) == base
    variants = [
        scope_fingerprint("other-sampling", [QUESTION]),
        scope_fingerprint("fp", [("system", "You are a pirate."), QUESTION]),
        scope_fingerprint("fp", [("user", "Hi"), ("assistant", "Hello!"), QUESTION]),
        scope_fingerprint("fp", [("system", "Sources:\n[1] Premium: 10 seats"), QUESTION]),
        scope_fingerprint("fp", [QUESTION], cited=[("pricing", 2)]),
        scope_fingerprint("fp", [QUESTION], user="alice"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_the_cited_documents_scope_by_version_in_any_order() -> None:
    one = scope_fingerprint("fp", [QUESTION], cited=[("a", 1), ("b", 3)])
    assert scope_fingerprint("fp", [QUESTION], cited=[("b", 3), ("a", 1)]) == one
    assert scope_fingerprint("fp", [QUESTION], cited=[("a", 2), ("b", 3)]) != one


def test_the_last_user_message_itself_is_not_in_the_scope() -> None:
    assert scope_fingerprint("fp", [("user", "Where is it?")]) == scope_fingerprint(
        "fp", [("user", "Where's it")]
    )


def test_an_overlong_cache_user_is_refused_naming_the_field() -> None:
    request = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="Where is my parcel?")],
        cache=router_pb2.CachePolicy(semantic=True, user="u" * 257),
    )
    with pytest.raises(errors.InvalidArgument) as caught:
        validate(request)
    assert caught.value.field == "cache.user"
    request.cache.user = "u" * 256
    validate(request)
