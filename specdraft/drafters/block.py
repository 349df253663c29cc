"""Block drafter (DFlash, "Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036) and
Multi-Future Drafting (MFD, "Mixture Block Drafters for Tree-Verified Speculative Decoding",
arXiv 2611.13017).

Notation: committed tokens x_0 .. x_n, where the root x_n is committed but not yet run through
the target; f_i = the target's hidden states at position i (layers ``feature_layers``,
concatenated), so f_0 .. f_{n-1} are known.

The network (``specdraft.nn.block``): the target's features of committed positions enter every
drafter layer as keys and values only (KV injection), cached here and extended on commit; one
pass over K*B block rows [e(x_n), MASK x (B-1)] + u_k drafts positions n+1 .. n+B-1 for all K
modes.

Trees (``tree`` option), all verified by the same engine:
- ``linear`` (DFlash): the argmax chain, min(B-1, budget) nodes; for K > 1 the chain of the mode
  whose chain has the highest joint log-probability;
- ``ddtree`` (DDTree): the top-budget prefixes under the product of per-position marginals; for
  K > 1 the marginal is the modes' average probability;
- ``mixture`` (MFD): the top-budget prefixes under the best mode's log-probability,
  max_k sum_j log q_k(y_j), prefix-closed and merged (``specdraft.search.mixture_tree``).

Training: ``specdraft.train.block`` (many anchors per sequence in one pass; winner-take-all
over modes for K > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.drafters.base import TrainedDrafter, TrainedOptions, prepare_network
from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput
from specdraft.nn.block import BlockModel, modes_mask
from specdraft.nn.checkpoint import DraftCheckpoint
from specdraft.search import ddtree, mixture_tree
from specdraft.tree import Tree
from specdraft.verify import Accepted

TREES = ("linear", "ddtree", "mixture")


# ---------------------------------------------------------------------------- drafter


@dataclass
class BlockOptions(TrainedOptions):
    """``block@key=value,...`` (also mfd and a block checkpoint path)."""

    tree: str = ""  # linear (DFlash) | ddtree (product) | mixture (MFD best-mode); "" = mixture for K > 1, else ddtree
    topk: int = 16  # candidates per depth (per mode) handed to the tree search, capped by the budget

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree and self.tree not in TREES:
            raise SpecdraftError(f"option tree must be one of {', '.join(TREES)} (got {self.tree!r})")
        if self.topk < 1:
            raise SpecdraftError(f"option topk must be >= 1 (got {self.topk})")


class BlockDrafter(TrainedDrafter):
    """Drafter protocol around a trained ``BlockModel`` (see the module docstring); its cache holds
    the context K/V of every drafter layer."""

    default_budget = 12  # drafted nodes per tree without a cost curve (the registry sets the machine's)

    def __init__(self, model: BlockModel, options: BlockOptions | None = None, name: str | None = None,
                 manifest: dict | None = None) -> None:
        k = model.cfg.modes
        super().__init__(model, options or BlockOptions(), name or ("mfd" if k > 1 else "block"), manifest, model.cfg.layers)
        self.tree = self.opts.tree or ("mixture" if k > 1 else "ddtree")
        self._logp: Tensor | None = None  # [K, D, V'] of the current state, computed on demand
        self._prior: Tensor | None = None  # [K] log pi_k of the current state, with _logp

    # ------------------------------------------------------------------ protocol
    @torch.inference_mode()
    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.start(first_token)
        self._extend(self.target_features(prefill, slice(0, len(prompt_ids)))[None])

    @torch.inference_mode()
    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        # the root and the accepted nodes are now committed at positions n .. n+len(path)-1
        self.root = accepted.bonus
        self._extend(self.target_features(out, accepted.path)[None])

    def _extend(self, feats: Tensor) -> None:
        """Append the context K/V of new committed positions (features [1, T, n_layers * H])."""
        t, n = feats.shape[1], self.n
        self.cache.reserve(n + t, n, self.model.head_w)
        pos = torch.arange(n, n + t, device=feats.device)[None]
        self.cache.write(self.model.context_kv(self.model.context(feats), pos), n)
        self.n = n + t
        self._logp = None

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def block_logp(self, depth: int | None = None) -> Tensor:
        """Log-probabilities [K, depth, V'] over the draft vocabulary of the next block's first
        ``depth`` positions (default all D; all K modes in one pass over the shared context).  A
        tree of budget b never goes deeper than b, so propose scores only min(D, b) rows."""
        depth = self.cfg.depth if depth is None else max(1, min(depth, self.cfg.depth))
        if self._logp is None or self._logp.shape[1] < depth:
            m, cfg, n = self.model, self.cfg, self.n
            dev = m.head_w.device
            x = m.block_inputs(torch.tensor([self.root], device=dev))  # [1, K, B, H]
            pos = (n + torch.arange(cfg.block_size, device=dev)).repeat(cfg.modes)[None]  # [1, K*B]
            ctx = self.cache.past(n)
            h = m.run_blocks(x.flatten(1, 2), pos, modes_mask(cfg.modes, cfg.block_size, n, dev), ctx)
            h = h.view(cfg.modes, cfg.block_size, -1)  # [K, B, H]: row 0 = the root, rows 1 .. B-1 draft positions 1 .. D
            self._logp = torch.log_softmax(m.logits(h[:, 1 : depth + 1]).float(), -1)
            self._prior = m.mode_logp(h[:, 0])
        return self._logp[:, :depth]

    def mode_prior(self) -> Tensor:
        """log pi_k [K] of the next block: the gate's (uniform for an ungated drafter)."""
        if self._logp is None:
            self.block_logp()
        return self._prior

    def marginals(self, k: int, depth: int | None = None) -> tuple[Tensor, Tensor]:
        """Per mode and depth the top-k draft tokens (target ids) and their log-probabilities, sorted
        descending: (tokens LongTensor [K, depth, k], logp FloatTensor [K, depth, k]; depth default D)."""
        top = self.block_logp(depth).topk(min(k, self.model.head_w.shape[0]), -1)
        return self.model.vocab_ids[top.indices], top.values

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        k = min(self.opts.topk, budget)
        depth = min(self.cfg.depth, budget)  # no path of a budget-b tree is longer than b
        self.block_logp(depth)
        prior = self.mode_prior()  # [K]
        if self.tree == "linear":
            tokens, logp = self.marginals(1, depth)  # [K, depth, 1]
            best = int((prior + logp[:, :, 0].sum(1)).argmax())  # the mode whose chain is most likely
            chain = tokens[best, :, 0].tolist()
            return Tree(tokens=[self.root] + chain, parents=list(range(-1, depth)))
        if self.tree == "mixture":
            tokens, logp = self.marginals(k, depth)
            return mixture_tree(self.root, tokens, logp, budget, prior=prior if self.cfg.gate else None).tree
        lp = self.block_logp(depth)  # [K, depth, V']: the product tree over the modes' mixture sum_k pi_k q_k
        avg = lp[0] if lp.shape[0] == 1 else torch.logsumexp(lp + prior[:, None, None], 0)  # [D, V']
        top = avg.topk(min(k, avg.shape[-1]), -1)
        return ddtree(self.root, self.model.vocab_ids[top.indices], top.values, budget).tree


# ---------------------------------------------------------------------------- loading


def load_block(target, ckpt: DraftCheckpoint, options: BlockOptions, name: str | None) -> BlockDrafter:
    """The registry's builder: the checkpoint's network on the fast kernel or in bfloat16 (``prepare_network``)."""
    return BlockDrafter(prepare_network(ckpt.model, target, options), options, name=name, manifest=ckpt.manifest)
