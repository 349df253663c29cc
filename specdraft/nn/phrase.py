"""The phrase drafter's network: an MLP head scoring entries of a phrase vocabulary.

A phrase vocabulary entry is a span of one to three words of the target's own responses, stored with
its expansion into target tokens (``PhraseVocab``).  The head reads the target's final hidden state
at the last accepted node (``FEATURE_LAYER``) and the root token's frozen embedding, and scores every
entry with one 257-parameter row (256-wide bottleneck + bias).  Mining and training:
``specdraft.train.phrase``; drafting: ``specdraft.drafters.phrase``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

FEATURE_LAYER = -1  # the target feature the head reads: the final (normed) hidden state


@dataclass
class PhraseVocab:
    texts: list[str]  # byte-level text of each entry (decode with the tokenizer for display)
    expansions: list[list[int]]  # target token ids of each entry
    counts: list[int]  # occurrences in the mined responses
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.expansions)

    def to_json(self) -> dict:
        return {"texts": self.texts, "expansions": self.expansions, "counts": self.counts, "stats": self.stats}

    @classmethod
    def from_json(cls, d: dict) -> "PhraseVocab":
        return cls(d["texts"], [list(e) for e in d["expansions"]], d["counts"], d.get("stats", {}))

    def trie(self) -> dict:
        """token -> {..., -1: entry index}: for longest-match labelling."""
        root: dict = {}
        for k, exp in enumerate(self.expansions):
            node = root
            for t in exp:
                node = node.setdefault(t, {})
            node[-1] = k
        return root


@dataclass
class PhraseHeadConfig:
    hidden_size: int  # target hidden size
    vocab_size: int  # draft entries
    bottleneck: int = 256  # width of the two hidden layers
    use_root_embedding: bool = True  # read the root token's (frozen target) embedding beside h


class PhraseHead(nn.Module):
    """[h ; e(root)] -> 256 -> SiLU -> 256 -> SiLU -> one 257-parameter row per entry."""

    def __init__(self, cfg: PhraseHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d_in = cfg.hidden_size * (2 if cfg.use_root_embedding else 1)
        self.inp = nn.Linear(d_in, cfg.bottleneck)
        self.mid = nn.Linear(cfg.bottleneck, cfg.bottleneck)
        self.out = nn.Linear(cfg.bottleneck, cfg.vocab_size)

    def forward(self, h: Tensor, e: Tensor | None = None) -> Tensor:
        x = torch.cat([h, e], -1) if self.cfg.use_root_embedding else h
        x = nn.functional.silu(self.inp(x))
        x = nn.functional.silu(self.mid(x))
        return self.out(x)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
