"""Prompt lookup inside a model drafter's tree: ``NAME@ngram=N``.

A model drafter (gumiho, medusa, eagle, block, mfd) ranks its own nodes; the ``ngram`` drafter
copies continuations of earlier matches of the latest n-grams.  They fail on different tokens
(a drafter has never seen this prompt's names and numbers; a lookup knows nothing else), so one
tree can hold both: up to ``N`` nodes go to the lookup's candidates, best first, and the model's
own best nodes fill the rest of the budget.  When nothing matches, the model gets every node.
Both parts are prefix-closed, so their union is a valid tree; verification is unchanged, so the
output stays exactly the target's.
"""

from __future__ import annotations

import copy

from specdraft.drafters.ngram import NgramConfig, NgramDrafter
from specdraft.model.llama import ForwardOutput
from specdraft.tree import Tree
from specdraft.verify import Accepted


def node_paths(tree: Tree) -> list[list[int]]:
    """Token path (root excluded) to every drafted node, in the tree's node order."""
    paths: list[list[int]] = [[]]
    for i in range(1, len(tree)):
        paths.append(paths[tree.parents[i]] + [tree.tokens[i]])
    return paths[1:]


def merge(root: int, lookup: list[list[int]], model: Tree, lookup_nodes: int, budget: int) -> Tree:
    """The lookup's candidates (at most ``lookup_nodes`` nodes, best first), then the model's nodes in
    its own order, trie-merged under ``budget`` drafted nodes."""
    first = Tree.from_paths(root, lookup, budget=min(lookup_nodes, budget))
    return Tree.from_paths(root, node_paths(first) + node_paths(model), budget=budget)


class WithNgram:
    """Wraps a model drafter; same protocol, same name and features."""

    def __init__(self, drafter, lookup_nodes: int, config: NgramConfig | None = None) -> None:
        self.inner = drafter
        self.ngram = NgramDrafter(config)
        self.lookup_nodes = lookup_nodes
        self.name = drafter.name
        self.hidden_layers = drafter.hidden_layers
        self.default_budget = drafter.default_budget
        self.manifest = getattr(drafter, "manifest", {})

    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.inner.reset(prompt_ids, first_token, prefill)
        self.ngram.reset(prompt_ids, first_token, prefill)

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self.inner.commit(accepted, out)
        self.ngram.commit(accepted, out)

    def fork(self) -> "WithNgram":
        new = copy.copy(self)
        new.inner, new.ngram = self.inner.fork(), self.ngram.fork()
        return new

    def propose(self, budget: int) -> Tree:
        model = self.inner.propose(budget)
        if budget <= 0:
            return model
        return merge(model.tokens[0], self.ngram.candidates(), model, self.lookup_nodes, budget)

    def __getattr__(self, item):  # e.g. marginals() of a block drafter
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)
