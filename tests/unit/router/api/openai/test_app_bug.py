"""A real bug behind an endpoint answers an OpenAI-shaped 500, never a traceback.

The only test here with a stand-in pipeline (``BuggyPipeline``): no real turn
raises an unexpected exception on purpose, and this is the catch-all's one job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.router.admission.auth import Authenticator
from services.router.api.openai.app import OpenAiFront
from services.router.placement.models import ModelCatalog


class _Pool:
    def models(self) -> set[str]:
        return {"m"}


class _Services:
    pool = _Pool()
    catalog = ModelCatalog()


class BuggyPipeline:
    """Stands in for TurnPipeline: every turn fails with an exception no table knows."""

    s = _Services()

    async def run_turn(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise RuntimeError("a bug's internals")
        yield  # an async generator, like the real one


async def test_an_unexpected_exception_is_a_500_in_openai_shape() -> None:
    front = OpenAiFront(BuggyPipeline(), Authenticator(open_tenant="t"))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=front.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        response = await client.post("/v1/chat/completions", json=body)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    for r in (response, streamed):
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "internals" not in error["message"]
