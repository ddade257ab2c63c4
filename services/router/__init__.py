"""The router: the public front door of llm-mesh (auth, balancing, failover, caches, tasks)."""
