"""A lean Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3) for speculative decoding.

Differences from a generic implementation, all in service of tree verification:
- a static KV cache (``KVCache``) preallocated once and written by slot, so a draft tree can be
  written after the committed prefix and the accepted path compacted in place;
- the caller passes the token positions (RoPE) and a boolean attention mask explicitly, so the
  same forward serves prefill, one-token decoding, tree verification and left-padded batches;
- the hidden states of any requested layers come back beside the logits (drafters read them).

Maths (per block):  h = x + Wo·Attn(RoPE(Wq·n(x)), RoPE(Wk·n(x)), Wv·n(x));  y = h + Wd·(silu(Wg·n(h)) * Wu·n(h))
with n = RMSNorm.  Q/K/V and gate/up projections are fused into one matmul each.  Gemma 3 adds (all in
``ModelConfig``): the embedding times sqrt(H), q/k RMSNorm per head, an RMSNorm on the attention's and the
MLP's outputs before each residual add (``sandwich_norms``), GeGLU (gelu_tanh for silu), its own
attention scale, and sliding layers: a query sees only the keys of the last ``sliding_window`` positions
(``windowed``) and rotates by its own RoPE base.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.model.config import ModelConfig
from specdraft.model.fast import FORMATS as FAST_FORMATS, SUPER as FAST_SUPER, FastWeight, rotation_table
from specdraft.model.quant import QuantWeight, RawQuant, concat_rows, kernel_available, supported

FUSED_BLOCKS = os.environ.get("SPECDRAFT_FUSED", "1") != "0"  # see Block.fused_args; tests compare both paths
FINAL = -1  # key of the final (normed) hidden state in ForwardOutput.hidden


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class Linear(nn.Linear):
    """``nn.Linear`` that can also hold MKL-packed copies of its weight for given row counts.

    A CPU fp32 matmul with a few rows (a draft tree) is memory-bound, and the generic kernel
    re-packs the whole weight on every call: with a copy packed once for exactly M rows, a
    16-token pass costs about 1.6x one token instead of ~2x (measured on a 2-core CPU).  Inputs
    with another row count take the generic path.  Packs are not part of the state dict.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packs: dict[int, Tensor] = {}
        self.quant = None  # a model.quant.QuantWeight: the GGUF's own blocks, used for passes of <= quant_rows tokens
        self.quant_rows = 0

    def reset_parameters(self) -> None:  # a model built on "meta" is loaded, not initialised (and skips the
        if not self.weight.is_meta:      # Python decompositions that random init on meta would import)
            super().reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        if self.quant is not None and x.numel() // x.shape[-1] <= self.quant_rows and x.dtype == torch.float32:
            y = self.quant(x)
            return y if self.bias is None else y + self.bias
        if self.packs:
            m = x.numel() // x.shape[-1]
            p = self.packs.get(m)
            if p is not None:
                return torch.ops.mkl._mkl_linear(x, p, self.weight, self.bias, m)
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def pack(self, rows: int) -> None:
        if rows not in self.packs:
            self.packs[rows] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that is not initialised when built on "meta" (see ``Linear.reset_parameters``)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class BlockTable(nn.Module):
    """A token table kept as a GGUF stores it (``raw``: its blocks, e.g. mapped from the file), for the fast
    mode: ``forward(tokens)`` dequantizes only the rows looked up, to the same fp32 values as the whole
    table dequantized (gguf-py's dequantizer, as the exact mode's table): Q8_0 blocks in one C++ call
    (``fast_rows_q8``), other formats through numpy.  ``weight`` dequantizes the whole
    table on first use and keeps it (drafter networks read the target's embeddings and LM-head rows)."""

    def __init__(self, raw: RawQuant, device: torch.device) -> None:
        super().__init__()
        self.raw = raw
        self.num_embeddings, self.embedding_dim = raw.rows, raw.cols
        self._device = device
        self._weight: Tensor | None = None
        self._q8: Tensor | bool | None = None  # the Q8_0 blocks as a uint8 tensor for the kernel; False: numpy's way

    def _q8_table(self) -> Tensor | bool:
        """``raw``'s bytes as a tensor (no copy) where the kernel can read them: a Q8_0 table, kernels built."""
        if self.raw.kind != "Q8_0" or not kernel_available():
            return False
        data = np.ascontiguousarray(self.raw.data)
        with warnings.catch_warnings():  # a read-only mapping of the file: the kernel only reads it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)

    def forward(self, tokens: Tensor) -> Tensor:
        if self._weight is not None:
            return F.embedding(tokens, self._weight)
        if self._q8 is None:
            self._q8 = self._q8_table()
        if self._q8 is not False:  # one C++ call: a pass's lookup costs ~0.1 ms less than numpy's dozen steps
            rows = torch.ops.specdraft_quant.fast_rows_q8(self._q8, tokens.reshape(-1).cpu().long())  # (no copy if int64)
            return rows.view(*tokens.shape, self.raw.cols).to(self._device)
        ids = tokens.reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.raw.rows):
            raise IndexError(f"token id out of range [0, {self.raw.rows})")
        rows = RawQuant(self.raw.kind, self.raw.cols, self.raw.data[ids]).dequantize()
        return rows.view(*tokens.shape, self.raw.cols).to(self._device)

    def __getitem__(self, ids) -> Tensor:
        """Rows ``ids`` (an int, a list or a tensor of token ids), as ``weight[ids]`` would give them."""
        return self.forward(torch.as_tensor(ids))

    @property
    def weight(self) -> Tensor:
        if self._weight is None:
            self._weight = self.raw.dequantize().to(self._device)
        return self._weight


@dataclass
class ForwardOutput:
    logits: Tensor | None  # [B, T', V] for the positions asked for (T' = T or 1), None if skipped
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, T, H]; 0 = embeddings,
    # i = output of block i (1-based), FINAL = final-normed state that feeds the LM head


class KVCache:
    """Static key/value cache for every layer in one tensor, written by slot.

    ``kv``: [L, 2, B, Hkv, S, D].  Slots are positions in the cache, not RoPE positions: the
    caller decides what lives where (committed prefix, then tree nodes).
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_slots: int, device, dtype) -> None:
        shape = (cfg.num_layers, 2, batch, cfg.num_kv_heads, max_slots, cfg.head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def layers(self) -> tuple[Tensor, ...]:
        """Per-layer views ``kv[i]`` ([2, B, Hkv, S, D]), made once (again if ``kv`` is replaced)."""
        if getattr(self, "_layers_of", None) is not self.kv:
            self._layers, self._layers_of = self.kv.unbind(0), self.kv
        return self._layers

    @property
    def max_slots(self) -> int:
        return self.kv.shape[4]

    def compact(self, src_slots: Tensor, dst_start: int) -> None:
        """Move the entries at ``src_slots`` to ``dst_start, dst_start+1, ...`` in every layer.

        Gathering first makes overlapping source/destination ranges safe.
        """
        n = src_slots.numel()
        self.kv[:, :, :, :, dst_start : dst_start + n] = self.kv.index_select(4, src_slots)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, normalised in fp32 as HF does.  With ``scale=False``
    the weight w is folded into the next projection's columns (W diag(w)) by the loader."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        y = y.to(x.dtype)
        return y if self.weight is None else self.weight * y


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> Tensor:
    """Inverse frequencies theta^(-2i/D) [D/2], with Llama-3 frequency scaling when ``scaling`` is given."""
    d = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = scaling
    if sc is None:
        return inv
    factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


def rope_rotation(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """positions [B, T] -> e^{i pos theta}, complex [B, T, 1, D/2] (angles in fp32 whatever the weights' dtype)."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    return torch.polar(torch.ones_like(freqs), freqs)[:, :, None]


def apply_rope(x: Tensor, rot: Tensor) -> Tensor:
    """x [B, T, heads, D] with each (2i, 2i+1) pair rotated by ``rot`` (complex [B, T, 1, D/2]): one
    complex multiply in fp32, the result in x's dtype."""
    y = torch.view_as_complex(x.float().unflatten(-1, (x.shape[-1] // 2, 2))) * rot
    return torch.view_as_real(y).flatten(-2).to(x.dtype)


def interleave_rope_rows(w: Tensor, head_dim: int) -> Tensor:
    """Reorder q/k output rows of each head from HF's half-split RoPE layout (pairs j, j+D/2)
    to adjacent pairs (2i, 2i+1), so RoPE becomes one complex multiply.  q.k is unchanged
    because q and k are permuted alike."""
    h = w.shape[0] // head_dim
    return w.reshape(h, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.attn_norm = RMSNorm(h, cfg.rms_eps, scale=False)  # folded into wqkv
        self.wqkv = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(self.q_size, h, bias=False)
        if cfg.qk_norm:  # one weight row per q head then per k head: [Hq+Hkv, D]
            self.qk_norm_weight = nn.Parameter(torch.ones(cfg.num_heads + cfg.num_kv_heads, d))
        self.mlp_norm = RMSNorm(h, cfg.rms_eps, scale=False)  # folded into w_gate_up
        self.w_gate_up = Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, h, bias=False)
        if cfg.sandwich_norms:  # Gemma: RMSNorm (weights kept) on each sub-layer's output, before the residual add
            self.post_attn_norm = RMSNorm(h, cfg.rms_eps)
            self.post_mlp_norm = RMSNorm(h, cfg.rms_eps)
        self._fargs: tuple | None = None  # see fused_args
        self._frows = 0
        self.fast: tuple | None = None  # the fast mode's weights, as fast_block takes them (Transformer.attach_fast)
        self.fast_extra: tuple = ()  # fast_block's optional arguments after head_dim (attach_fast)

    def fused_args(self) -> tuple:
        """The weights the one-op C++ block (``model.quant``: norms, RoPE, cache writes and residuals as
        plain loops, the projections on the quantized kernel, ATen's attention) takes, or () when this
        block cannot run as one: every projection quantized, no q/k norm and no bias outside q/k/v.
        Static, so computed once (``Transformer.attach_quantized``/``drop_quantized`` reset it)."""
        if self._fargs is None:
            lins = (self.wqkv, self.wo, self.w_gate_up, self.w_down)
            c = self.cfg
            ok = (not c.qk_norm and not c.sandwich_norms and c.activation == "silu" and c.query_scale is None
                  and all(m.quant is not None for m in lins)
                  and self.wo.bias is None and self.w_gate_up.bias is None and self.w_down.bias is None
                  and self.attn_norm.weight is None and self.mlp_norm.weight is None
                  and hasattr(torch.ops.specdraft_quant, "block"))
            qkv, o, gu, dn = (m.quant for m in lins)
            self._fargs = ((qkv.blocks, qkv.kind, qkv.in_scale, self.wqkv.bias, o.blocks, o.kind, gu.blocks, gu.kind,
                            gu.in_scale, dn.blocks, dn.kind) if ok else ())
            self._frows = min(m.quant_rows for m in lins) if ok else 0
        return self._fargs

    def fused_rows(self) -> int:
        """Largest pass (tokens) this block runs as one C++ op; 0 = never."""
        self.fused_args()
        return self._frows

    def forward(self, x: Tensor, rot: Tensor, mask: Tensor | None, kv: Tensor, start: int) -> Tensor:
        # x: [B, T, H]; rot: complex [B, T, 1, D/2]; mask: additive [B, 1, G*T, start+T] (rows of
        # the G query heads per KV head, see Transformer.forward) or None (all visible);
        # kv: [2, B, Hkv, S, D]
        cfg = self.cfg
        b, t, _ = x.shape
        d, hq = cfg.head_dim, cfg.num_heads
        qkv = self.wqkv(self.attn_norm(x))  # [B, T, (Hq + 2 Hkv) * D]
        qk = qkv[..., : self.q_size + self.kv_size].unflatten(-1, (hq + cfg.num_kv_heads, d))
        if cfg.qk_norm:
            qk = F.rms_norm(qk, (d,), None, cfg.rms_eps) * self.qk_norm_weight
        qk = apply_rope(qk, rot)  # q and k at once: [B, T, Hq + Hkv, D]
        q = qk[:, :, :hq].transpose(1, 2)  # [B, Hq, T, D]
        k = qk[:, :, hq:].transpose(1, 2)  # [B, Hkv, T, D]
        v = qkv[..., self.q_size + self.kv_size :].view(b, t, cfg.num_kv_heads, d).transpose(1, 2)
        kv[0, :, :, start : start + t] = k
        kv[1, :, :, start : start + t] = v
        keys, values = kv[0, :, :, : start + t], kv[1, :, :, : start + t]
        # grouped-query attention without expanding K/V: the G query heads that share a KV head
        # become G*T query rows of that head ([B, Hq, T, D] -> [B, Hkv, G*T, D]), mask rows likewise
        g = hq // cfg.num_kv_heads
        qg = q.reshape(b, cfg.num_kv_heads, g * t, d)
        att = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=cfg.query_scale)  # [B, Hkv, G*T, D]
        att = att.reshape(b, hq, t, d)  # (CUDA kernels may return it non-contiguous)
        o = self.wo(att.transpose(1, 2).reshape(b, t, self.q_size))
        x = x + (self.post_attn_norm(o) if cfg.sandwich_norms else o)
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        gate = F.silu(gate) if cfg.activation == "silu" else F.gelu(gate, approximate="tanh")
        m = self.w_down(gate * up)
        return x + (self.post_mlp_norm(m) if cfg.sandwich_norms else m)


class Transformer(nn.Module):
    """The decoder.  ``forward`` never allocates the cache; see ``new_cache``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)  # a BlockTable in a model loaded for the fast mode only
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        # per block: (its attention window or None, whether it rotates by the sliding layers' RoPE base); the
        # distinct windows, one mask each per pass
        self.attn_kinds = [(cfg.window(i), cfg.local_rope(i)) for i in range(cfg.num_layers)]
        self.windows = {w for w, _ in self.attn_kinds} - {None}
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # RoPE's inverse frequencies [D/2]: set by the loader (model.load), which knows the scaling the file stores
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.precision = "exact"  # or "fast" (model.fast; see Transformer.set_precision)
        self._fast_head: FastWeight | None = None
        self._fast_weights: list[FastWeight] = []  # every projection and the head (attach_fast)

    def set_precision(self, precision: str) -> str:
        """Use the "exact" (fp32 activations) or "fast" (8-bit activations, ``model.fast``) path;
        returns the mode in effect ("exact" when this model cannot run fast)."""
        if precision != "fast" and not self.exact_available:
            raise SpecdraftError("this model was loaded for the fast mode only (no fp32 weights); "
                                 "load it with precision 'exact' for the exact mode")
        self.precision = "fast" if precision == "fast" and self.fast_available else "exact"
        return self.precision

    def pack_for_rows(self, rows: int, keep: int = 2) -> bool:
        """Pack every projection for passes of exactly ``rows`` tokens (CPU fp32 with MKL only).

        Costs one weight copy per packed size; at most ``keep`` sizes are held (oldest dropped).
        Returns whether packing is in effect.
        """
        if (rows < 2 or self.device.type != "cpu" or self.dtype != torch.float32 or not self.exact_available
                or not mkl_packing_available()):
            return False
        # projections whose quantized kernel serves passes of this size need no packed copy
        lins = [m for m in self.modules() if isinstance(m, Linear) and not (m.quant is not None and rows <= m.quant_rows)]
        if not lins:
            return True
        held = list(lins[0].packs)
        if rows in held:
            return True
        for old in held[: max(0, len(held) - keep + 1)]:
            for m in lins:
                m.packs.pop(old, None)
        for m in lins:
            m.pack(rows)
        return True

    def _gguf_projections(self, raw: dict, sd: dict[str, Tensor]) -> dict:
        """Each projection's GGUF matrices as this model fuses them (q|k|v and gate|up side by side, q/k
        rows in RoPE pair order), with the RMSNorm weight the fp32 path folds into it: Linear -> (list of
        RawQuant parts, in_scale or None).  A projection with a part missing is left out."""
        cfg, d = self.cfg, self.cfg.head_dim

        def rope_rows(r):
            idx = interleave_rope_rows(torch.arange(r.rows, dtype=torch.float64)[:, None], d)[:, 0].long().numpy()
            return r.take_rows(idx)

        out = {}

        def add(lin: Linear, parts: list[str], perm=(), in_scale: Tensor | None = None) -> None:
            if not all(n in raw for n in parts):
                return
            got = [rope_rows(raw[n]) if n in perm else raw[n] for n in parts]
            if sum(r.rows for r in got) == lin.weight.shape[0] and all(r.cols == lin.weight.shape[1] for r in got):
                out[lin] = (got, in_scale, parts)

        for i, blk in enumerate(self.blocks):
            p = f"model.layers.{i}."
            q, k, v = (p + f"self_attn.{x}_proj.weight" for x in "qkv")
            add(blk.wqkv, [q, k, v], perm=(q, k), in_scale=sd[p + "input_layernorm.weight"])
            add(blk.wo, [p + "self_attn.o_proj.weight"])
            add(blk.w_gate_up, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                in_scale=sd[p + f"{cfg.mlp_norm_key}.weight"])
            add(blk.w_down, [p + "mlp.down_proj.weight"])
        add(self.lm_head, ["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"])
        return out

    @torch.no_grad()
    def attach_quantized(self, raw: dict, sd: dict[str, Tensor], max_rows: int) -> int:
        """Let passes of <= ``max_rows`` tokens read the GGUF's quantized blocks in the exact mode
        (``raw``: Hugging Face name -> ``quant.RawQuant``, rows already in HF order; ``sd``: the fp32
        state dict for the norm weights the fp32 path folds into W).  Only projections whose parts are
        all in one of the exact kernel's formats (Q4_1, Q8_0).  Returns how many projections use them."""
        n = 0
        for lin, (parts, in_scale, _) in self._gguf_projections(raw, sd).items():
            fused = concat_rows([r.load() for r in parts]) if all(supported(r.kind) for r in parts) else None
            if fused is not None:
                lin.quant, lin.quant_rows = QuantWeight(fused, in_scale), max_rows
                n += 1
        self._forget_fused_args()
        return n

    @torch.no_grad()
    def attach_fast(self, raw: dict, sd: dict[str, Tensor], pack=None) -> str:
        """Give every block and the head their fast-mode weights (``model.fast``) from ``raw`` (as in
        ``attach_quantized``; values may be ``quant.LazyRaw``, read one projection at a time).  Returns ""
        on success, else why not (changing nothing): the whole model must be able to run in that mode:
        every projection in a format the kernel reads, no bias outside q/k/v, the head size a multiple of
        16.  ``pack(names, parts)``: a FastWeight already packed for those GGUF tensors (the loader's
        cache), or None to repack them here."""
        cfg = self.cfg
        projections = self._gguf_projections(raw, sd)
        lins = [m for b in self.blocks for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down)] + [self.lm_head]
        if not hasattr(torch.ops.specdraft_quant, "fast_block"):
            return "the CPU kernel could not be built"
        if cfg.head_dim % 16 or any(b.wo.bias is not None or b.w_gate_up.bias is not None
                                    or b.w_down.bias is not None for b in self.blocks):
            return "the architecture (head size or biases)"
        missing = [m for m in lins if m not in projections]
        if missing:
            return "a projection has no quantized blocks"
        for m in lins:
            parts, _, names = projections[m]
            for r, name in zip(parts, names):
                if r.kind not in FAST_FORMATS:
                    return f"tensor {name} is stored as {r.kind}, which the fast kernel does not read"
                if r.kind in FAST_SUPER and r.cols % 256:
                    return f"tensor {name} is {r.kind} with rows of {r.cols} (not a multiple of 256)"

        def fw(lin: Linear) -> tuple[FastWeight, Tensor | None]:
            parts, in_scale, names = projections[lin]
            w = pack(names, parts) if pack is not None else None
            if w is None:  # read and repack one projection at a time (parts may be LazyRaw: read now)
                w = FastWeight.from_raw(*(p.load() for p in parts))
            return w, None if in_scale is None else in_scale.detach().float().contiguous()

        def vec(name: str) -> Tensor:
            return sd[name].detach().float().contiguous()

        d = cfg.head_dim
        self._fast_weights = []
        for i, b in enumerate(self.blocks):
            (qkv, s_attn), (o, _), (gu, s_mlp), (dn, _) = (fw(m) for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down))
            bias = None if b.wqkv.bias is None else b.wqkv.bias.detach().float().contiguous()
            b.fast = (*qkv.args(), s_attn, bias, *o.args(), *gu.args(), s_mlp, *dn.args())
            p = f"model.layers.{i}."
            qk = None if not cfg.qk_norm else torch.cat([interleave_rope_rows(vec(p + f"self_attn.{n}_norm.weight"), d)
                                                         for n in "qk"]).contiguous()  # [2D]: q's then k's, pair order
            post = (vec(p + "post_attention_layernorm.weight"), vec(p + "post_feedforward_layernorm.weight")) \
                if cfg.sandwich_norms else (None, None)
            # fast_block's optional tail: q/k norm, out_rows, the sandwich norms, GeGLU, the attention scale (0: 1/sqrt(D))
            b.fast_extra = (qk, -1, *post, cfg.activation == "gelu_tanh", cfg.query_scale or 0.0)
            self._fast_weights += [qkv, o, gu, dn]
        self._fast_head = fw(self.lm_head)[0]
        self._fast_names = [projections[m][2] for m in lins]  # GGUF tensors of each fast weight, in order
        self._fast_weights.append(self._fast_head)
        self._rot_tables = {False: rotation_table(min(cfg.max_position, 4096), self.inv_freq)}  # per RoPE base (local: True); grown
        if cfg.rope_local_theta is not None:
            self._rot_tables[True] = rotation_table(min(cfg.max_position, 4096), self.local_inv_freq)
        return ""

    @property
    def local_inv_freq(self) -> Tensor:
        """The sliding layers' RoPE inverse frequencies [D/2] (``rope_local_theta``; Gemma 3), made once."""
        inv = getattr(self, "_local_inv_freq", None)
        if inv is None or inv.device != self.inv_freq.device:
            inv = self._local_inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_local_theta).to(self.inv_freq.device)
        return inv

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def exact_available(self) -> bool:
        """Whether the fp32 weights are here (False for a model loaded for the fast mode only)."""
        return not isinstance(self.embed, BlockTable)

    @property
    def fast_weights(self) -> list[FastWeight]:
        """Every projection and the head as the fast mode reads them ([] when it is off)."""
        return self._fast_weights if self._fast_head is not None else []

    def fast_formats(self) -> dict[str, int]:
        """How many matrices of each block format the fast mode reads ({} when it is off)."""
        return dict(Counter(kind for w in self.fast_weights for kind, _, _ in w.parts))

    @property
    def fast_available(self) -> bool:
        """Whether this model can run in the fast precision mode (``model.fast``)."""
        return getattr(self, "_fast_head", None) is not None

    @property
    def quantized_rows(self) -> int:
        """Largest pass (tokens) the quantized kernel serves; 0 = fp32 weights only."""
        return max((m.quant_rows for m in self.modules() if isinstance(m, Linear) and m.quant is not None), default=0)

    def drop_quantized(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.quant, m.quant_rows = None, 0
        for b in self.blocks:
            b.fast = None
        self._fast_head = None
        self._fast_weights = []
        self.precision = "exact"
        self._forget_fused_args()

    def _forget_fused_args(self) -> None:
        """The blocks' quantized weights changed: ``Block.fused_args`` is computed again on next use."""
        for blk in self.blocks:
            blk._fargs = None

    def drop_packs(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.packs.clear()

    def _fused_pass(self, x: Tensor) -> bool:
        """Whether this pass runs every block as one C++ op (``Block.fused_args``): fp32 on the CPU, at
        most as many tokens as the quantized kernel serves; ``SPECDRAFT_FUSED=0`` turns it off."""
        if not (FUSED_BLOCKS and x.dtype == torch.float32 and x.device.type == "cpu"):
            return False
        rows = x.numel() // x.shape[-1]
        return rows <= min(b.fused_rows() for b in self.blocks)

    def new_cache(self, batch: int, max_slots: int) -> KVCache:
        return KVCache(self.cfg, batch, max_slots, self.device, self.dtype)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        mask: Tensor | None,
        cache: KVCache,
        start: int,
        *,
        hidden_layers: tuple[int, ...] = (),
        logits: str = "all",
        key_positions: Tensor | None = None,
    ) -> ForwardOutput:
        """Run ``tokens`` [B, T] at RoPE ``positions`` [B, T], writing their K/V to cache slots
        ``start .. start+T-1``.  ``mask`` [B, T, start+T] (True = may attend) covers every slot
        read; None means every slot is visible.  ``logits``: "all", "last", "none", or a 1-D index
        tensor of the rows (of T) to give logits for.  ``key_positions`` [B or 1, start+T]: the position
        of each slot's key, for the sliding layers' windows (None: the committed slots hold positions in
        order up to the pass's first, as after a prefill with left padding; see ``windowed``).
        """
        if self.precision == "fast":
            return self._forward_fast(tokens, positions, mask, cache, start, hidden_layers, logits, key_positions)
        cfg = self.cfg
        x = self.embed(tokens)  # [B, T, H]
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        rots = {False: rope_rotation(positions, self.inv_freq)}  # e^{i*pos*theta}: [B, T, 1, D/2], per RoPE base
        if cfg.rope_local_theta is not None:
            rots[True] = rope_rotation(positions, self.local_inv_freq)
        masks = self._window_masks(mask, positions, start, key_positions)
        g = cfg.num_heads // cfg.num_kv_heads

        def additive(m: Tensor | None) -> Tensor | None:  # bool [B, T, S] -> additive [B, 1, G*T, S], once per pass
            if m is None:
                return None
            m4 = torch.zeros(m.shape, dtype=x.dtype, device=x.device).masked_fill_(~m, float("-inf"))
            return m4[:, None].repeat(1, 1, g, 1) if g > 1 else m4[:, None]

        masks4 = {w: additive(m) for w, m in masks.items()}
        hidden: dict[int, Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        fused = self._fused_pass(x)  # the blocks as one C++ op each, called straight from here (no per-block Python)
        op = torch.ops.specdraft_quant.block if fused else None
        for i, (block, kv, (window, local)) in enumerate(zip(self.blocks, cache.layers, self.attn_kinds)):
            rot, mask4 = rots[local], masks4[window]
            if fused:
                x = op(x, *block.fused_args(), rot, mask4, kv, start, cfg.rms_eps, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim)
            else:
                x = block(x, rot, mask4, kv, start)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        x = self.norm(x)
        if FINAL in hidden_layers:
            hidden[FINAL] = x
        if isinstance(logits, Tensor):
            x = x[:, logits]
        elif logits == "none":
            return ForwardOutput(logits=None, hidden=hidden)
        elif logits == "last":
            x = x[:, -1:]
        return ForwardOutput(logits=self.lm_head(x).float(), hidden=hidden)

    def _forward_fast(self, tokens: Tensor, positions: Tensor, mask: Tensor | None, cache: KVCache, start: int,
                      hidden_layers: tuple[int, ...], logits: str, key_positions: Tensor | None) -> ForwardOutput:
        """``forward`` in the fast precision mode (``model.fast``): every block one C++ op, every row's
        arithmetic its own, whatever the pass."""
        cfg, op = self.cfg, torch.ops.specdraft_quant
        x = self.embed(tokens)  # [B, T, H]: rows of the fp32 table, copied
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        need = int(positions.max()) + 1
        have = self._rot_tables[False].shape[0]
        if need > have:  # a tree past the context end: more rows, the ones there unchanged
            for local, table in self._rot_tables.items():
                inv = self.local_inv_freq if local else self.inv_freq
                self._rot_tables[local] = torch.cat([table, rotation_table(max(need, 2 * have), inv, start=have)])
        at = positions.clamp(min=0)
        rots = {local: table[at] for local, table in self._rot_tables.items()}  # [B, T, D/2, 2]: looked up
        hidden: dict[int, Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x
        if mask is not None and mask.shape[0] != tokens.shape[0]:  # one mask for every row of a batch, as SDPA broadcasts
            mask = mask.expand(tokens.shape[0], *mask.shape[1:])
        masks = self._window_masks(mask, positions, start, key_positions)
        for i, (block, kv, (window, local)) in enumerate(zip(self.blocks, cache.layers, self.attn_kinds)):
            x = op.fast_block(x, *block.fast, rots[local], masks[window], kv, start, cfg.rms_eps,
                              cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, *block.fast_extra)
            if i + 1 in hidden_layers:
                hidden[i + 1] = x
        head = (self.norm.weight, cfg.rms_eps, *self._fast_head.args())
        out = None  # logits [B, T', V]; the final norm over all rows comes with them when T' = T
        rows = logits if isinstance(logits, Tensor) else None
        if rows is not None or logits != "none":
            every = rows is None and logits == "all"
            normed, out = op.fast_head(x if every else (x[:, -1:] if rows is None else x[:, rows]), *head, True)
            if FINAL in hidden_layers and every:
                hidden[FINAL] = normed
        if FINAL in hidden_layers and FINAL not in hidden:
            hidden[FINAL] = op.fast_head(x, *head, False)[0]
        return ForwardOutput(logits=out, hidden=hidden)

    def _window_masks(self, mask: Tensor | None, positions: Tensor, start: int,
                      key_positions: Tensor | None) -> dict[int | None, Tensor | None]:
        """The pass's mask per attention window (None: the global layers'), each made once (``windowed``)."""
        return {None: mask} | {w: windowed(mask, positions, start, w, key_positions) for w in self.windows}

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Load weights named as in Hugging Face ``*ForCausalLM`` checkpoints (fusing q/k/v and gate/up)."""
        cfg = self.cfg

        def take(name: str) -> Tensor:
            if name not in sd:
                raise KeyError(name)
            return sd[name]

        self.embed.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if not cfg.tie_embeddings:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, blk in enumerate(self.blocks):
            p = f"model.layers.{i}."
            attn_w = take(p + "input_layernorm.weight")  # folded: W diag(w)
            mlp_w = take(p + f"{cfg.mlp_norm_key}.weight")
            if cfg.sandwich_norms:
                blk.post_attn_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
                blk.post_mlp_norm.weight.copy_(take(p + "post_feedforward_layernorm.weight"))
            d = cfg.head_dim
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            qkv = torch.cat([interleave_rope_rows(q, d), interleave_rope_rows(k, d), v])
            blk.wqkv.weight.copy_(qkv * attn_w[None, :])
            if cfg.qkv_bias:
                qb, kb, vb = (take(p + f"self_attn.{n}_proj.bias") for n in "qkv")
                blk.wqkv.bias.copy_(torch.cat([interleave_rope_rows(qb, d), interleave_rope_rows(kb, d), vb]))
            blk.wo.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if cfg.qk_norm:
                qn = interleave_rope_rows(take(p + "self_attn.q_norm.weight"), d)
                kn = interleave_rope_rows(take(p + "self_attn.k_norm.weight"), d)
                blk.qk_norm_weight.copy_(torch.cat([qn.expand(cfg.num_heads, d), kn.expand(cfg.num_kv_heads, d)]))
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            blk.w_gate_up.weight.copy_(torch.cat([gate, up], dim=0) * mlp_w[None, :])
            blk.w_down.weight.copy_(take(p + "mlp.down_proj.weight"))


def windowed(mask: Tensor | None, positions: Tensor, start: int, window: int,
             key_positions: Tensor | None = None) -> Tensor | None:
    """``mask`` [B or 1, T, S] (None: all visible) narrowed to the keys a sliding layer's query sees: those
    less than ``window`` positions behind it.  Key positions: ``key_positions`` [B or 1, S], else slot j <
    ``start`` holds position j - (start - positions[b, 0]) (the committed slots in order up to the pass's
    first position, left padding before them) and slot start + t the pass's own positions[b, t].  The mask
    itself when every key is within the window."""
    if key_positions is None:
        first = positions[:, :1]  # [B, 1]
        if int((positions.max() - (first - start).min())) < window:
            return mask
        key_positions = torch.cat([torch.arange(start, device=positions.device)[None] - (start - first), positions], 1)
    near = key_positions[:, None, :] > positions[:, :, None] - window  # [B, T, S]
    return near if mask is None else mask & near


def causal_mask(t: int, start: int, device=None) -> Tensor:
    """[1, T, start+T] mask for T new tokens after ``start`` committed slots."""
    m = torch.ones(t, start + t, dtype=torch.bool, device=device)
    m[:, start:] = torch.tril(m[:, start:])
    return m[None]
