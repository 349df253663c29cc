"""Matmuls straight from a GGUF's quantized blocks (Q4_1, Q8_0) on the CPU.

A pass of the default target over a few tokens is memory-bound: in fp32 it reads 538 MB of
weights (4 bytes each), about 30 ms on this 2-core machine however well the matmul is tuned.
The GGUF stores the same weights in 32-weight blocks, Q4_1 = {fp16 d, fp16 m, 32 x 4-bit q} with
w = d*q + m (5 bits per weight) and Q8_0 = {fp16 d, 32 x int8 q} with w = d*q: the kernel below
reads those blocks, rebuilds each weight exactly as the fp32 dequantisation does (the same
float32 multiply, then add; contraction into FMA is disabled) and takes the dot products in
fp32.  So the weights are bit-identical to the fp32 model's and only the summation order of the
dot products differs (as between any two fp32 matmul kernels): greedy output matches HF's fp32
`generate` token for token except at floating-point ties (measured by ``specdraft bench``).

Activations stay fp32 (unlike llama.cpp, which rounds them to 8 bits and so changes the output).
The kernel is C++ compiled once per machine with the system compiler through
``torch.utils.cpp_extension`` (cached; about a minute on 2 cores) and runs on torch's own thread
pool.  Anything unusual (no compiler, not x86 AVX-512, another dtype or device) falls back to the
fp32 path with one warning; ``SPECDRAFT_QUANT=0`` turns it off.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

BLOCK = 32  # weights per block, both formats
QUANT_ROWS = 16  # passes of at most this many tokens use the kernel (more: the fp32 matmul, packed)
_KIND = {"Q4_1": 0, "Q8_0": 1}
_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes per block

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// One row of blocks -> K floats, exactly as the fp32 dequantisation: w = d*q + m (Q4_1), w = q*d (Q8_0).
static inline void row_q4_1(const uint8_t* qs, const float* d, const float* m, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * 16;
    float* o = out + b * 32;
#if defined(__AVX512F__)
    __m128i v = _mm_loadu_si128((const __m128i*)q);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    __m512 vd = _mm512_set1_ps(d[b]), vm = _mm512_set1_ps(m[b]);
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), vm));
    _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), vm));
#else
    for (int j = 0; j < 16; ++j) {
      o[j] = d[b] * (float)(q[j] & 15) + m[b];
      o[j + 16] = d[b] * (float)(q[j] >> 4) + m[b];
    }
#endif
  }
}

static inline void row_q8_0(const int8_t* qs, const float* d, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = qs + b * 32;
    float* o = out + b * 32;
#if defined(__AVX512F__)
    __m512 vd = _mm512_set1_ps(d[b]);
    __m128i a = _mm_loadu_si128((const __m128i*)q), c = _mm_loadu_si128((const __m128i*)(q + 16));
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), vd));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), vd));
#else
    for (int j = 0; j < 32; ++j) o[j] = (float)q[j] * d[b];
#endif
  }
}

static inline float dot(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float r = 0.f;
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  r = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#endif
  for (; i < k; ++i) r += a[i] * b[i];
  return r;
}

// y[M, N] = x[M, K] @ W^T with W [N, K] in blocks; kind 0 = Q4_1 (qs [N, K/2] u8, d, m [N, K/32]),
// kind 1 = Q8_0 (qs [N, K] i8, d [N, K/32]).  Rows of W are split over torch's threads; each row
// is rebuilt once into a K-float buffer (L1) and dotted with every row of x.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [M, K] contiguous fp32");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && d.size(0) == N && d.size(1) == nb, "weight blocks do not fit x");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* q = (const uint8_t*)qs.data_ptr();
  const float* dp = d.data_ptr<float>();
  const float* mp = kind == 0 ? m.data_ptr<float>() : nullptr;
  const int64_t row_bytes = kind == 0 ? K / 2 : K;
  at::parallel_for(0, N, 8, [&](int64_t s, int64_t e) {
    std::vector<float> buf(K);
    for (int64_t n = s; n < e; ++n) {
      if (kind == 0) row_q4_1(q + n * row_bytes, dp + n * nb, mp + n * nb, nb, buf.data());
      else row_q8_0((const int8_t*)(q + n * row_bytes), dp + n * nb, nb, buf.data());
      for (int64_t i = 0; i < M; ++i) yp[i * N + n] = dot(buf.data(), xp + i * K, K);
    }
  });
  return y;
}

TORCH_LIBRARY(specdraft_quant, lib) {
  lib.def("qlinear(Tensor x, Tensor qs, Tensor d, Tensor m, int kind) -> Tensor", &qlinear);
}
"""

_STATE: dict[str, object] = {}


def kernel_available() -> bool:
    """Compile (once per machine, cached) and load the kernel; False (with one warning) if impossible."""
    if "ok" in _STATE:
        return bool(_STATE["ok"])
    ok = False
    if os.environ.get("SPECDRAFT_QUANT", "1") != "0":
        try:
            from torch.utils.cpp_extension import load_inline

            load_inline("specdraft_quant", cpp_sources=[_SOURCE], is_python_module=False, verbose=False,
                        extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"])
            ok = hasattr(torch.ops.specdraft_quant, "qlinear")
        except Exception as e:  # no compiler / ninja / headers: the fp32 path still works
            warnings.warn(f"specdraft: quantized CPU kernel unavailable, using fp32 weights ({type(e).__name__}: {e})",
                          stacklevel=2)
    _STATE["ok"] = ok
    return ok


@dataclass
class RawQuant:
    """A GGUF tensor's blocks as stored: [rows, row_bytes] uint8, rows = output features."""

    kind: str  # "Q4_1" or "Q8_0"
    cols: int  # input features K
    data: np.ndarray

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def take_rows(self, index) -> "RawQuant":
        return RawQuant(self.kind, self.cols, np.ascontiguousarray(self.data[index]))

    def dequantize(self) -> Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        arr = dequantize(self.data, GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.asarray(arr, dtype=np.float32).reshape(self.rows, self.cols).copy())


def supported(kind: str) -> bool:
    return kind in _KIND


def concat_rows(parts: list[RawQuant]) -> RawQuant | None:
    if len({(p.kind, p.cols) for p in parts}) != 1:
        return None  # mixed formats: not fused, the layer keeps the fp32 path
    return RawQuant(parts[0].kind, parts[0].cols, np.concatenate([p.data for p in parts]))


class QuantWeight:
    """Kernel-ready form of a ``RawQuant`` (scales and minima widened to fp32 once), plus an optional
    per-input scale applied to x first (an RMSNorm weight the fp32 path folds into W)."""

    def __init__(self, raw: RawQuant, in_scale: Tensor | None = None) -> None:
        nb = raw.cols // BLOCK
        blocks = raw.data.reshape(raw.rows, nb, _BYTES[raw.kind])
        self.kind = _KIND[raw.kind]
        self.rows, self.cols = raw.rows, raw.cols
        self.d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32).reshape(raw.rows, nb))
        if raw.kind == "Q4_1":
            self.m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32).reshape(raw.rows, nb))
            self.qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:]).reshape(raw.rows, nb * 16))
        else:
            self.m = torch.empty(0)
            self.qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).reshape(raw.rows, nb * 32))
        self.in_scale = None if in_scale is None else in_scale.detach().float().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.in_scale is not None:
            x2 = x2 * self.in_scale
        y = torch.ops.specdraft_quant.qlinear(x2.contiguous(), self.qs, self.d, self.m, self.kind)
        return y.view(*shape[:-1], self.rows)
