"""The session service's quotas and TTL bounds, validated once at startup."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import flag

#: The TTL a session gets when CreateSession asks for none, as in the seeds' `SETEX … 3600`.
DEFAULT_TTL_SECONDS = 3600


@dataclass(frozen=True)
class SessionLimits:
    """What one session and one owner may hold; beyond it calls are refused with a message."""

    default_ttl_seconds: int = flag(DEFAULT_TTL_SECONDS, help="sliding TTL when a call asks none")
    # A week: longer-lived state belongs in a real database, not a cache-like store.
    max_ttl_seconds: int = flag(7 * 24 * 3600, help="largest TTL")
    max_turns_per_session: int = flag(1000, help="turns per session")
    # Counts a turn's content plus its metadata keys and values (UTF-8 bytes); also bounds the system prompt.
    max_turn_bytes: int = flag(64 * 1024, help="UTF-8 bytes per turn")
    max_sessions_per_owner: int = flag(1000, help="live sessions per owner")
    # Per-message metadata entries; keeps one header from growing without bound.
    max_metadata_entries: int = 64

    def __post_init__(self) -> None:
        for name in (
            "default_ttl_seconds",
            "max_ttl_seconds",
            "max_turns_per_session",
            "max_turn_bytes",
            "max_sessions_per_owner",
            "max_metadata_entries",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.default_ttl_seconds > self.max_ttl_seconds:
            raise ValueError(
                f"default_ttl_seconds ({self.default_ttl_seconds}) must not exceed "
                f"max_ttl_seconds ({self.max_ttl_seconds})"
            )
