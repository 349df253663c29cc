"""Draft trees: candidate continuations merged into one prefix tree, verified in one target pass.

Node 0 is the root: the last committed token, whose K/V is not yet in the cache.  Every other
node is a drafted token; ``parents[i] < i`` (topological order), so a node's ancestors come
before it.  The target sees node i at RoPE position ``committed + depth[i]`` and may attend to
the committed prefix plus the node's ancestors (itself included): the *ancestor mask*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import Tensor


@dataclass
class Tree:
    tokens: list[int]  # [N] token id per node; tokens[0] = root
    parents: list[int]  # [N] parent index; parents[0] = -1
    depths: list[int] = field(default_factory=list)  # [N] distance from the root
    probs: list[float] = field(default_factory=list)  # [N] the drafter's calibrated probability that node i is
    # accepted (the target's continuation passes through it; probs[0] = 1), or [] when it gives none
    _children: list[dict[int, int]] = field(default_factory=list, repr=False)  # token -> child index

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a tree needs as many parents as tokens, and at least the root")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if self.probs and len(self.probs) != len(self.tokens):
            raise ValueError("a tree's probs need one entry per node")
        self.depths = [0] * len(self.tokens)
        self._children = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must come before it")
            if self.tokens[i] in self._children[p]:
                raise ValueError(f"node {i}: duplicate token {self.tokens[i]} under node {p}")
            self.depths[i] = self.depths[p] + 1
            self._children[p][self.tokens[i]] = i

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def single(cls, root: int) -> "Tree":
        return cls(tokens=[root], parents=[-1])

    @classmethod
    def from_paths(cls, root: int, paths: Iterable[Sequence[int]], budget: int | None = None) -> "Tree":
        """Trie-merge candidate continuations (in priority order) under ``budget`` drafted nodes.

        A path that no longer fits is cut where the budget runs out.
        """
        tokens, parents = [root], [-1]
        children: list[dict[int, int]] = [{}]
        for path in paths:
            node = 0
            for tok in path:
                nxt = children[node].get(tok)
                if nxt is None:
                    if budget is not None and len(tokens) - 1 >= budget:
                        break
                    nxt = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                    children.append({})
                    children[node][tok] = nxt
                node = nxt
        return cls(tokens=tokens, parents=parents)

    def with_probs(self, probs: Sequence[float]) -> "Tree":
        """This tree with node probabilities ``probs`` [N], each capped by its parent's (a node is accepted
        only if its parent is), so every prefix-closed cut by probability is a subtree."""
        p = [1.0] + [0.0] * (len(self.tokens) - 1)
        for i in range(1, len(self.tokens)):
            p[i] = min(max(float(probs[i]), 0.0), p[self.parents[i]])
        return Tree(tokens=self.tokens, parents=self.parents, probs=p)

    def keep(self, nodes: Sequence[int]) -> "Tree":
        """The subtree of ``nodes`` (the root included, each node's parent among them), in tree order."""
        order = sorted(set(nodes) | {0})
        new = {old: i for i, old in enumerate(order)}
        try:
            parents = [-1] + [new[self.parents[i]] for i in order[1:]]
        except KeyError:
            raise ValueError("the kept nodes are not prefix-closed") from None
        probs = [self.probs[i] for i in order] if self.probs else []
        return Tree(tokens=[self.tokens[i] for i in order], parents=parents, probs=probs)

    def walk(self, path: Sequence[int]) -> list[int]:
        """The nodes along token ``path`` from the root (root excluded), as far as the tree holds it."""
        out, node = [], 0
        for tok in path:
            node = self._children[node].get(tok)
            if node is None:
                break
            out.append(node)
        return out

    def child(self, node: int, token: int) -> int | None:
        return self._children[node].get(token)

    def children(self, node: int) -> dict[int, int]:
        return self._children[node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        out = []
        while node != -1:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self, device=None) -> Tensor:
        """[N, N] bool: entry (i, j) is True when j is i or an ancestor of i."""
        n = len(self.tokens)
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for i in range(1, n):
            m[i] = m[self.parents[i]]
            m[i, i] = True
        return m.to(device) if device is not None else m

    def leaves(self) -> list[int]:
        return [i for i in range(len(self.tokens)) if not self._children[i]]
