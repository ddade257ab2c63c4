"""One chat turn end to end: admission, history and RAG context, response caches, relay, save."""
