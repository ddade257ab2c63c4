"""Terminal clients of the router: `llm-mesh chat`, `ask` and `status`."""
