"""What a turn knows when it asks for a replica: the placement request (pure data)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PromptPrefix:
    """The prompt's chained block hashes, as the replicas' block managers compute them.

    Hash *i* covers tokens ``[0, (i + 1) * block_size)``: a replica holding hash *i* holds
    the whole prefix up to it. Empty when the router does not know the prompt's tokens.
    """

    hashes: Sequence[int] = ()
    #: Tokens per block the hashes were computed with (0 when there are none).
    block_size: int = 0
    #: Tokens in the whole prompt, the partial last block included (0: only the blocks are known).
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        # Hashes without their block size cannot be matched against any replica's blocks.
        if self.hashes and self.block_size <= 0:
            raise ValueError(f"prefix hashes need a block size > 0, got {self.block_size}")


#: The prefix of a prompt whose tokens the router does not know (yet).
NO_PREFIX = PromptPrefix()


@dataclass(frozen=True)
class PlacementRequest:
    """Everything placement may weigh for one attempt of one generation."""

    #: Models to try, in the plan's fallback order.
    models: Sequence[str]
    #: ``tenant:session`` for a session's turn: the affinity ring's key.
    session_key: str | None = None
    #: The replica the session is pinned to (its KV prefix is warm there).
    pinned: str | None = None
    #: Replicas already tried for this generation.
    exclude: frozenset[str] = frozenset()
    #: Monotonic-clock deadline; None = no deadline.
    deadline: float | None = None
    #: The generation's id: a deterministic tie-break key when nothing else identifies it.
    request_id: str = ""
    prefix: PromptPrefix = field(default=NO_PREFIX)

    @property
    def prefix_hashes(self) -> Sequence[int]:
        return self.prefix.hashes

    @property
    def block_size(self) -> int:
        return self.prefix.block_size

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens placement knows of: the whole prompt, or at least its full blocks."""
        return max(self.prefix.prompt_tokens, len(self.prefix.hashes) * self.prefix.block_size)

    @property
    def tie_key(self) -> str:
        """What identifies the request alike on every router: its session, else its prompt
        (the last block hash covers all of it), else its id."""
        if self.session_key:
            return self.session_key
        if self.prefix.hashes:
            return f"prefix:{self.prefix.hashes[-1]}"
        return self.request_id
