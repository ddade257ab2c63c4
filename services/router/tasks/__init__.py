"""Durable async tasks: the task records, their event streams and the shared work queue in Redis."""
