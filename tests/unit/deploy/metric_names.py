"""Metric names the services define, read from their code (what deploy artefacts may refer to)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONSTRUCTOR_RE = re.compile(r'(?:Counter|Gauge|Histogram|Summary)\(\s*"(llmmesh_[a-z0-9_]+)"')


def exported_metric_names() -> set[str]:
    """Names passed to prometheus_client constructors anywhere in services/ (generated code aside)."""
    names: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        if "gen" in path.parts:
            continue
        names |= set(CONSTRUCTOR_RE.findall(path.read_text()))
    # prometheus_client appends _total to counters it is given without it.
    return names | {f"{n}_total" for n in names}
