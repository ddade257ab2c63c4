"""`llm-mesh up`: the whole mesh as local processes, started, watched and stopped together."""
