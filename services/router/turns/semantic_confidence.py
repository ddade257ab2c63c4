"""Per-entry confidence for semantic-cache hits, in place of one global threshold (vCache's idea).

Every entry starts with a prior of one wrong answer in ``1 / error_budget`` (so a
new entry is served exactly at the budget) and learns from *refreshes*: a
would-be hit that the router answers fresh instead and compares with the cached
answer. A refresh happens for a random ``refresh_rate`` share of hits, and for
every lookup the entry's confidence refuses (those are answered fresh anyway).

An entry serves a hit only while both hold:

- the posterior mean of its error rate, ``(wrong + 1) / (refreshes + 1/ε)``, is at
  most the error budget ε, so served hits' expected false-hit rate stays within ε;
- the hit's similarity is above the highest similarity at which a refresh found
  it wrong (its own learned threshold: a nearer question than the one it failed
  can still be served once the entry has earned it back).

One wrong refresh therefore stops an entry at once; it needs about 1/ε agreeing
refreshes to serve again. State is this router's, in memory, bounded (least
recently used entries are forgotten, and start again from the prior).
"""

from __future__ import annotations

import enum
import random
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_ERROR_BUDGET = 0.01
DEFAULT_REFRESH_RATE = 0.05
DEFAULT_MAX_ENTRIES = 100_000
_WORD = re.compile(r"\w+")


class Decision(enum.Enum):
    SERVE = "serve"
    #: Confident enough, but picked for a refresh: answer fresh and compare.
    REFRESH = "refresh"
    #: Not confident: answer fresh (and compare, which is a refresh too).
    REFUSE = "refuse"


@dataclass
class EntryStats:
    refreshes: int = 0
    wrong: int = 0
    #: The highest similarity at which a refresh found this entry's answer wrong.
    wrong_at: float = -1.0


def answers_agree(cached: str, fresh: str) -> bool:
    """Whether a fresh answer says what the cached one said: the same words, in any spacing or case."""
    return _WORD.findall(cached.lower()) == _WORD.findall(fresh.lower())


class EntryConfidence:
    """What each semantic-cache entry has shown, and whether it may serve the next hit."""

    def __init__(
        self,
        error_budget: float = DEFAULT_ERROR_BUDGET,
        refresh_rate: float = DEFAULT_REFRESH_RATE,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0.0 < error_budget < 1.0:
            raise ValueError(f"--semantic-cache-error-budget must be in (0, 1), got {error_budget}")
        if not 0.0 <= refresh_rate <= 1.0:
            raise ValueError(f"--semantic-cache-refresh-rate must be in [0, 1], got {refresh_rate}")
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        self.error_budget = error_budget
        self.refresh_rate = refresh_rate
        self._max_entries = max_entries
        self._rng = rng
        self._stats: OrderedDict[str, EntryStats] = OrderedDict()

    def estimated_error(self, entry_id: str) -> float:
        """The posterior mean of the entry's false-hit rate (the prior alone for an unseen entry)."""
        stats = self._stats.get(entry_id, EntryStats())
        return (stats.wrong + 1) / (stats.refreshes + 1 / self.error_budget)

    def decide(self, entry_id: str, similarity: float) -> Decision:
        stats = self._stats.get(entry_id)
        if stats is not None:
            self._stats.move_to_end(entry_id)
            # A tiny tolerance: the budget itself (1/(1/ε)) must not refuse for float rounding.
            if (
                self.estimated_error(entry_id) > self.error_budget * (1 + 1e-9)
                or similarity <= stats.wrong_at
            ):
                return Decision.REFUSE
        if self.refresh_rate and self._rng() < self.refresh_rate:
            return Decision.REFRESH
        return Decision.SERVE

    def record(self, entry_id: str, similarity: float, agreed: bool) -> None:
        """A refresh's outcome: the fresh answer agreed with the entry's, or not."""
        stats = self._stats.get(entry_id)
        if stats is None:
            stats = self._stats[entry_id] = EntryStats()
            while len(self._stats) > self._max_entries:
                self._stats.popitem(last=False)
        self._stats.move_to_end(entry_id)
        stats.refreshes += 1
        if not agreed:
            stats.wrong += 1
            stats.wrong_at = max(stats.wrong_at, similarity)
