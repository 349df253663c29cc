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
from specdraft.drafters.calibration import with_scores
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
        self._logits: Tensor | None = None  # [K, depth, V'] of the current state, computed on demand
        self._logp: Tensor | None = None  # their log-softmax, when asked for
        self._prior: Tensor | None = None  # [K] log pi_k of the current state, with _logits

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
        self._logits = self._logp = None

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def block_logp(self, depth: int | None = None) -> Tensor:
        """Log-probabilities [K, depth, V'] over the draft vocabulary of the next block's first
        ``depth`` positions (default all D; all K modes in one pass over the shared context).  A
        tree of budget b never goes deeper than b, so propose scores only min(D, b) rows."""
        depth = self._score(depth)
        if self._logp is None:
            self._logp = torch.log_softmax(self._logits, -1)
        return self._logp[:, :depth]

    def _score(self, depth: int | None) -> int:
        """Make sure the logits of the next block's first ``depth`` positions (default D) and the mode prior
        are here; returns that depth (capped at D)."""
        depth = self.cfg.depth if depth is None else max(1, min(depth, self.cfg.depth))
        if self._logits is None or self._logits.shape[1] < depth:
            h = self._block_states(depth) if self.model.fast else self._block_states_module()
            self._logits = self.model.logits(h[:, 1 : depth + 1]).float()  # [K, depth, V']
            self._prior = self.model.mode_logp(h[:, 0])
            self._logp = None
        return depth

    def _block_states_module(self) -> Tensor:
        """The block's final states [K, B, W] (row 0 = the root, rows 1 .. B-1 draft positions 1 .. D),
        through the network's modules."""
        m, cfg, n = self.model, self.cfg, self.n
        dev = m.head_w.device
        x = m.block_inputs(torch.tensor([self.root], device=dev))  # [1, K, B, W]
        pos = (n + torch.arange(cfg.block_size, device=dev)).repeat(cfg.modes)[None]  # [1, K*B]
        h = m.run_blocks(x.flatten(1, 2), pos, modes_mask(cfg.modes, cfg.block_size, n, dev), self.cache.past(n))
        return h.view(cfg.modes, cfg.block_size, -1)

    def _block_states(self, depth: int) -> Tensor:
        """The block's first depth+1 final states of each mode [K, depth+1, W], each layer one call of the
        fast kernel.  The rows go in mode by mode with the ones read first (rows 0 .. depth), the rest after:
        the last layer computes only what the tree reads; the others give the keys and values the block's
        bidirectional attention needs.  The block rows' K/V land in the cache past the committed slots."""
        m, cfg, n = self.model, self.cfg, self.n
        k, b = cfg.modes, cfg.block_size
        order = [i * b + j for i in range(k) for j in range(depth + 1)] + \
                [i * b + j for i in range(k) for j in range(depth + 1, b)]  # kept rows first
        idx = torch.tensor(order)
        x = m.block_inputs(torch.tensor([self.root])).flatten(1, 2)[:, idx].float().contiguous()  # [1, K*B, W]
        rot = m.rot_rows((n + idx % b)[None])  # [1, K*B, D/2, 2]
        mask = modes_mask(k, b, n)
        if mask is not None:  # [1, K*B, n+K*B], queries and block keys in the new order
            mask = mask[0, :, idx][:, :, torch.cat([torch.arange(n), n + idx])].contiguous()
        self.cache.reserve(n + k * b, n, m.head_w)
        last = len(m.layers) - 1
        for i, layer in enumerate(m.layers):
            x = layer.fast_forward(x, rot, mask, self.cache.kv[i], n, k * (depth + 1) if i == last else -1)
        return m.norm(x.view(k, depth + 1, -1))

    def mode_prior(self) -> Tensor:
        """log pi_k [K] of the next block: the gate's (uniform for an ungated drafter)."""
        self._score(None if self._logits is None else self._logits.shape[1])
        return self._prior

    def marginals(self, k: int, depth: int | None = None) -> tuple[Tensor, Tensor]:
        """Per mode and depth the top-k draft tokens (target ids) and their log-probabilities, sorted
        descending: (tokens LongTensor [K, depth, k], logp FloatTensor [K, depth, k]; depth default D)."""
        depth = self._score(depth)
        return self.model.top_of_logits(self._logits[:, :depth], k)  # on the fast kernel: no V'-wide log-softmax

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        k = min(self.opts.topk, budget)
        depth = min(self.cfg.depth, budget)  # no path of a budget-b tree is longer than b
        self._score(depth)
        prior = self.mode_prior()  # [K]
        if self.tree == "linear":
            tokens, logp = self.marginals(1, depth)  # [K, depth, 1]
            best = int((prior + logp[:, :, 0].sum(1)).argmax())  # the mode whose chain is most likely
            chain = tokens[best, :, 0].tolist()
            tree = Tree(tokens=[self.root] + chain, parents=list(range(-1, depth)))
            return with_scores(tree, [0.0] + logp[best, :, 0].cumsum(0).tolist(), self.calibration, log=True)
        if self.tree == "mixture":
            tokens, logp = self.marginals(k, depth)
            ranked = mixture_tree(self.root, tokens, logp, budget, prior=prior if self.cfg.gate else None)
        elif self.cfg.modes == 1:  # the product tree over the one mode's marginals
            tokens, logp = self.marginals(k, depth)
            ranked = ddtree(self.root, tokens[0], logp[0], budget)
        else:
            lp = self.block_logp(depth)  # [K, depth, V']: the product tree over the modes' mixture sum_k pi_k q_k
            avg = torch.logsumexp(lp + prior[:, None, None], 0)  # [D, V']
            top = avg.topk(min(k, avg.shape[-1]), -1)
            ranked = ddtree(self.root, self.model.vocab_ids[top.indices], top.values, budget)
        return with_scores(ranked.tree, ranked.scores, self.calibration, log=True)


# ---------------------------------------------------------------------------- loading


def load_block(target, ckpt: DraftCheckpoint, options: BlockOptions, name: str | None) -> BlockDrafter:
    """The registry's builder: the checkpoint's network on the fast kernel or in bfloat16 (``prepare_network``)."""
    return BlockDrafter(prepare_network(ckpt.model, target, options, ckpt.manifest), options, name=name, manifest=ckpt.manifest)
