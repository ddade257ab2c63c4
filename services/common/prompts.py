"""Turns a client's chat messages or raw prompt into prompt token ids, validating them.

The one rendering of a prompt: a replica prefills exactly these ids, and the router computes
its prefix block hashes from the same ids (``services/router/placement/prompt_hashes.py``), so
both live here rather than in either service. transformers is only a type here: the caller
hands in the tokenizer it loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from jinja2 import TemplateError

from services.common.errors import InvalidArgument

#: "tool": a function's result, rendered as the template renders any role (as vLLM does).
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Seq[Message],
    prompt: str,
    encode_rendered: Callable[[str], list[int]] | None = None,
    token_ids: Seq[int] = (),
) -> list[int]:
    """Chat-templated ``messages`` (generation prompt appended), the raw ``prompt``, or the raw
    prompt's ``token_ids`` as given; exactly one of them.

    ``encode_rendered`` tokenizes the rendered chat (default: the tokenizer, no special tokens
    added); the router passes one that gives the same ids faster for repeated prefixes. Given
    ids are not checked against the vocabulary here: the engine, which knows its size, does.
    """
    if sum(1 for given in (messages, prompt, token_ids) if given) > 1:
        field = "prompt_token_ids" if token_ids else "prompt"
        raise InvalidArgument(field, "set one of messages, prompt or prompt_token_ids")
    if token_ids:
        return list(token_ids)
    if prompt:
        return list(tokenizer.encode(prompt))
    if not messages:
        raise InvalidArgument("messages", "give at least one chat message (or a raw prompt)")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
    try:
        text = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=False,
        )
    except TemplateError as exc:
        # Another model's template may refuse an order or a role (raise_exception in Jinja): a
        # client's conversation it cannot render, not a server fault.
        raise InvalidArgument("messages", f"this model's chat template refuses them: {exc}") from None
    assert isinstance(text, str)
    if encode_rendered is not None:
        return encode_rendered(text)
    # The template already wrote the special tokens it wants.
    return list(tokenizer.encode(text, add_special_tokens=False))
