"""GenerateMany's one merge rule, as the engine, the router's client half and the client's delta use it."""

from __future__ import annotations

from services.common.generate_many.merge import Span, merge
from services.gen.llmmesh.v1 import inference_pb2


def test_pieces_merge_in_order_at_the_first_tokens_index() -> None:
    ids: list[int] = []
    assert merge([Span(4, [7], "a"), Span(5, [8], ""), Span(6, [9], "bc")], ids) == (4, "abc")
    assert ids == [7, 8, 9]


def test_text_without_tokens_does_not_move_the_index() -> None:
    # Text flushed before any token of the stretch (the detokenizer's tail) sits where the next token will.
    ids: list[int] = []
    assert merge([Span(3, [], "x"), Span(5, [1, 2], "yz")], ids) == (5, "xyz") and ids == [1, 2]
    assert merge([Span(3, [], "x"), Span(3, [], "y")], []) == (3, "xy")


def test_protobuf_chunks_merge_into_a_protobuf_field() -> None:
    chunks = [
        inference_pb2.TokenChunk(index=2, token_ids=[5, 6], text="ab"),
        inference_pb2.TokenChunk(index=4, token_ids=[7], text="c"),
    ]
    merged = inference_pb2.TokenChunk()
    merged.index, merged.text = merge(chunks, merged.token_ids)
    assert merged == inference_pb2.TokenChunk(index=2, token_ids=[5, 6, 7], text="abc")
