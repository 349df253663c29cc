"""GGUF block formats: the layouts of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K,
taken apart (``decode``: what the fast kernel repacks and its reference reads) and put together
(``quantize``: a float matrix into any of them, for test models and for drafters).  Written from
ggml's block definitions; gguf-py's dequantizer is the independent check (tests/test_fast.py).

Every format comes down to unsigned codes u per input and, per 32-input block, a scale and for some
a minimum (K-quants: 6- or 8-bit sub-block scales under fp16 super-block scales):

    Q4_0 / Q5_0   w = d (u - 8) / d (u - 16)           Q4_1 / Q5_1   w = d u + m
    Q8_0          w = d c, c the stored int8           Q4_K / Q5_K   w = (d sc) u - dmin mn   (sc, mn 6-bit)
    Q6_K          w = (d sc_h) (u - 32), sc_h the int8 scale of each 16 inputs
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specdraft.model.quant import RawQuant

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the kernel's kind numbers, in order
KINDS = {name: i for i, name in enumerate(FORMATS)}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
SUPER = {"Q4_K", "Q5_K", "Q6_K"}  # 256 inputs a block (8 blocks of 32 for the kernel)
OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # w = scale * (u - offset)
HAS_MIN = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}


def block_inputs(kind: str) -> int:
    return 256 if kind in SUPER else 32


@dataclass
class Decoded:
    """A GGUF matrix's blocks taken apart (written from ggml's block layouts), per 32-input block b:
    ``codes`` [rows, cols] uint8 (the unsigned u; Q8_0: int8 c); ``d`` fp16 [rows, NB] the block scale, or
    [rows, NB/8] the super-block's (K-quants); ``m`` like d: the block minimum (Q4_1, Q5_1) or the
    super-block's dmin (Q4_K, Q5_K), else None; ``sc`` [rows, NB, 2]: Q4_K / Q5_K uint8 (sc, mn) of
    block b, Q6_K int8 (sc_0, sc_1) of its two halves, else None."""

    kind: str
    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    sc: np.ndarray | None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.codes.shape[1]

    def block_params(self) -> tuple[Tensor, Tensor | None]:
        """Per (row, 32-block) fp32: the scale dw and the additive minimum mw (None where the format
        has none), as the kernel forms them: Q4_K / Q5_K dw = d * float(sc), mw = -(dmin * float(mn))."""
        nb = self.cols // 32
        d = torch.from_numpy(self.d.astype(np.float32))
        m = None if self.m is None else torch.from_numpy(self.m.astype(np.float32))
        if self.kind in ("Q4_K", "Q5_K"):
            sc = torch.from_numpy(self.sc.astype(np.float32))
            d8, m8 = d.repeat_interleave(8, dim=1), m.repeat_interleave(8, dim=1)
            return d8 * sc[..., 0], -(m8 * sc[..., 1])
        if self.kind == "Q6_K":
            return d.repeat_interleave(8, dim=1), None
        assert d.shape[1] == nb
        return d, m

    def dequantize(self) -> Tensor:
        """fp32 [rows, cols], in the formats' own arithmetic (equal to gguf-py's dequantizer: tested)."""
        r, k = self.rows, self.cols
        u = torch.from_numpy(self.codes.astype(np.float32)).view(r, k // 32, 32)
        if self.kind == "Q6_K":
            d = torch.from_numpy(self.d.astype(np.float32)).repeat_interleave(16, dim=1)  # per 16 inputs
            scale = d * torch.from_numpy(self.sc.astype(np.float32)).reshape(r, -1)
            return (scale.view(r, -1, 1) * (u.view(r, -1, 16) - 32)).reshape(r, k)
        dw, mw = self.block_params()
        if self.kind in OFFSET:
            u = u - OFFSET[self.kind]
        w = dw[..., None] * u
        if mw is not None:
            w = w + mw[..., None]
        return w.reshape(r, k)


def _f16(b: np.ndarray) -> np.ndarray:  # [..., 2] bytes -> fp16 [...]
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [..., n] bytes -> [..., 2n]: the low nibbles, then the high
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 scale bytes of a super-block [..., 12] -> 6-bit (sc, mn) [..., 8] each."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def decode(raw: RawQuant) -> Decoded:
    """Take a GGUF matrix's blocks apart (see ``Decoded``)."""
    kind, rows, cols = raw.kind, raw.rows, raw.cols
    if kind not in KINDS:
        raise ValueError(f"the fast mode reads {', '.join(FORMATS)} blocks, not {kind}")
    per = block_inputs(kind)
    if cols % per or raw.data.shape[1] != cols // per * BLOCK_BYTES[kind]:
        raise ValueError(f"{kind}: a row of {cols} inputs is not {cols // per} blocks of {BLOCK_BYTES[kind]} bytes")
    b = raw.data.reshape(rows, cols // per, BLOCK_BYTES[kind])
    m = sc = None
    if kind in ("Q4_0", "Q4_1"):
        o = 2 if kind == "Q4_0" else 4
        d, m = _f16(b[..., 0:2]), None if kind == "Q4_0" else _f16(b[..., 2:4])
        codes = _nibbles(b[..., o:o + 16])
    elif kind in ("Q5_0", "Q5_1"):
        o = 2 if kind == "Q5_0" else 4
        d, m = _f16(b[..., 0:2]), None if kind == "Q5_0" else _f16(b[..., 2:4])
        qh = np.ascontiguousarray(b[..., o:o + 4]).view("<u4")  # [rows, nb, 1]: bit e = bit 4 of input e
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = _nibbles(b[..., o + 4:o + 20]) | (high << 4)
    elif kind == "Q8_0":
        d, codes = _f16(b[..., 0:2]), b[..., 2:34].view(np.int8)
    elif kind in ("Q4_K", "Q5_K"):
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        s, mn = _k_scales(b[..., 4:16])
        sc = np.stack([s, mn], axis=-1).reshape(rows, -1, 2)  # [rows, NB, 2]
        o = 16 if kind == "Q4_K" else 48
        qs = b[..., o:o + 128].reshape(rows, -1, 4, 32)  # chunk i: blocks 2i (low nibbles) and 2i+1 (high)
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 256)
        if kind == "Q5_K":  # bit 4 of input 32j + l: bit j of qh[l]
            qh = b[..., 16:48]
            high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            codes = codes | (high.reshape(rows, -1, 256) << 4)
    else:  # Q6_K: ql[128], qh[64], int8 scales[16] (one per 16 inputs), fp16 d
        ql, qh = b[..., 0:128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 32)
        low = np.stack([ql & 15, ql >> 4], axis=3).reshape(rows, -1, 2, 4, 32)  # half, quarter, l
        high = (qh[:, :, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, None, :, None]) & 3
        codes = (low | (high << 4)).reshape(rows, -1, 256)
        d = _f16(b[..., 208:210])
        sc = b[..., 192:208].view(np.int8).reshape(rows, -1, 2)  # [rows, NB, 2]: block b's halves
    return Decoded(kind, np.ascontiguousarray(codes.reshape(rows, cols)), np.ascontiguousarray(d),
                   None if m is None else np.ascontiguousarray(m), None if sc is None else np.ascontiguousarray(sc))




def _f16_bytes(a: np.ndarray) -> np.ndarray:  # float [...] -> its fp16 bytes [..., 2]
    return np.ascontiguousarray(a.astype(np.float16)).view(np.uint8).reshape(*a.shape, 2)


def _pack_nibbles(u: np.ndarray) -> np.ndarray:  # [..., 2n] codes < 16 -> [..., n]: low nibbles, then high
    n = u.shape[-1] // 2
    return (u[..., :n] | (u[..., n:] << 4)).astype(np.uint8)


def _round_div(x: np.ndarray, d: np.ndarray) -> np.ndarray:  # round(x / d), 0 where d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d != 0, np.rint(x / np.where(d != 0, d, 1)), 0)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 6-bit (sc, mn) [..., 8] each -> the 12 scale bytes (the inverse of ``_k_scales``)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def quantize(w: Tensor | np.ndarray, kind: str) -> RawQuant:
    """A float matrix [rows, cols] in ``kind``'s blocks (cols a multiple of 32, or of 256 for the
    K-quants), with plain round-to-nearest scales (not llama.cpp's error-minimizing search: these are
    for test models and for checking the kernels, where any valid blocks will do)."""
    x = np.asarray(w.detach().float().cpu().numpy() if isinstance(w, Tensor) else w, dtype=np.float32)
    if kind not in KINDS:
        raise ValueError(f"no quantizer for {kind} (only {', '.join(FORMATS)})")
    rows, cols = x.shape
    per = 256 if kind in SUPER else 32
    if cols % per:
        raise ValueError(f"{kind} needs rows of a multiple of {per} inputs, not {cols}")
    xb = x.reshape(rows, -1, per)
    if kind in ("Q8_0", "Q4_0", "Q5_0"):
        amax = np.abs(xb).max(-1, keepdims=True)
        if kind == "Q8_0":
            d = (amax / 127).astype(np.float16).astype(np.float32)
            q = np.clip(_round_div(xb, d), -127, 127).astype(np.int8).view(np.uint8)
            return RawQuant(kind, cols, np.concatenate([_f16_bytes(d[..., 0]), q], -1).reshape(rows, -1))
        levels = 8 if kind == "Q4_0" else 16
        # the signed extreme maps to -levels (as llama.cpp): d = max / -levels
        ext = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
        d = (ext / -levels).astype(np.float16).astype(np.float32)
        u = np.clip(_round_div(xb, d) + levels, 0, 2 * levels - 1).astype(np.uint8)
        parts = [_f16_bytes(d[..., 0])]
    elif kind in ("Q4_1", "Q5_1"):
        top = 15 if kind == "Q4_1" else 31
        lo, hi = xb.min(-1, keepdims=True), xb.max(-1, keepdims=True)
        d = ((hi - lo) / top).astype(np.float16).astype(np.float32)
        m = lo.astype(np.float16).astype(np.float32)
        u = np.clip(_round_div(xb - m, d), 0, top).astype(np.uint8)
        parts = [_f16_bytes(d[..., 0]), _f16_bytes(m[..., 0])]
    elif kind in ("Q4_K", "Q5_K"):
        top = 15 if kind == "Q4_K" else 31
        sub = xb.reshape(rows, -1, 8, 32)
        lo = np.minimum(sub.min(-1), 0)  # [rows, nsb, 8]: w = scale u - min, min >= 0
        scale = (sub.max(-1) - lo) / top
        d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
        dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
        sc = np.clip(_round_div(scale, d), 0, 63).astype(np.uint8)
        mn = np.clip(_round_div(-lo, dmin), 0, 63).astype(np.uint8)
        eff_d, eff_m = (d * sc)[..., None], (dmin * mn)[..., None]
        u = np.clip(_round_div(sub + eff_m, eff_d), 0, top).astype(np.uint8).reshape(rows, -1, 256)
        parts = [_f16_bytes(d[..., 0]), _f16_bytes(dmin[..., 0]), _k_scale_bytes(sc, mn)]
        chunks = u.reshape(rows, -1, 4, 2, 32)  # chunk i: blocks 2i (low nibbles), 2i+1 (high)
        if kind == "Q5_K":
            high = (u >> 4).reshape(rows, -1, 8, 32)  # bit 4 of input 32j + l -> bit j of qh[l]
            parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(2, dtype=np.uint8))
        chunks = chunks & 15
        parts.append((chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(rows, -1, 128))
        return RawQuant(kind, cols, np.concatenate(parts, -1).reshape(rows, -1))
    else:  # Q6_K
        sub = xb.reshape(rows, -1, 16, 16)
        ext = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]  # [rows, nsb, 16]
        scale = ext / -32
        d = (np.abs(scale).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(_round_div(scale, d), -128, 127).astype(np.int8)
        eff = (d * sc)[..., None]
        u = np.clip(_round_div(sub, eff) + 32, 0, 63).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # half, quarter, l
        low, high = u & 15, u >> 4
        ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)
        qh = (high << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(3, dtype=np.uint8)  # [rows, nsb, 2, 32]
        data = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                               _f16_bytes(d[..., 0])], -1)
        return RawQuant(kind, cols, data.reshape(rows, -1))
    # the 32-input formats with 4 or 5 bits: [scales], (qh), nibbles
    if kind in ("Q5_0", "Q5_1"):
        bits = ((u >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
        parts.append(np.ascontiguousarray(bits.astype("<u4")).view(np.uint8).reshape(rows, -1, 4))
    parts.append(_pack_nibbles(u & 15))
    return RawQuant(kind, cols, np.concatenate(parts, -1).reshape(rows, -1))
