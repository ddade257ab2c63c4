"""Where a request goes: the replica pool, health and outlier ejection, pins, prewarm, the ring and policies."""
