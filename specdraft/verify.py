"""Verification: walk the draft tree with the target's own choices.

Greedy: from the root, move to the child whose token is the target's argmax at the current
node; when there is none, the argmax is the *bonus* token.  The committed tokens are exactly
what plain greedy decoding would produce.

Sampling (sample-and-match): at the current node draw x ~ p_target(. | node) (after
temperature / top-k / top-p); move to the child with token x if there is one, else x is the
bonus.  Each committed token is a genuine sample from the target's distribution at its
prefix, so the output distribution equals plain sampling for any tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.tree import Tree


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecdraftError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise SpecdraftError(f"top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise SpecdraftError(f"top-k must be >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Accepted:
    path: list[int]  # accepted node indices, starting with the root (0)
    tokens: list[int]  # the drafted tokens accepted (tokens of path[1:])
    bonus: int  # the target's own next token after the last accepted node

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens + [self.bonus]


CANDIDATES = 256  # top-p without top-k: the most likely tokens looked at first (all of them only if these hold < top-p)


def candidates(logits: Tensor, s: Sampling) -> tuple[Tensor, Tensor]:
    """The tokens the sampling transforms keep for one row of logits [V], most likely first, and their
    probabilities [C] (summing to 1): temperature, then top-k (ties at the k-th value kept), then
    top-p (a token is kept while the mass before it is below top-p).  Only the top-k or a few hundred
    candidates are sorted, never the whole vocabulary."""
    z = logits.float()
    if s.temperature < torch.finfo(torch.float32).tiny:  # not representable: the T -> 0 limit, one-hot
        return z.argmax(-1, keepdim=True), torch.ones(1, device=z.device)
    # subtract the max first: with a tiny temperature the top logit stays 0 and the rest go to
    # -inf (a one-hot distribution) instead of inf - inf = NaN
    z = (z - z.amax()) / s.temperature
    v = z.shape[-1]
    if 0 < s.top_k < v:
        vals, ids = torch.topk(z, s.top_k)  # sorted, most likely first
        tied = z >= vals[-1]
        if int(tied.sum()) > s.top_k:  # ties at the k-th value: all of them are kept
            ids = tied.nonzero().flatten()
            vals, order = torch.sort(z[ids], descending=True, stable=True)
            ids = ids[order]
        p = torch.softmax(vals, -1)
    elif s.top_p < 1.0:
        full = torch.softmax(z, -1)
        c = min(v, CANDIDATES)
        p, ids = torch.topk(full, c)
        while c < v and float(p.sum()) < s.top_p:  # the nucleus reaches past the candidates: look at more
            c = min(v, 8 * c)
            p, ids = torch.topk(full, c)
    else:
        ids, p = torch.arange(v, device=z.device), torch.softmax(z, -1)
    if s.top_p < 1.0:
        keep = (p.cumsum(-1) - p) < s.top_p  # drop a token when the mass strictly before it reaches top-p
        keep[0] = True  # nothing comes before the first (a top-p below float32's range would compare 0 < 0)
        p, ids = p[keep], ids[keep]
    return ids, p / p.sum()


def target_probs(logits: Tensor, s: Sampling) -> Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (``candidates`` of every row)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.zeros(flat.shape, dtype=torch.float32, device=logits.device)
    for row, lg in zip(out, flat):
        ids, p = candidates(lg, s)
        row[ids] = p
    return out.view(logits.shape)


def sample(logits: Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    """One token drawn from the target's distribution for one row of logits [V]: inverse CDF over
    the kept candidates with one uniform draw (cheaper than ``torch.multinomial`` over the vocabulary)."""
    ids, p = candidates(logits, s)
    cdf = p.cumsum(-1)
    u = torch.rand((), generator=generator, device=cdf.device) * cdf[-1]
    i = min(int(torch.searchsorted(cdf, u, right=True)), len(ids) - 1)
    return int(ids[i])


def argmax_rows(logits: Tensor) -> list[int]:
    """The argmax of each row of ``logits`` [N, V] (the first index of the maximum, as torch's).  On
    the CPU in fp32 numpy's SIMD argmax does it (torch's scans a 49k vocabulary several times slower)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().contiguous().numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def verify_greedy(tree: Tree, logits: Tensor) -> Accepted:
    """logits: [N, V] target logits at each tree node."""
    choice = argmax_rows(logits)
    node, path = 0, [0]
    while True:
        nxt = tree.child(node, choice[node])
        if nxt is None:
            break
        node = nxt
        path.append(node)
    return Accepted(path=path, tokens=[tree.tokens[i] for i in path[1:]], bonus=choice[node])


def verify_sample(tree: Tree, logits: Tensor, s: Sampling, generator: torch.Generator | None) -> Accepted:
    node, path = 0, [0]
    while True:
        x = sample(logits[node], s, generator)  # only at the nodes the walk visits
        nxt = tree.child(node, x)
        if nxt is None:
            return Accepted(path=path, tokens=[tree.tokens[i] for i in path[1:]], bonus=x)
        node = nxt
        path.append(node)


def verify(tree: Tree, logits: Tensor, s: Sampling, generator: torch.Generator | None = None) -> Accepted:
    if s.greedy:
        return verify_greedy(tree, logits)
    return verify_sample(tree, logits, s, generator)
