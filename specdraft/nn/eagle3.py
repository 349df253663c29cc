"""The EAGLE-3 drafter's network, exactly in EAGLE-3's architecture (Li et al., 2025), so that an
export (``specdraft.export.drafter``) is the same model in the layout vLLM, SGLang and llama.cpp load.

Notation: f_i = [a_i ; b_i ; c_i] the target's residual stream at the input of three of its layers
(``feature_layers``, EAGLE-3's ``eagle_aux_hidden_state_layer_ids``, default [2, L//2, L-3]) at
position i, e(x) the target's (frozen) token embedding.  One step at position i:

    g_i   = fc(f_i)                                   fc: 3H -> H, no bias (the first step only;
                                                      later steps read the previous step's output)
    u_i   = [input_layernorm(e(x_{i+1})) ; hidden_norm(g_i)]          [2H]
    r_i   = g_i + o_proj(attention(q, k, v of u_i))                    the residual is g_i itself
    h_i   = r_i + mlp(post_attention_layernorm(r_i))                   the "pre-norm" output
    p(x_{i+2}) = softmax(lm_head(norm(h_i)))                          over the draft vocabulary

The next step at position i+1 reads h_i in place of g (and the drafted token).  The lm_head is the
drafter's own (trained, initialised from the target's rows of the draft vocabulary); ``vocab_ids``
is the draft vocabulary, from which EAGLE-3's ``d2t`` (target id = draft id + d2t[draft id]) and
``t2d`` are derived on export.

The module keeps the interface of the hybrid drafter's serial part (``feature``, ``serial``,
``logits``), so ``drafters.hybrid.HybridDrafter`` drives it with the same tree search and
``train.hybrid`` trains it with the same training-time test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.model.llama import RMSNorm
from specdraft.nn.layers import DraftLayer, DraftModel, TargetShape


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers for an L-layer target: (2, L//2, L-3)."""
    return (2, n_layers // 2, n_layers - 3)


@dataclass
class Eagle3Config(TargetShape):
    """An EAGLE-3 drafter's shape: target-shaped layers (``TargetShape``) and its own fields."""

    feature_layers: tuple[int, ...] = ()  # the 3 target layers whose inputs fc fuses (() = not set: refused)
    steps: int = 7  # draft depth: serial steps run when drafting (and trained with the training-time test)
    draft_vocab: int = 8192  # rows of the drafter's own lm_head (the most frequent response tokens; 0 = all)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        if len(self.feature_layers) != 3 or min(self.feature_layers) < 0:
            raise SpecdraftError(f"an eagle3 drafter reads exactly 3 target layers (layer ids >= 0, the input of "
                                 f"that layer; got {self.feature_layers})")
        if self.steps < 1:
            raise SpecdraftError(f"an eagle3 drafter needs steps >= 1 (got {self.steps})")

    # the hybrid drafter's view of this network: S serial steps of one layer, no parallel heads
    @property
    def serial(self) -> int:
        return self.steps

    parallel = 0
    serial_layers = 1
    kind = "eagle3"

    @property
    def depth(self) -> int:
        return self.steps


class Eagle3Layer(DraftLayer):
    """EAGLE-3's ``midlayer``: a Llama decoder layer whose attention reads
    [input_layernorm(e(x)) ; hidden_norm(g)] (2H) and whose residual is g.  ``attn_norm`` is
    EAGLE-3's input_layernorm, ``mlp_norm`` its post_attention_layernorm."""

    def __init__(self, cfg: TargetShape) -> None:
        super().__init__(cfg, d_in=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, emb: Tensor, g: Tensor, rot: Tensor, mask: Tensor | None, past_k: Tensor | None = None,
                past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # emb, g: [B, T, H].  Returns (h [B, T, H] pre-norm output, k, v [B, Hkv, T, D]).
        a, k, v = self.attend(self.attn_input(emb, g), rot, mask, past_k, past_v)
        return self.mlp(g + a), k, v

    def attn_input(self, emb: Tensor, g: Tensor) -> Tensor:
        """u = [input_layernorm(e) ; hidden_norm(g)] [B, T, 2H]: what the attention reads."""
        return torch.cat([self.attn_norm(emb), self.hidden_norm(g)], -1)

    def attach_fast(self) -> bool:
        """The whole layer as one call of the fast kernel (``fast_forward``), its attention reading u (normed here,
        2H wide) and its residual g, once its projections are ``QuantLinear``.  Returns whether it did."""
        return self._attach(None)

    def fast_forward(self, emb: Tensor, g: Tensor, rot: Tensor, mask: Tensor | None, kv: Tensor, start: int) -> Tensor:
        """``forward`` as one call of the fast kernel: emb, g [B, T, H] at slots start .. start+T-1 of the cache kv
        [2, B, Hkv, S, D] (their keys and values written there); rot, mask as ``DraftLayer.fast_forward``.  Returns h
        [B, T, H]."""
        u = self.attn_input(emb, g).float().contiguous()
        return torch.ops.specdraft_quant.fast_block(g.float().contiguous(), *self._fast, rot, mask, kv, start, self.eps,
                                                    self.hq, self.hkv, self.d, None, -1, None, None, False, 0.0, u)


class Eagle3Model(DraftModel):
    """The trainable EAGLE-3 drafter: fc, one ``Eagle3Layer``, the final norm and its own lm_head
    (``head_w``, a parameter here); the target's embeddings stay frozen and unsaved."""

    def __init__(self, cfg: Eagle3Config, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor) -> None:
        super().__init__(cfg, embed, lm_head, vocab_ids)
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(h, cfg.rms_eps)
        rows = self._buffers.pop("head_w")  # the target's rows: the trained lm_head's start, and the teacher
        self.head_w = nn.Parameter(rows.clone())
        self.register_buffer("target_rows", rows, persistent=False)

    def keep_vocab(self, rows: int) -> None:
        """``DraftModel.keep_vocab``, the target's rows (the teacher's) cut alike."""
        super().keep_vocab(rows)
        self.target_rows = self.target_rows[: len(self.vocab_ids)]

    def feature(self, f: Tensor) -> Tensor:
        """[..., 3H] target features -> g [..., H]."""
        return self.fc(f)

    def serial(self, state: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None,
               past: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One step over T rows: state [B, T, H] (g, or the previous step's output), tokens [B, T] (the
        token each row reads), positions [B, T].  Returns (h [B, T, H], [(k, v)] of the layer)."""
        pk, pv = past[0] if past is not None else (None, None)
        h, k, v = self.layers[0](self.embed[tokens], state, self.rotation(positions), mask, pk, pv)
        return h, [(k, v)]

    @property
    def fast_serial(self) -> bool:
        """Whether a step runs on the fast kernel, one C++ call (``serial_fast``)."""
        return self.fast and self.layers[0].fast

    def serial_fast(self, state: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None, kv: list[Tensor],
                    start: int) -> Tensor:
        """``serial`` on the fast kernel (``HybridModel.serial_fast``'s contract): the T rows attend to slots
        0 .. start-1 of the cache ``kv[0]`` and to each other as ``mask`` [1, T, start+T] allows (None: all); their K/V
        are written at slots start .. start+T-1.  Returns h [1, T, H]."""
        return self.layers[0].fast_forward(self.embed[tokens], state, self.rot_rows(positions), mask, kv[0], start)

    def logits(self, h: Tensor) -> Tensor:
        """[..., H] pre-norm states -> [..., V'] scores over the draft vocabulary: lm_head(norm(h))."""
        return super().logits(self.norm(h))

    def head_norm(self) -> RMSNorm:
        return self.norm

    def teacher_logits(self, f: Tensor) -> Tensor:
        """The target's own scores over the draft vocabulary from its final (normed) feature f [..., H]."""
        return nn.functional.linear(f, self.target_rows)
