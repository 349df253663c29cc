"""Phrase drafter: an MLP head predicts one- to three-word phrases from a separate draft vocabulary.

At each step the head reads the target's final hidden state at the last accepted node (the state
that chose the root) and the root token's embedding, scores every entry, and the expansions of the
top entries are trie-merged into one prefix tree; the ``ngram`` drafter's candidates can share
the same tree (the phrase unit is orthogonal to tree width and depth).  Training:
``specdraft.train.phrase``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.checkpoint import load_checkpoint
from specdraft.drafters.ngram import NgramConfig, NgramDrafter
from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput
from specdraft.train.phrase import FEATURE_LAYER, PhraseHead, PhraseHeadConfig, PhraseVocab
from specdraft.tree import Tree
from specdraft.verify import Accepted

DEFAULT_WEIGHTS = "phrase_smollm2_135m.safetensors"


def default_weights_path() -> Path:
    return Path(__file__).resolve().parents[1] / "weights" / DEFAULT_WEIGHTS


@dataclass
class PhraseConfig:
    top_n: int = 16  # entries expanded per step (the budget cuts the tree; more fill it when entries share prefixes)
    budget: int = 6  # drafted nodes per tree without a cost curve (best measured on a 2-core CPU)
    with_ngram: bool = True  # also merge the prompt-lookup candidates into the tree
    ngram_first: bool = False  # order: phrase top-1 first (False) or ngram top-1 first


class PhraseDrafter:
    name = "phrase"
    hidden_layers: tuple[int, ...] = (FEATURE_LAYER,)

    def __init__(self, head: PhraseHead, vocab: PhraseVocab, embed: torch.Tensor, config: PhraseConfig | None = None,
                 manifest: dict | None = None) -> None:
        self.cfg = config or PhraseConfig()
        self.default_budget = self.cfg.budget
        self.head = head.eval()
        self.vocab = vocab
        self.embed = embed  # the target's (frozen) token embeddings
        self.manifest = manifest or {}
        self.ngram = NgramDrafter(NgramConfig()) if self.cfg.with_ngram else None
        self.h: torch.Tensor | None = None
        self.root = -1

    @classmethod
    def load(cls, target, path: str | Path | None = None, config: PhraseConfig | None = None) -> "PhraseDrafter":
        path = Path(path) if path is not None else default_weights_path()
        tensors, manifest = load_checkpoint(path, target_hash=target.weight_hash, kind="phrase")
        try:
            hcfg = PhraseHeadConfig(**manifest["head"])
            vocab = PhraseVocab.from_json(manifest["vocab"])
            head = PhraseHead(hcfg)
            head.load_state_dict({k: v.float() for k, v in tensors.items()})
        except (KeyError, TypeError, RuntimeError) as e:
            raise SpecdraftError(f"checkpoint {path} does not hold a valid phrase head ({e})") from None
        if hcfg.hidden_size != target.config.hidden_size or len(vocab) != hcfg.vocab_size:
            raise SpecdraftError(f"checkpoint {path} does not fit the target (hidden size {hcfg.hidden_size})")
        dev = target.device
        return cls(head.to(dev), vocab, target.model.embed.weight.detach(), config, manifest)

    # ------------------------------------------------------------------ drafter protocol
    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.h = prefill.hidden[FEATURE_LAYER][0, -1]
        self.root = first_token
        if self.ngram is not None:
            self.ngram.reset(prompt_ids, first_token, prefill)

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self.h = out.hidden[FEATURE_LAYER][0, accepted.path[-1]]
        self.root = accepted.bonus
        if self.ngram is not None:
            self.ngram.commit(accepted, out)

    @torch.inference_mode()
    def phrase_candidates(self, n: int) -> list[list[int]]:
        logits = self.head(self.h.float()[None], self.embed[self.root].float()[None])[0]
        top = logits.topk(min(n, logits.shape[-1])).indices.tolist()
        return [self.vocab.expansions[k] for k in top]

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        phrases = self.phrase_candidates(self.cfg.top_n)
        grams = self.ngram.candidates() if self.ngram is not None else []
        a, b = (grams, phrases) if self.cfg.ngram_first else (phrases, grams)
        paths = [p for pair in zip(a, b) for p in pair] + a[len(b):] + b[len(a):]
        return Tree.from_paths(self.root, paths, budget=budget)


def load_phrase(target, path: str | Path | None = None, budget: int | None = None, with_ngram: bool = True,
                top_n: int | None = None) -> PhraseDrafter:
    cfg = PhraseConfig(with_ngram=with_ngram)
    if top_n is not None:
        if top_n < 1:
            raise SpecdraftError(f"phrase option top_n must be >= 1 (got {top_n})")
        cfg.top_n = top_n
    p = Path(path) if path is not None else default_weights_path()
    if path is None and not p.is_file():
        raise SpecdraftError(f"the shipped phrase head {p} is missing from this install")
    d = PhraseDrafter.load(target, p, cfg)
    if budget is None and with_ngram:
        # the budget that maximises held-out tokens per pass / pass cost on this machine's curve
        from specdraft.bench.cost import profile_budget

        budget = profile_budget(target, d.manifest, cfg.budget)
    if budget is not None:
        d.cfg.budget = d.default_budget = budget
    return d
