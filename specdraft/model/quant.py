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
pool, with an AVX-512 and an AVX2 version (other CPUs run plain loops).  Anything unusual (no
compiler, another dtype or device) falls back to the fp32 path with one warning;
``SPECDRAFT_QUANT=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import Tensor

BLOCK = 32  # weights per block, both formats
QUANT_ROWS = 24  # passes of at most this many tokens use the kernel (more: the fp32 matmul, packed)
_KIND = {"Q4_1": 0, "Q8_0": 1}
_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes per block

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>
#include <immintrin.h>

// Blocks are read as the GGUF stores them: Q4_1 = {fp16 d, fp16 m, 16 bytes of 4-bit q} (20 bytes),
// Q8_0 = {fp16 d, 32 int8 q} (34 bytes); block j of 32 weights: q_j = low nibbles then high nibbles.
static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

#if defined(__AVX512F__)
// One block as 32 floats, exactly as the fp32 dequantisation: w = d*q + m (Q4_1), w = q*d (Q8_0).
template <int KIND>
static inline void block(const uint8_t* b, __m512& w0, __m512& w1) {
  if (KIND == 0) {
    __m512 vd = _mm512_set1_ps(half_to_float(b)), vm = _mm512_set1_ps(half_to_float(b + 2));
    __m128i v = _mm_loadu_si128((const __m128i*)(b + 4));
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    w0 = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), vm);
    w1 = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), vm);
  } else {
    __m512 vd = _mm512_set1_ps(half_to_float(b));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), vd);
  }
}

// R weight rows x T rows of x, all R*T accumulators in registers (independent FMA chains).
template <int KIND, int R, int T>
static inline void tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t K, float* y,
                        int64_t N) {
  constexpr int BB = KIND == 0 ? 20 : 34;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w0[R], w1[R];
    for (int r = 0; r < R; ++r) block<KIND>(w + r * row_bytes + b * BB, w0[r], w1[r]);
    for (int t = 0; t < T; ++t) {
      __m512 x0 = _mm512_loadu_ps(x + t * K + b * 32), x1 = _mm512_loadu_ps(x + t * K + b * 32 + 16);
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(w0[r], x0, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(w1[r], x1, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * N + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// Rows [s, e) of W against T rows of x: tiles of R weight rows (R*T accumulators + 2R weights in registers).
template <int KIND, int R, int T>
static inline void rows_t(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t s, int64_t e, const float* x,
                          int64_t K, float* y, int64_t N) {
  int64_t n = s;
  for (; n + R <= e; n += R) tile<KIND, R, T>(w + n * row_bytes, row_bytes, nb, x, K, y + n, N);
  for (; n < e; ++n) tile<KIND, 1, T>(w + n * row_bytes, row_bytes, nb, x, K, y + n, N);
}

// All M rows of x in tiles of <= 8 (each weight block is rebuilt once per tile): 4 weight rows at a
// time for tiles of <= 5 x-rows, 3 for larger tiles (R*T accumulators + 2R weights + 2 x in 32 registers).
template <int KIND>
static void rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t s, int64_t e, const float* x, int64_t M,
                 int64_t K, float* y, int64_t N) {
  for (int64_t i = 0; i < M; i += 8) {
    const float* xi = x + i * K;
    float* yi = y + i * N;
    switch (std::min<int64_t>(8, M - i)) {
      case 8: rows_t<KIND, 3, 8>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 7: rows_t<KIND, 3, 7>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 6: rows_t<KIND, 3, 6>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 5: rows_t<KIND, 4, 5>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 4: rows_t<KIND, 4, 4>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 3: rows_t<KIND, 4, 3>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 2: rows_t<KIND, 4, 2>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      default: rows_t<KIND, 4, 1>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (e.g. Zen 3): the same weights rebuilt exactly, a block as 4 quarters of 8 floats.
// Quarter p of block b: Q4_1 low nibbles 0-7, 8-15, then high nibbles 0-7, 8-15; Q8_0 codes 8p .. 8p+7.
template <int KIND>
static inline __m256 quarter(const uint8_t* b, int p) {
  if (KIND == 0) {
    const __m256 vd = _mm256_set1_ps(half_to_float(b)), vm = _mm256_set1_ps(half_to_float(b + 2));
    __m128i v = _mm_loadl_epi64((const __m128i*)(b + 4 + 8 * (p & 1)));
    v = p < 2 ? _mm_and_si128(v, _mm_set1_epi8(0x0F)) : _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    return _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))), vm);
  } else {
    const __m256 vd = _mm256_set1_ps(half_to_float(b));
    const __m128i v = _mm_loadl_epi64((const __m128i*)(b + 2 + 8 * p));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), vd);
  }
}

static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// R weight rows x T rows of x: R*T accumulators, R rebuilt quarters and one x quarter in 16 registers.
template <int KIND, int R, int T>
static inline void tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t K, float* y,
                        int64_t N) {
  constexpr int BB = KIND == 0 ? 20 : 34;
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b)
    for (int p = 0; p < 4; ++p) {
      __m256 wq[R];
      for (int r = 0; r < R; ++r) wq[r] = quarter<KIND>(w + r * row_bytes + b * BB, p);
      for (int t = 0; t < T; ++t) {
        const __m256 xq = _mm256_loadu_ps(x + t * K + b * 32 + 8 * p);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wq[r], xq, acc[r][t]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * N + r] = hsum8(acc[r][t]);
}

template <int KIND, int R, int T>
static inline void rows_t(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t s, int64_t e, const float* x,
                          int64_t K, float* y, int64_t N) {
  int64_t n = s;
  for (; n + R <= e; n += R) tile<KIND, R, T>(w + n * row_bytes, row_bytes, nb, x, K, y + n, N);
  for (; n < e; ++n) tile<KIND, 1, T>(w + n * row_bytes, row_bytes, nb, x, K, y + n, N);
}

// All M rows of x in tiles of <= 4: 6 weight rows for one x-row, 4 for two, 3 for three or four.
template <int KIND>
static void rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t s, int64_t e, const float* x, int64_t M,
                 int64_t K, float* y, int64_t N) {
  for (int64_t i = 0; i < M; i += 4) {
    const float* xi = x + i * K;
    float* yi = y + i * N;
    switch (std::min<int64_t>(4, M - i)) {
      case 4: rows_t<KIND, 3, 4>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 3: rows_t<KIND, 3, 3>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      case 2: rows_t<KIND, 4, 2>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
      default: rows_t<KIND, 6, 1>(w, row_bytes, nb, s, e, xi, K, yi, N); break;
    }
  }
}
#else
// Portable fallback: rebuild each weight row into a buffer, then plain dot products.
template <int KIND>
static void rows(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t s, int64_t e, const float* x, int64_t M,
                 int64_t K, float* y, int64_t N) {
  std::vector<float> buf(K);
  for (int64_t n = s; n < e; ++n) {
    const uint8_t* r = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      if (KIND == 0) {
        const uint8_t* bl = r + b * 20;
        float d = half_to_float(bl), m = half_to_float(bl + 2);
        for (int j = 0; j < 16; ++j) {
          buf[b * 32 + j] = d * (float)(bl[4 + j] & 15) + m;
          buf[b * 32 + j + 16] = d * (float)(bl[4 + j] >> 4) + m;
        }
      } else {
        const uint8_t* bl = r + b * 34;
        float d = half_to_float(bl);
        for (int j = 0; j < 32; ++j) buf[b * 32 + j] = (float)((const int8_t*)(bl + 2))[j] * d;
      }
    }
    for (int64_t i = 0; i < M; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += buf[k] * x[i * K + k];
      y[i * N + n] = acc;
    }
  }
}
#endif

// y[M, N] = x[M, K] @ W^T, W = [N, row_bytes] GGUF blocks (kind 0 = Q4_1, 1 = Q8_0).  Rows of W are
// split over torch's threads; each block is rebuilt in registers once per tile of <= 8 rows of x.
static void qlinear_raw(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int64_t kind, float* yp) {
  const int64_t nb = K / 32, row_bytes = nb * (kind == 0 ? 20 : 34);
  at::parallel_for(0, N, 64, [&](int64_t s, int64_t e) {
    if (kind == 0) rows<0>(wp, row_bytes, nb, s, e, xp, M, K, yp, N);
    else rows<1>(wp, row_bytes, nb, s, e, xp, M, K, yp, N);
  });
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [M, K] contiguous fp32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte, "w must be [N, row_bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * (kind == 0 ? 20 : 34), "weight blocks do not fit x");
  auto y = at::empty({M, N}, x.options());
  qlinear_raw(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N, kind, y.data_ptr<float>());
  return y;
}

// RMSNorm rows: fastk::rms_rows (fast.cpp, compiled first), one fixed summation order per row.

// One decoder block (llama.Block.forward) with every projection on the quantized kernel.  Everything
// but the matmuls and the attention itself is plain loops over the pass's few rows: the ~25 small
// ATen ops per block they replace cost more than the arithmetic (about a quarter of a one-token pass
// of the default target).  The loops compute each row on its own; ATen's attention is not guaranteed to
// (a tree node's logits equal one-token decoding of its path to fp32 rounding, not to the bit).
at::Tensor fused_block(const at::Tensor& x_in, const at::Tensor& wqkv, int64_t kqkv, const std::optional<at::Tensor>& s_attn,
                 const std::optional<at::Tensor>& bqkv, const at::Tensor& wo, int64_t ko, const at::Tensor& wgu,
                 int64_t kgu, const std::optional<at::Tensor>& s_mlp, const at::Tensor& wd, int64_t kd,
                 const at::Tensor& rot, const std::optional<at::Tensor>& mask, const at::Tensor& kv, int64_t start,
                 double eps, int64_t hq, int64_t hkv, int64_t d) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat && kv.is_contiguous(),
              "fused block: fp32 x and a contiguous fp32 cache");
  at::Tensor x = x_in.contiguous();
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2), M = b * t, qs = hq * d, ks = hkv * d, g = hq / hkv;
  const int64_t nqkv = wqkv.size(0), inter2 = wgu.size(0), inter = inter2 / 2;
  TORCH_CHECK(nqkv == qs + 2 * ks && wo.size(0) == h && wd.size(0) == h, "fused block: projection shapes");
  const float* xp = x.data_ptr<float>();
  auto opt = x.options();
  // scratch: normed x / attention rows / gate*up rows share one buffer sized for the largest
  at::Tensor buf = at::empty({M * std::max({h, qs, inter})}, opt);
  float* bp = buf.data_ptr<float>();
  at::Tensor qkv = at::empty({M, nqkv}, opt);
  float* qkvp = qkv.data_ptr<float>();

  fastk::rms_rows(xp, M, h, eps, s_attn ? s_attn->data_ptr<float>() : nullptr, bp);
  qlinear_raw(bp, M, h, wqkv.data_ptr<uint8_t>(), nqkv, kqkv, qkvp);
  if (bqkv) {
    const float* bb = bqkv->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) for (int64_t j = 0; j < nqkv; ++j) qkvp[m * nqkv + j] += bb[j];
  }
  // RoPE on q and k: rows are in (2i, 2i+1) pairs, rotated by e^{i pos theta_i} (rot: complex [B, T, 1, D/2])
  at::Tensor rr = at::view_as_real(rot).contiguous();  // [B, T, 1, D/2, 2]
  fastk::rope_rows(qkvp, M, nqkv, hq + hkv, d, rr.data_ptr<float>());
  // K/V into the cache slots start .. start+T-1; q as [B, Hkv, G*T, D] (the G heads sharing a KV head
  // become G*T rows of it, as Block.forward does)
  float* kvp = kv.data_ptr<float>();
  const int64_t s_kv = kv.stride(0), s_b = kv.stride(1), s_h = kv.stride(2), s_s = kv.stride(3);
  at::Tensor q = at::empty({b, hkv, g * t, d}, opt);
  float* qp = q.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti) {
      const float* row = qkvp + (bi * t + ti) * nqkv;
      for (int64_t kh = 0; kh < hkv; ++kh) {
        float* kdst = kvp + bi * s_b + kh * s_h + (start + ti) * s_s;
        std::memcpy(kdst, row + qs + kh * d, d * sizeof(float));
        std::memcpy(kdst + s_kv, row + qs + ks + kh * d, d * sizeof(float));
        for (int64_t gi = 0; gi < g; ++gi)
          std::memcpy(qp + ((bi * hkv + kh) * g * t + gi * t + ti) * d, row + (kh * g + gi) * d, d * sizeof(float));
      }
    }
  at::Tensor kc = kv.select(0, 0).slice(2, 0, start + t), vc = kv.select(0, 1).slice(2, 0, start + t);
  at::Tensor att = at::scaled_dot_product_attention(q, kc, vc, mask).contiguous();  // [B, Hkv, G*T, D]
  const float* ap = att.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)  // back to rows of [Hq * D]
    for (int64_t kh = 0; kh < hkv; ++kh)
      for (int64_t gi = 0; gi < g; ++gi)
        for (int64_t ti = 0; ti < t; ++ti)
          std::memcpy(bp + (bi * t + ti) * qs + (kh * g + gi) * d, ap + ((bi * hkv + kh) * g * t + gi * t + ti) * d,
                      d * sizeof(float));
  at::Tensor y = at::empty({b, t, h}, opt);
  float* yp = y.data_ptr<float>();
  qlinear_raw(bp, M, qs, wo.data_ptr<uint8_t>(), h, ko, yp);
  for (int64_t i = 0; i < M * h; ++i) yp[i] += xp[i];  // y = x + Wo att
  // MLP: y + Wd (silu(gate) * up)
  fastk::rms_rows(yp, M, h, eps, s_mlp ? s_mlp->data_ptr<float>() : nullptr, bp);
  at::Tensor gu = at::empty({M, inter2}, opt);
  float* gup = gu.data_ptr<float>();
  qlinear_raw(bp, M, h, wgu.data_ptr<uint8_t>(), inter2, kgu, gup);
  at::Tensor gate = at::silu(gu.slice(1, 0, inter)).contiguous();
  const float* gp = gate.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < inter; ++j) bp[m * inter + j] = gp[m * inter + j] * gup[m * inter2 + inter + j];
  at::Tensor out = at::empty({b, t, h}, opt);
  float* op = out.data_ptr<float>();
  qlinear_raw(bp, M, inter, wd.data_ptr<uint8_t>(), h, kd, op);
  for (int64_t i = 0; i < M * h; ++i) op[i] += yp[i];
  return out;
}

TORCH_LIBRARY(specdraft_quant, lib) {
  lib.def("qlinear(Tensor x, Tensor w, int kind) -> Tensor", &qlinear);
  lib.def("block(Tensor x, Tensor wqkv, int kqkv, Tensor? s_attn, Tensor? bqkv, Tensor wo, int ko, Tensor wgu, "
          "int kgu, Tensor? s_mlp, Tensor wd, int kd, Tensor rot, Tensor? mask, Tensor(a!) kv, int start, float eps, "
          "int hq, int hkv, int d) -> Tensor", &fused_block);
}
"""

_STATE: dict[str, object] = {}

# fast.cpp's body is compiled once per instruction set, each copy in its own namespace (see its header)
_FAST_ISAS = ((0, ""), (1, "avx2,f16c"), (2, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c"))


def fast_source() -> str:
    """fast.cpp with its body repeated for the portable, AVX2 and AVX-512 VNNI implementations."""
    text = (Path(__file__).parent / "fast.cpp").read_text()
    head, rest = text.split("// FAST-BODY begin\n", 1)
    body, tail = rest.split("// FAST-BODY end\n", 1)
    copies = []
    for isa, target in _FAST_ISAS:
        pragma = f'#pragma GCC push_options\n#pragma GCC target("{target}")\n' if target else ""
        pop = "#pragma GCC pop_options\n" if target else ""
        copies.append(f"{pragma}#define FAST_ISA {isa}\n#define FAST_NS fastk{isa}\n{body}#undef FAST_NS\n#undef FAST_ISA\n{pop}")
    return head + "".join(copies) + tail


def cpuinfo(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo ("" where there is none, as off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fsched-pressure", "-fschedule-insns"]


def _extension_name() -> str:
    """The build's name, keyed by this CPU's instruction-set flags (the cache, built with -march=native, is
    never loaded on a CPU it was not built for), the sources, the flags and torch's version: a build of
    that name is these sources' for this CPU, so it is loaded without asking the build tool."""
    flags = " ".join(sorted(cpuinfo("flags").split()))
    key = "\0".join([platform.machine(), flags, fast_source(), _SOURCE, " ".join(_CFLAGS), torch.__version__])
    return "specdraft_quant_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _built_library() -> str | None:
    """The path of this build of the kernels in torch's extension cache, or None if not built yet."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    name = _extension_name()
    path = os.path.join(root, name, name + ".so")
    return path if os.path.isfile(path) else None


def kernel_available() -> bool:
    """Compile (once per machine, cached) and load the kernel; False (with one warning) if impossible."""
    if "ok" in _STATE:
        return bool(_STATE["ok"])
    ok = False
    cxx = os.environ.get("CXX", "c++")
    if os.environ.get("SPECDRAFT_QUANT", "1") == "0":
        pass
    elif shutil.which(cxx) is None:
        warnings.warn(f"specdraft: no C++ compiler ({cxx}) found, so the CPU kernels cannot be built: the exact mode "
                      "runs on fp32 weights (install g++, then run `specdraft prepare`)", stacklevel=2)
    else:
        built = _built_library()
        if built is None:
            print("specdraft: compiling the CPU kernels for this CPU (once; about a minute)...", file=sys.stderr,
                  flush=True)
        try:
            if built is not None:  # these sources' build for this CPU: loaded as it is (milliseconds)
                torch.ops.load_library(built)
            else:
                from torch.utils.cpp_extension import load_inline  # the build tooling: only to compile, once

                if shutil.which("ninja") is None:  # pip puts ninja next to this interpreter (an unactivated venv)
                    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
                load_inline(_extension_name(), cpp_sources=[fast_source(), _SOURCE], is_python_module=False,
                            verbose=False, extra_cflags=_CFLAGS)
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
        if self.kind == "Q8_0":  # gguf-py's formula (fp16 scale times int8 code, in fp32) without its per-call overhead
            b = np.ascontiguousarray(self.data).reshape(-1, 34)  # a looked-up embedding row: ~10x quicker
            arr = b[:, 2:].view(np.int8).astype(np.float32) * b[:, :2].view(np.float16).astype(np.float32)
            return torch.from_numpy(arr.reshape(self.rows, self.cols))
        arr = dequantize(self.data, GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.asarray(arr, dtype=np.float32).reshape(self.rows, self.cols).copy())

    def load(self) -> "RawQuant":
        return self


@dataclass
class LazyRaw:
    """A ``RawQuant`` not read yet: its kind and shape now, its bytes when ``load`` is called (each time:
    the loader repacks one projection at a time, so the file's blocks are never all in memory at once)."""

    kind: str
    cols: int
    rows: int
    read: Callable[[], np.ndarray]  # -> [rows, row_bytes] uint8

    def take_rows(self, index) -> "LazyRaw":
        return LazyRaw(self.kind, self.cols, len(index), lambda: np.ascontiguousarray(self.read()[index]))

    def load(self) -> RawQuant:
        return RawQuant(self.kind, self.cols, self.read())


def supported(kind: str) -> bool:
    return kind in _KIND


def concat_rows(parts: list[RawQuant]) -> RawQuant | None:
    if len({(p.kind, p.cols) for p in parts}) != 1:
        return None  # mixed formats: not fused, the layer keeps the fp32 path
    return RawQuant(parts[0].kind, parts[0].cols, np.concatenate([p.data for p in parts]))


class QuantWeight:
    """A ``RawQuant``'s blocks for the kernel (as stored, one stream per row), plus an optional
    per-input scale applied to x first (an RMSNorm weight the fp32 path folds into W)."""

    def __init__(self, raw: RawQuant, in_scale: Tensor | None = None) -> None:
        self.kind = _KIND[raw.kind]
        self.rows, self.cols = raw.rows, raw.cols
        self.blocks = torch.from_numpy(np.ascontiguousarray(raw.data, dtype=np.uint8))  # [rows, row_bytes]
        self.in_scale = None if in_scale is None else in_scale.detach().float().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.in_scale is not None:
            x2 = x2 * self.in_scale
        y = torch.ops.specdraft_quant.qlinear(x2.contiguous(), self.blocks, self.kind)
        return y.view(*shape[:-1], self.rows)
