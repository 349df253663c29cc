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
    _children: list[dict[int, int]] = field(default_factory=list, repr=False)  # token -> child index

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a tree needs as many parents as tokens, and at least the root")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
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
