"""The search modes and the proto numbers they travel as."""

from __future__ import annotations

import enum


class SearchMode(enum.Enum):
    """How Search finds candidates; the values are ``retriever.proto``'s SearchMode numbers."""

    DENSE = 1
    KEYWORD = 2
    HYBRID = 3


DEFAULT_MODE = SearchMode.HYBRID
