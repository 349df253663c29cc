"""Paired comparison of drafters over the same prompts (``specdraft.bench.stats``), in the offline
replay and in the bench report."""

from __future__ import annotations

import json

import pytest

from specdraft.bench.report import paired_section, per_prompt_counts, write_report
from specdraft.bench.stats import format_comparison, paired_bootstrap, paired_comparisons, verdict
from specdraft.errors import SpecdraftError


def test_pooled_difference_interval_and_verdict():
    a = [(10, 5), (20, 10), (30, 12)]
    b = [(10, 4), (20, 10), (30, 15)]
    c = paired_bootstrap(a, b)
    assert c["diff"] == pytest.approx(60 / 27 - 60 / 29)
    lo, hi = c["ci"]
    assert lo <= c["diff"] <= hi
    assert (c["fewer_passes"], c["more_passes"], c["prompts"]) == (1, 1, 3)
    assert paired_bootstrap(a, b) == c  # seeded: the same numbers every time
    # the same drafter against itself: no difference in any resample
    same = paired_bootstrap(a, a)
    assert same["diff"] == 0 and same["ci"] == [0, 0] and same["p_ahead"] == 0 and verdict(same) == "tie within noise"


def test_a_drafter_better_on_every_prompt_is_ahead_and_the_reverse_behind():
    good = [(100, 40 + i % 3) for i in range(20)]
    bad = [(100, 50 + i % 5) for i in range(20)]
    c = paired_comparisons({"x": good, "y": bad})[0]
    assert (c["a"], c["b"]) == ("x", "y")
    assert c["ci"][0] > 0 and c["p_ahead"] == 1.0 and c["fewer_passes"] == 20 and verdict(c) == "x ahead"
    r = paired_bootstrap(bad, good)
    assert r["ci"][1] < 0 and r["p_ahead"] == 0.0
    assert "x ahead" in format_comparison(c) and "over 20 prompts" in format_comparison(c)
    # one lucky prompt is not a win: the interval holds 0
    mixed = paired_bootstrap([(100, 40), (100, 52), (100, 51)], [(100, 50), (100, 50), (100, 50)])
    assert mixed["diff"] > 0 and mixed["ci"][0] < 0 and verdict({**mixed, "a": "x", "b": "y"}) == "tie within noise"


def test_bad_input_is_refused():
    with pytest.raises(SpecdraftError, match="same prompts"):
        paired_bootstrap([(1, 1)], [(1, 1), (2, 1)])
    with pytest.raises(SpecdraftError, match="at least one prompt"):
        paired_bootstrap([], [])
    with pytest.raises(SpecdraftError, match="reps"):
        paired_bootstrap([(1, 1)], [(1, 1)], reps=0)


def bench_results(passes: dict[str, list[int]], budgets: dict[str, int]) -> dict:
    rows = []
    for m, ps in passes.items():
        for i, p in enumerate(ps):
            rows.append({"prompt": i, "method": m, "new_tokens": 61, "wall_s": 1.0, "tok_s": 61.0,
                         "tokens_per_pass": 60 / p, "passes": p, "committed": 60, "exact_match": True,
                         "divergence": None})
    agg = {m: {"tokens_per_pass": 60 * len(ps) / sum(ps)} for m, ps in passes.items()}
    return {"config": {"budgets": budgets}, "datasets": {"gsm": {"methods": agg, "rows": rows}}}


def test_report_compares_drafters_paired(tmp_path):
    res = bench_results({"greedy": [60] * 8, "x": [30, 31, 29, 30, 32, 30, 28, 31], "y": [40] * 8},
                        {"greedy": 0, "x": 3, "y": 3})
    assert per_prompt_counts(res["datasets"]["gsm"]["rows"], "x")[0] == (60, 30)
    md = "\n".join(paired_section(res))
    assert "| gsm | x - y | +" in md and "x ahead" in md and "nodes)" not in md
    # different budgets are named, so nobody reads it as a same-budget comparison
    res["config"]["budgets"]["y"] = 6
    assert "x - y (3 vs 6 nodes)" in "\n".join(paired_section(res))
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert "## Drafters compared, paired over prompts" in write_report(tmp_path).read_text()
    # one drafter alone, or rows without pass counts: no section
    assert paired_section(bench_results({"greedy": [60] * 3, "x": [30] * 3}, {})) == []
    for r in res["datasets"]["gsm"]["rows"]:
        r["passes"] = None
    assert paired_section(res) == []


def test_replay_stores_per_prompt_counts_that_pool_to_its_tokens_per_pass(tiny_llama):
    from specdraft.replay import simulate_dataset
    from specdraft.drafters.ngram import NgramDrafter
    from specdraft.drafters.base import NoDrafter

    _, target, _ = tiny_llama
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10]]
    outputs = [[8, 5, 6, 7, 8, 5, 6, 7, 8], [11, 9, 10, 11, 9, 10, 11]]  # repetitive: prompt lookup helps
    each: dict = {}
    tpp = simulate_dataset(target, {"ngram": NgramDrafter(), "none": NoDrafter()}, prompts, outputs, [3],
                           per_prompt=each)
    for name in ("ngram", "none"):
        counts = each[name][3]
        assert len(counts) == 2
        assert tpp[name][3] == pytest.approx(sum(t for t, _ in counts) / sum(p for _, p in counts))
    assert tpp["none"][3] == 1.0 and tpp["ngram"][3] > 1.5
    c = paired_comparisons({m: each[m][3] for m in ("ngram", "none")})[0]
    assert c["diff"] == pytest.approx(tpp["ngram"][3] - 1.0) and c["fewer_passes"] == 2
