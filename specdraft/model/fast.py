"""The "fast" precision mode: 8-bit activations against the GGUF's own blocks, bit-exact per row.

The exact mode (``model.quant``) rebuilds every weight in fp32 before multiplying; this mode does what
llama.cpp does instead and takes integer dot products.  Each activation row is quantized per 32-block,
q = round(x / d) with d = max|x| / 127, and the weights stay as the GGUF stores them, in any of the
common block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-input blocks) and the K-quants Q4_K, Q5_K, Q6_K
(256-input super-blocks with 6- or 8-bit sub-block scales).  Every format comes down to unsigned codes
u per input and, per 32-input block, a scale (and for some a minimum):

    Q4_0 / Q5_0   w = d (u - 8) / d (u - 16)           Q4_1 / Q5_1   w = d u + m
    Q8_0          w = d c, c the stored int8           Q4_K / Q5_K   w = (d sc) u - dmin mn   (sc, mn 6-bit)
    Q6_K          w = (d sc_h) (u - 32), sc_h the int8 scale of the block's half h (16 inputs each)

so per block the kernel takes one exact int32 dot product of the codes with the activation bytes
(minus the offset times sum q; Q6_K: its two halves' sums times their scales), and then a fixed
sequence of fp32 operations (``fast.cpp`` states it; ``reference_linear`` below is the same arithmetic in
torch, written from the GGUF's own block layout).  Attention takes each row's visible slots in slot
order, and the norms, RoPE, SiLU and residuals are row-by-row loops.  So a row's result depends on
nothing but the row: a tree node's logits are bit-identical to a one-token pass over its path, and
speculative greedy equals plain greedy in this mode with no exception for ties.

What it does not promise: equality with HF's fp32 model.  Rounding the activations to 8 bits moves
the logits (as llama.cpp's do), so greedy output can differ from the exact mode's where two tokens
are close.  The kernel has AVX-512 VNNI, AVX2 and portable implementations of the same arithmetic,
picked at run time (``isa()``): the same bits, at different speeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from specdraft.model.blocks import FORMATS, KINDS, OFFSET, SUPER, Decoded, decode  # noqa: F401 (re-exported)
from specdraft.model.quant import RawQuant, cpuinfo

ISAS = ("portable", "avx2", "avx512_vnni")  # fast_isa() numbers
DEFAULT_PRECISION = None  # fast where it can run (the CPU, float32, a supported architecture), else exact
PRECISIONS = {  # --precision: what each mode promises
    "fast": "8-bit activations against the GGUF's blocks (llama.cpp's arithmetic); bit-exact per row, so "
            "speculative output equals this mode's plain decoding token for token",
    "exact": "fp32 activations and weights rebuilt exactly from the GGUF; equals HF transformers' fp32 "
             "model within 1e-4",
}


def isa() -> str:
    """The kernel implementation in use on this CPU: "avx512_vnni", "avx2" or "portable"."""
    return ISAS[int(torch.ops.specdraft_quant.fast_isa())]


def cpu_name() -> str:
    """This CPU's model name, for benchmark JSON: figures depend on it."""
    import platform

    return cpuinfo("model name") or platform.processor() or platform.machine()


def kernel_info(model) -> dict:
    """What runs a model's passes, for benchmark JSON and ``--verbose``: the precision mode, and in the
    fast mode the kernel's instruction set and the block formats it reads (matrices of each)."""
    info = {"precision": model.precision}
    if model.precision == "fast":
        info.update(isa=isa(), formats=model.fast_formats())
    return info


def _per_group(a: np.ndarray, g: int) -> np.ndarray:  # [16g, nb, ...] -> [g, nb, 16, ...]
    return a.reshape(g, 16, *a.shape[1:]).swapaxes(1, 2)


def _lanes(a: np.ndarray) -> np.ndarray:  # [g, nb, 16, V, 4] -> [g, nb, V, 16, 4]: vector, lane, byte
    return a.swapaxes(2, 3)


def repack(dec: Decoded) -> list[Tensor]:
    """``fast.cpp``'s layout (its "weights" comment) of a decoded matrix: [qs, d, m, sc] (empty tensors
    where the format has none), in groups of 16 rows (zero rows pad the last)."""
    n, k, kind = dec.rows, dec.cols, dec.kind
    g, nb = (n + 15) // 16, k // 32
    pad = 16 * g - n

    def rows(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)]) if pad else a

    c = _per_group(rows(dec.codes).reshape(16 * g, nb, 32), g)  # [g, nb, 16, 32]
    if kind == "Q8_0":
        planes = [_lanes(c.view(np.uint8).reshape(g, nb, 16, 8, 4))]  # quad j = inputs 4j .. 4j+3
    else:
        q = c.reshape(g, nb, 16, 4, 2, 4)  # input 8k + 4h + i
        planes = [_lanes((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4))]  # vector k: quads 2k, 2k+1
        hi = (c >> 4).reshape(g, nb, 16, 8, 4)  # the codes' bits 4 (and 5), quad j, byte i
        if kind in ("Q5_0", "Q5_1", "Q5_K"):
            bit = (hi << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=3, dtype=np.uint8)  # bit j: quad j
            planes.append(bit.reshape(g, nb, 1, 16, 4))
        elif kind == "Q6_K":
            two = hi.reshape(g, nb, 16, 2, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
            planes.append(_lanes(two.sum(axis=4, dtype=np.uint8)))  # vector p, bits 2jj: quad 4p + jj
    qs = np.concatenate([p.reshape(g, nb, -1) for p in planes], axis=2)

    def scales(a: np.ndarray | None) -> Tensor:  # [n, x, ...] -> [g, x, ..., 16]
        if a is None:
            return torch.empty(0, dtype=torch.int16)
        a = _per_group(rows(a), g)  # [g, x, 16, ...]
        a = np.moveaxis(a, 2, -1)
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16 if a.dtype == np.float16 else a.dtype))

    sc = scales(dec.sc)
    return [torch.from_numpy(np.ascontiguousarray(qs)), scales(dec.d), scales(dec.m),
            sc if dec.sc is not None else torch.empty(0, dtype=torch.uint8)]


@dataclass
class FastWeight:
    """A projection for ``fast.cpp``: one or more GGUF matrices (a fused q|k|v or gate|up may mix
    formats) repacked side by side in the output; ``parts`` holds (kind, rows, [qs, d, m, sc]) each."""

    rows: int
    cols: int
    parts: list

    def __post_init__(self) -> None:  # the op arguments, built once (drafters call this on every step)
        self._args = ([t for p in self.parts for t in p[2]], [x for p in self.parts for x in (KINDS[p[0]], p[1])])

    @classmethod
    def from_raw(cls, *raws: RawQuant) -> "FastWeight":
        parts = []
        for raw in raws:
            if raw.cols != raws[0].cols:
                raise ValueError("fused parts must have the same input width")
            parts.append((raw.kind, raw.rows, repack(decode(raw))))
        return cls(sum(p[1] for p in parts), raws[0].cols, parts)

    @classmethod
    def from_dense(cls, w: Tensor, kind: str = "Q8_0") -> "FastWeight":
        """A float matrix [rows, cols] (cols a multiple of 32) rounded to ``kind``'s blocks (Q8_0 or Q4_0, as
        llama.cpp's quantizer does) and repacked: for drafter networks, which have no GGUF blocks."""
        return cls.from_raw(dense_raw(w, kind))

    def args(self) -> tuple[list[Tensor], list[int]]:
        """(tensors, meta): [qs, d, m, sc] and [kind, rows] per part, as the C++ ops take a weight."""
        return self._args

    @property
    def nbytes(self) -> int:
        """The repacked weight's size: what a pass streams for it."""
        return sum(t.numel() * t.element_size() for t in self._args[0])

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """y = x @ W^T (+ ``bias`` [rows] fp32, added in the kernel) for x [..., cols] fp32."""
        y = torch.ops.specdraft_quant.fast_linear(x.reshape(-1, self.cols).float(), *self.args(), bias)
        return y.view(*x.shape[:-1], self.rows)


class QuantLinear(nn.Module):
    """Stand-in for an ``nn.Linear`` at inference: its weight rounded to Q8_0 (or ``kind``: Q4_0) and
    multiplied on the fast kernel (8-bit activations); output in the input's dtype.  ``weight`` and
    ``bias`` stay readable."""

    def __init__(self, lin: nn.Linear, kind: str = "Q8_0") -> None:
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.mm = FastWeight.from_dense(lin.weight, kind)

    def forward(self, x: Tensor) -> Tensor:
        b = self.bias
        if x.dtype == torch.float32 and (b is None or b.dtype == torch.float32):
            return self.mm(x, b)  # one kernel call, the bias added in it
        y = self.mm(x).to(x.dtype)
        return y if b is None else y + b


def quantize_linears(module: nn.Module, kind: str = "Q8_0") -> int:
    """Replace every ``nn.Linear`` under ``module`` whose input width is a multiple of 32 by a
    ``QuantLinear`` with ``kind``'s blocks; returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
            setattr(module, name, QuantLinear(child, kind))
            n += 1
        else:
            n += quantize_linears(child, kind)
    return n


DENSE_KINDS = ("Q8_0", "Q4_0")  # the blocks a dense (drafter) matrix can be rounded to


def dense_raw(w: Tensor, kind: str) -> RawQuant:
    """A float matrix [rows, cols] (cols a multiple of 32) rounded to ``kind``'s blocks (``DENSE_KINDS``),
    as llama.cpp's quantizer does."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind not in DENSE_KINDS:
        raise ValueError(f"a dense matrix rounds to {' or '.join(DENSE_KINDS)}, not {kind}")
    return RawQuant(kind, w.shape[1], quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType[kind]))


def q8_raw(w: Tensor) -> RawQuant:
    """A float matrix [rows, cols] (cols a multiple of 32) rounded to Q8_0 blocks, as llama.cpp's quantizer does."""
    return dense_raw(w, "Q8_0")


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


def reference_linear(x: Tensor, *raws: RawQuant) -> Tensor:
    """``fast_linear``'s arithmetic in torch, equal to the kernel bit for bit, written from the GGUF
    blocks (``decode``), not from the kernel's layout.  Per block b in order, with s_b the block's exact
    integer dot product of the codes (less the format's offset) with the activation bytes:
        acc = acc + float(s_b) * (dw_b * dx_b),  then (formats with a minimum) acc = acc + mw_b * sx_b;
    Q6_K: s_b = sc_0 * (its first 16 inputs' sum) + sc_1 * (the last 16's).  Each float op a separate
    fp32 op, as in the kernel.  Several ``raws``: the parts of a fused projection, side by side."""
    q, dx, sx = reference_quantize(x)
    m, nb = x.shape[0], x.shape[1] // 32
    out = []
    for raw in raws:
        dec = decode(raw)
        u = torch.from_numpy(dec.codes.astype(np.int64)).view(dec.rows, nb, 32)
        if dec.kind in OFFSET:
            u = u - OFFSET[dec.kind]
        if dec.kind == "Q6_K":  # the halves apart, each times its int8 scale: still exact integers
            prod = torch.einsum("mbe,nbe->mnbe", q.view(m, nb, 32), u)
            sc = torch.from_numpy(dec.sc.astype(np.int64))  # [n, nb, 2]
            s = prod[..., :16].sum(-1) * sc[None, ..., 0] + prod[..., 16:].sum(-1) * sc[None, ..., 1]
        else:
            s = torch.einsum("mbe,nbe->mnb", q.view(m, nb, 32), u)  # int64, exact
        dw, mw = dec.block_params()
        acc = torch.zeros(m, dec.rows)
        for b in range(nb):
            acc = acc + s[:, :, b].float() * (dw[None, :, b] * dx[:, None, b])
            if mw is not None:
                acc = acc + mw[None, :, b] * sx[:, None, b]
        out.append(acc)
    return torch.cat(out, dim=1)
