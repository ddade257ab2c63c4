"""Who may come in and how fast: API keys, rate limits, circuit breakers, the TLS the router dials with."""
