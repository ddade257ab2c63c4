"""A session's history as the messages a replica is pre-warmed with (placement/prewarm.py asks for it)."""

from __future__ import annotations

from services.router.placement.prewarm import LoadMessages
from services.router.turns.context import ConversationContext, build_messages
from services.router.turns.sources import HISTORY_TOKEN_BUDGET


def warm_messages(
    context: ConversationContext | None, token_budget: int = HISTORY_TOKEN_BUDGET
) -> LoadMessages | None:
    """The loader ``SessionMover`` takes, or None when there is no session service to read from.

    The budget is the turn's own, so the prefix warmed is the prefix the next turn sends.
    """
    if context is None or context.session is None:
        return None
    session_context = context

    async def load(tenant: str, session_id: str) -> list[dict[str, str]]:
        history = await session_context.load_history(tenant, session_id, token_budget)
        if not history.turns:
            return []
        return build_messages(history.system_prompt, history.turns, [], [])

    return load
