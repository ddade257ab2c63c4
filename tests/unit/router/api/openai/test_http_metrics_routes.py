"""The HTTP metrics' route label: every endpoint its own, never the raw path."""

from __future__ import annotations

import pytest

from services.router.api.openai.metrics import route_label


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        # The Responses API was counted under `other`, with the 404s of paths nobody serves.
        ("/v1/responses", "/v1/responses"),
        ("/v1/responses/resp_0123abcd", "/v1/responses/{id}"),
        ("/v1/models/SmolLM2-135M-Instruct", "/v1/models/{model}"),
        ("/v1/made-up/abc123", "other"),  # a client cannot grow the label set
        ("/v1/responsesX", "other"),
    ],
)
def test_each_endpoint_has_its_own_label_and_anything_else_is_other(path: str, label: str) -> None:
    assert route_label(path) == label
