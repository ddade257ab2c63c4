"""Turn checkpoints: what another router needs to finish a turn the way its first attempt began it."""

from __future__ import annotations

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, router_pb2
from services.router.turns.checkpoints import ResumePoint, TurnCheckpoint, resumed_start
from services.router.turns.turn_end import TurnState


def test_a_resumed_turn_gets_back_everything_its_checkpoint_settled() -> None:
    """Through JSON, as the task store keeps it: the prompt, the session version, citations,
    degradations, and the cited documents' versions. Without those a resumed RAG answer's
    semantic-cache entry was scoped to no document: never served, never invalidated."""
    start = inference_pb2.GenerateStart(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    citation = router_pb2.Citation(document_id="doc-1", title="Water law", chunk_id="doc-1:0")
    checkpoint = TurnCheckpoint(
        start=start.SerializeToString(),
        model="served",
        session_id="s1",
        session_exists=True,
        session_version=4,
        citations=(citation.SerializeToString(),),
        degraded=("rag: slow",),
        cited=(("doc-1", 3), ("doc-2", 1)),
    )
    kept = TurnCheckpoint.from_json(checkpoint.to_json())
    assert kept == checkpoint

    state = TurnState("task-1", 0.0)
    resumed = resumed_start(ResumePoint(kept, (5, 6), "Hel"), state)
    # This attempt's own engine id, named by the turn's request id.
    assert resumed.messages[0].content == "hi" and resumed.request_id == state.engine_id
    assert state.engine_id.startswith("task-1.")
    assert state.session is not None and state.session.version == 4
    assert state.citations == [citation]
    assert state.degraded == ["rag: slow"]
    assert state.cited == [("doc-1", 3), ("doc-2", 1)]


def test_a_checkpoint_from_before_cited_documents_reads_as_citing_none() -> None:
    old = '{"start": "", "model": "served", "citations": [], "degraded": []}'
    assert TurnCheckpoint.from_json(old).cited == ()
