"""Tree searches over per-position draft distributions: DDTree and the MFD mixture tree.

A block drafter (DFlash) scores every draft position of the next block in one pass, giving
per-depth marginals q_i(.) rather than a distribution per path.

* **DDTree** (product-ranked draft tree): score a prefix p = (p_1 .. p_d) by the product of the
  marginals, log-score s(p) = sum_i log q_i(p_i), and keep the top-B prefixes.  Best-first
  search with one heap: candidates at each depth are sorted, so popping the node (depth i,
  rank r, parent u) pushes its next sibling (i, r+1, u) and its first child (i+1, rank 0, the
  popped node).  Every prefix's two successors score no higher than it (log q <= 0), so the
  pops come in non-increasing score order and the first B pops are exactly the top-B prefixes;
  a child is pushed only once its parent is in the tree, so the result is prefix-closed.

* **Mixture tree** (Multi-Future Drafting, MFD, arXiv 2611.13017): K modes each give their own marginals q_k.
  A prefix scores by its best mode, s(p) = max_k sum_i log q_k(p_i) (-inf under mode k when
  some p_i is outside mode k's candidates), so a path stays inside one coherent future instead
  of mixing tokens from different futures ("chimeras").  The K per-mode DDTree streams share one
  heap; their pops are still in non-increasing score order, so the first pop of a prefix (a
  token sequence; several modes may propose it) carries its best-mode score and later pops of
  the same prefix are dropped from the tree (their successors are still expanded within their
  mode, which may rank them higher than any other mode does).  The first B distinct prefixes
  are exactly the top-B under the best-mode score.

Both run every decoding step on a few small lists (B <= 64, D <= 16, k <= 16): pure Python and
``heapq``, tensors converted to lists once.  Ties break deterministically: shallower first, then
(mixture) lower mode index, then push order.  ``mixture_marginals`` turns K modes into one set
of per-depth marginals (the modes' average) for a product-ranked tree over a K > 1 drafter.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.tree import Tree


@dataclass
class Ranked:
    tree: Tree  # root + at most `budget` drafted nodes, prefix-closed, no duplicate prefixes
    scores: list[float]  # [N] log-score of each node's prefix, tree order; scores[0] = 0.0 (root)


def _candidates(tokens: list[list[int]], logp: list[list[float]]) -> list[list[tuple[float, int]]]:
    """Per depth: (log q, token) sorted by log q descending (stable), -inf/NaN dropped, a token
    that repeats within a depth kept once at its best log q."""
    out = []
    for toks, lps in zip(tokens, logp):
        seen: set[int] = set()
        row = []
        for lp, t in sorted(zip(lps, toks), key=lambda x: -x[0] if not math.isnan(x[0]) else math.inf):
            if math.isfinite(lp) and t not in seen:
                seen.add(t)
                row.append((float(lp), int(t)))
        out.append(row)
    return out


def ddtree(root: int, tokens: Tensor, logp: Tensor, budget: int) -> Ranked:
    """Top-``budget`` prefixes under the product of per-position marginals (see module docstring).

    tokens, logp: [D, k] per-depth candidates (token ids, log-probabilities; logp sorted
    descending along k; -inf entries are skipped).  Node order = pop order (best first), which
    is topological.
    """
    cands = _candidates(tokens.tolist(), logp.tolist())  # [D][<=k] (logp, token)
    out_tokens, parents, scores = [root], [-1], [0.0]
    heap: list[tuple[float, int, int, int, int, float]] = []  # (-score, depth, push no., rank, parent node, parent score)
    pushes = 0

    def push(depth: int, rank: int, parent: int, parent_score: float) -> None:
        nonlocal pushes
        if depth < len(cands) and rank < len(cands[depth]):
            heapq.heappush(heap, (-(parent_score + cands[depth][rank][0]), depth, pushes, rank, parent, parent_score))
            pushes += 1

    push(0, 0, 0, 0.0)
    while heap and len(out_tokens) - 1 < budget:
        neg, depth, _, rank, parent, parent_score = heapq.heappop(heap)
        out_tokens.append(cands[depth][rank][1])
        parents.append(parent)
        scores.append(-neg)
        push(depth, rank + 1, parent, parent_score)  # next sibling: same parent, next rank
        push(depth + 1, 0, len(out_tokens) - 1, -neg)  # first child of the new node
    return Ranked(tree=Tree(tokens=out_tokens, parents=parents), scores=scores)


def mixture_tree(root: int, tokens: Tensor, logp: Tensor, budget: int, prior: Tensor | None = None) -> Ranked:
    """Top-``budget`` prefixes under the best mode's log-score (see module docstring).

    tokens, logp: [K, D, k], one set of per-depth candidates per mode (logp sorted descending
    along k; -inf entries skipped).  ``prior`` [K] (optional, log pi_k <= 0, a mode gate) adds
    to mode k's score: s(p) = max_k [log pi_k + sum_i log q_k(p_i)].  Prefix-closed, no
    duplicate prefixes, best first.
    """
    modes = [_candidates(t, lp) for t, lp in zip(tokens.tolist(), logp.tolist())]  # [K][D][<=k]
    base = [0.0] * len(modes) if prior is None else [float(x) for x in prior.tolist()]
    if len(base) != len(modes) or any(not x <= 0.0 for x in base):
        raise ValueError(f"prior must hold {len(modes)} log-probabilities <= 0 (got {base})")
    out_tokens, parents, scores = [root], [-1], [0.0]
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> tree node: one node per prefix
    heap: list[tuple[float, int, int, int, int, int, float]] = []
    # (-score, depth, mode, push no., rank, parent node, parent score)
    pushes = 0

    def push(mode: int, depth: int, rank: int, parent: int, parent_score: float) -> None:
        nonlocal pushes
        c = modes[mode]
        if depth < len(c) and rank < len(c[depth]):
            heapq.heappush(heap, (-(parent_score + c[depth][rank][0]), depth, mode, pushes, rank, parent, parent_score))
            pushes += 1

    for m in range(len(modes)):
        push(m, 0, 0, 0, base[m])
    while heap and len(out_tokens) - 1 < budget:
        neg, depth, m, _, rank, parent, parent_score = heapq.heappop(heap)
        tok = modes[m][depth][rank][1]
        node = node_of.get((parent, tok))
        if node is None:  # first pop of this prefix: its best-mode score
            node = len(out_tokens)
            node_of[(parent, tok)] = node
            out_tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
        push(m, depth, rank + 1, parent, parent_score)
        push(m, depth + 1, 0, node, -neg)  # mode m's own score of the prefix, not the node's best
    return Ranked(tree=Tree(tokens=out_tokens, parents=parents), scores=scores)


def mixture_marginals(tokens: Tensor, logp: Tensor, k: int | None = None,
                      prior: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One set of per-depth marginals from K modes: q(t) = sum_k pi_k q_k(t) over the union of
    the modes' candidates (a mode gives 0 to a token outside its own top-k); pi = exp(``prior``)
    [K] of a mode gate, or 1/K.

    tokens, logp: [K, D, k] -> tokens, logp: [D, k'] sorted descending, k' = ``k`` or the widest
    union (padded with -inf and token -1 where a depth has fewer candidates).
    """
    n_modes, depth, _ = tokens.shape
    modes = [_candidates(t, lp) for t, lp in zip(tokens.tolist(), logp.tolist())]  # [K][D][<=k]
    pi = [1.0 / n_modes] * n_modes if prior is None else [math.exp(float(x)) for x in prior.tolist()]
    per_depth: list[list[tuple[float, int]]] = []
    for i in range(depth):
        mass: dict[int, float] = {}
        for m in range(n_modes):
            for lp, t in modes[m][i]:
                mass[t] = mass.get(t, 0.0) + math.exp(lp) * pi[m]
        per_depth.append(sorted(((math.log(p), t) for t, p in mass.items() if p > 0), key=lambda x: -x[0]))
    width = k if k is not None else max((len(r) for r in per_depth), default=0)
    out_t = torch.full((depth, width), -1, dtype=torch.long)
    out_lp = torch.full((depth, width), -math.inf)
    for i, row in enumerate(per_depth):
        row = row[:width]
        if row:
            out_lp[i, : len(row)] = torch.tensor([lp for lp, _ in row])
            out_t[i, : len(row)] = torch.tensor([t for _, t in row])
    return out_t, out_lp
