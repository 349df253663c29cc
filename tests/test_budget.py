"""The one budget policy (drafters/budget.py) as the registry applies it."""

from specdraft.drafters import budget, make_drafter
from specdraft.drafters.budget import budget_from_curve, default_budget

# a pass over n tokens costs 1 + 0.1 (n - 1) one-token passes: trees of up to 6 tokens cost <= 1.5x
STEEP = {"n": list(range(1, 65)), "ratio": [1 + 0.1 * (n - 1) for n in range(1, 65)], "ms": [10.0] * 64}


def test_policy_rules(tiny_llama, monkeypatch):
    t = tiny_llama[1]
    monkeypatch.setattr(budget, "load_cost_curve", lambda target: None)
    assert default_budget(t, 7, {"acceptance_by_budget": {"1": 1.5, "4": 2.5}}) == 7  # no curve: the fallback
    monkeypatch.setattr(budget, "load_cost_curve", lambda target: STEEP)
    assert budget_from_curve(STEEP, default=3) == 5
    assert default_budget(t, 7) == 5  # curve only: the largest tree within 1.5x
    assert default_budget(t, 7, scale_with_curve=False) == 7  # a drafter whose budget does not follow the curve
    # with a profile: tokens per pass / pass cost, 1 -> 1.5 / 1.1, 4 -> 2.5 / 1.4 (best), 8 -> 2.6 / 1.8
    assert default_budget(t, 7, {"acceptance_by_budget": {"1": 1.5, "4": 2.5, "8": 2.6}}) == 4


def test_registry_budgets(tiny_llama, monkeypatch):
    t = tiny_llama[1]
    monkeypatch.setattr(budget, "load_cost_curve", lambda target: STEEP)
    assert make_drafter("ngram", t).default_budget == 5
    assert make_drafter("ngram@budget=3", t).default_budget == 3
    assert make_drafter("ngram", t, budget=1).default_budget == 1
    assert make_drafter("none", t).default_budget == 0  # plain decoding never drafts
    monkeypatch.setattr(budget, "load_cost_curve", lambda target: None)
    assert make_drafter("ngram", t).default_budget == 2
