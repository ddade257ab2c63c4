"""Per-entry confidence: a wrong refresh stops an entry, agreeing ones earn it back, the budget sets both."""

from __future__ import annotations

import pytest

from services.router.turns.semantic_confidence import Decision, EntryConfidence, answers_agree


def test_a_new_entry_serves_and_one_wrong_refresh_stops_it() -> None:
    confidence = EntryConfidence(error_budget=0.01, refresh_rate=0.0)
    assert confidence.decide("e1", 0.95) is Decision.SERVE
    confidence.record("e1", 0.95, agreed=False)
    assert confidence.estimated_error("e1") > 0.01
    assert confidence.decide("e1", 0.99) is Decision.REFUSE
    assert confidence.decide("e2", 0.95) is Decision.SERVE  # other entries keep their own


def test_an_entry_earns_serving_back_with_about_one_over_the_budget_agreeing_refreshes() -> None:
    confidence = EntryConfidence(error_budget=0.05, refresh_rate=0.0)
    confidence.record("e", 0.90, agreed=False)
    agreeing = 0
    while confidence.decide("e", 0.97) is Decision.REFUSE:
        confidence.record("e", 0.97, agreed=True)
        agreeing += 1
    # (1 + 1) / (refreshes + 20) <= 0.05 once refreshes reach 20: one wrong, 19 agreeing.
    assert agreeing == 19
    # Its own threshold stays: no longer served at or below the similarity it once failed at.
    assert confidence.decide("e", 0.90) is Decision.REFUSE
    assert confidence.decide("e", 0.91) is Decision.SERVE


def test_a_looser_budget_tolerates_a_wrong_refresh_among_many_agreeing_ones() -> None:
    strict = EntryConfidence(error_budget=0.01, refresh_rate=0.0)
    loose = EntryConfidence(error_budget=0.2, refresh_rate=0.0)
    for confidence in (strict, loose):
        for _ in range(10):
            confidence.record("e", 0.9, agreed=True)
        confidence.record("e", 0.8, agreed=False)
    assert strict.decide("e", 0.95) is Decision.REFUSE
    assert loose.decide("e", 0.95) is Decision.SERVE


def test_refreshes_are_drawn_at_the_refresh_rate() -> None:
    draws = iter([0.5, 0.01, 0.9])
    confidence = EntryConfidence(refresh_rate=0.05, rng=lambda: next(draws))
    assert [confidence.decide("e", 0.9) for _ in range(3)] == [
        Decision.SERVE,
        Decision.REFRESH,
        Decision.SERVE,
    ]


def test_the_least_recently_used_entries_are_forgotten_past_the_bound() -> None:
    confidence = EntryConfidence(refresh_rate=0.0, max_entries=2)
    confidence.record("old", 0.9, agreed=False)
    confidence.record("a", 0.9, agreed=False)
    confidence.record("b", 0.9, agreed=False)
    assert confidence.decide("old", 0.95) is Decision.SERVE  # forgotten: back to the prior
    assert confidence.decide("b", 0.95) is Decision.REFUSE


def test_answers_agree_on_the_same_words_only() -> None:
    assert answers_agree("Paris is the capital.", "paris  is the capital")
    assert not answers_agree("You can take it with water.", "You cannot take it with water.")


@pytest.mark.parametrize(("budget", "rate"), [(0.0, 0.1), (1.0, 0.1), (0.01, 1.5), (0.01, -0.1)])
def test_out_of_range_settings_are_refused_naming_the_flag(budget: float, rate: float) -> None:
    with pytest.raises(ValueError, match="--semantic-cache-"):
        EntryConfidence(error_budget=budget, refresh_rate=rate)
