"""The one rule for merging consecutive pieces of one generation's answer into one.

Every hop that finds several pieces waiting for a busy reader sends them as one
(the engine's outputs, the router's pending chunks, the client's token delta):
a message costs per message, not per token. Whatever the piece's type, the
merged piece is all their tokens and text in order, numbered where its first
token sits in the answer, so a reader sees the same answer in fewer messages.
Pure: the engine uses it, so it knows no protobuf and no grpc.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Piece:
    """A stretch of one generation's answer: where it starts, its token ids, its text."""

    index: int
    token_ids: Sequence[int]
    text: str


def merge(pieces: Sequence[Piece]) -> Piece:
    """Consecutive ``pieces`` as one: every token id and all the text in order, at the first
    token's ``index`` (a piece with text but no tokens yet, held back by the detokenizer or
    flushed at the end, does not move it; with no tokens at all, the last piece's index)."""
    if len(pieces) == 1:
        return pieces[0]
    first = next((p for p in pieces if p.token_ids), pieces[-1])
    return Piece(first.index, [t for p in pieces for t in p.token_ids], "".join(p.text for p in pieces))
