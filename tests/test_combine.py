"""Prompt lookup merged into a model drafter's tree (``NAME@ngram=N``)."""

from __future__ import annotations

import pytest
import torch

from specdraft.drafters import make_drafter
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.combine import WithNgram, merge, node_paths
from specdraft.drafters.hybrid import HybridDrafter, HybridOptions
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.tree import Tree
from tests.test_hybrid import PROMPTS, _random_model


def _paths(tree: Tree) -> set[tuple[int, ...]]:
    return {tuple(p) for p in node_paths(tree)}


def test_merge_gives_lookup_its_nodes_and_model_the_rest():
    model = Tree(tokens=[0, 1, 2, 3, 4], parents=[-1, 0, 0, 1, 3])  # best first: 1, 2, 1-3, 1-3-4
    assert node_paths(model) == [[1], [2], [1, 3], [1, 3, 4]]
    # lookup path 1-5-6 shares node 1 with the model: 2 new nodes for the lookup, model fills 3
    t = merge(0, [[1, 5, 6], [7]], model, lookup_nodes=3, budget=5)
    assert _paths(t) == {(1,), (1, 5), (1, 5, 6), (2,), (1, 3)}
    # no lookup candidates: the model's tree as it was
    assert _paths(merge(0, [], model, 3, 4)) == _paths(model)
    # the lookup never takes more than its share, nor more than the budget
    assert _paths(merge(0, [[8, 9, 10, 11]], model, 2, 3)) == {(8,), (8, 9), (1,)}
    assert _paths(merge(0, [[8, 9, 10, 11]], model, 9, 2)) == {(8,), (8, 9)}
    for t in (merge(0, [[1, 5, 6], [7]], model, 3, 5), merge(0, [[8, 9]], model, 1, 4)):
        assert all(p < i for i, p in enumerate(t.parents) if i)  # topological, prefix-closed


def test_model_drafter_with_lookup_is_lossless(tiny_chat_target):
    t = tiny_chat_target
    torch.set_num_threads(1)
    model = _random_model(t, 2, 2, vocab=512)
    for p in PROMPTS[:2]:
        ids = t.encode_prompt(p)
        ref = generate(t, ids, NoDrafter(), GenerateConfig(max_new_tokens=32)).token_ids
        for budget, lookup in ((1, 1), (4, 2), (9, 6)):
            d = WithNgram(HybridDrafter(model, HybridOptions(topk=3, beams=2)), lookup)
            d.default_budget = budget
            r = generate(t, ids, d, GenerateConfig(max_new_tokens=32))
            assert r.token_ids == ref, (p, budget, lookup)


@pytest.mark.parametrize("bad,match", [("gumiho@ngram=-1", "gumiho option ngram must be >= 0"),
                                       ("gumiho@ngram=x", "gumiho option ngram must be an integer"),
                                       ("ngram@ngram=2", "drafter 'ngram' has no option 'ngram'"),
                                       ("gumiho@ngram", "is not key=value")])
def test_lookup_option_errors(tiny_llama, bad, match):
    with pytest.raises(SpecdraftError, match=match):
        make_drafter(bad, tiny_llama[1])


def test_budget_option_sets_any_drafters_budget(tiny_llama):
    assert make_drafter("ngram@budget=5", tiny_llama[1]).default_budget == 5
    for bad in ("ngram@budget=x", "ngram@budget=-2"):
        with pytest.raises(SpecdraftError, match="budget must be an integer >= 0"):
            make_drafter(bad, tiny_llama[1])
