"""The hybrid drafter's network (Gumiho, ICML 2025): serial Transformer steps for the first draft
tokens, parallel MLP heads for the later ones; Medusa (S = 0) and EAGLE-style (M = 0) are
configurations of the same module.

Serial part (S steps, EAGLE-style): decoder layers over u_i = fc([e(x_{i+1}) ; g(f_i)]), where f_i is
the target's feature at position i and g = identity for one feature layer or a linear fusion of
several RMS-normalised ones (EAGLE-3).  Parallel part (M heads): head j reads [h^1 .. h^S ; e(x^_S)]
(S = 0: [g(f_{n-1}) ; e(x_n)]) and scores depth S+1+j: SiLU(Linear) then zero-initialised residual
blocks, then the frozen LM-head rows.  With ``width`` W < H (a cheap drafter on a CPU) the states h, g(f)
and the heads' outputs are W wide, the layers are the target's at width W (``TargetShape.narrow``), the
embeddings stay the target's (H wide), and the scores go through a learned lift W -> H into the frozen rows
(``DraftModel``), folded into them for inference.  How the drafter runs it: ``specdraft.drafters.hybrid``;
training: ``specdraft.train.hybrid``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.model.fast import QuantLinear
from specdraft.model.llama import RMSNorm
from specdraft.nn.layers import DraftLayer, DraftModel, MLPHead, TargetShape


@dataclass
class HybridConfig(TargetShape):
    """A hybrid drafter's shape: the target-shaped part (``TargetShape``) and its own."""

    serial: int = 2  # S: draft positions produced by the serial (EAGLE-style) part
    parallel: int = 5  # M: MLP heads, head j drafts position S+1+j
    serial_layers: int = 1  # decoder layers of the serial part
    head_blocks: int = 1  # zero-initialised residual blocks per MLP head (Gumiho: 5)
    feature_layers: tuple[int, ...] = (-1,)  # target features read (-1 = final normed state)
    draft_vocab: int = 8192  # LM-head rows drafted from (the most frequent tokens; 0 = all)
    width: int = 0  # W: the network's own hidden size (0 = the target's H; narrower = a cheaper step)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        if self.serial < 0 or self.parallel < 0 or self.serial + self.parallel < 1:
            raise SpecdraftError(f"a hybrid drafter needs serial >= 0, parallel >= 0 and serial + parallel >= 1 "
                                 f"(got {self.serial}, {self.parallel})")
        if self.serial_layers < 1 or self.head_blocks < 0 or not self.feature_layers:
            raise SpecdraftError("serial layers must be >= 1, head blocks >= 0, and at least one feature layer")
        self.check_width(self.width)

    @property
    def depth(self) -> int:
        return self.serial + self.parallel

    @property
    def kind(self) -> str:
        """The paper this configuration reproduces."""
        return "medusa" if self.serial == 0 else "eagle" if self.parallel == 0 else "gumiho"


class HybridModel(DraftModel):
    """The trainable hybrid drafter (frozen embeddings and LM-head rows: ``DraftModel``)."""

    def __init__(self, cfg: HybridConfig, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor) -> None:
        super().__init__(cfg, embed, lm_head, vocab_ids)
        h, w = cfg.hidden_size, self.layer_cfg.hidden_size  # the target's width, the network's
        n_feat = len(cfg.feature_layers)
        # several target layers (EAGLE-3 style): each is RMS-normalised before the fusing
        # projection, as the target's own next layer would read it; the raw residual stream of
        # middle layers carries massive activations (SmolLM2-135M layers 15, 27: |x| up to 2.5e4,
        # RMS ~65 vs 1.9 for the final state) that would otherwise swamp the projection
        self.feat_norms = nn.ModuleList(RMSNorm(h, cfg.rms_eps) for _ in range(n_feat)) if n_feat > 1 else None
        self.fuse = nn.Linear(n_feat * h, w, bias=False) if n_feat > 1 or w != h else None
        if cfg.serial > 0:
            self.fc = nn.Linear(h + w, w)  # [e(x) ; state] -> W
            self.layers = nn.ModuleList(DraftLayer(self.layer_cfg) for _ in range(cfg.serial_layers))
        self.heads = nn.ModuleList(MLPHead(max(cfg.serial, 1) * w + h, w, cfg.head_blocks)
                                   for _ in range(cfg.parallel))
        self._norms_folded = False  # the feature norms' weights folded into ``fuse`` (fold_feature_norms)
        self._fast_features = False  # features_fast stands for feature (set by prepack)

    def prepack(self, int8: bool = False, fused: bool = True, kind: str = "Q8_0") -> bool:
        """``DraftModel.prepack``, the feature norms' weights folded into the fusing projection first."""
        self.fold_feature_norms()
        done = super().prepack(int8, fused, kind)
        self._fast_features = (self.fast and self._norms_folded and isinstance(self.fuse, QuantLinear)
                               and self.fuse.bias is None and len(self.fuse.mm.args()[1]) == 2)
        return done

    @torch.no_grad()
    def fold_feature_norms(self) -> None:
        """For inference: fuse(norm_i(f_i) w_i) = (fuse diag(w)) norm_i(f_i), so each feature layer's RMSNorm weight
        w_i goes into the projection's columns once (in fp32, then the weight's dtype) and a step's norms are one
        op without weights.  Training reads the norms as they are (never called there)."""
        if self.feat_norms is None or self._norms_folded:
            return
        scale = torch.cat([norm.weight.float() for norm in self.feat_norms])  # [n H], in the projection's column order
        self.fuse.weight.copy_((self.fuse.weight.float() * scale).to(self.fuse.weight.dtype))
        for norm in self.feat_norms:
            norm.weight.fill_(1.0)
        self._norms_folded = True

    def feature(self, f: Tensor) -> Tensor:
        """[..., n_layers * H] target features -> [..., W]."""
        if self.fuse is None:
            return f
        if self.feat_norms is None:  # one feature layer into a narrower network
            return self.fuse(f)
        # each layer's RMSNorm (``feat_norms``), all layers in one set of ops: [..., n, H] normed over H
        x = f.unflatten(-1, (len(self.feat_norms), self.cfg.hidden_size))
        if self._norms_folded:  # the norms' weights are in the projection's columns: one op for the norms
            return self.fuse(F.rms_norm(x.float(), (self.cfg.hidden_size,), eps=self.cfg.rms_eps).to(f.dtype).flatten(-2))
        y = x.float()
        y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.cfg.rms_eps)).to(f.dtype)
        scale = torch.stack([norm.weight for norm in self.feat_norms])  # [n, H]
        return self.fuse((y * scale).flatten(-2))

    @property
    def fast_features(self) -> bool:
        """Whether ``features_fast`` can stand for ``feature``: several feature layers, their norms folded, the fusing
        projection on the fast kernel (decided once, by ``prepack``)."""
        return self._fast_features

    def features_fast(self, feats: list[Tensor], rows: list[int]) -> Tensor:
        """``feature`` of rows ``rows`` (R indices) of the target layers ``feats`` (each [T, H], fp32) in one call of the
        fast kernel (the pick, the join, the norms and the projection): [R, W]."""
        return torch.ops.specdraft_quant.fast_norms_linear(feats, rows, self.cfg.rms_eps, *self.fuse.mm.args())

    def serial(self, state: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None,
               past: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One serial step over T rows: state [B, T, W] (g(f) or the previous step's output),
        tokens [B, T] (the token each row reads), positions [B, T].  Returns (out [B, T, W], the
        new (k, v) of every layer)."""
        rot = self.rotation(positions)
        x = self.fc(torch.cat([self.embed[tokens], state], -1))
        new = []
        for i, layer in enumerate(self.layers):
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = layer(x, rot, mask, pk, pv)
            new.append((k, v))
        return x, new

    @property
    def fast_serial(self) -> bool:
        """Whether the serial layers run on the fast kernel, one C++ call each (``serial_fast``)."""
        return self.cfg.serial > 0 and self.fast and all(layer.fast for layer in self.layers)

    def serial_fast(self, state: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None, kv: list[Tensor],
                    start: int) -> Tensor:
        """``serial`` on the fast kernel: the T rows attend to slots 0 .. start-1 of every layer's cache
        ``kv`` ([2, 1, Hkv, S, D] each) and to each other as ``mask`` [1, T, start+T] allows (None: all), and
        their K/V are written at slots start .. start+T-1.  Returns out [1, T, W]."""
        x = self.fc(torch.cat([self.embed[tokens], state], -1)).float().contiguous()
        rot = self.rot_rows(positions)
        for layer, cache in zip(self.layers, kv):
            x = layer.fast_forward(x, rot, mask, cache, start)
        return x

    def head_states(self, x: Tensor, n: int | None = None) -> Tensor:
        """[R, max(S,1) W + H] -> [R, n, W] outputs of the first ``n`` MLP heads."""
        heads = self.heads if n is None else self.heads[:n]
        return torch.stack([hd(x) for hd in heads], 1)
