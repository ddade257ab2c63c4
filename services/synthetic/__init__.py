"""A synthetic token source: a fake Inference replica (no model) for router tests, load tests and benches."""
