"""The block drafter's network: DFlash (arXiv 2602.06036) and its multi-mode form, Multi-Future
Drafting (MFD, arXiv 2611.13017).

The root x_n is the last committed token, not yet run through the target; f_i, the concatenated
target hidden states of layers ``feature_layers`` at position i, is known for i < n.

Context.  c_i = RMSNorm(W_fuse f_i) [W] (W = H but in a narrow drafter).  In every drafter layer l the context enters as keys and
values only ("KV injection"): K_i = RoPE(W_k^l c_i, i), V_i = W_v^l c_i, with the layer's own K/V
projection.  They depend on committed positions only, so the drafter caches them and extends the
cache on commit with the features of the newly accepted tokens.

Block.  Input rows at positions n .. n+B-1: [e(x_n), m, .., m] + u_k, with e the target's frozen
embedding (through a learned projection H -> W in a narrow drafter), m a learned MASK embedding and
u_k the learned embedding of mode k (K modes; K = 1 is the single-mode DFlash drafter, whose one u
acts as a bias).  Each decoder layer (the target's layer shape, at width W) takes queries from the block rows only; keys/values are [context ; block], bidirectional inside
the block, the context strictly before the anchor n.  Row j (1 <= j <= B-1) scores x_{n+j} through
a final RMSNorm and the frozen target LM head restricted to a draft vocabulary (the training
responses' most frequent tokens; only their ids are stored).  All K blocks share the context and
run in one pass (K*B query rows, a block-diagonal mask between the modes).

Width.  With ``width`` W < H (a cheaper pass on a CPU) the context, the block rows and the layers are W
wide (the target's layer shape at width W, ``TargetShape.narrow``) and the scores go through a learned
lift W -> H into the frozen LM-head rows (``DraftModel``), folded into them for inference.

DFlash's exact shape (``BlockConfig.dflash``, exportable with ``specdraft export --format dflash``):
q/k RMSNorm per head before RoPE (on the context keys too), m = e(mask_token), the target's own
embedding of a fixed token, and no u (K = 1).

How the drafter runs it and the trees it builds: ``specdraft.drafters.block``; training:
``specdraft.train.block``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.model.fast import FastWeight
from specdraft.model.llama import RMSNorm, apply_rope
from specdraft.model.packed import PackedWeight
from specdraft.nn.layers import DraftLayer, DraftModel, TargetShape


@dataclass
class BlockConfig(TargetShape):
    """A block drafter's shape: the target-shaped part (``TargetShape``) and its own."""

    layers: int = 1  # drafter decoder layers
    block_size: int = 8  # B: the root plus B-1 drafted positions
    feature_layers: tuple[int, ...] = (3, 15, 27)  # target layers fused into the context (-1 = final)
    modes: int = 1  # K: mode embeddings, blocks drafted per pass (1 = single-mode DFlash)
    draft_vocab: int = 8192  # LM-head rows drafted from (the most frequent tokens; 0 = all)
    gate: bool = False  # K > 1: a mode gate pi_k(context) scored from each mode's root row
    qk_norm: bool = False  # an RMSNorm over each query / key head before RoPE (Qwen3's layers, DFlash's)
    mask_token: int = -1  # >= 0: the mask rows are the target's frozen embedding of this token and
    #                       there is no mode embedding (DFlash); -1: a learned MASK plus mode embeddings
    width: int = 0  # W: the network's own hidden size (0 = the target's H; narrower = a cheaper drafting pass)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        self.gate = bool(self.gate) and self.modes > 1
        self.qk_norm, self.mask_token = bool(self.qk_norm), int(self.mask_token)
        if self.layers < 1 or self.block_size < 2 or self.modes < 1 or not self.feature_layers:
            raise SpecdraftError(f"a block drafter needs >= 1 layer, block size >= 2, >= 1 mode and a feature "
                                 f"layer (got {self.layers}, {self.block_size}, {self.modes}, {self.feature_layers})")
        if self.mask_token >= self.vocab_size or (self.mask_token >= 0 and self.modes != 1):
            raise SpecdraftError(f"mask_token must be a target token id (< {self.vocab_size}) and needs a single "
                                 f"mode (got mask_token={self.mask_token}, modes={self.modes})")
        self.check_width(self.width)
        if self.width not in (0, self.hidden_size) and (self.qk_norm or self.mask_token >= 0):
            raise SpecdraftError("DFlash's shape (q/k norm, the target's mask token) is the target's width: "
                                 f"a narrower width ({self.width}) cannot be exported to it")

    @property
    def dflash(self) -> bool:
        """In DFlash's exact shape (q/k norm, the target's mask token, one mode): exportable to it."""
        return self.qk_norm and self.mask_token >= 0 and self.modes == 1

    @property
    def depth(self) -> int:
        """D: drafted positions per block."""
        return self.block_size - 1


class BlockModel(DraftModel):
    """The trainable block drafter (frozen embeddings and LM-head rows: ``DraftModel``)."""

    def __init__(self, cfg: BlockConfig, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor) -> None:
        super().__init__(cfg, embed, lm_head, vocab_ids)
        h, w = cfg.hidden_size, self.layer_cfg.hidden_size  # the target's width, the network's
        self.fuse = nn.Linear(len(cfg.feature_layers) * h, w, bias=False)
        self.ctx_norm = RMSNorm(w, cfg.rms_eps)
        self.inp = nn.Linear(h, w, bias=False) if w != h else None  # e(root) into the network's width
        self.layers = nn.ModuleList(DraftLayer(self.layer_cfg, qk_norm=cfg.qk_norm) for _ in range(cfg.layers))
        self.norm = RMSNorm(w, cfg.rms_eps)
        if cfg.mask_token < 0:
            std = float(embed.float().std())  # new embeddings on the scale of the target's
            self.mask_emb = nn.Parameter(torch.randn(w) * std)
            self.mode_emb = nn.Parameter(torch.randn(cfg.modes, w) * std)  # [K, W]
        if cfg.gate:
            self.gate = nn.Linear(w, 1, bias=False)  # score of mode k = w . (final state of mode k's root row)
        self._kv: list | None = None  # per layer the K/V rows of wqkv as a PackedWeight or FastWeight (prepack)

    def prepack(self, int8: bool = False, fused: bool = True, kind: str = "Q8_0") -> bool:
        """``DraftModel.prepack``, plus the K/V rows of every layer's wqkv (the context's KV injection)."""
        if not super().prepack(int8, fused, kind):
            return False
        q_rows = self.layer_cfg.num_heads * self.layer_cfg.head_dim
        make = (lambda w: FastWeight.from_dense(w, kind)) if int8 else PackedWeight
        self._kv = [make(layer.wqkv.weight[q_rows:]) for layer in self.layers]
        return True

    def context(self, feats: Tensor) -> Tensor:
        """[B, T, n_layers * H] target features -> c [B, T, W]."""
        return self.ctx_norm(self.fuse(feats))

    def context_kv(self, c: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per drafter layer the context's keys (RoPE at ``positions`` [B, T]) and values, each
        [B, Hkv, T, D], through the layer's own K/V projection (KV injection)."""
        cfg = self.layer_cfg
        rot = self.rotation(positions)
        q_rows = cfg.num_heads * cfg.head_dim
        out = []
        for i, layer in enumerate(self.layers):
            kv = c @ layer.wqkv.weight[q_rows:].T if self._kv is None else self._kv[i](c)
            kv = kv.unflatten(-1, (2 * cfg.num_kv_heads, cfg.head_dim))  # [B, T, 2 Hkv, D]
            k, v = kv[:, :, : cfg.num_kv_heads], kv[:, :, cfg.num_kv_heads :]
            if layer.k_norm is not None:
                k = layer.k_norm(k)
            out.append((apply_rope(k, rot).transpose(1, 2), v.transpose(1, 2)))
        return out

    def block_inputs(self, first: Tensor) -> Tensor:
        """first [...] root tokens -> block inputs [..., K, B, W]: [e(root), m x (B-1)] + u_k (DFlash:
        m = e(mask_token), no u; a narrow drafter projects e(root) to W)."""
        cfg = self.cfg
        e = self.embed[first]  # [..., H]
        if self.inp is not None:
            e = self.inp(e)  # [..., W]
        m = self.mask_emb if cfg.mask_token < 0 else self.embed[cfg.mask_token].to(e.dtype)
        rows = torch.cat([e[..., None, :], m.expand(*e.shape[:-1], cfg.block_size - 1, -1)], -2)  # [..., B, W]
        if cfg.mask_token >= 0:
            return rows[..., None, :, :]  # [..., 1, B, H]
        return rows[..., None, :, :] + self.mode_emb[:, None, :]  # [..., K, B, W]

    def run_blocks(self, x: Tensor, positions: Tensor, mask: Tensor | None, ctx: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Block rows x [B, Q, W] at ``positions`` [B, Q] through the layers, attending to the
        context K/V ``ctx`` (per layer [B, Hkv, P, D]) and to block rows as ``mask`` allows
        (bool [B, 1, Q, P+Q], True = may attend; None = everything).  Returns RMSNorm(out) [B, Q, W]."""
        rot = self.rotation(positions)
        for layer, (k, v) in zip(self.layers, ctx):
            x, _, _ = layer(x, rot, mask, k, v)
        return self.norm(x)

    def mode_logp(self, h_root: Tensor) -> Tensor:
        """Final states of the K root rows [..., K, W] -> log pi_k [..., K]: the gate's
        log-probability that mode k's block is the one the target continues (uniform without a gate)."""
        if not self.cfg.gate:
            return torch.full(h_root.shape[:-1], -math.log(self.cfg.modes), device=h_root.device)
        return torch.log_softmax(self.gate(h_root).squeeze(-1).float(), -1)


def modes_mask(modes: int, block: int, context: int, device=None) -> Tensor | None:
    """[1, 1, K*B, P+K*B]: every context slot, then the query's own block (block-diagonal);
    None when K = 1 (everything visible)."""
    if modes == 1:
        return None
    blk = torch.arange(modes * block, device=device) // block
    own = blk[:, None] == blk[None]
    return torch.cat([torch.ones(modes * block, context, dtype=torch.bool, device=device), own], 1)[None, None]
