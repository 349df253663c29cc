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


def target_probs(logits: Tensor, s: Sampling) -> Tensor:
    """Probabilities after temperature, top-k and top-p; logits [..., V]."""
    logits = logits.float()
    if s.temperature < torch.finfo(torch.float32).tiny:  # not representable: the T -> 0 limit, one-hot
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # subtract the max first: with a tiny temperature the top logit stays 0 and the rest go to
    # -inf (a one-hot distribution) instead of inf - inf = NaN
    logits = (logits - logits.amax(-1, keepdim=True)) / s.temperature
    if s.top_k > 0 and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (sorted_p.cumsum(-1) - sorted_p) >= s.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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
        probs = target_probs(logits[node], s)
        x = int(torch.multinomial(probs, 1, generator=generator).item())
        nxt = tree.child(node, x)
        if nxt is None:
            return Accepted(path=path, tokens=[tree.tokens[i] for i in path[1:]], bonus=x)
        node = nxt
        path.append(node)


def verify(tree: Tree, logits: Tensor, s: Sampling, generator: torch.Generator | None = None) -> Accepted:
    if s.greedy:
        return verify_greedy(tree, logits)
    return verify_sample(tree, logits, s, generator)
