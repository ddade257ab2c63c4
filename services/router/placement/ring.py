"""Consistent hashing with virtual nodes and bounded loads, for session affinity."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping

#: Bounded-load slack: a node may hold up to (1 + epsilon) times the average load (``--epsilon``).
DEFAULT_EPSILON = 0.25


def ring_hash(key: str) -> int:
    """A stable 64-bit hash: the same on every router, unlike Python's salted ``hash``."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def bounded_capacity(total_in_flight: int, nodes: int, epsilon: float) -> int:
    """Most requests one node may hold: ⌈(1+ε)·avg⌉, counting the one being placed."""
    if nodes <= 0:
        return 0
    return math.ceil((1.0 + epsilon) * (total_in_flight + 1) / nodes)


class ConsistentHashRing:
    """Nodes placed at ``vnodes`` points each; a key belongs to the next point clockwise.

    Virtual nodes even out the arcs, so adding one node to N moves about 1/(N+1) of keys.
    """

    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._nodes: set[str] = set()
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        if node in self._nodes:
            return
        self._nodes.add(node)
        for i in range(self.vnodes):
            point = ring_hash(f"{node}#{i}")
            at = bisect.bisect_left(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def sync(self, nodes: Iterable[str]) -> None:
        """Make the ring hold exactly ``nodes`` (adding and removing only the difference)."""
        wanted = set(nodes)
        for node in self._nodes - wanted:
            self.remove(node)
        for node in sorted(wanted - self._nodes):
            self.add(node)

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes in ring order starting at ``key``'s owner: its successors on failover."""
        if not self._points:
            return
        start = bisect.bisect_right(self._points, ring_hash(key)) % len(self._points)
        seen: set[str] = set()
        count = len(self._points)
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._nodes):
                    return

    def owner(self, key: str) -> str | None:
        return next(self.walk(key), None)

    def choose_bounded(
        self,
        key: str,
        load: Mapping[str, int] | Callable[[str], int],
        epsilon: float = DEFAULT_EPSILON,
        eligible: Callable[[str], bool] | None = None,
    ) -> str | None:
        """The first node from ``key``'s position with room under the bounded-load cap.

        Only eligible nodes count toward the average and the cap; a full node
        passes the key on to its ring successor (Mirrokni et al., 2018).
        """
        load_of = load if callable(load) else (lambda n, m=load: m.get(n, 0))
        nodes = [n for n in self._nodes if eligible is None or eligible(n)]
        if not nodes:
            return None
        cap = bounded_capacity(sum(load_of(n) for n in nodes), len(nodes), epsilon)
        for node in self.walk(key):
            if (eligible is None or eligible(node)) and load_of(node) < cap:
                return node
        return None
