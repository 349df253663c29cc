"""The one budget policy (drafters/budget.py) as the registry applies it."""

import pytest

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


# ---------------------------------------------------------------------- live costs and the tree cut
from specdraft.drafters.budget import BURST, PROBE, PROBE_MAX, SEEN, STALE, LiveCosts  # noqa: E402
from specdraft.drafters.calibration import Calibration, fit, with_scores  # noqa: E402
from specdraft.tree import Tree  # noqa: E402

LINEAR = {"n": list(range(1, 33)), "ms": [10.0 + 2.0 * (n - 1) for n in range(1, 33)]}  # +20% a row


def test_cut_keeps_the_nodes_that_pay():
    costs = LiveCosts(LINEAR)
    tree = Tree.from_paths(1, [[2, 3, 4], [5]]).with_probs([1, 0.9, 0.8, 0.1, 0.3])
    # best first: 2 (0.9), 3 (0.8), 5 (0.3), 4 (0.1); tokens / ms: k=0 1/10, k=1 1.9/12, k=2 2.7/14 (best),
    # k=3 3.0/16, k=4 3.1/18
    cut = costs.cut(tree, "d")
    assert cut.tokens == [1, 2, 3] and cut.probs == [1.0, 0.9, 0.8]
    costs.propose["d"] = 100.0  # drafting this dear: every node is worth its rows (the rate only rises)
    assert len(costs.cut(tree, "d")) == 5
    flat = Tree.from_paths(1, [[2], [3]]).with_probs([1, 0.1, 0.05])
    assert costs.cut(flat, "e").tokens == [1]  # nothing confident: a plain step
    assert costs.cut(Tree.from_paths(1, [[2]]), "e").tokens == [1, 2]  # no probabilities: as proposed
    assert abs(costs.floor("e") - 0.2) < 1e-9  # (12 - 10) / 10: a node under p = 0.2 never pays here


def test_live_costs_follow_the_passes():
    costs = LiveCosts(LINEAR)
    assert costs.pass_ms(3) == [10.0, 12.0, 14.0]
    for _ in range(SEEN):
        costs.observe("d", 2, 24.0, 1.0, 0.5, 2, True)  # 2-row passes cost twice the curve's
    est = costs.pass_ms(4)
    assert est[1] == 24.0  # seen often enough: its own average
    assert costs.scale > 1.2 and est[3] >= est[2] >= est[1]  # the others: the curve at the live pace, never cheaper
    assert costs.curve_ms(40) == 10.0 + 2.0 * 39  # past the curve's end: along its last segment
    before = costs.pass_ms(2)[1]
    costs.observe("d", 2, 10_000.0, 1.0, 0.5, 2, True)  # one preempted pass moves the average a little
    assert costs.pass_ms(2)[1] <= before * 1.06
    assert abs(costs.draft_ms("d") - 1.5) < 1e-9


def test_a_size_not_seen_for_long_is_priced_by_the_curve_again():
    """A size priced high once (the cut then never picks it, so it is never re-measured) gets the scaled curve back
    after ``STALE`` passes without it; seen again, its average starts over."""
    costs = LiveCosts(LINEAR)
    for _ in range(SEEN):
        costs.observe_pass(3, 40.0)  # 3-row passes once cost 40 ms against the curve's 14
    assert costs.pass_ms(3)[2] > 30.0
    for _ in range(STALE):
        costs.observe_pass(1, 10.0)
    assert costs.pass_ms(3)[2] > 30.0  # not stale yet
    costs.observe_pass(1, 10.0)
    assert costs.pass_ms(3)[2] < 20.0  # stale: the curve at the live pace
    costs.observe_pass(3, 15.0)  # seen again: its average starts over from the scaled curve (used until SEEN passes)
    assert costs.live[3][1] == 1 and costs.live[3][0] < 20.0 and costs.pass_ms(3)[2] < 20.0
    for _ in range(2 * SEEN):
        costs.observe_pass(3, 15.0)
    assert 14.0 < costs.pass_ms(3)[2] < 16.0 and costs.totals[3][1] == 3 * SEEN + 1


def test_drafting_pauses_where_it_does_not_pay_and_probes():
    costs = LiveCosts(LINEAR)
    for _ in range(SEEN):  # drafted steps of 1 token for 10 + 5 ms against a 10 ms plain pass
        assert costs.drafting_pays("d")
        costs.observe("d", 1, 10.0, 5.0, 0.0, 1, True)

    def run(steps, tokens):  # answers over ``steps`` steps, drafted ones committing ``tokens`` for 14 + 1 ms
        answers = []
        for _ in range(steps):
            answers.append(costs.drafting_pays("d"))
            costs.observe("d", 3 if answers[-1] else 1, 14.0 if answers[-1] else 10.0, 1.0, 0.0,
                          tokens if answers[-1] else 1, answers[-1])
        return answers

    pauses = [min(PROBE << i, PROBE_MAX) for i in range(6)]  # it keeps not paying: each pause twice the last
    answers = run(sum(pauses) + BURST * len(pauses), 1)
    starts = [i for i, a in enumerate(answers) if a and (i == 0 or not answers[i - 1])]
    assert starts == [sum(pauses[: j + 1]) + BURST * j for j in range(len(pauses))]  # after each pause, a probe ...
    assert sum(answers) == BURST * len(pauses)  # ... of BURST drafted steps
    costs.start("d")  # a new generation: the next probe comes after PROBE steps
    answers = run(PROBE + BURST + 40, 3)  # its text changed: 3 tokens a step pay, the probe resumes it
    assert not any(answers[:PROBE]) and all(answers[PROBE:])
    for _ in range(40):  # drafting pays ...
        costs.observe("d", 3, 14.0, 1.0, 0.0, 3, True)
    for _ in range(80):  # ... then stops paying: it pauses
        costs.observe("d", 1, 10.0, 5.0, 0.0, 1, True)
    answers = []
    for _ in range(PROBE + BURST + 2 * PROBE):  # its probe would pay (3 tokens for 15 ms), but catching up costs 100 ms
        answers.append(costs.drafting_pays("d"))
        first = answers[-1] and costs.burst.get("d", [0, 0, 1])[2] == 0
        costs.observe("d", 3 if answers[-1] else 1, 14.0 if answers[-1] else 10.0, 1.0, 0.0, 3 if answers[-1] else 1,
                      answers[-1], catch_up_ms=100.0 if first else 0.0)
    assert answers[PROBE:PROBE + BURST] == [True] * BURST and sum(answers) == BURST  # resuming costs more: paused
    dear = LiveCosts(LINEAR)  # 1.4 tokens for a 12 ms pass and 1 ms of propose would pay; its 3 ms commit does not
    for _ in range(SEEN):
        assert dear.drafting_pays("c")
        dear.observe("c", 2, 12.0, 1.0, 3.0, 1.4, True)
    assert not dear.drafting_pays("c")


def test_calibration_fit_and_scores():
    cal = fit([0.1] * 50 + [0.5] * 50 + [0.9] * 50, [False] * 45 + [True] * 5 + [False] * 35 + [True] * 15
              + [True] * 40 + [False] * 10, bins=3)
    assert [round(x, 6) for x in cal.xs] == [0.1, 0.5, 0.9] and [round(y, 2) for y in cal.ys] == [0.1, 0.3, 0.8]
    assert abs(cal(0.3) - 0.2) < 1e-9 and cal(0.0) == 0.1 and cal(1.0) == 0.8
    pooled = fit([0.1] * 50 + [0.5] * 50, [True] * 30 + [False] * 20 + [True] * 10 + [False] * 40, bins=2)
    assert [round(y, 6) for y in pooled.ys] == [0.4]  # a violation (0.6 then 0.2) pools into one monotone knot
    assert Calibration()(1.7) == 1.0
    with pytest.raises(ValueError):
        Calibration([0.5, 0.1], [0.1, 0.2])
    tree = Tree.from_paths(1, [[2, 3]])
    assert with_scores(tree, [0.0, -0.1, -0.5], None) is tree
    scored = with_scores(tree, [0.0, -0.1, -0.5], Calibration(), log=True)
    assert [round(p, 4) for p in scored.probs] == [1.0, 0.9048, 0.6065]


def test_fit_probabilities_resolves_the_confident_nodes():
    """Equal-width bins: 1,000 unlikely nodes do not swallow the 200 confident ones; a sparse bin joins the next one
    up (the last the one below); violations pool."""
    from specdraft.drafters.calibration import fit_probabilities

    probs = [0.02] * 1000 + [0.52] * 100 + [0.83] * 100 + [0.97] * 10
    acc = [False] * 990 + [True] * 10 + [True] * 30 + [False] * 70 + [True] * 60 + [False] * 40 + [True] * 10
    cal = fit_probabilities(probs, acc)
    assert [round(x, 4) for x in cal.xs] == [0.02, 0.52, round((83 + 9.7) / 110, 4)]
    assert [round(y, 4) for y in cal.ys] == [0.01, 0.3, round(70 / 110, 4)]
    pooled = fit_probabilities([0.3] * 100 + [0.6] * 100, [True] * 50 + [False] * 50 + [True] * 20 + [False] * 80)
    assert [round(y, 4) for y in pooled.ys] == [0.35]


def test_auto_is_phrase_where_its_weights_fit_else_ngram(tiny_llama, default_target):
    assert make_drafter("auto", default_target).name == "phrase"
    assert make_drafter("auto", tiny_llama[1]).name == "ngram"  # phrase's weights refuse another target
    assert make_drafter("auto", tiny_llama[1], budget=3).default_budget == 3


def test_shipped_maps_calibrate_the_shipped_weights_only(default_target):
    """The fitted maps describe the shipped weights: the same weights by path (a user's checkpoint) score raw."""
    from specdraft.drafters.registry import weights_path

    assert make_drafter("phrase", default_target).calibration.xs
    assert make_drafter(str(weights_path("phrase")), default_target).calibration.xs == []
    assert make_drafter("mfd", default_target).calibration.xs
    assert make_drafter(str(weights_path("mfd")), default_target).calibration.xs == []
    for name in ("ngram", "phrase", "mfd"):  # the sampled maps likewise: the shipped drafters' own
        assert 0.7 in make_drafter(name, default_target).sampled
    assert make_drafter(str(weights_path("phrase")), default_target).sampled == {}


def test_cost_curve_prepares_each_size_once(tiny_chat_target, monkeypatch):
    """The exact mode packs its weights per pass size (``Target.prepare``): measuring the curve prepares each
    size once, its repeats together, not once per round."""
    from specdraft.bench.cost import measure_cost_curve

    t = tiny_chat_target
    assert t.precision == "exact"
    calls = []
    real = t.prepare
    monkeypatch.setattr(t, "prepare", lambda budget: calls.append(budget) or real(budget))
    curve = measure_cost_curve(t, max_n=4, context=8, repeats=3, quiet=True)
    assert calls == [0, 1, 2, 3] and curve["n"] == [1, 2, 3, 4] and len(curve["ms"]) == 4
