"""GenerateMany's one merge rule, as the engine, the router's client half and the client's delta use it."""

from __future__ import annotations

from services.common.generate_many.merge import Piece, merge


def test_pieces_merge_in_order_at_the_first_tokens_index() -> None:
    pieces = [Piece(4, [7], "a"), Piece(5, [8], ""), Piece(6, [9], "bc")]
    assert merge(pieces) == Piece(4, [7, 8, 9], "abc")


def test_text_without_tokens_does_not_move_the_index() -> None:
    # Text flushed before any token of the stretch (the detokenizer's tail) sits where the next token will.
    assert merge([Piece(3, [], "x"), Piece(5, [1, 2], "yz")]) == Piece(5, [1, 2], "xyz")
    assert merge([Piece(3, [], "x"), Piece(3, [], "y")]).index == 3


def test_one_piece_is_itself() -> None:
    piece = Piece(0, [1], "a")
    assert merge([piece]) is piece
