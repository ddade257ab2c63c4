"""Which models a request may be served by: aliases, fallback order, canary splits."""

from __future__ import annotations

import random
from collections.abc import Set
from dataclasses import dataclass

from services.common import errors


@dataclass(frozen=True)
class CanarySplit:
    """Send ``share`` of ``model``'s requests to ``new_model`` (a version being rolled out)."""

    model: str
    new_model: str
    share: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"--canary {self.model}: share must be in [0, 1], got {self.share}")


def parse_pairs(text: str, flag: str, sep: str) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        left, found, right = item.partition(sep)
        if not found or not left or not right:
            raise ValueError(f"{flag}: expected NAME{sep}VALUE items separated by commas, got {item!r}")
        pairs.append((left.strip(), right.strip()))
    return pairs


class ModelCatalog:
    """Turns the requested model name into the ordered list of models to try."""

    def __init__(
        self,
        aliases: dict[str, str] | None = None,
        fallbacks: dict[str, list[str]] | None = None,
        canaries: dict[str, CanarySplit] | None = None,
        default_model: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.aliases = aliases or {}
        self.fallbacks = fallbacks or {}
        self.canaries = canaries or {}
        self.default_model = default_model
        self._rng = rng or random.Random()

    @classmethod
    def from_flags(
        cls, aliases: str = "", fallbacks: str = "", canary: str = "", default_model: str | None = None
    ) -> ModelCatalog:
        """``fast=M1,quality=M2``; ``M1:M2,M2:M3`` (M1 falls back to M2, …); ``M=NEW:0.1``."""
        fallback_map: dict[str, list[str]] = {}
        for model, fallback in parse_pairs(fallbacks, "--model-fallbacks", ":"):
            fallback_map.setdefault(model, []).append(fallback)
        canaries: dict[str, CanarySplit] = {}
        for model, spec in parse_pairs(canary, "--canary", "="):
            new_model, found, share = spec.rpartition(":")
            try:
                canaries[model] = CanarySplit(model, new_model, float(share))
            except ValueError as exc:
                if not found or not new_model:
                    raise ValueError(f"--canary: expected MODEL=NEW:SHARE, got {model}={spec}") from exc
                raise
        return cls(dict(parse_pairs(aliases, "--model-aliases", "=")), fallback_map, canaries, default_model)

    def plan(self, requested: str, known: Set[str]) -> list[str]:
        """Models to try, best first; raises when nothing could ever serve the name."""
        if not known:
            raise errors.DependencyUnavailable("no inference replica is reachable yet")
        name = requested or self.default_model or self.aliases.get("default") or ""
        if not name:
            # One model served: that is the default; several: the first by name, predictably.
            name = sorted(known)[0]
        model = self.aliases.get(name, name)
        order = [model]
        split = self.canaries.get(model)
        if split is not None and split.new_model in known and self._rng.random() < split.share:
            order.insert(0, split.new_model)
        # Fallbacks in order, following chains (A→B→C), never repeating one.
        i = 0
        while i < len(order):
            for fallback in self.fallbacks.get(order[i], []):
                if fallback not in order:
                    order.append(fallback)
            i += 1
        if not any(m in known for m in order):
            served = ", ".join(sorted(known))
            raise errors.InvalidArgument(
                "model", f"unknown model {requested!r}; this router serves: {served}"
            )
        return order
