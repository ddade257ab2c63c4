"""A turn's usage when it did not end by itself: the prompt's size as its first chunk said."""

from __future__ import annotations

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, router_pb2
from services.router.streams.relay import RelayOutcome
from services.router.turns.turn_end import TurnState, stopped_end, turn_end

REQUEST = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")])


def test_a_turn_stopped_or_failed_after_its_first_tokens_reports_its_prompt() -> None:
    """The prompt's count came only with the replica's end, so a cancelled turn, and one that
    failed in-band after tokens, said prompt_tokens 0 for a prompt the replica had prefilled."""
    state = TurnState("r", 0.0)
    state.streamed = 2
    state.outcome = RelayOutcome(token_ids=[5, 6], prompt_tokens=42)
    cancelled = stopped_end(state, REQUEST, 1.0, common_pb2.FINISH_REASON_CANCELLED).end
    assert (cancelled.usage.prompt_tokens, cancelled.usage.completion_tokens) == (42, 2)
    failed = turn_end(TurnState("r", 0.0), REQUEST, state.outcome, 1.0, error="replica gone").end
    assert (failed.usage.prompt_tokens, failed.usage.completion_tokens) == (42, 2)
    # The replica's own end, when there is one, is what counts (with its cached tokens).
    finished = inference_pb2.GenerationFinished(
        finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=common_pb2.Usage(prompt_tokens=40, completion_tokens=2, cached_prompt_tokens=16),
    )
    state.outcome.finished = finished
    whole = turn_end(TurnState("r", 0.0), REQUEST, state.outcome, 1.0).end
    assert (whole.usage.prompt_tokens, whole.usage.cached_prompt_tokens) == (40, 16)
    # Before the first token nothing is known of the prompt: 0, never a guess.
    early = stopped_end(TurnState("r", 0.0), REQUEST, 1.0, common_pb2.FINISH_REASON_CANCELLED).end
    assert early.usage.prompt_tokens == 0
