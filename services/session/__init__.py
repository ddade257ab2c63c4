"""The session service: conversation state in Redis with sliding TTLs and optimistic versions."""
