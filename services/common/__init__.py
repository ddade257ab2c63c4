"""Shared pieces of every llm-mesh service: bootstrap, errors, settings, metrics."""
