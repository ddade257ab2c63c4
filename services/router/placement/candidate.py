"""What placement may know about a replica: the ``Candidate`` protocol the pool's replicas meet."""

from __future__ import annotations

from typing import Protocol, TypeVar


class Candidate(Protocol):
    """The load and latency facts of one replica, as filters, scorers and selectors read them."""

    @property
    def address(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """Generations this router has open there."""
        ...

    @property
    def queue_depth(self) -> int:
        """Requests waiting there, as it last reported."""
        ...

    @property
    def ewma_ttft_s(self) -> float | None: ...

    @property
    def ewma_itl_s(self) -> float | None: ...

    # What the prefix policy reads. Its load is what the replica reported (GetLoad), not what
    # this router sent, so every router that polls the replica sees the same figure.

    @property
    def reported_load(self) -> int:
        """Sequences running plus waiting, as the replica last reported them."""
        ...

    @property
    def prefill_s_per_token(self) -> float | None:
        """Learned prefill time per uncached prompt token; None before a sample."""
        ...

    @property
    def decode_s_per_request(self) -> float | None:
        """Learned decode time of one request; None before a sample."""
        ...


C = TypeVar("C", bound=Candidate)


def outstanding(c: Candidate) -> int:
    """Work ahead of a new request on this replica, as this router sees it plus what it reports."""
    return c.in_flight + c.queue_depth
