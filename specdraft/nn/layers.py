"""Drafter network parts shared by the trained drafters: a target-shaped decoder layer, the MLP
head, the frozen LM-head rows of a draft vocabulary, the shape copied from the target, and a
drafter's own K/V cache of committed positions.

RoPE is the target's (``model.llama.rope_rotation`` / ``apply_rope``), with its angles in fp32
whatever the drafter's dtype (a bfloat16 angle would shift every position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import UnionType
from typing import Union, get_args, get_origin, get_type_hints

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.model.fast import FastWeight, QuantLinear, quantize_linears, rotation_table
from specdraft.model.llama import RMSNorm, apply_rope, rope_inv_freq, rope_rotation
from specdraft.model.packed import prepack_model
from specdraft.model.quant import kernel_available


@dataclass
class TargetShape:
    """The part of a drafter's config copied from its target: layers shaped like the target's."""

    hidden_size: int  # target width H
    vocab_size: int  # target vocabulary
    num_heads: int  # query heads of a drafter layer
    num_kv_heads: int  # key/value heads of a drafter layer
    head_dim: int  # per-head width D
    intermediate_size: int  # SwiGLU width of a drafter layer
    rms_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base

    @classmethod
    def for_target(cls, tcfg, **kw):
        """This config with the shape of the target's decoder blocks (``tcfg``: a ``ModelConfig``)."""
        return cls(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size, num_heads=tcfg.num_heads,
                   num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim, intermediate_size=tcfg.intermediate_size,
                   rms_eps=tcfg.rms_eps, rope_theta=tcfg.rope_theta, **kw)

    def check_width(self, width: int) -> None:
        """Refuse a drafter width (``width`` fields: 0 = the target's) outside 0 .. H or one the layers cannot take
        (``narrow``): at config time, not at the first forward."""
        if not 0 <= width <= self.hidden_size:
            raise SpecdraftError(f"width must be in 0 .. {self.hidden_size} (0 = the target's hidden size; got {width})")
        self.narrow(width)

    def narrow(self, width: int) -> "TargetShape":
        """The target's layer shape at another width W (0 or H: this shape): as many heads of the target's
        head size as fit, its share of key/value heads (at least one, dividing the heads), the SwiGLU
        width scaled by W / H (a multiple of 32)."""
        if width in (0, self.hidden_size):
            return self
        if width < self.head_dim or width % self.head_dim or width % 32:
            raise SpecdraftError(f"a drafter width must be a multiple of the head size {self.head_dim} and of 32 "
                                 f"(got {width})")
        heads = width // self.head_dim
        kv = max(1, heads * self.num_kv_heads // self.num_heads)
        while heads % kv:
            kv -= 1
        inter = max(32, round(self.intermediate_size * width / self.hidden_size / 32) * 32)
        return TargetShape(hidden_size=width, vocab_size=self.vocab_size, num_heads=heads, num_kv_heads=kv,
                           head_dim=self.head_dim, intermediate_size=inter, rms_eps=self.rms_eps,
                           rope_theta=self.rope_theta)

    @classmethod
    def from_json(cls, d: dict):
        """From a checkpoint manifest's ``config`` (keys this version does not know are ignored), each value
        checked against its field's type (a malformed manifest is one SpecdraftError naming the field)."""
        if not isinstance(d, dict):
            raise SpecdraftError(f"its config is a {type(d).__name__}, not an object")
        hints = get_type_hints(cls)
        names = {f.name for f in fields(cls)}
        for k, v in d.items():
            if k in names and not _fits_type(v, hints[k]):
                raise SpecdraftError(f"config field {k} is {v!r}, not of type {hints[k]}")
            if k in names and k not in _SIZES and hints[k] is int and not -1 <= v <= MAX_COUNT:
                raise SpecdraftError(f"config field {k} is {v}, outside -1 .. {MAX_COUNT}")  # counts of layers, heads, steps
        return cls(**{k: v for k, v in d.items() if k in names})


MAX_COUNT = 32  # the largest layer / head / step / position count a drafter config may state (shipped: <= 8)
_SIZES = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "draft_vocab",
          "mask_token", "width")  # checked against the target instead (nn.checkpoint.check_fits)


def _fits_type(value, hint) -> bool:
    """Whether a JSON value can be a dataclass field of type ``hint`` (int, float, bool, str, tuple[int, ...], or
    X | None of those)."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple:
        item = args[0] if args else object
        return isinstance(value, (list, tuple)) and all(_fits_type(x, item) for x in value)
    if origin in (Union, UnionType):
        return any(_fits_type(value, a) for a in args if a is not type(None)) or (value is None and type(None) in args)
    return True  # a type this check does not know: the dataclass's own __post_init__ checks it


class DraftLayer(nn.Module):
    """One decoder layer (pre-norm attention + SwiGLU), returning its new keys/values so the
    caller decides where they live: a cache at inference, plain tensors in training.  ``d_in``: the
    width its attention reads (H; EAGLE-3's layer reads 2H, ``nn.eagle3``).  ``qk_norm``: an RMSNorm
    over each query and key head before RoPE (Qwen3's layers, and so DFlash's)."""

    def __init__(self, cfg: TargetShape, d_in: int | None = None, qk_norm: bool = False) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.wqkv = nn.Linear(d_in or h, (self.hq + 2 * self.hkv) * d, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_eps) if qk_norm else None
        self.wo = nn.Linear(self.hq * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.w_gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.eps = cfg.rms_eps
        self._fast: tuple | None = None  # fast_block's weight arguments once on the fast kernel (attach_fast)

    def attach_fast(self) -> bool:
        """Run the whole layer as one call of the target's fast kernel (``fast_forward``), once its projections
        are ``QuantLinear`` (``DraftModel.prepack(int8=True)``).  A layer whose attention reads another width
        than its output (EAGLE-3's) has its own (``nn.eagle3``).  Returns whether it did."""
        if self.wqkv.in_features != self.wo.out_features:
            return False
        return self._attach(_f32(self.attn_norm.weight))

    def _attach(self, s_attn: Tensor | None) -> bool:
        """``fast_block``'s weight arguments (``_fast``), with ``s_attn`` the attention norm's weight (None: the caller
        norms the rows the attention reads), where the projections are ``QuantLinear`` without a bias and the head size
        a multiple of 16.  Returns whether it could."""
        lins = (self.wqkv, self.wo, self.w_gate_up, self.w_down)
        if not all(isinstance(m, QuantLinear) for m in lins) or self.d % 16 or any(m.bias is not None for m in lins):
            return False
        qkv, o, gu, dn = (m.mm for m in lins)
        self._fast = (*qkv.args(), s_attn, None, *o.args(), *gu.args(), _f32(self.mlp_norm.weight), *dn.args())
        self._qk = None if self.q_norm is None else torch.cat([_f32(self.q_norm.weight), _f32(self.k_norm.weight)])
        return True

    @property
    def fast(self) -> bool:
        return self._fast is not None

    def fast_forward(self, x: Tensor, rot: Tensor, mask: Tensor | None, kv: Tensor, start: int,
                     out_rows: int = -1) -> Tensor:
        """``forward`` as one call of the fast kernel (8-bit activations; its norms, RoPE and attention in
        C++): x [B, T, H] fp32 at slots start .. start+T-1 of the layer's cache kv [2, B, Hkv, S, D], where
        their keys and values are written; rot [B, T, D/2, 2] (``DraftModel.rot_rows``); mask bool
        [B, T, start+T] (True = may attend) or None (every slot).  Returns the first ``out_rows`` rows of
        each sequence, [B, out_rows, H] (-1: all T): the other rows only give keys and values."""
        return torch.ops.specdraft_quant.fast_block(x, *self._fast, rot, mask, kv, start, self.eps, self.hq, self.hkv,
                                                    self.d, self._qk, out_rows)

    def attend(self, x: Tensor, rot: Tensor, mask: Tensor | None, past_k: Tensor | None = None,
               past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, T, d_in] (already normed); rot: complex [B, T, 1, D/2]; mask: bool [B, 1, T, P+T]
        # (True = may attend) or None (all visible); past_k/v: [B, Hkv, P, D].
        # Returns (attention output after wo [B, T, H], k, v [B, Hkv, T, D]).
        b, t, _ = x.shape
        qkv = self.wqkv(x).unflatten(-1, (self.hq + 2 * self.hkv, self.d))  # [B, T, heads, D]
        qk = qkv[:, :, : self.hq + self.hkv]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, : self.hq]), self.k_norm(qk[:, :, self.hq :])], 2)
        qk = apply_rope(qk, rot).transpose(1, 2)  # [B, Hq + Hkv, T, D]
        q, k = qk[:, : self.hq], qk[:, self.hq :]
        v = qkv[:, :, self.hq + self.hkv :].transpose(1, 2)  # [B, Hkv, T, D]
        keys = k if past_k is None else torch.cat([past_k, k], 2)
        values = v if past_v is None else torch.cat([past_v, v], 2)
        # grouped-query attention without expanding K/V: the G query heads sharing a KV head become
        # G*T query rows of that head ([B, Hq, T, D] -> [B, Hkv, G*T, D]), mask rows likewise
        g = self.hq // self.hkv
        if mask is not None and g > 1:
            mask = mask.repeat(1, 1, g, 1)
        att = F.scaled_dot_product_attention(q.reshape(b, self.hkv, g * t, self.d), keys, values, attn_mask=mask)
        return self.wo(att.reshape(b, self.hq, t, self.d).transpose(1, 2).reshape(b, t, self.hq * self.d)), k, v

    def mlp(self, x: Tensor) -> Tensor:
        """x + SwiGLU(mlp_norm(x)), [B, T, H]."""
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def forward(self, x: Tensor, rot: Tensor, mask: Tensor | None, past_k: Tensor | None = None,
                past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, T, H].  Returns (y [B, T, H], k, v [B, Hkv, T, D]).
        a, k, v = self.attend(self.attn_norm(x), rot, mask, past_k, past_v)
        return self.mlp(x + a), k, v


def _f32(w: Tensor) -> Tensor:
    return w.detach().float().contiguous()


class MLPHead(nn.Module):
    """SiLU(Linear(d_in -> H)), then ``blocks`` residual blocks x + SiLU(Linear(x)), zero-initialised
    (identity at the start of training)."""

    def __init__(self, d_in: int, h: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, h)
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(blocks))
        for blk in self.blocks:
            nn.init.zeros_(blk.weight)
            nn.init.zeros_(blk.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.silu(self.inp(x))
        for blk in self.blocks:
            x = x + F.silu(blk(x))
        return x


class DraftModel(nn.Module):
    """Base of the trainable drafter networks.  The target's embeddings and the rows of its LM head
    for a draft vocabulary are frozen, non-persistent buffers (shared, never saved); only
    ``vocab_ids`` [V'] (target ids of the draft vocabulary) is stored with the weights.  Scoring
    over V' rows instead of the whole vocabulary is EAGLE-3's reduced draft vocabulary: a step
    costs a fraction of a full LM head on a CPU.

    A narrow network (``cfg.width`` W < H) works at width W and reads out through a learned ``lift``
    W -> H into those frozen rows: logits = head_w (lift h).  For inference the product head_w lift
    [V', W] is taken once (``fold_lift``), so a drafted row's scores cost V' W, not V' H."""

    def __init__(self, cfg: TargetShape, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_cfg = cfg.narrow(getattr(cfg, "width", 0))  # the shape of the network's own layers (width W)
        w, h = self.layer_cfg.hidden_size, cfg.hidden_size
        self.lift = nn.Linear(w, h, bias=False) if w != h else None  # W -> H before the frozen head rows
        self._folded = False  # head_w is head_w @ lift (fold_lift): scores read W-wide states directly
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H]
        self.register_buffer("head_w", lm_head.detach()[self.vocab_ids].contiguous(), persistent=False)  # [V', H]
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)  # fp32, not a buffer: .to(dtype) keeps it fp32
        self._head = None  # head_w as a PackedWeight (bf16) or FastWeight (int8) once prepack() ran
        self._rot_table: Tensor | None = None  # (cos, sin) per position for the fast layers (rot_rows)
        self._fused = False  # decoder layers and top-k in C++ (prepack(int8=True))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def rotation(self, positions: Tensor) -> Tensor:
        """positions [B, T] -> e^{i pos theta}, complex [B, T, 1, D/2]."""
        if self.inv_freq.device != positions.device:  # moved once, on first use on a device
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_rotation(positions, self.inv_freq)

    def rot_rows(self, positions: Tensor) -> Tensor:
        """positions [B, T] -> (cos, sin) [B, T, D/2, 2] fp32 looked up in a table that grows as needed:
        the rotation ``DraftLayer.fast_forward`` takes."""
        need = int(positions.max()) + 1
        if self._rot_table is None or self._rot_table.shape[0] < need:
            self._rot_table = rotation_table(max(need, 2 * (0 if self._rot_table is None else self._rot_table.shape[0]),
                                                 1024), self.inv_freq)
        return self._rot_table[positions]

    @property
    def fast(self) -> bool:
        """Whether the network drafts on the fast kernel (``prepack(int8=True)``): its decoder layers one C++
        call each (where their shape allows: ``DraftLayer.fast``), the head's top-k taken in C++."""
        return self._fused

    def keep_vocab(self, rows: int) -> None:
        """For inference: draft from the draft vocabulary's first ``rows`` tokens only, a head of rows x W scored each
        step instead of V' x W (the draft vocabulary is ranked most frequent first: ``train.corpus.draft_vocabulary``);
        0 or >= V': all of it.  Before ``prepack``, which packs the head."""
        if not 0 < rows < len(self.vocab_ids):
            return
        if self._head is not None:
            raise SpecdraftError("keep_vocab must come before prepack (the head is packed already)")
        head = self.head_w[:rows].detach().clone()
        self.vocab_ids = self.vocab_ids[:rows].clone()
        self.head_w = nn.Parameter(head, requires_grad=False) if isinstance(self.head_w, nn.Parameter) else head

    def fold_lift(self) -> None:
        """For inference: the lift into the head rows taken once, head_w <- head_w @ lift [V', W] (in fp32, then
        the network's dtype), so a row's scores cost V' W.  The target's own scores over the rows
        (``teacher_logits``, a training signal) are gone after it."""
        if self.lift is None:
            return
        w = self.lift.weight.detach().float()
        self.head_w = (self.head_w.float() @ w).to(self.head_w.dtype).contiguous()
        self.lift = None
        self._folded = True

    def lift_state(self, h: Tensor) -> Tensor:
        """A state of the network's width [..., W] at the target's width [..., H] (through the lift; W = H: as is)."""
        return h if self.lift is None else self.lift(h)

    def prepack(self, int8: bool = False, fused: bool = True, kind: str = "Q8_0") -> bool:
        """Get ready for inference on a CPU: with ``int8``, every linear layer and the head on the fast
        kernel (weights rounded to Q8_0, 8-bit activations: ``model.fast``) and, with ``fused``, each decoder
        layer one call of it and the top-k in C++ (without: the same 8-bit projections under torch's modules,
        the reference the fused path is tested against); ``kind``: the weights' blocks there (Q8_0, or Q4_0:
        half the bytes a drafting step reads); otherwise, on a bfloat16 CPU, let oneDNN reorder every weight
        once (``model.packed``) instead of on every call.  Either way the lift is folded into the head rows
        first (``fold_lift``).  Returns whether it did either."""
        if int8 and not kernel_available():
            return False
        self.fold_lift()
        if int8:
            quantize_linears(self, kind)
            if fused:
                for layer in self.modules():
                    if isinstance(layer, DraftLayer):
                        layer.attach_fast()
            self._head = FastWeight.from_dense(self.head_w, kind)
            self._fused = fused
            return True
        self._head = prepack_model(self, self.head_w)
        return self._head is not None

    def teacher_logits(self, f: Tensor) -> Tensor:
        """The target's own scores over the draft vocabulary from its final (normed) feature f [..., H]."""
        if self._folded:
            raise SpecdraftError("a drafter whose lift is folded into its head rows (for inference) has no teacher scores")
        if self.lift is None:
            return self.logits(f)
        return F.linear(f.reshape(-1, f.shape[-1]), self.head_w).view(*f.shape[:-1], -1)

    def logits(self, h: Tensor) -> Tensor:
        """[..., W] -> [..., V'] scores over the draft vocabulary (frozen LM-head rows, through the lift)."""
        if self.lift is not None:
            h = self.lift(h)
        h2 = h.reshape(-1, h.shape[-1])  # one matmul, not a batched one
        y = F.linear(h2, self.head_w) if self._head is None else self._head(h2).to(h2.dtype)
        return y.view(*h.shape[:-1], -1)

    @property
    def fast_features(self) -> bool:
        """Whether ``features_fast`` (one kernel call) stands for ``feature``: only a hybrid network's can."""
        return False

    def head_norm(self) -> RMSNorm | None:
        """The norm ``logits`` applies before the head rows (None: none; EAGLE-3's network has one)."""
        return None

    def top_logp(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k most likely draft tokens of each row of h [..., W], descending: (target ids LongTensor
        [..., k], log-probabilities fp32 [..., k]); on the fast kernel one C++ call (norm, head rows and top-k:
        ``fast_linear_topk``), without the V'-wide scores or log-softmax."""
        if not (self.fast and self.lift is None and isinstance(self._head, FastWeight)):
            return self.top_of_logits(self.logits(h), k)
        k = min(k, self.head_w.shape[0])
        norm = self.head_norm()
        nw, eps = (None, 0.0) if norm is None else (_f32(norm.weight), norm.eps)
        lp, ids = torch.ops.specdraft_quant.fast_linear_topk(h.reshape(-1, h.shape[-1]).float(), nw, eps,
                                                             *self._head.args(), k, self.vocab_ids)
        shape = (*h.shape[:-1], k)
        return ids.view(shape), lp.view(shape)

    def top_of_logits(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``top_logp`` from scores already computed, logits [..., V'] (k capped at V')."""
        logits = logits.float()
        k = min(k, logits.shape[-1])
        if self.fast:
            lp, idx = torch.ops.specdraft_quant.fast_logp_topk(logits.reshape(-1, logits.shape[-1]), k)
            lp, idx = lp.view(*logits.shape[:-1], k), idx.view(*logits.shape[:-1], k)
        else:
            lp, idx = torch.log_softmax(logits, -1).topk(k, -1)
        return self.vocab_ids[idx], lp


class DraftCache:
    """A drafter's own K/V of committed positions, per layer one tensor [2, 1, Hkv, capacity, D] (keys,
    values: the layout the fast kernel writes); grows by doubling, keeping the first ``n`` slots.  Slots
    past the committed ones are scratch for the rows being drafted."""

    def __init__(self, layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.shape = (layers, num_kv_heads, head_dim)
        self.kv: list[Tensor] = []  # per layer [2, 1, Hkv, capacity, D]

    def reserve(self, slots: int, n: int, like: Tensor) -> None:
        """Room for ``slots`` positions, the first ``n`` kept (dtype and device of ``like``)."""
        if self.kv and self.kv[0].shape[3] >= slots:
            return
        layers, hkv, d = self.shape
        cap = max(slots, 2 * (self.kv[0].shape[3] if self.kv else 256))
        grown = []
        for i in range(layers):
            t = torch.zeros((2, 1, hkv, cap, d), dtype=like.dtype, device=like.device)
            if self.kv:
                t[:, :, :, :n] = self.kv[i][:, :, :, :n]
            grown.append(t)
        self.kv = grown

    def write(self, new: list[tuple[Tensor, Tensor]], n: int) -> None:
        """Store every layer's new (k, v) [1, Hkv, T, D] at slots n .. n+T-1."""
        for t, (k, v) in zip(self.kv, new):
            t[0, :, :, n : n + k.shape[2]] = k
            t[1, :, :, n : n + v.shape[2]] = v

    def past(self, n: int) -> list[tuple[Tensor, Tensor]]:
        """Every layer's K/V of the first ``n`` slots, each [1, Hkv, n, D]."""
        return [(t[0, :, :, :n], t[1, :, :, :n]) for t in self.kv]
