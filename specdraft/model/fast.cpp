// The "fast" precision mode's CPU kernels (see specdraft/model/fast.py for the maths and the layouts).
//
// Every result a row gets is a function of that row alone: the same activation quantization per row,
// integer dot products within a 32-weight block (exact), and one fixed order for every float sum
// (over the blocks of a weight row, in order; over the lanes of a norm or a q.k product in one fixed
// tree; over the visible keys in attention, taken in slot order).  Tiling, the number of rows in the
// pass and the thread split only decide *who* computes a result, never *how*.  So a tree node's
// logits are bit-identical to a one-token pass over its path.
//
// Three implementations of the same arithmetic, picked at compile time (-march=native): AVX-512 VNNI
// (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd: the same exact int32 block sums, and the same float
// operations in 8-lane halves) and a portable one (plain loops); all give the same bits (tested: the
// portable one runs beside the vector one on the same machine).  No FMA contraction anywhere
// (-ffp-contract=off, and the vector code multiplies then adds), so the float operations are exactly
// those a reference written with separate multiplies and adds performs (fast.reference_linear).
// This file is compiled before model/quant.py's kernels, which use its rms_rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define FAST_VNNI 1
#else
#define FAST_VNNI 0
#endif
#if !FAST_VNNI && defined(__AVX2__) && defined(__F16C__)
#define FAST_AVX2 1
#else
#define FAST_AVX2 0
#endif

namespace fastk {

static inline float h2f(uint16_t h) {  // IEEE half -> float, exact
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Sum of 16 lanes in one fixed tree: v[i] + v[i+8], then + [i+4], then + [i+2], then the two left.
static inline float reduce16(const float* v) {
  float a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  for (int i = 0; i < 2; ++i) c[i] = b[i] + b[i + 2];
  return c[0] + c[1];
}

// e^x for the softmax and SiLU, the same operations in both implementations (Cephes' expf polynomial):
// x clamped to [-87.3, 88], n = round(x log2 e), r = x - n ln2 (in two parts), e^r by a degree-6
// polynomial, times 2^n built from its exponent bits.  About 1 ulp; what matters here is that it is
// one fixed function.
static constexpr float EXP_LO = -87.3f, EXP_HI = 88.0f, LOG2E = 1.44269504088896341f, C1 = 0.693359375f,
                       C2 = -2.12194440e-4f;
static constexpr float P0 = 1.9875691500E-4f, P1 = 1.3981999507E-3f, P2 = 8.3334519073E-3f, P3 = 4.1665795894E-2f,
                       P4 = 1.6666665459E-1f, P5 = 5.0000001201E-1f;

static inline float exp_s(float x) {
  x = std::min(std::max(x, EXP_LO), EXP_HI);
  const float n = std::nearbyint(x * LOG2E);
  float r = x - n * C1;
  r = r - n * C2;
  const float z = r * r;
  float p = P0;
  p = p * r + P1;
  p = p * r + P2;
  p = p * r + P3;
  p = p * r + P4;
  p = p * r + P5;
  p = p * z + r;
  p = p + 1.f;
  const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

#if FAST_VNNI
static inline float reduce16v(__m512 v) {  // the same tree as reduce16
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

static inline __m512 exp_v(__m512 x) {  // exp_s on 16 lanes
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(C1)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(C2)));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 p = _mm512_set1_ps(P0);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P1));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P2));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P3));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P4));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P5));
  p = _mm512_add_ps(_mm512_mul_ps(p, z), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if FAST_AVX2
// The same 16-lane tree as reduce16, the 16 lanes held as two 8-lane halves (lo = lanes 0-7).
static inline float reduce16h(__m256 lo, __m256 hi) {
  const __m256 a = _mm256_add_ps(lo, hi);  // v[i] + v[i+8]
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

static inline __m256 exp_v8(__m256 x) {  // exp_s on 8 lanes
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(C1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(C2)));
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(P0);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P1));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P2));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P4));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P5));
  p = _mm256_add_ps(_mm256_mul_ps(p, z), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static bool g_portable = false;  // tests switch to the portable implementation to compare the two

// ------------------------------------------------------------------ activation quantization
// A row of K floats (K a multiple of 32) -> NB = K/32 blocks:
//   q    int8 [NB*32]   q = round_half_even(x / d), d = max|x| / 127 per block (|q| <= 127)
//   dx   float [NB]     d
//   sx   float [NB]     d * sum(q)               (Q4_1's minimum term)
//   negc int32 [NB]     -128 * sum(q)            (a Q8_0 code is stored + 128, see the weights)
struct QRows {
  int64_t NB = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> negc;
};

static void quantize_row(const float* x, QRows& o, int64_t m) {
  const int64_t NB = o.NB;
  for (int64_t b = 0; b < NB; ++b) {
    const float* xb = x + 32 * b;
    int8_t* qb = o.q.data() + (m * NB + b) * 32;
    float d;
    int32_t isum = 0;
#if FAST_VNNI
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));  // max: exact
    d = amax / 127.f;
    const __m512 vid = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
    // cvtps_epi32 rounds half to even (the default MXCSR mode), as nearbyint does below
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    i0 = _mm512_min_epi32(_mm512_max_epi32(i0, lo), hi);
    i1 = _mm512_min_epi32(_mm512_max_epi32(i1, lo), hi);
    _mm_storeu_si128((__m128i*)qb, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(qb + 16), _mm512_cvtepi32_epi8(i1));
    isum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));  // integers: exact in any order
#else
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < 32; ++j) {
      int v = (int)std::nearbyint(xb[j] * id);
      v = std::min(127, std::max(-127, v));
      qb[j] = (int8_t)v;
      isum += v;
    }
#endif
    o.dx[m * NB + b] = d;
    o.sx[m * NB + b] = d * (float)isum;
    o.negc[m * NB + b] = -128 * isum;
  }
}

static void quantize_rows(const float* x, int64_t M, int64_t K, QRows& o) {
  o.NB = K / 32;
  o.q.resize(M * K);
  o.dx.resize(M * o.NB);
  o.sx.resize(M * o.NB);
  o.negc.resize(M * o.NB);
  at::parallel_for(0, M, 16, [&](int64_t s, int64_t e) {
    for (int64_t m = s; m < e; ++m) quantize_row(x + m * K, o, m);
  });
}

// ------------------------------------------------------------------ weights
// A weight matrix [N, K] repacked once at load (fast.py) in groups of 16 rows (zero rows pad N), block
// by block: group g, block b holds
//   qs  Q4_1: 4 x 64 bytes; vector k, lane l, byte i = code(16g+l, 32b + 8k+i) | code(16g+l, 32b + 8k+4+i) << 4
//       Q8_0: 8 x 64 bytes; vector j, lane l, byte i = code(16g+l, 32b + 4j+i) + 128
//   d, m  16 fp16 (the 16 rows' scale and minimum for block b)
// so one vpdpbusd multiplies 4 inputs of block b for 16 rows at once, and 8 of them (j = 0..7) sum a
// whole block in each row's lane: an exact int32 per (row, block), no horizontal sums.
struct W {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* mn;  // Q4_1 only
  int64_t N, K, NB, G, kind;
  int64_t grp() const { return kind == 0 ? 256 : 512; }  // qs bytes per (group, block)
};

// y[m, n] = sum over blocks b in order of:
//   acc = acc + float(s_b) * (d_w,b * d_x,b)     s_b = sum_e code_e q_e (int32, exact)
//   acc = acc + m_w,b * sx_b                     (Q4_1)
static float dot_portable(const W& w, int64_t n, const QRows& x, int64_t m) {
  const int64_t g = n / 16, l = n % 16, NB = w.NB;
  float acc = 0.f;
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* qs = w.qs + (g * NB + b) * w.grp();
    const int8_t* xq = x.q.data() + (m * NB + b) * 32;
    int32_t s = 0;
    for (int e = 0; e < 32; ++e) {
      int32_t c;
      if (w.kind == 0) {
        const int k = e / 8, lo = (e % 8) < 4, i = e % 4;
        const uint8_t byte = qs[k * 64 + l * 4 + i];
        c = lo ? (byte & 15) : (byte >> 4);
      } else {
        c = (int32_t)qs[(e / 4) * 64 + l * 4 + e % 4] - 128;
      }
      s += c * (int32_t)xq[e];
    }
    const int64_t gb = (g * NB + b) * 16 + l;
    acc = acc + (float)s * (h2f(w.d[gb]) * x.dx[m * NB + b]);
    if (w.kind == 0) acc = acc + h2f(w.mn[gb]) * x.sx[m * NB + b];
  }
  return acc;
}

#if FAST_VNNI
// One group of 16 weight rows x T activation rows from m0: y[(m0+t) * ldy + 16g + l] for l < nv.
template <int KIND, int T>
static inline void gtile(const W& w, int64_t g, const QRows& x, int64_t m0, float* y, int64_t ldy, int64_t nv) {
  const int64_t NB = w.NB;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const uint8_t* qs = w.qs + g * NB * w.grp();
  for (int64_t b = 0; b < NB; ++b) {
    __m512i wv[8];
    if (KIND == 0) {
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512((const void*)(qs + b * 256 + 64 * k));
        wv[2 * k] = _mm512_and_si512(v, nib);
        wv[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    } else {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512((const void*)(qs + b * 512 + 64 * j));
    }
    const int64_t gb = (g * NB + b) * 16;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.d + gb)));
    __m512 mw;
    if (KIND == 0) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.mn + gb)));
    for (int t = 0; t < T; ++t) {
      const int64_t xb = (m0 + t) * NB + b;
      int32_t xq[8];  // the block's 32 int8 as 8 groups of 4 (memcpy: no aliasing through int8 storage)
      std::memcpy(xq, x.q.data() + xb * 32, 32);
      __m512i s = KIND == 0 ? _mm512_setzero_si512() : _mm512_set1_epi32(x.negc[xb]);
      for (int j = 0; j < 8; ++j) s = _mm512_dpbusd_epi32(s, wv[j], _mm512_set1_epi32(xq[j]));
      acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(x.dx[xb]))));
      if (KIND == 0) acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(mw, _mm512_set1_ps(x.sx[xb])));
    }
  }
  const __mmask16 keep = (__mmask16)((1u << nv) - 1);
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (m0 + t) * ldy + 16 * g, keep, acc[t]);
}

template <int KIND>
static void groups_vnni(const W& w, int64_t gs, int64_t ge, const QRows& x, int64_t M, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += 64) {  // 64 activation rows at a time stay in L1/L2 while the weights stream
    const int64_t m1 = std::min(M, m0 + 64);
    for (int64_t g = gs; g < ge; ++g) {
      const int64_t nv = std::min<int64_t>(16, w.N - 16 * g);
      for (int64_t m = m0; m < m1; m += 8) {
        switch (std::min<int64_t>(8, m1 - m)) {
          case 8: gtile<KIND, 8>(w, g, x, m, y, ldy, nv); break;
          case 7: gtile<KIND, 7>(w, g, x, m, y, ldy, nv); break;
          case 6: gtile<KIND, 6>(w, g, x, m, y, ldy, nv); break;
          case 5: gtile<KIND, 5>(w, g, x, m, y, ldy, nv); break;
          case 4: gtile<KIND, 4>(w, g, x, m, y, ldy, nv); break;
          case 3: gtile<KIND, 3>(w, g, x, m, y, ldy, nv); break;
          case 2: gtile<KIND, 2>(w, g, x, m, y, ldy, nv); break;
          default: gtile<KIND, 1>(w, g, x, m, y, ldy, nv); break;
        }
      }
    }
  }
}
#endif

#if FAST_AVX2
// Half a group (8 weight rows, h = 0 or 1) x T activation rows from m0: y[(m0+t) * ldy + 16g + 8h + l]
// for l < nv.  One 256-bit register holds 4 inputs of block b for the 8 rows (the same bytes as half
// of a VNNI vector).  vpmaddubsw multiplies unsigned weight bytes by signed inputs and adds pairs into
// int16 lanes, vpmaddwd adds those pairs into one int32 per row: each row's 4-input sum, exactly.
//   Q4_1: codes 0..15, so a pair is at most 2*15*127 and the 8 vectors' pairs (32 inputs) at most
//         30480: they add up in int16 before one vpmaddwd.
//   Q8_0: the stored byte is code + 128; byte ^ 0x80 is the code as int8.  vpmaddubsw takes |code|
//         (<= 128) against the input with the code's sign (vpsignb), so a pair is at most 2*128*127 =
//         32512: no saturation; each vector goes to int32 on its own.
// The int32 is sum_e code_e q_e, the same integer as vpdpbusd's (there: sum (code+128) q_e - 128 sum q_e),
// and the float steps that follow are VNNI's, lane for lane.
template <int KIND, int T>
static inline void htile(const W& w, int64_t g, int64_t h, const QRows& x, int64_t m0, float* y, int64_t ldy,
                         int64_t nv) {
  const int64_t NB = w.NB;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  const uint8_t* qs = w.qs + g * NB * w.grp() + 32 * h;
  for (int64_t b = 0; b < NB; ++b) {
    __m256i wv[8];  // Q4_1: codes; Q8_0: |code|
    __m256i ws[8];  // Q8_0: the code as int8 (for its sign)
    if (KIND == 0) {
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + b * 256 + 64 * k));
        wv[2 * k] = _mm256_and_si256(v, nib);
        wv[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        ws[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qs + b * 512 + 64 * j)), flip);
        wv[j] = _mm256_abs_epi8(ws[j]);
      }
    }
    const int64_t gb = (g * NB + b) * 16 + 8 * h;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + gb)));
    __m256 mw;
    if (KIND == 0) mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.mn + gb)));
    for (int t = 0; t < T; ++t) {
      const int64_t xb = (m0 + t) * NB + b;
      int32_t xq[8];  // the block's 32 int8 as 8 groups of 4
      std::memcpy(xq, x.q.data() + xb * 32, 32);
      __m256i s;
      if (KIND == 0) {
        __m256i p = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(xq[0]));
        for (int j = 1; j < 8; ++j) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(xq[j])));
        s = _mm256_madd_epi16(p, ones);
      } else {
        s = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xq[j]), ws[j]);
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j], xs), ones));
        }
      }
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(x.dx[xb]))));
      if (KIND == 0) acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(mw, _mm256_set1_ps(x.sx[xb])));
    }
  }
  const int64_t keep = std::min<int64_t>(8, nv - 8 * h);
  for (int t = 0; t < T; ++t) {
    float* dst = y + (m0 + t) * ldy + 16 * g + 8 * h;
    if (keep == 8) {
      _mm256_storeu_ps(dst, acc[t]);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, acc[t]);
      std::memcpy(dst, tmp, keep * sizeof(float));
    }
  }
}

template <int KIND>
static void groups_avx2(const W& w, int64_t gs, int64_t ge, const QRows& x, int64_t M, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += 64) {  // 64 activation rows at a time stay in L1/L2 while the weights stream
    const int64_t m1 = std::min(M, m0 + 64);
    for (int64_t g = gs; g < ge; ++g) {
      const int64_t nv = std::min<int64_t>(16, w.N - 16 * g);
      for (int64_t h = 0; h < 2 && 8 * h < nv; ++h)
        for (int64_t m = m0; m < m1; m += 4) {
          switch (std::min<int64_t>(4, m1 - m)) {
            case 4: htile<KIND, 4>(w, g, h, x, m, y, ldy, nv); break;
            case 3: htile<KIND, 3>(w, g, h, x, m, y, ldy, nv); break;
            case 2: htile<KIND, 2>(w, g, h, x, m, y, ldy, nv); break;
            default: htile<KIND, 1>(w, g, h, x, m, y, ldy, nv); break;
          }
        }
    }
  }
}
#endif

// y[M, N] (row stride ldy) = the quantized rows x against every weight row; groups of 16 weight rows
// split over threads.
static void linear_q(const QRows& x, int64_t M, const W& w, float* y, int64_t ldy) {
  at::parallel_for(0, w.G, 4, [&](int64_t gs, int64_t ge) {
#if FAST_VNNI
    if (!g_portable) {
      if (w.kind == 0) groups_vnni<0>(w, gs, ge, x, M, y, ldy);
      else groups_vnni<1>(w, gs, ge, x, M, y, ldy);
      return;
    }
#elif FAST_AVX2
    if (!g_portable) {
      if (w.kind == 0) groups_avx2<0>(w, gs, ge, x, M, y, ldy);
      else groups_avx2<1>(w, gs, ge, x, M, y, ldy);
      return;
    }
#endif
    for (int64_t n = 16 * gs; n < std::min(w.N, 16 * ge); ++n)
      for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot_portable(w, n, x, m);
  });
}

static W weight(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& mn, int64_t N, int64_t K,
                int64_t kind) {
  TORCH_CHECK(kind == 0 || kind == 1, "fast weight: kind 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(qs.is_cpu() && d.is_cpu() && (!mn || mn->is_cpu()), "fast weight: CPU tensors");
  TORCH_CHECK(K % 32 == 0 && N > 0, "fast weight: K a multiple of 32");
  const int64_t NB = K / 32, G = (N + 15) / 16;
  W w{nullptr, nullptr, nullptr, N, K, NB, G, kind};
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == G * NB * w.grp(),
              "fast weight: qs [G, NB, bytes] uint8");
  TORCH_CHECK(d.scalar_type() == at::kShort && d.is_contiguous() && d.numel() == G * NB * 16,
              "fast weight: d [G, NB, 16] int16 (fp16 bits)");
  w.qs = qs.data_ptr<uint8_t>();
  w.d = (const uint16_t*)d.data_ptr<int16_t>();
  if (kind == 0) {
    TORCH_CHECK(mn.has_value() && mn->numel() == d.numel() && mn->scalar_type() == at::kShort && mn->is_contiguous(),
                "fast weight: Q4_1 needs m like d");
    w.mn = (const uint16_t*)mn->data_ptr<int16_t>();
  }
  return w;
}

// ------------------------------------------------------------------ glue, row by row
static inline float sumsq(const float* x, int64_t n) {  // 16 lanes in index order, then reduce16
  float a[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) a[l] = a[l] + x[i + l] * x[i + l];
  for (int l = 0; i < n; ++i, ++l) a[l] = a[l] + x[i] * x[i];
  return reduce16(a);
}

static void rms_rows(const float* x, int64_t M, int64_t H, double eps, const float* scale, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float* o = out + m * H;
    const float r = 1.f / std::sqrt(sumsq(xr, H) / (float)H + (float)eps);
    if (scale) for (int64_t i = 0; i < H; ++i) o[i] = (xr[i] * r) * scale[i];
    else for (int64_t i = 0; i < H; ++i) o[i] = xr[i] * r;
  }
}

// RoPE on the first `heads` heads of each row (q then k): each (2i, 2i+1) pair rotated by its
// position's (cos, sin), rot [M, D/2, 2].
static void rope_rows(float* x, int64_t M, int64_t row_stride, int64_t heads, int64_t D, const float* rot) {
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* cs = rot + m * half * 2;
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* p = x + m * row_stride + hh * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[2 * i], b = p[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
        p[2 * i] = a * c - b * s;
        p[2 * i + 1] = a * s + b * c;
      }
    }
  }
}

static inline float dot_d(const float* a, const float* b, int64_t D) {  // 16 lanes in index order, then reduce16
  float acc[16] = {0.f};
  for (int64_t i = 0; i < D; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] = acc[l] + a[i + l] * b[i + l];
  return reduce16(acc);
}

// Attention of one query row for the G query heads sharing a KV head, over the row's visible slots
// `idx` (slot order), exactly:
//   s_i = (q . k_i) * scale,  e_i = exp(s_i - max s),  out = (sum_i e_i v_i) / (sum_i e_i)
// q . k_i in 16 lanes over the head dim then reduce16; sum_i e_i in 16 lanes by position i in the list;
// sum_i e_i v_i in order of i.  The list is the row's own (its prefix and its ancestors), so it is the
// same in a tree pass and a one-token pass.  sc: scratch [G][n].
static void attend(const float* q, int64_t q_stride, const float* kbase, const float* vbase, int64_t s_s,
                   const int32_t* idx, int64_t n, int64_t G, int64_t D, float scale, float* sc, float* out,
                   int64_t out_stride) {
  std::vector<float> mx(G, -INFINITY);
#if FAST_VNNI
  if (!g_portable && G <= 8 && D <= 256) {
    const int64_t C = D / 16;
    for (int64_t i = 0; i < n; ++i) {  // scores: each key read once for the G heads
      const float* k = kbase + idx[i] * s_s;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * q_stride;
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(k + 16 * c)));
        const float v = reduce16v(a) * scale;
        sc[g * n + i] = v;
        mx[g] = std::max(mx[g], v);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* e = sc + g * n;
      const __m512 vmx = _mm512_set1_ps(mx[g]);
      __m512 a = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const __m512 v = exp_v(_mm512_sub_ps(_mm512_loadu_ps(e + i), vmx));
        _mm512_storeu_ps(e + i, v);
        a = _mm512_add_ps(a, v);
      }
      float lanes[16];
      _mm512_storeu_ps(lanes, a);
      for (; i < n; ++i) {
        e[i] = exp_s(e[i] - mx[g]);
        lanes[i % 16] = lanes[i % 16] + e[i];
      }
      const __m512 vsum = _mm512_set1_ps(reduce16(lanes));
      __m512 o[16];
      for (int64_t c = 0; c < C; ++c) o[c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vbase + idx[j] * s_s;
        const __m512 w = _mm512_set1_ps(e[j]);
        for (int64_t c = 0; c < C; ++c) o[c] = _mm512_add_ps(o[c], _mm512_mul_ps(w, _mm512_loadu_ps(v + 16 * c)));
      }
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(out + g * out_stride + 16 * c, _mm512_div_ps(o[c], vsum));
    }
    return;
  }
#elif FAST_AVX2
  if (!g_portable && G <= 8 && D <= 256) {  // the VNNI loop's arithmetic in 8-lane halves
    const int64_t C = D / 16;
    for (int64_t i = 0; i < n; ++i) {
      const float* k = kbase + idx[i] * s_s;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * q_stride;
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int64_t c = 0; c < C; ++c) {
          lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(qg + 16 * c), _mm256_loadu_ps(k + 16 * c)));
          hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(qg + 16 * c + 8), _mm256_loadu_ps(k + 16 * c + 8)));
        }
        const float v = reduce16h(lo, hi) * scale;
        sc[g * n + i] = v;
        mx[g] = std::max(mx[g], v);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* e = sc + g * n;
      const __m256 vmx = _mm256_set1_ps(mx[g]);
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const __m256 a = exp_v8(_mm256_sub_ps(_mm256_loadu_ps(e + i), vmx));
        const __m256 b = exp_v8(_mm256_sub_ps(_mm256_loadu_ps(e + i + 8), vmx));
        _mm256_storeu_ps(e + i, a);
        _mm256_storeu_ps(e + i + 8, b);
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
      }
      float lanes[16];
      _mm256_storeu_ps(lanes, lo);
      _mm256_storeu_ps(lanes + 8, hi);
      for (; i < n; ++i) {
        e[i] = exp_s(e[i] - mx[g]);
        lanes[i % 16] = lanes[i % 16] + e[i];
      }
      const __m256 vsum = _mm256_set1_ps(reduce16(lanes));
      __m256 o[32];
      const int64_t C8 = D / 8;
      for (int64_t c = 0; c < C8; ++c) o[c] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vbase + idx[j] * s_s;
        const __m256 w = _mm256_set1_ps(e[j]);
        for (int64_t c = 0; c < C8; ++c) o[c] = _mm256_add_ps(o[c], _mm256_mul_ps(w, _mm256_loadu_ps(v + 8 * c)));
      }
      for (int64_t c = 0; c < C8; ++c) _mm256_storeu_ps(out + g * out_stride + 8 * c, _mm256_div_ps(o[c], vsum));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float v = dot_d(q + g * q_stride, kbase + idx[i] * s_s, D) * scale;
      sc[g * n + i] = v;
      mx[g] = std::max(mx[g], v);
    }
  for (int64_t g = 0; g < G; ++g) {
    float* e = sc + g * n;
    float lanes[16] = {0.f};
    for (int64_t i = 0; i < n; ++i) {
      e[i] = exp_s(e[i] - mx[g]);
      lanes[i % 16] = lanes[i % 16] + e[i];
    }
    const float sum = reduce16(lanes);
    float* o = out + g * out_stride;
    for (int64_t dd = 0; dd < D; ++dd) o[dd] = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vbase + idx[j] * s_s;
      for (int64_t dd = 0; dd < D; ++dd) o[dd] = o[dd] + e[j] * v[dd];
    }
    for (int64_t dd = 0; dd < D; ++dd) o[dd] = o[dd] / sum;
  }
}

static inline float silu_mul(float g, float u) { return g / (1.f + exp_s(-g)) * u; }

static void silu_rows(const float* gu, int64_t M, int64_t inter, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * inter;
    float* o = out + m * inter;
    int64_t j = 0;
#if FAST_VNNI
    if (!g_portable)
      for (; j + 16 <= inter; j += 16) {
        const __m512 gv = _mm512_loadu_ps(g + j);
        const __m512 e = exp_v(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                              _mm512_loadu_ps(g + inter + j)));
      }
#elif FAST_AVX2
    if (!g_portable)
      for (; j + 8 <= inter; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp_v8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                              _mm256_loadu_ps(g + inter + j)));
      }
#endif
    for (; j < inter; ++j) o[j] = silu_mul(g[j], g[inter + j]);
  }
}

// ------------------------------------------------------------------ ops
at::Tensor linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& mn,
                  int64_t kind, int64_t N) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat, "fast linear: x [M, K] fp32 on the CPU");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  W w = weight(qs, d, mn, N, K, kind);
  QRows qx;
  quantize_rows(xc.data_ptr<float>(), M, K, qx);
  at::Tensor y = at::empty({M, w.N}, xc.options());
  linear_q(qx, M, w, y.data_ptr<float>(), w.N);
  return y;
}

// The activation quantization alone: (q int8 [M, K], d [M, K/32], sx [M, K/32]), for tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "fast quantize: x [M, K] fp32 on the CPU, 32 | K");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  QRows qx;
  quantize_rows(xc.data_ptr<float>(), M, K, qx);
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, K / 32}, xc.options()), sx = at::empty({M, K / 32}, xc.options());
  std::memcpy(q.data_ptr<int8_t>(), qx.q.data(), qx.q.size());
  std::memcpy(dx.data_ptr<float>(), qx.dx.data(), qx.dx.size() * 4);
  std::memcpy(sx.data_ptr<float>(), qx.sx.data(), qx.sx.size() * 4);
  return {q, dx, sx};
}

// The final norm and the LM head over rows x [M, H]: (normed rows, logits [M, V]).
std::tuple<at::Tensor, at::Tensor> head(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& qs,
                                        const at::Tensor& d, const std::optional<at::Tensor>& mn, int64_t kind,
                                        int64_t N, bool want_logits) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && norm_w.is_cpu() && norm_w.scalar_type() == at::kFloat &&
                  norm_w.numel() == x.size(-1), "fast head: x [..., H] and norm_w [H], fp32 on the CPU");
  at::Tensor xc = x.contiguous();
  const int64_t H = xc.size(-1), M = xc.numel() / H;
  at::Tensor normed = at::empty_like(xc);
  rms_rows(xc.data_ptr<float>(), M, H, eps, norm_w.contiguous().data_ptr<float>(), normed.data_ptr<float>());
  if (!want_logits) return {normed, at::empty({0}, xc.options())};
  W w = weight(qs, d, mn, N, H, kind);
  QRows qx;
  quantize_rows(normed.data_ptr<float>(), M, H, qx);
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = w.N;
  at::Tensor y = at::empty(shape, xc.options());
  linear_q(qx, M, w, y.data_ptr<float>(), w.N);
  return {normed, y};
}

// One decoder block (llama.Block.forward's maths) in the fast mode:
//   x [B, T, H]; rot [B, T, D/2, 2] (cos, sin) per pair; mask bool [B, T, start+T] (true = may attend)
//   or none (every slot visible); kv [2, B, Hkv, S, D] written at slots start .. start+T-1.
at::Tensor block(const at::Tensor& x_in, const at::Tensor& qkv_qs, const at::Tensor& qkv_d,
                 const std::optional<at::Tensor>& qkv_m, int64_t qkv_kind, int64_t qkv_n,
                 const std::optional<at::Tensor>& s_attn, const std::optional<at::Tensor>& bqkv, const at::Tensor& o_qs,
                 const at::Tensor& o_d, const std::optional<at::Tensor>& o_m, int64_t o_kind, int64_t o_n,
                 const at::Tensor& gu_qs, const at::Tensor& gu_d, const std::optional<at::Tensor>& gu_m, int64_t gu_kind,
                 int64_t gu_n, const std::optional<at::Tensor>& s_mlp, const at::Tensor& dn_qs, const at::Tensor& dn_d,
                 const std::optional<at::Tensor>& dn_m, int64_t dn_kind, int64_t dn_n,
                 const at::Tensor& rot, const std::optional<at::Tensor>& mask, const at::Tensor& kv, int64_t start,
                 double eps, int64_t hq, int64_t hkv, int64_t D) {
  TORCH_CHECK(x_in.is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 3, "fast block: x [B, T, H] fp32 on the CPU");
  TORCH_CHECK(D % 16 == 0 && hq % hkv == 0, "fast block: head size a multiple of 16");
  at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T, qsz = hq * D, ksz = hkv * D, G = hq / hkv;
  const int64_t S = start + T, half = D / 2;
  TORCH_CHECK(kv.is_cpu() && kv.scalar_type() == at::kFloat && kv.is_contiguous() && kv.dim() == 5 && kv.size(0) == 2 &&
                  kv.size(1) == B && kv.size(2) == hkv && kv.size(4) == D,
              "fast block: a contiguous fp32 cache [2, B, Hkv, S, D] on the CPU");
  TORCH_CHECK(start >= 0 && S <= kv.size(3), "fast block: the pass does not fit in the cache");
  TORCH_CHECK(!s_attn || (s_attn->is_contiguous() && s_attn->numel() == H && s_attn->scalar_type() == at::kFloat),
              "fast block: s_attn [H] fp32");
  TORCH_CHECK(!s_mlp || (s_mlp->is_contiguous() && s_mlp->numel() == H && s_mlp->scalar_type() == at::kFloat),
              "fast block: s_mlp [H] fp32");
  W wqkv = weight(qkv_qs, qkv_d, qkv_m, qkv_n, H, qkv_kind), wo = weight(o_qs, o_d, o_m, o_n, qsz, o_kind);
  W wgu = weight(gu_qs, gu_d, gu_m, gu_n, H, gu_kind);
  const int64_t inter = wgu.N / 2;
  W wd = weight(dn_qs, dn_d, dn_m, dn_n, inter, dn_kind);
  const int64_t nqkv = wqkv.N;
  TORCH_CHECK(nqkv == qsz + 2 * ksz && wo.N == H && wd.N == H, "fast block: projection shapes");
  TORCH_CHECK(!bqkv || (bqkv->is_contiguous() && bqkv->numel() == nqkv && bqkv->scalar_type() == at::kFloat),
              "fast block: bqkv [Hq*D + 2*Hkv*D] fp32");
  at::Tensor rc = rot.contiguous();
  TORCH_CHECK(rc.scalar_type() == at::kFloat && rc.numel() == M * half * 2, "fast block: rot [B, T, D/2, 2] fp32");
  const float* rp = rc.data_ptr<float>();
  const bool* mp = nullptr;
  at::Tensor mc;
  if (mask) {
    mc = mask->contiguous();
    TORCH_CHECK(mc.scalar_type() == at::kBool && mc.numel() == B * T * S, "fast block: mask bool [B, T, start+T]");
    mp = mc.data_ptr<bool>();
  }
  const float* xp = x.data_ptr<float>();
  auto opt = x.options();
  std::vector<float> buf(M * std::max({H, qsz, inter}));
  std::vector<float> qkv(M * nqkv);
  QRows qx;

  // q, k, v = W_qkv RMSNorm(x) (+ b)
  rms_rows(xp, M, H, eps, s_attn ? s_attn->data_ptr<float>() : nullptr, buf.data());
  quantize_rows(buf.data(), M, H, qx);
  linear_q(qx, M, wqkv, qkv.data(), nqkv);
  if (bqkv) {
    const float* bb = bqkv->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) for (int64_t j = 0; j < nqkv; ++j) qkv[m * nqkv + j] = qkv[m * nqkv + j] + bb[j];
  }
  rope_rows(qkv.data(), M, nqkv, hq + hkv, D, rp);
  // K/V into the cache
  float* kvp = kv.data_ptr<float>();
  const int64_t s_kv = kv.stride(0), s_b = kv.stride(1), s_h = kv.stride(2), s_s = kv.stride(3);
  for (int64_t bi = 0; bi < B; ++bi)
    for (int64_t ti = 0; ti < T; ++ti) {
      const float* row = qkv.data() + (bi * T + ti) * nqkv;
      for (int64_t kh = 0; kh < hkv; ++kh) {
        float* kdst = kvp + bi * s_b + kh * s_h + (start + ti) * s_s;
        std::memcpy(kdst, row + qsz + kh * D, D * sizeof(float));
        std::memcpy(kdst + s_kv, row + qsz + ksz + kh * D, D * sizeof(float));
      }
    }
  // attention, one task per (row, KV head); each row's visible slots in slot order
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, M * hkv, 1, [&](int64_t s, int64_t e) {
    std::vector<int32_t> idx(S);
    std::vector<float> sc(S * G);
    int64_t have = -1;
    int64_t n = 0;
    for (int64_t task = s; task < e; ++task) {
      const int64_t m = task / hkv, kh = task % hkv, bi = m / T;
      if (m != have) {
        n = 0;
        if (mp) {
          const bool* mr = mp + m * S;
          for (int64_t j = 0; j < S; ++j) if (mr[j]) idx[n++] = (int32_t)j;
        } else {
          for (int64_t j = 0; j < S; ++j) idx[n++] = (int32_t)j;  // no mask: every slot is visible
        }
        have = m;
      }
      const float* kb = kvp + bi * s_b + kh * s_h;
      attend(qkv.data() + m * nqkv + kh * G * D, D, kb, kb + s_kv, s_s, idx.data(), n, G, D, scale, sc.data(),
             buf.data() + m * qsz + kh * G * D, D);
    }
  });
  // y = x + W_o att
  at::Tensor y = at::empty({B, T, H}, opt);
  float* yp = y.data_ptr<float>();
  quantize_rows(buf.data(), M, qsz, qx);
  linear_q(qx, M, wo, yp, H);
  for (int64_t i = 0; i < M * H; ++i) yp[i] = yp[i] + xp[i];
  // out = y + W_down (silu(gate) * up),  gate|up = W_gu RMSNorm(y)
  rms_rows(yp, M, H, eps, s_mlp ? s_mlp->data_ptr<float>() : nullptr, buf.data());
  quantize_rows(buf.data(), M, H, qx);
  std::vector<float> gu(M * 2 * inter);
  linear_q(qx, M, wgu, gu.data(), 2 * inter);
  silu_rows(gu.data(), M, inter, buf.data());
  quantize_rows(buf.data(), M, inter, qx);
  at::Tensor out = at::empty({B, T, H}, opt);
  float* op = out.data_ptr<float>();
  linear_q(qx, M, wd, op, H);
  for (int64_t i = 0; i < M * H; ++i) op[i] = op[i] + yp[i];
  return out;
}

void set_portable(bool on) { g_portable = on; }
bool vnni() { return FAST_VNNI != 0; }
int64_t simd() { return FAST_VNNI ? 2 : FAST_AVX2 ? 1 : 0; }  // the vector implementation compiled in

}  // namespace fastk

TORCH_LIBRARY_FRAGMENT(specdraft_quant, lib) {
  lib.def("fast_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, int kind, int n) -> Tensor", &fastk::linear);
  lib.def("fast_quantize(Tensor x) -> (Tensor, Tensor, Tensor)", &fastk::quantize);
  lib.def("fast_head(Tensor x, Tensor norm_w, float eps, Tensor qs, Tensor d, Tensor? m, int kind, int n, "
          "bool want_logits) -> (Tensor, Tensor)", &fastk::head);
  lib.def("fast_block(Tensor x, Tensor qkv_qs, Tensor qkv_d, Tensor? qkv_m, int qkv_kind, int qkv_n, Tensor? s_attn, "
          "Tensor? bqkv, Tensor o_qs, Tensor o_d, Tensor? o_m, int o_kind, int o_n, Tensor gu_qs, Tensor gu_d, "
          "Tensor? gu_m, int gu_kind, int gu_n, Tensor? s_mlp, Tensor dn_qs, Tensor dn_d, Tensor? dn_m, int dn_kind, "
          "int dn_n, Tensor rot, Tensor? mask, Tensor(a!) kv, int start, float eps, int hq, int hkv, int d) -> Tensor",
          &fastk::block);
  lib.def("fast_set_portable(bool on) -> ()", &fastk::set_portable);
  lib.def("fast_vnni() -> bool", &fastk::vnni);
  lib.def("fast_simd() -> int", &fastk::simd);
}
