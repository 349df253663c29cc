"""Phrase drafter: an MLP head predicts one- to three-word phrases from a separate draft vocabulary.

At each step the head reads the target's final hidden state at the last accepted node (the state
that chose the root) and the root token's embedding, scores every entry, and the expansions of the
top entries are trie-merged into one prefix tree; the ``ngram`` drafter's candidates can share
the same tree (the phrase unit is orthogonal to tree width and depth).  Training:
``specdraft.train.phrase``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specdraft.drafters.calibration import Calibration, calibration_for
from specdraft.drafters.ngram import NgramDrafter
from specdraft.errors import SpecdraftError
from specdraft.model.fast import quantize_linears
from specdraft.model.llama import BlockTable, ForwardOutput
from specdraft.model.quant import kernel_available
from specdraft.nn.checkpoint import DraftCheckpoint
from specdraft.nn.phrase import FEATURE_LAYER, PhraseHead, PhraseVocab
from specdraft.tree import Tree
from specdraft.verify import Accepted


@dataclass
class PhraseOptions:
    """``phrase@key=value,...``."""

    top_n: int = 16  # entries expanded per step (the budget cuts the tree; more fill it when entries share prefixes)
    ngram: bool = True  # also merge the prompt-lookup candidates into the tree
    ngram_first: bool = False  # order: phrase top-1 first (False) or ngram top-1 first

    def __post_init__(self) -> None:
        if self.top_n < 1:
            raise SpecdraftError(f"option top_n must be >= 1 (got {self.top_n})")

    @property
    def profiled(self) -> bool:
        """Whether the checkpoint's budget profile (replayed with prompt lookup) describes this configuration."""
        return self.ngram


class PhraseDrafter:
    name = "phrase"
    hidden_layers: tuple[int, ...] = (FEATURE_LAYER,)
    default_budget = 6  # drafted nodes per tree without a cost curve (the registry sets the machine's)

    def __init__(self, head: PhraseHead, vocab: PhraseVocab, embed, options: PhraseOptions | None = None,
                 manifest: dict | None = None, calibration: Calibration | None = None, fast: bool = False) -> None:
        self.cfg = options or PhraseOptions()
        self.head = head.eval()
        self.vocab = vocab
        self.embed = embed  # the target's (frozen) token embeddings: a tensor [V, H] or a BlockTable (rows on lookup)
        self.manifest = manifest or {}
        self.ngram = NgramDrafter() if self.cfg.ngram else None
        self.h: torch.Tensor | None = None
        self.root = -1
        self.calibration = calibration  # raw node score -> probability of acceptance; None: trees carry no probs
        self.fast = fast  # the head's matmuls on the fast kernel: the whole head and its top-k one call there
        self._mlp = mlp_args(head) if fast else None  # (weights, meta, biases) of its layers, as fast_mlp_topk takes them

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

    def fork(self) -> "PhraseDrafter":
        """The same head, vocabulary and options, a fresh sequence state."""
        new = copy.copy(self)
        new.ngram = self.ngram.fork() if self.ngram is not None else None
        new.h, new.root = None, -1
        return new

    @torch.inference_mode()
    def phrase_candidates(self, n: int) -> tuple[list[list[int]], list[float]]:
        """The ``n`` most likely entries' expansions and their probabilities under the head."""
        if self.fast:  # the head's three layers and its top-k in one kernel call, no entries-wide softmax
            x = self.h.float()[None]
            if self.head.cfg.use_root_embedding:
                x = torch.cat([x, self.embed[self.root].float()[None]], -1)
            w, meta, bias = self._mlp
            lp, idx = torch.ops.specdraft_quant.fast_mlp_topk(x, w, meta, bias, min(n, self.head.cfg.vocab_size))
            return [self.vocab.expansions[i] for i in idx[0].tolist()], lp[0].exp().tolist()
        logits = self.head(self.h.float()[None], self.embed[self.root].float()[None]).float()  # [1, entries]
        top = torch.softmax(logits[0], -1).topk(min(n, logits.shape[-1]))
        return [self.vocab.expansions[i] for i in top.indices.tolist()], top.values.tolist()

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        phrases, q = self.phrase_candidates(self.cfg.top_n)
        scored = self.ngram.scored() if self.ngram is not None else []
        grams = [c for c, _ in scored]
        a, b = (grams, phrases) if self.cfg.ngram_first else (phrases, grams)
        paths = [p for pair in zip(a, b) for p in pair] + a[len(b):] + b[len(a):]
        tree = Tree.from_paths(self.root, paths, budget=budget)
        if self.calibration is None or len(tree) == 1:
            return tree
        return tree.with_probs(self.node_probs(tree, phrases, q, scored))

    def raw_scores(self, tree: Tree, phrases: list[list[int]], q: list[float], scored) -> list[float]:
        """Each node's raw score: the head's probability mass of the entries whose expansion passes through
        it (the entries are exclusive labels), joined with the lookup's measured acceptance as independent
        chances: 1 - (1 - mass)(1 - lookup)."""
        mass = [0.0] * len(tree)
        for exp, p in zip(phrases, q):
            for node in tree.walk(exp):
                mass[node] += p
        look = self.ngram.node_probs(tree, scored) if scored else [0.0] * len(tree)
        return [1.0] + [1.0 - (1.0 - min(m, 1.0)) * (1.0 - g) for m, g in zip(mass[1:], look[1:])]

    def node_probs(self, tree: Tree, phrases, q, scored) -> list[float]:
        return [self.calibration(r) for r in self.raw_scores(tree, phrases, q, scored)]


def mlp_args(head: PhraseHead) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """The head's layers (``QuantLinear`` after ``quantize_linears``) as ``fast_mlp_topk`` takes them: each
    layer's weight tensors and (kind, rows), and its bias in fp32 (SiLU between them, as ``PhraseHead.forward``)."""
    w, meta, bias = [], [], []
    for lin in (head.inp, head.mid, head.out):
        tensors, m = lin.mm.args()
        w += tensors
        meta += m
        bias.append(torch.empty(0) if lin.bias is None else lin.bias.detach().float().contiguous())
    return w, meta, bias


def load_phrase(target, ckpt: DraftCheckpoint, options: PhraseOptions, name: str | None) -> PhraseDrafter:
    """The registry's builder: the head reads the target's (frozen) token embeddings; with a target in
    the fast precision mode its matmuls run on the fast kernel too (Q8_0 weights; lossless either way,
    the target verifies)."""
    model = ckpt.model
    fast = target.precision == "fast" and kernel_available()
    if fast:
        quantize_linears(model)
    embed = target.model.embed
    rows = embed if isinstance(embed, BlockTable) else embed.weight.detach()  # a row at a time: no fp32 table
    cal = calibration_for("phrase", target) if name else Calibration()  # a checkpoint path: its raw probabilities
    return PhraseDrafter(model, ckpt.vocab, rows, options, ckpt.manifest, cal, fast)
