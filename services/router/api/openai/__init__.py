"""The OpenAI-compatible HTTP front of the router: /v1/chat/completions, /v1/completions, /v1/models.

Served by the router process itself, beside its gRPC port and in the same event
loop, so an HTTP turn runs the very pipeline a gRPC turn does, with no extra hop.
"""
