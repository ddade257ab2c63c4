"""The one rule for merging consecutive pieces of one generation's answer into one.

Every hop that finds several pieces waiting for a busy reader sends them as one
(the engine's outputs, the router's pending chunks, the client's token delta):
a message costs per message, not per token. Whatever the piece's type, the
merged piece is all their tokens and text in order, numbered where its first
token sits in the answer, so a reader sees the same answer in fewer messages.
Pure: the engine uses it, so it knows no protobuf and no grpc.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from typing import Protocol


class Piece(Protocol):
    """A stretch of one generation's answer (a protobuf ``TokenChunk`` is one as it is)."""

    @property
    def index(self) -> int:
        """Where its first token sits in the answer (resumed tokens count)."""
        ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def text(self) -> str: ...


@dataclass(slots=True)
class Span:
    """A ``Piece`` for what names its fields otherwise (the engine's ``RequestOutput``)."""

    index: int
    token_ids: Sequence[int]
    text: str


def merge(pieces: Sequence[Piece], token_ids: MutableSequence[int]) -> tuple[int, str]:
    """Consecutive ``pieces`` as one: every token id, in order, appended to ``token_ids``, and the
    merged piece's ``(index, text)``.

    The index is the first token's: a piece with text but no tokens (held back by the
    detokenizer, or flushed at the end) does not move it; with no tokens at all, the last
    piece's. ``token_ids`` is the merged message's own field (a list, a protobuf repeated
    field), so each piece's ids are copied in one ``extend``, never token by token in Python.
    """
    first = None
    for piece in pieces:
        ids = piece.token_ids
        if ids:
            if first is None:
                first = piece
            token_ids.extend(ids)
    return (first or pieces[-1]).index, "".join([p.text for p in pieces])
