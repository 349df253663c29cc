"""The "fast" precision mode: 8-bit activations against the GGUF's own blocks, bit-exact per row.

The exact mode (``model.quant``) rebuilds every weight in fp32 before multiplying; this mode does what
llama.cpp does instead and takes integer dot products.  Each activation row is quantized per 32-block,
q = round(x / d) with d = max|x| / 127, and the weights stay as stored (Q4_1: w = d_w c + m, c in 0..15;
Q8_0: w = d_w c).  Per block,

    sum_j w_j x_j  ~=  d_w d_x sum_j c_j q_j  (+ m_w d_x sum_j q_j  for Q4_1),

with sum_j c_j q_j an exact int32 (AVX-512 VNNI ``vpdpbusd`` multiplies 4 byte pairs per lane).  One
register holds 16 weight rows; 8 ``vpdpbusd`` sum a whole block in each row's lane, and each row's float
sum then runs over its blocks in order, with no lane reductions (``fast.cpp`` states it exactly;
``reference_linear`` below is the same arithmetic in torch).  Attention takes each row's visible slots
in slot order, and the norms, RoPE, SiLU and residuals are row-by-row loops.  So a row's result
depends on nothing but the row: a tree node's logits are bit-identical to a one-token pass over its
path, and speculative greedy equals plain greedy in this mode with no exception for ties.

What it does not promise: equality with HF's fp32 model.  Rounding the activations to 8 bits moves
the logits (as llama.cpp's do), so greedy output can differ from the exact mode's where two tokens
are close.  CPUs without VNNI run an AVX2 version (``vpmaddubsw`` + ``vpmaddwd``: the same int32 block sums
and float steps), and CPUs without AVX2 a portable one: the same bits, slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from specdraft.model.quant import RawQuant

KINDS = {"Q4_1": 0, "Q8_0": 1}
DEFAULT_PRECISION = None  # fast where it can run (the CPU, float32, a supported architecture), else exact
PRECISIONS = {  # --precision: what each mode promises
    "fast": "8-bit activations against the GGUF's blocks (llama.cpp's arithmetic); bit-exact per row, so "
            "speculative output equals this mode's plain decoding token for token",
    "exact": "fp32 activations and weights rebuilt exactly from the GGUF; equals HF transformers' fp32 "
             "model within 1e-4",
}


@dataclass
class FastWeight:
    """A GGUF matrix [rows, cols] repacked for ``fast.cpp`` (see its "weights" comment): groups of 16 rows
    (zero rows pad the last), block by block.  ``qs`` uint8 [G, NB, 256] (Q4_1) or [G, NB, 512] (Q8_0,
    code + 128); ``d`` / ``m`` the per-block fp16 scale / minimum as int16 bits [G, NB, 16]."""

    kind: int
    rows: int
    cols: int
    qs: Tensor
    d: Tensor
    m: Tensor | None

    @classmethod
    def from_raw(cls, raw: RawQuant) -> "FastWeight":
        if raw.kind not in KINDS:
            raise ValueError(f"fast mode reads Q4_1 / Q8_0 blocks, not {raw.kind}")
        n, k = raw.rows, raw.cols
        nb, g = k // 32, (n + 15) // 16
        blocks = np.zeros((16 * g, nb, raw.data.shape[1] // nb), dtype=np.uint8)
        blocks[:n] = raw.data.reshape(n, nb, -1)

        def per_group(a: np.ndarray) -> Tensor:  # [16g, nb, ...] -> [g, nb, 16, ...]
            return a.reshape(g, 16, nb, *a.shape[2:]).swapaxes(1, 2)

        d = torch.from_numpy(np.ascontiguousarray(per_group(blocks[:, :, 0:2].copy().view(np.int16)[..., 0])))
        if raw.kind == "Q4_1":
            m = torch.from_numpy(np.ascontiguousarray(per_group(blocks[:, :, 2:4].copy().view(np.int16)[..., 0])))
            packed = blocks[:, :, 4:20]  # element e < 16: low nibble of byte e; e >= 16: high nibble of byte e - 16
            codes = np.concatenate([packed & 15, packed >> 4], axis=2)  # [16g, nb, 32]
            c = per_group(codes).reshape(g, nb, 16, 4, 2, 4)  # e = 8k + 4h + i -> (k, h, i)
            qs = c[:, :, :, :, 0, :] | (c[:, :, :, :, 1, :] << 4)  # [g, nb, lane, k, i]
            qs = qs.transpose(0, 1, 3, 2, 4)  # [g, nb, k, lane, i]: vector k, lane l, byte i
            return cls(0, n, k, torch.from_numpy(np.ascontiguousarray(qs, dtype=np.uint8).reshape(g, nb, 256)), d, m)
        codes = blocks[:, :, 2:34].view(np.int8).astype(np.int16) + 128  # [16g, nb, 32]
        c = per_group(codes.astype(np.uint8)).reshape(g, nb, 16, 8, 4)  # e = 4j + i -> (j, i)
        qs = c.transpose(0, 1, 3, 2, 4)  # [g, nb, j, lane, i]
        return cls(1, n, k, torch.from_numpy(np.ascontiguousarray(qs).reshape(g, nb, 512)), d, None)

    @classmethod
    def from_dense(cls, w: Tensor) -> "FastWeight":
        """A float matrix [rows, cols] (cols a multiple of 32) rounded to Q8_0 blocks (as llama.cpp's
        quantizer does) and repacked: for drafter networks, which have no GGUF blocks."""
        return cls.from_raw(q8_raw(w))

    def args(self) -> tuple:
        """(qs, d, m, kind, rows), the order the C++ ops take a weight in."""
        return (self.qs, self.d, self.m, self.kind, self.rows)

    def __call__(self, x: Tensor) -> Tensor:
        """y = x @ W^T for x [..., cols] fp32."""
        y = torch.ops.specdraft_quant.fast_linear(x.reshape(-1, self.cols).float(), *self.args())
        return y.view(*x.shape[:-1], self.rows)

    def codes(self) -> Tensor:
        """The codes per weight, int64 [rows, cols] (Q4_1 0..15, Q8_0 -128..127): for the reference."""
        g, nb = self.qs.shape[0], self.qs.shape[1]
        q = self.qs.long()
        if self.kind == 0:
            v = q.view(g, nb, 4, 16, 4)  # [g, nb, k, lane, i]
            c = torch.stack([v & 15, v >> 4], dim=3)  # [g, nb, k, h, lane, i]
            c = c.permute(0, 4, 1, 2, 3, 5)  # [g, lane, nb, k, h, i]: e = 8k + 4h + i
        else:
            c = (q.view(g, nb, 8, 16, 4) - 128).permute(0, 3, 1, 2, 4)  # [g, lane, nb, j, i]
        return c.reshape(16 * g, self.cols)[: self.rows]

    def scales(self) -> tuple[Tensor, Tensor | None]:
        """Per-block d and m as fp32 [rows, NB] (m None for Q8_0)."""
        def rows(t: Tensor) -> Tensor:
            return t.view(torch.float16).float().permute(0, 2, 1).reshape(-1, t.shape[1])[: self.rows]
        return rows(self.d), None if self.m is None else rows(self.m)


class QuantLinear(nn.Module):
    """Stand-in for an ``nn.Linear`` at inference: its weight rounded to Q8_0 and multiplied on the fast
    kernel (8-bit activations); output in the input's dtype.  ``weight`` and ``bias`` stay readable."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.mm = FastWeight.from_dense(lin.weight)

    def forward(self, x: Tensor) -> Tensor:
        y = self.mm(x).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` whose input width is a multiple of 32 by a
    ``QuantLinear``; returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
            setattr(module, name, QuantLinear(child))
            n += 1
        else:
            n += quantize_linears(child)
    return n


def q8_raw(w: Tensor) -> RawQuant:
    """A float matrix [rows, cols] (cols a multiple of 32) rounded to Q8_0 blocks, as llama.cpp's quantizer does."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return RawQuant("Q8_0", w.shape[1], quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType.Q8_0))


def q8_blocks(state_dict: dict[str, Tensor]) -> dict[str, RawQuant]:
    """Q8_0 blocks of every projection and the embedding / LM head of an fp32 state dict (an HF folder has
    no GGUF blocks): what the fast mode reads for such a target.  Tensors whose width is not a
    multiple of 32 are left out (the model then stays in the exact mode)."""
    return {name: q8_raw(t) for name, t in state_dict.items()
            if t.dim() == 2 and t.shape[1] % 32 == 0
            and (name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight"))}


def rotation_table(max_positions: int, inv_freq: Tensor, start: int = 0) -> Tensor:
    """(cos, sin) of the RoPE angles of positions ``start .. max_positions-1``, fp32 [N, D/2, 2]: a pass
    looks its rows up, so a position's rotation is the same bits whatever the pass."""
    pos = torch.arange(start, max_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None]
    return torch.view_as_real(torch.polar(torch.ones_like(freqs), freqs)).contiguous()


def reference_quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Activation quantization as the kernel does it: (q int64 [M, K], d [M, NB], sx [M, NB])."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).long()  # round half to even, as the kernel
    return q.reshape(m, k), d, d * q.sum(-1).float()


def reference_linear(x: Tensor, w: FastWeight) -> Tensor:
    """``fast_linear``'s arithmetic in torch, equal to the kernel bit for bit: per block b in order,
    acc = acc + float(s_b) * (d_w,b * d_x,b), then (Q4_1) acc = acc + m_w,b * sx_b, where s_b is the
    block's integer dot product (exact); each float op a separate fp32 op, as in the kernel."""
    q, dx, sx = reference_quantize(x)
    m, nb = x.shape[0], w.cols // 32
    s = torch.einsum("mbe,nbe->mnb", q.view(m, nb, 32), w.codes().view(w.rows, nb, 32))  # int64, exact
    dw, mw = w.scales()
    acc = torch.zeros(m, w.rows)
    for b in range(nb):
        acc = acc + s[:, :, b].float() * (dw[None, :, b] * dx[:, None, b])
        if mw is not None:
            acc = acc + mw[None, :, b] * sx[:, None, b]
    return acc
