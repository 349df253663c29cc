// The "fast" precision mode's CPU kernels (see specdraft/model/fast.py for the maths and the layouts).
//
// Every result a row gets is a function of that row alone: the same activation quantization per row,
// integer dot products within a 32-weight block (exact), and one fixed order for every float sum
// (over the blocks of a weight row, in order; over the lanes of a norm or a q.k product in one fixed
// tree; over the visible keys in attention, taken in slot order).  Tiling, the number of rows in the
// pass and the thread split only decide *who* computes a result, never *how*.  So a tree node's
// logits are bit-identical to a one-token pass over its path.
//
// Written once over a small per-ISA layer.  The body between the two FAST-BODY lines is compiled three
// times (model/quant.py does the copying): FAST_ISA 0 = portable loops (the reference), 1 = AVX2 + F16C
// (vpmaddubsw + vpmaddwd), 2 = AVX-512 VNNI (vpdpbusd), each in its own namespace fastk<ISA> under
// `#pragma GCC target`; the ops at the end pick one at run time from what the CPU has
// (`__builtin_cpu_supports`).  Each block format's kernel (`quad`, `tile`) is one piece of code over the
// layer's few operations (`struct Isa`: loads, bit selects, the int8 dot product of a quad, int32 and
// float lane arithmetic); all three give the same bits (tested: each runs beside the portable one on the
// same machine).  No FMA contraction anywhere (-ffp-contract=off, and the vector code multiplies then
// adds), so the float operations are exactly those of a reference written with separate multiplies and
// adds (fast.reference_linear).  This file is compiled before model/quant.py's kernels, which use its
// rms_rows and rope_rows.

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

// FAST-BODY begin
namespace FAST_NS {

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

#if FAST_ISA == 2
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

#if FAST_ISA == 1
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

// ------------------------------------------------------------------ activation quantization
// A row of K floats (K a multiple of 32) -> NB = K/32 blocks:
//   q    int8 [NB*32]   q = round_half_even(x / d), d = max|x| / 127 per block (|q| <= 127)
//   dx   float [NB]     d
//   sx   float [NB]     d * sum(q)               (the minimum term of Q4_1, Q5_1, Q4_K, Q5_K)
//   sq   int32 [NB]     sum(q)                   (the code offsets: Q4_0 8, Q5_0 16, Q6_K 32, VNNI's Q8_0 128)
//   sq0  int32 [NB]     sum(q) of the first 16   (Q6_K's halves)
struct QRows {
  int64_t NB = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> sq, sq0;
};

static void quantize_row(const float* x, QRows& o, int64_t m) {
  const int64_t NB = o.NB;
  for (int64_t b = 0; b < NB; ++b) {
    const float* xb = x + 32 * b;
    int8_t* qb = o.q.data() + (m * NB + b) * 32;
    float d;
    int32_t isum = 0, isum0 = 0;
#if FAST_ISA == 2
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
    isum0 = _mm512_reduce_add_epi32(i0);  // integers: exact in any order
    isum = isum0 + _mm512_reduce_add_epi32(i1);
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
      if (j == 15) isum0 = isum;
    }
#endif
    o.dx[m * NB + b] = d;
    o.sx[m * NB + b] = d * (float)isum;
    o.sq[m * NB + b] = isum;
    o.sq0[m * NB + b] = isum0;
  }
}

static void quantize_rows(const float* x, int64_t M, int64_t K, QRows& o) {
  o.NB = K / 32;
  o.q.resize(M * K);
  o.dx.resize(M * o.NB);
  o.sx.resize(M * o.NB);
  o.sq.resize(M * o.NB);
  o.sq0.resize(M * o.NB);
  at::parallel_for(0, M, 16, [&](int64_t s, int64_t e) {
    for (int64_t m = s; m < e; ++m) quantize_row(x + m * K, o, m);
  });
}

// ------------------------------------------------------------------ weights
// A weight matrix [N, K] is repacked once at load (fast.py, FastWeight) in groups of 16 rows (zero rows pad
// N), block by block.  Group g, block b (32 inputs) holds, for every format, its codes u >= 0 in "quad
// vectors": quad j = inputs 4j .. 4j+3 of the block, lane l = row 16g+l, byte i = input 4j+i, so one
// 64-byte vector is a quad for 16 rows (AVX2 and the portable path take it as two 32-byte halves of 8 rows).
// The bytes stored per (group, block), in this order:
//   nibbles  4 x 64   vector k, lane l, byte i = u(8k+i) & 15 | (u(8k+4+i) & 15) << 4   (all but Q8_0)
//   bit 4    1 x 64   lane l, byte i: bit j = bit 4 of u(4j+i)                        (Q5_0, Q5_1, Q5_K)
//   bits 4-5 2 x 64   vector p, lane l, byte i: bits 2jj, 2jj+1 = bits 4-5 of u(4(4p+jj)+i)   (Q6_K)
//   int8     8 x 64   vector j, lane l, byte i = the signed code of input 4j+i          (Q8_0)
// and the scales, 16 rows side by side:
//   d  fp16 [G, NB, 16] the block scale (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), or [G, NB/8, 16] the super-block
//      scale of 256 inputs (Q4_K, Q5_K, Q6_K)
//   m  fp16 [G, NB, 16] the block minimum (Q4_1, Q5_1), or [G, NB/8, 16] the super-block dmin (Q4_K, Q5_K)
//   sc bytes [G, NB, 2, 16]: Q4_K / Q5_K the 6-bit scale and minimum of the block; Q6_K the int8 scales of
//      its two 16-input halves
// What a block computes, per weight row n and activation row r (s exact in int32; every float op one
// fp32 operation, in this order):
//   Q4_0, Q5_0, Q8_0  s = sum_e c_e q_e, c = u - 8 / u - 16 / the int8        acc = acc + float(s) * (d * dx)
//   Q4_1, Q5_1        s = sum_e u_e q_e                 acc = acc + float(s) * (d * dx);  acc = acc + m * sx
//   Q4_K, Q5_K        s = sum_e u_e q_e,  dw = d * float(sc),  mw = -(dmin * float(mn))
//                                                       acc = acc + float(s) * (dw * dx); acc = acc + mw * sx
//   Q6_K              s = sc0 * sum_{e<16} (u_e - 32) q_e + sc1 * sum_{e>=16} (u_e - 32) q_e
//                                                       acc = acc + float(s) * (d * dx)
// over the blocks of the row in order (fast.reference_linear is the same in torch).
enum Fmt : int64_t { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };

static constexpr int64_t fmt_bytes(int64_t f) {
  return f == Q8_0 ? 512 : (f == Q5_0 || f == Q5_1 || f == Q5_K) ? 320 : f == Q6_K ? 384 : 256;
}
static constexpr int fmt_cmax(int64_t f) {  // the largest unsigned code
  return (f == Q5_0 || f == Q5_1 || f == Q5_K) ? 31 : f == Q6_K ? 63 : 15;
}
static constexpr bool fmt_min(int64_t f) { return f == Q4_1 || f == Q5_1 || f == Q4_K || f == Q5_K; }
static constexpr bool fmt_super(int64_t f) { return f >= Q4_K; }

struct W {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;
  const uint8_t* sc;
  int64_t N, K, NB, G, kind;
};

static inline int32_t ld32(const int8_t* p) {  // 4 activation bytes as one int32 (no aliasing through int8)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- the per-ISA layer: L weight rows per vector.  B: L rows x 4 bytes; I: L int32; F: L floats.
// Acc sums one block's products per lane: step(a, w, x4, j) for quads j = 0, 1, ... (unsigned codes <= CMAX
// against 4 signed activation bytes x4); done(a) the exact int32.  The signed Q8_0 codes: prep_s once per
// quad vector, step_s per row, done_s(a, sum q).
#if FAST_ISA == 2
struct Isa {
  static constexpr int L = 16, T = 8;  // 16 rows a vector, 8 activation rows a tile (32 zmm registers)
  using B = __m512i;
  using I = __m512i;
  using F = __m512;
  struct Acc { I s; };
  static B load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  template <int SH, int MASK> static B bits(B v) {  // per byte: (v << SH or >> -SH) & MASK (MASK keeps bytes apart)
    const B m = _mm512_set1_epi8((char)MASK);
    if (SH > 0) return _mm512_and_si512(_mm512_slli_epi16(v, SH), m);
    if (SH < 0) return _mm512_and_si512(_mm512_srli_epi16(v, -SH), m);
    return _mm512_and_si512(v, m);
  }
  static B bor(B a, B b) { return _mm512_or_si512(a, b); }
  using X = __m512i;  // 4 activation bytes in every lane
  static X bcast(int32_t x4) { return _mm512_set1_epi32(x4); }
  template <int CMAX> static void step(Acc& a, B w, X x, int j) {
    a.s = _mm512_dpbusd_epi32(j == 0 ? _mm512_setzero_si512() : a.s, w, x);
  }
  static I done(const Acc& a) { return a.s; }
  using SB = B;  // the code + 128, unsigned
  static SB prep_s(B w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
  static void step_s(Acc& a, SB w, X x, int j) { step<255>(a, w, x, j); }
  static I done_s(const Acc& a, int32_t sq) { return _mm512_add_epi32(a.s, _mm512_set1_epi32(-128 * sq)); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I iset(int32_t v) { return _mm512_set1_epi32(v); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fneg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static void store(float* y, F v, int64_t n) { _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v); }
};
#elif FAST_ISA == 1
struct Isa {
  static constexpr int L = 8, T = 4;  // 8 rows a vector, 4 activation rows a tile (16 ymm registers)
  using B = __m256i;
  using I = __m256i;
  using F = __m256;
  // vpmaddubsw multiplies unsigned codes by signed activations and adds pairs into int16, vpmaddwd adds
  // those pairs into one int32 per row.  A pair is at most 2 * CMAX * 127, so 32767 / that many quads'
  // pairs add up in int16 before one vpmaddwd (codes <= 15: all 8; <= 31: 4; <= 63: 2): no saturation.
  struct Acc { I s; I p; };
  static B load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  template <int SH, int MASK> static B bits(B v) {
    const B m = _mm256_set1_epi8((char)MASK);
    if (SH > 0) return _mm256_and_si256(_mm256_slli_epi16(v, SH), m);
    if (SH < 0) return _mm256_and_si256(_mm256_srli_epi16(v, -SH), m);
    return _mm256_and_si256(v, m);
  }
  static B bor(B a, B b) { return _mm256_or_si256(a, b); }
  using X = __m256i;
  static X bcast(int32_t x4) { return _mm256_set1_epi32(x4); }
  template <int CMAX> static void step(Acc& a, B w, X x, int j) {
    constexpr int P = 32767 / (2 * CMAX * 127);  // quads whose pairs fit in int16
    const I prod = _mm256_maddubs_epi16(w, x);
    a.p = j % P == 0 ? prod : _mm256_add_epi16(a.p, prod);
    if (j % P == P - 1) {
      const I t = _mm256_madd_epi16(a.p, _mm256_set1_epi16(1));
      a.s = j == P - 1 ? t : _mm256_add_epi32(a.s, t);
    }
  }
  static I done(const Acc& a) { return a.s; }
  // Q8_0: |code| (<= 128) against the activation with the code's sign (vpsignb): a pair is at most
  // 2 * 128 * 127 = 32512, so each quad goes to int32 on its own.
  struct SB { B abs, sgn; };
  static SB prep_s(B w) { return {_mm256_abs_epi8(w), w}; }
  static void step_s(Acc& a, const SB& w, X x, int j) {
    const I t = _mm256_madd_epi16(_mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x, w.sgn)),
                                  _mm256_set1_epi16(1));
    a.s = j == 0 ? t : _mm256_add_epi32(a.s, t);
  }
  static I done_s(const Acc& a, int32_t) { return a.s; }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I iset(int32_t v) { return _mm256_set1_epi32(v); }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I load_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fneg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static void store(float* y, F v, int64_t n) {
    if (n == 8) {
      _mm256_storeu_ps(y, v);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, v);
      std::memcpy(y, tmp, n * sizeof(float));
    }
  }
};
#else
struct Isa {  // the portable reference: plain loops over 8 lanes, the same integers and float operations
  static constexpr int L = 8, T = 4;
  struct B { uint8_t v[32]; };
  struct I { int32_t v[8]; };
  struct F { float v[8]; };
  struct Acc { I s; };
  static B load(const uint8_t* p) { B b; std::memcpy(b.v, p, 32); return b; }
  template <int SH, int MASK> static B bits(B b) {
    for (int i = 0; i < 32; ++i) b.v[i] = (uint8_t)((SH >= 0 ? b.v[i] << SH : b.v[i] >> -SH) & MASK);
    return b;
  }
  static B bor(B a, const B& b) { for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i]; return a; }
  using X = int32_t;
  static X bcast(int32_t x4) { return x4; }
  template <int CMAX> static void step(Acc& a, const B& w, X x4, int j) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < 8; ++l) {
      int32_t s = j == 0 ? 0 : a.s.v[l];
      for (int i = 0; i < 4; ++i) s += (int32_t)w.v[4 * l + i] * x[i];
      a.s.v[l] = s;
    }
  }
  static I done(const Acc& a) { return a.s; }
  using SB = B;
  static SB prep_s(const B& w) { return w; }
  static void step_s(Acc& a, const B& w, X x4, int j) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < 8; ++l) {
      int32_t s = j == 0 ? 0 : a.s.v[l];
      for (int i = 0; i < 4; ++i) s += (int32_t)(int8_t)w.v[4 * l + i] * x[i];
      a.s.v[l] = s;
    }
  }
  static I done_s(const Acc& a, int32_t) { return a.s; }
  static I iadd(I a, const I& b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
  static I imul(I a, const I& b) { for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l]; return a; }
  static I iset(int32_t v) { I a; for (int l = 0; l < 8; ++l) a.v[l] = v; return a; }
  static I load_u8(const uint8_t* p) { I a; for (int l = 0; l < 8; ++l) a.v[l] = p[l]; return a; }
  static I load_i8(const uint8_t* p) { I a; for (int l = 0; l < 8; ++l) a.v[l] = (int8_t)p[l]; return a; }
  static F cvt(const I& v) { F a; for (int l = 0; l < 8; ++l) a.v[l] = (float)v.v[l]; return a; }
  static F fadd(F a, const F& b) { for (int l = 0; l < 8; ++l) a.v[l] = a.v[l] + b.v[l]; return a; }
  static F fmul(F a, const F& b) { for (int l = 0; l < 8; ++l) a.v[l] = a.v[l] * b.v[l]; return a; }
  static F fneg(F a) { for (int l = 0; l < 8; ++l) a.v[l] = -a.v[l]; return a; }
  static F fset(float v) { F a; for (int l = 0; l < 8; ++l) a.v[l] = v; return a; }
  static F fzero() { return fset(0.f); }
  static F load_h(const uint16_t* p) { F a; for (int l = 0; l < 8; ++l) a.v[l] = h2f(p[l]); return a; }
  static void store(float* y, const F& v, int64_t n) { std::memcpy(y, v.v, n * sizeof(float)); }
};
#endif

// ---- the formats, once, over that layer
// Quad j of a block's codes, for the L rows of this slice (blk points at the slice's lanes of the block).
template <int64_t KIND, int J>
static inline typename Isa::B quad(const uint8_t* blk) {
  if (KIND == Q8_0) return Isa::load(blk + 64 * J);
  const typename Isa::B v = Isa::load(blk + 64 * (J / 2));
  const typename Isa::B nib = J % 2 == 0 ? Isa::template bits<0, 0x0F>(v) : Isa::template bits<-4, 0x0F>(v);
  if (KIND == Q5_0 || KIND == Q5_1 || KIND == Q5_K)
    return Isa::bor(nib, Isa::template bits<4 - J, 0x10>(Isa::load(blk + 256)));
  if (KIND == Q6_K)
    return Isa::bor(nib, Isa::template bits<4 - 2 * (J % 4), 0x30>(Isa::load(blk + 256 + 64 * (J / 4))));
  return nib;
}

// The quads of one block for H slices (H x L rows) x T activation rows: each quad vector decoded once,
// each activation quad broadcast once.
template <int64_t KIND, int H, int T, int J>
static inline void quads(const uint8_t* blk, const int8_t* const* xq, typename Isa::Acc (*a)[T],
                         typename Isa::Acc (*a2)[T]) {
  if constexpr (J < 8) {
    typename Isa::B w[H];
    for (int h = 0; h < H; ++h) w[h] = quad<KIND, J>(blk + 4 * Isa::L * h);
    for (int t = 0; t < T; ++t) {
      const typename Isa::X x = Isa::bcast(ld32(xq[t] + 4 * J));
      for (int h = 0; h < H; ++h) {
        if constexpr (KIND == Q8_0) {
          Isa::step_s(a[h][t], Isa::prep_s(w[h]), x, J);
        } else if constexpr (KIND == Q6_K) {  // the two 16-input halves apart: each has its own scale
          Isa::template step<63>(J < 4 ? a[h][t] : a2[h][t], w[h], x, J % 4);
        } else {
          Isa::template step<fmt_cmax(KIND)>(a[h][t], w[h], x, J);
        }
      }
    }
    quads<KIND, H, T, J + 1>(blk, xq, a, a2);
  }
}

// H slices of L rows (lanes lo .. lo+H*L-1 of group g) x T activation rows from r0:
// y[(r0+t) * ldy + 16g + lane] for the lanes < nv.
// pf: this tile also prefetches the weight stream PF blocks ahead (past the group's end, the next group's)
// and the scales with it, so the memory reads overlap the arithmetic instead of adding to it.
static constexpr int64_t PF = 8;

template <int64_t KIND, int H, int T>
static void tile(const W& w, int64_t g, int64_t lo, const QRows& x, int64_t r0, float* y, int64_t ldy, int64_t nv,
                 bool pf) {
  const int64_t NB = w.NB, NSB = NB / 8;
  typename Isa::F acc[H][T];
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) acc[h][t] = Isa::fzero();
  const uint8_t* base = w.qs + g * NB * fmt_bytes(KIND) + 4 * lo;
  for (int64_t b = 0; b < NB; ++b) {
    if (pf) {  // a prefetch never faults, so the last group's may point past the end
      const char* q = (const char*)(base + (b + PF) * fmt_bytes(KIND));
      for (int64_t o = 0; o < fmt_bytes(KIND); o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
      if (b % 2 == 0) {  // scales: 32 bytes a block (or a super-block), one line every two
        if constexpr (fmt_super(KIND)) {
          _mm_prefetch((const char*)(w.sc + (g * NB + b + PF) * 32), _MM_HINT_T0);
          if (b % 8 == 0) {
            _mm_prefetch((const char*)(w.d + (g * NSB + b / 8 + 1) * 16), _MM_HINT_T0);
            if constexpr (fmt_min(KIND)) _mm_prefetch((const char*)(w.m + (g * NSB + b / 8 + 1) * 16), _MM_HINT_T0);
          }
        } else {
          _mm_prefetch((const char*)(w.d + (g * NB + b + PF) * 16), _MM_HINT_T0);
          if constexpr (fmt_min(KIND)) _mm_prefetch((const char*)(w.m + (g * NB + b + PF) * 16), _MM_HINT_T0);
        }
      }
    }
    const int8_t* xq[T];
    for (int t = 0; t < T; ++t) xq[t] = x.q.data() + ((r0 + t) * NB + b) * 32;
    typename Isa::Acc a[H][T], a2[H][T];
    quads<KIND, H, T, 0>(base + b * fmt_bytes(KIND), xq, a, a2);
    for (int h = 0; h < H; ++h) {
      const int64_t l0 = lo + h * Isa::L;
      typename Isa::F dw, mw;
      typename Isa::I sc0, sc1;
      if constexpr (fmt_super(KIND)) {
        const int64_t sg = (g * NSB + b / 8) * 16 + l0;
        const uint8_t* scb = w.sc + (g * NB + b) * 32 + l0;
        dw = Isa::load_h(w.d + sg);
        if constexpr (KIND == Q6_K) {
          sc0 = Isa::load_i8(scb);
          sc1 = Isa::load_i8(scb + 16);
        } else {
          dw = Isa::fmul(dw, Isa::cvt(Isa::load_u8(scb)));
          mw = Isa::fneg(Isa::fmul(Isa::load_h(w.m + sg), Isa::cvt(Isa::load_u8(scb + 16))));
        }
      } else {
        const int64_t gb = (g * NB + b) * 16 + l0;
        dw = Isa::load_h(w.d + gb);
        if constexpr (fmt_min(KIND)) mw = Isa::load_h(w.m + gb);
      }
      for (int t = 0; t < T; ++t) {
        const int64_t xb = (r0 + t) * NB + b;
        typename Isa::I s;
        if constexpr (KIND == Q8_0) {
          s = Isa::done_s(a[h][t], x.sq[xb]);
        } else if constexpr (KIND == Q4_0 || KIND == Q5_0) {
          s = Isa::iadd(Isa::done(a[h][t]), Isa::iset((KIND == Q4_0 ? -8 : -16) * x.sq[xb]));
        } else if constexpr (KIND == Q6_K) {
          const typename Isa::I s0 = Isa::iadd(Isa::done(a[h][t]), Isa::iset(-32 * x.sq0[xb]));
          const typename Isa::I s1 = Isa::iadd(Isa::done(a2[h][t]), Isa::iset(-32 * (x.sq[xb] - x.sq0[xb])));
          s = Isa::iadd(Isa::imul(s0, sc0), Isa::imul(s1, sc1));
        } else {
          s = Isa::done(a[h][t]);
        }
        acc[h][t] = Isa::fadd(acc[h][t], Isa::fmul(Isa::cvt(s), Isa::fmul(dw, Isa::fset(x.dx[xb]))));
        if constexpr (fmt_min(KIND)) acc[h][t] = Isa::fadd(acc[h][t], Isa::fmul(mw, Isa::fset(x.sx[xb])));
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t l0 = lo + h * Isa::L;
    if (l0 >= nv) break;
    for (int t = 0; t < T; ++t) Isa::store(y + (r0 + t) * ldy + 16 * g + l0, acc[h][t], std::min<int64_t>(Isa::L, nv - l0));
  }
}

template <int64_t KIND, int H, int T>
static inline void tile_upto(int64_t n, const W& w, int64_t g, int64_t lo, const QRows& x, int64_t r0, float* y,
                             int64_t ldy, int64_t nv, bool pf) {  // a tile of n <= T rows
  if constexpr (T > 1) {
    if (n < T) return tile_upto<KIND, H, T - 1>(n, w, g, lo, x, r0, y, ldy, nv, pf);
  }
  tile<KIND, H, T>(w, g, lo, x, r0, y, ldy, nv, pf);
}

// Groups gs .. ge-1 of w against all M rows.  The activation rows go in chunks of 64 (they stay in L1/L2);
// within a chunk each group's weights are read from memory once and reused from L1 by every tile of rows,
// the first of which prefetches the stream ahead.  Passes of 1-2 rows take a whole group a tile (each
// activation quad broadcast once for its 16 rows); longer ones a slice of L rows x T rows (register-bound).
// Either way each row gets the same operations.
template <int64_t KIND>
static void groups(const W& w, int64_t gs, int64_t ge, const QRows& x, int64_t M, float* y, int64_t ldy) {
  constexpr int HW = 16 / Isa::L;  // slices in a group
  for (int64_t r0 = 0; r0 < M; r0 += 64) {
    const int64_t r1 = std::min(M, r0 + 64);
    for (int64_t g = gs; g < ge; ++g) {
      const int64_t nv = std::min<int64_t>(16, w.N - 16 * g);
      if (M <= 2 && HW > 1) {
        tile_upto<KIND, HW, 2>(M, w, g, 0, x, 0, y, ldy, nv, true);
        continue;
      }
      for (int64_t lo = 0; lo < nv; lo += Isa::L)
        for (int64_t r = r0; r < r1; r += Isa::T)
          tile_upto<KIND, 1, Isa::T>(std::min<int64_t>(Isa::T, r1 - r), w, g, lo, x, r, y, ldy, nv, lo == 0 && r == r0);
    }
  }
}

// One projection: its parts (a fused q|k|v or gate|up whose parts may be stored in different formats)
// side by side in the output row.
struct WSet {
  std::vector<W> parts;
  int64_t N = 0, K = 0;
};

// y[M, N] (row stride ldy) = the quantized rows x against every weight row; the groups of 16 rows of
// all parts split over threads.
static void linear_q(const QRows& x, int64_t M, const WSet& ws, float* y, int64_t ldy) {
  int64_t total = 0;
  for (const W& w : ws.parts) total += w.G;
  at::parallel_for(0, total, 4, [&](int64_t s, int64_t e) {
    int64_t first = 0, col = 0;
    for (const W& w : ws.parts) {
      const int64_t gs = std::max(s, first) - first, ge = std::min(e, first + w.G) - first;
      if (gs < ge) {
        float* yp = y + col;
        switch (w.kind) {
          case Q4_0: groups<Q4_0>(w, gs, ge, x, M, yp, ldy); break;
          case Q4_1: groups<Q4_1>(w, gs, ge, x, M, yp, ldy); break;
          case Q5_0: groups<Q5_0>(w, gs, ge, x, M, yp, ldy); break;
          case Q5_1: groups<Q5_1>(w, gs, ge, x, M, yp, ldy); break;
          case Q8_0: groups<Q8_0>(w, gs, ge, x, M, yp, ldy); break;
          case Q4_K: groups<Q4_K>(w, gs, ge, x, M, yp, ldy); break;
          case Q5_K: groups<Q5_K>(w, gs, ge, x, M, yp, ldy); break;
          default: groups<Q6_K>(w, gs, ge, x, M, yp, ldy); break;
        }
      }
      first += w.G;
      col += w.N;
    }
  });
}

// A projection from its tensors: per part [qs, d, m, sc] (undefined or empty where the format has none),
// meta = [kind, rows] per part; K the input width.
static WSet weights(at::TensorList t, at::IntArrayRef meta, int64_t K) {
  TORCH_CHECK(t.size() == 2 * meta.size() && !meta.empty() && meta.size() % 2 == 0,
              "fast weight: 4 tensors and (kind, rows) per part");
  TORCH_CHECK(K % 32 == 0, "fast weight: K a multiple of 32");
  WSet ws;
  ws.K = K;
  for (size_t p = 0; p < meta.size() / 2; ++p) {
    const int64_t kind = meta[2 * p], N = meta[2 * p + 1], NB = K / 32, G = (N + 15) / 16;
    TORCH_CHECK(kind >= Q4_0 && kind <= Q6_K && N > 0, "fast weight: kind 0..7 and rows > 0");
    TORCH_CHECK(!fmt_super(kind) || K % 256 == 0, "fast weight: K-quants need K a multiple of 256");
    const at::Tensor &qs = t[4 * p], &d = t[4 * p + 1], &m = t[4 * p + 2], &sc = t[4 * p + 3];
    const int64_t nd = fmt_super(kind) ? NB / 8 : NB;
    TORCH_CHECK(qs.is_cpu() && qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == G * NB * fmt_bytes(kind),
                "fast weight: qs [G, NB, bytes] uint8");
    TORCH_CHECK(d.is_cpu() && d.scalar_type() == at::kShort && d.is_contiguous() && d.numel() == G * nd * 16,
                "fast weight: d [G, NB or NB/8, 16] int16 (fp16 bits)");
    W w{qs.data_ptr<uint8_t>(), (const uint16_t*)d.data_ptr<int16_t>(), nullptr, nullptr, N, K, NB, G, kind};
    if (fmt_min(kind)) {
      TORCH_CHECK(m.defined() && m.is_cpu() && m.scalar_type() == at::kShort && m.is_contiguous() && m.numel() == d.numel(),
                  "fast weight: m like d");
      w.m = (const uint16_t*)m.data_ptr<int16_t>();
    }
    if (fmt_super(kind)) {
      TORCH_CHECK(sc.defined() && sc.is_cpu() && (sc.scalar_type() == at::kByte || sc.scalar_type() == at::kChar) &&
                      sc.is_contiguous() && sc.numel() == G * NB * 32, "fast weight: sc [G, NB, 2, 16] bytes");
      w.sc = (const uint8_t*)sc.data_ptr();
    }
    ws.parts.push_back(w);
    ws.N += N;
  }
  return ws;
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
#if FAST_ISA == 2
// (q . k_j) * scale for the 16 keys k_j = kbase + idx[j] * s_s, each exactly as the one-key loop computes it:
// a_j = sum over c in order of q[16c..] * k_j[16c..] in 16 lanes, then reduce16's tree.  The trees of the 16
// keys run side by side: each step adds the same two lanes reduce16 adds, for 2, 4, 8, 16 keys per vector.
static inline __m512 scores16(const float* q, const float* kbase, int64_t s_s, const int32_t* idx, int64_t C,
                              float scale) {
  __m512 s1[8];  // step 1, keys 2p and 2p+1: lanes 0-7 = a_2p[i] + a_2p[i+8], lanes 8-15 the same of a_2p+1
  for (int p = 0; p < 8; ++p) {
    const float* k0 = kbase + idx[2 * p] * s_s;
    const float* k1 = kbase + idx[2 * p + 1] * s_s;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + 16 * c);
      a0 = _mm512_add_ps(a0, _mm512_mul_ps(qc, _mm512_loadu_ps(k0 + 16 * c)));
      a1 = _mm512_add_ps(a1, _mm512_mul_ps(qc, _mm512_loadu_ps(k1 + 16 * c)));
    }
    s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 s2[4];  // step 2, keys 4u .. 4u+3, one a 128-bit lane: b[i] = a[i] + a[i+4]
  for (int u = 0; u < 4; ++u)
    s2[u] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * u], s1[2 * u + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * u], s1[2 * u + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 s3[2];  // step 3, c[i] = b[i] + b[i+2]: 128-bit lane l holds c0, c1 of keys 8w+l and 8w+4+l
  for (int w = 0; w < 2; ++w)
    s3[w] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * w], s2[2 * w + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * w], s2[2 * w + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // step 4, c0 + c1: lane 4l + j holds key 4j + l; put key j in lane j
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_mul_ps(_mm512_permutexvar_ps(order, r), _mm512_set1_ps(scale));
}
#endif

#if FAST_ISA == 1
// scores16's arithmetic in 8-lane halves, for 8 keys: a_j = lo_j (lanes 0-7) + hi_j (lanes 8-15) after the
// loop over c, then reduce16h's steps (b[i] = a[i] + a[i+4], c[i] = b[i] + b[i+2], c0 + c1) for 2, 4, 8
// keys per vector, each exactly as reduce16h adds them for one key.
static inline __m256 scores8(const float* q, const float* kbase, int64_t s_s, const int32_t* idx, int64_t C,
                             float scale) {
  __m256 a[8];  // step 1, per key
  for (int j = 0; j < 8; ++j) {
    const float* k = kbase + idx[j] * s_s;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + 16 * c), _mm256_loadu_ps(k + 16 * c)));
      hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + 16 * c + 8), _mm256_loadu_ps(k + 16 * c + 8)));
    }
    a[j] = _mm256_add_ps(lo, hi);
  }
  __m256 b[4];  // step 2, keys 2p (low 128 bits) and 2p+1 (high)
  for (int p = 0; p < 4; ++p)
    b[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  __m256 c[2];  // step 3: 128-bit lane l holds c0, c1 of keys 4w+l and 4w+2+l
  for (int w = 0; w < 2; ++w)
    c[w] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * w], b[2 * w + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(b[2 * w], b[2 * w + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // step 4, c0 + c1: lane 4l + j holds key 2j + l; put key j in lane j
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return _mm256_mul_ps(_mm256_permutevar8x32_ps(r, order), _mm256_set1_ps(scale));
}

// out[0 .. 8N) = sum_j e_j v_j / sum for the 8N dims of the values at vbase (each v row s_s apart): each dim's sum
// over j in slot order, as the portable loop; N a compile-time count, so the N accumulators stay in registers.
template <int N>
static inline void wsum8(const float* e, const float* vbase, int64_t s_s, const int32_t* idx, int64_t n,
                         __m256 vsum, float* out) {
  __m256 o[N];
  for (int c = 0; c < N; ++c) o[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vbase + idx[j] * s_s;
    const __m256 w = _mm256_set1_ps(e[j]);
    for (int c = 0; c < N; ++c) o[c] = _mm256_add_ps(o[c], _mm256_mul_ps(w, _mm256_loadu_ps(v + 8 * c)));
  }
  for (int c = 0; c < N; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_div_ps(o[c], vsum));
}
#endif

static void attend(const float* q, int64_t q_stride, const float* kbase, const float* vbase, int64_t s_s,
                   const int32_t* idx, int64_t n, int64_t G, int64_t D, float scale, float* sc, float* out,
                   int64_t out_stride) {
  std::vector<float> mx(G, -INFINITY);
#if FAST_ISA == 2
  if (G <= 8 && D <= 256) {
    const int64_t C = D / 16;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)  // 16 keys at a time: their reduce16 trees side by side (scores16)
      for (int64_t g = 0; g < G; ++g) {
        const __m512 v = scores16(q + g * q_stride, kbase, s_s, idx + i, C, scale);
        _mm512_storeu_ps(sc + g * n + i, v);
        mx[g] = std::max(mx[g], _mm512_reduce_max_ps(v));  // a max: exact in any order
      }
    for (; i < n; ++i) {  // scores: each key read once for the G heads
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
#elif FAST_ISA == 1
  if (G <= 8 && D <= 256) {  // the VNNI loop's arithmetic in 8-lane halves
    const int64_t C = D / 16;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)  // 8 keys at a time: their reduce16h trees side by side (scores8)
      for (int64_t g = 0; g < G; ++g) {
        const __m256 v = scores8(q + g * q_stride, kbase, s_s, idx + i, C, scale);
        _mm256_storeu_ps(sc + g * n + i, v);
        const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        mx[g] = std::max(mx[g], _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1))));  // exact in any order
      }
    for (; i < n; ++i) {
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
      float* og = out + g * out_stride;
      int64_t c0 = 0;
      for (; c0 + 64 <= D; c0 += 64) wsum8<8>(e, vbase + c0, s_s, idx, n, vsum, og + c0);  // 64 dims in 8 registers
      switch ((D - c0) / 8) {  // the last 16, 32 or 48 dims
        case 2: wsum8<2>(e, vbase + c0, s_s, idx, n, vsum, og + c0); break;
        case 4: wsum8<4>(e, vbase + c0, s_s, idx, n, vsum, og + c0); break;
        case 6: wsum8<6>(e, vbase + c0, s_s, idx, n, vsum, og + c0); break;
      }
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

// The slots a row sees (its mask row mr, true = visible; none: all S), in slot order, into idx; returns how
// many.  Eight mask bytes at a time: a causal or tree mask is long runs of all-visible or none.
static int64_t visible(const bool* mr, int64_t S, int32_t* idx) {
  int64_t n = 0, j = 0;
  if (!mr) {
    for (; j < S; ++j) idx[n++] = (int32_t)j;
    return n;
  }
  for (; j + 8 <= S; j += 8) {
    uint64_t w;
    std::memcpy(&w, mr + j, 8);
    if (w == 0) continue;
    if (w == 0x0101010101010101ull) {
      for (int k = 0; k < 8; ++k) idx[n++] = (int32_t)(j + k);
      continue;
    }
    for (int k = 0; k < 8; ++k)
      if (mr[j + k]) idx[n++] = (int32_t)(j + k);
  }
  for (; j < S; ++j)
    if (mr[j]) idx[n++] = (int32_t)j;
  return n;
}

// The gated MLP's activation: silu(g) u = g / (1 + e^-g) u, or GeGLU's gelu_tanh(g) u = g / (1 + e^-z) u with
// z = 2 sqrt(2/pi) (g + 0.044715 g^3) (0.5 (1 + tanh(z/2)) = 1 / (1 + e^-z)): one exponential either way.
static constexpr float GELU_K = 1.5957691216057308f, GELU_A = 0.044715f;  // 2 sqrt(2/pi), the cubic's weight
static inline float gelu_arg(float g) { return GELU_K * (g + GELU_A * g * g * g); }
static inline float act_mul(float g, float u, bool gelu) { return g / (1.f + exp_s(-(gelu ? gelu_arg(g) : g))) * u; }

static void act_rows(const float* gu, int64_t M, int64_t inter, float* out, bool gelu) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * inter;
    float* o = out + m * inter;
    int64_t j = 0;
#if FAST_ISA == 2
    if (true)
      for (; j + 16 <= inter; j += 16) {
        const __m512 gv = _mm512_loadu_ps(g + j);
        const __m512 z = gelu ? _mm512_mul_ps(_mm512_set1_ps(GELU_K), _mm512_add_ps(gv, _mm512_mul_ps(
                                    _mm512_mul_ps(_mm512_set1_ps(GELU_A), gv), _mm512_mul_ps(gv, gv)))) : gv;
        const __m512 e = exp_v(_mm512_sub_ps(_mm512_setzero_ps(), z));
        _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                              _mm512_loadu_ps(g + inter + j)));
      }
#elif FAST_ISA == 1
    if (true)
      for (; j + 8 <= inter; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 z = gelu ? _mm256_mul_ps(_mm256_set1_ps(GELU_K), _mm256_add_ps(gv, _mm256_mul_ps(
                                    _mm256_mul_ps(_mm256_set1_ps(GELU_A), gv), _mm256_mul_ps(gv, gv)))) : gv;
        const __m256 e = exp_v8(_mm256_sub_ps(_mm256_setzero_ps(), z));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                              _mm256_loadu_ps(g + inter + j)));
      }
#endif
    for (; j < inter; ++j) o[j] = act_mul(g[j], g[inter + j], gelu);
  }
}

// y [M, w.N] = the rows x [M, w.K], quantized, against w: an op's projection, its two steps.
static void project(const float* x, int64_t M, const WSet& w, float* y) {
  QRows qx;
  quantize_rows(x, M, w.K, qx);
  linear_q(qx, M, w, y, w.N);
}

// y[m, :] + b for each of the M rows of y [M, N], in fp32 as torch adds a bias (``who``: the op, for errors).
static void add_bias(float* y, int64_t M, int64_t N, const at::Tensor& b, const char* who) {
  TORCH_CHECK(b.is_cpu() && b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == N, who,
              ": bias [rows] fp32, contiguous");
  const float* bp = b.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = y[m * N + n] + bp[n];
}

// ------------------------------------------------------------------ ops
at::Tensor linear(const at::Tensor& x, at::TensorList w_t, at::IntArrayRef w_meta, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat, "fast linear: x [M, K] fp32 on the CPU");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const WSet w = weights(w_t, w_meta, K);
  at::Tensor y = at::empty({M, w.N}, xc.options());
  project(xc.data_ptr<float>(), M, w, y.data_ptr<float>());
  if (bias.has_value() && bias->defined()) add_bias(y.data_ptr<float>(), M, w.N, *bias, "fast linear");
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
std::tuple<at::Tensor, at::Tensor> head(const at::Tensor& x, const at::Tensor& norm_w, double eps, at::TensorList w_t,
                                        at::IntArrayRef w_meta, bool want_logits) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && norm_w.is_cpu() && norm_w.scalar_type() == at::kFloat &&
                  norm_w.numel() == x.size(-1), "fast head: x [..., H] and norm_w [H], fp32 on the CPU");
  at::Tensor xc = x.contiguous();
  const int64_t H = xc.size(-1), M = xc.numel() / H;
  at::Tensor normed = at::empty_like(xc);
  rms_rows(xc.data_ptr<float>(), M, H, eps, norm_w.contiguous().data_ptr<float>(), normed.data_ptr<float>());
  if (!want_logits) return {normed, at::empty({0}, xc.options())};
  const WSet w = weights(w_t, w_meta, H);
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = w.N;
  at::Tensor y = at::empty(shape, xc.options());
  project(normed.data_ptr<float>(), M, w, y.data_ptr<float>());
  return {normed, y};
}

// One decoder block (llama.Block.forward's maths) in the fast mode:
//   x [B, T, H]; rot [B, T, D/2, 2] (cos, sin) per pair; mask bool [B, T, start+T] (true = may attend)
//   or none (every slot visible); kv [2, B, Hkv, S, D] written at slots start .. start+T-1.  A drafter's
//   layer also takes qk_norm [2, D] (an RMSNorm over each q / k head before RoPE, DFlash's) and out_rows: only
//   the first out_rows rows of each sequence come out (the others give their keys and values only).  Gemma 3's
//   blocks add post_attn / post_mlp [H] (an RMSNorm on W_o's and W_down's outputs before each residual add),
//   gelu (GeGLU for SwiGLU) and scale (the attention logits' factor; 0 = 1/sqrt(D)).  EAGLE-3's layer passes
//   x_attn [B, T, K]: the rows its attention reads ([input_layernorm(e) ; hidden_norm(g)], normed by the caller),
//   x (= g) staying the residual.
at::Tensor block(const at::Tensor& x_in, at::TensorList qkv_t, at::IntArrayRef qkv_meta,
                 const std::optional<at::Tensor>& s_attn, const std::optional<at::Tensor>& bqkv, at::TensorList o_t,
                 at::IntArrayRef o_meta, at::TensorList gu_t, at::IntArrayRef gu_meta,
                 const std::optional<at::Tensor>& s_mlp, at::TensorList dn_t, at::IntArrayRef dn_meta,
                 const at::Tensor& rot, const std::optional<at::Tensor>& mask, const at::Tensor& kv, int64_t start,
                 double eps, int64_t hq, int64_t hkv, int64_t D, const std::optional<at::Tensor>& qk_norm,
                 int64_t out_rows, const std::optional<at::Tensor>& post_attn, const std::optional<at::Tensor>& post_mlp,
                 bool gelu, double attn_scale, const std::optional<at::Tensor>& x_attn) {
  TORCH_CHECK(x_in.is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 3, "fast block: x [B, T, H] fp32 on the CPU");
  TORCH_CHECK(D % 16 == 0 && hq % hkv == 0, "fast block: head size a multiple of 16");
  at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T, qsz = hq * D, ksz = hkv * D, G = hq / hkv;
  const int64_t S = start + T, half = D / 2, To = out_rows < 0 ? T : out_rows, Mo = B * To;
  TORCH_CHECK(To >= 1 && To <= T, "fast block: out_rows in 1 .. T (or -1 = T)");
  TORCH_CHECK(!qk_norm || (qk_norm->is_contiguous() && qk_norm->numel() == 2 * D && qk_norm->scalar_type() == at::kFloat),
              "fast block: qk_norm [2, D] fp32 (the q and the k head norm's weights)");
  TORCH_CHECK(kv.is_cpu() && kv.scalar_type() == at::kFloat && kv.is_contiguous() && kv.dim() == 5 && kv.size(0) == 2 &&
                  kv.size(1) == B && kv.size(2) == hkv && kv.size(4) == D,
              "fast block: a contiguous fp32 cache [2, B, Hkv, S, D] on the CPU");
  TORCH_CHECK(start >= 0 && S <= kv.size(3), "fast block: the pass does not fit in the cache");
  TORCH_CHECK(!s_attn || (s_attn->is_contiguous() && s_attn->numel() == H && s_attn->scalar_type() == at::kFloat),
              "fast block: s_attn [H] fp32");
  TORCH_CHECK(!s_mlp || (s_mlp->is_contiguous() && s_mlp->numel() == H && s_mlp->scalar_type() == at::kFloat),
              "fast block: s_mlp [H] fp32");
  for (const auto* t : {&post_attn, &post_mlp})
    TORCH_CHECK(!*t || ((*t)->is_contiguous() && (*t)->numel() == H && (*t)->scalar_type() == at::kFloat),
                "fast block: post_attn / post_mlp [H] fp32");
  // EAGLE-3's layer: its attention reads other rows than its residual, x_attn [B, T, K] (normed by the caller)
  at::Tensor xa;
  if (x_attn) {
    xa = x_attn->contiguous();
    TORCH_CHECK(xa.is_cpu() && xa.scalar_type() == at::kFloat && xa.dim() == 3 && xa.size(0) == B && xa.size(1) == T && !s_attn,
                "fast block: x_attn [B, T, K] fp32 on the CPU, and no s_attn (the caller norms it)");
  }
  const int64_t Ka = x_attn ? xa.size(2) : H;
  const WSet wqkv = weights(qkv_t, qkv_meta, Ka), wo = weights(o_t, o_meta, qsz), wgu = weights(gu_t, gu_meta, H);
  const int64_t inter = wgu.N / 2;
  const WSet wd = weights(dn_t, dn_meta, inter);
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

  // q, k, v = W_qkv RMSNorm(x) (+ b); EAGLE-3: W_qkv x_attn
  if (x_attn) {
    quantize_rows(xa.data_ptr<float>(), M, Ka, qx);
  } else {
    rms_rows(xp, M, H, eps, s_attn ? s_attn->data_ptr<float>() : nullptr, buf.data());
    quantize_rows(buf.data(), M, H, qx);
  }
  linear_q(qx, M, wqkv, qkv.data(), nqkv);
  if (bqkv) add_bias(qkv.data(), M, nqkv, *bqkv, "fast block");
  if (qk_norm) {  // RMSNorm over each q and k head (Qwen3's layers, DFlash's), before RoPE
    const float* qn = qk_norm->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t hh = 0; hh < hq + hkv; ++hh) {
        float* p = qkv.data() + m * nqkv + hh * D;
        rms_rows(p, 1, D, eps, qn + (hh < hq ? 0 : D), p);
      }
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
  // From here on only the first To rows of each sequence (r = 0 .. Mo-1 stands for row m(r)): the others
  // gave their keys and values, and a caller that reads no output of theirs (a drafter's block rows past
  // the depth it scores) skips their attention, W_o and MLP.
  auto row = [&](int64_t r) { return (r / To) * T + r % To; };
  // attention, each row's visible slots in slot order.  A task is one KV head and a block of rows, so the
  // head's keys and values (2 MB at a 4k context) stay in cache while the block's rows, and the thread's
  // next blocks of the same head, read them; enough blocks that both threads have work.
  const float scale = attn_scale > 0 ? (float)attn_scale : 1.f / std::sqrt((float)D);
  const int64_t nrb = std::min<int64_t>(Mo, std::max<int64_t>((Mo + 63) / 64, (2 * at::get_num_threads() + hkv - 1) / hkv));
  const int64_t R = (Mo + nrb - 1) / nrb;
  at::parallel_for(0, hkv * nrb, 1, [&](int64_t s, int64_t e) {
    std::vector<int32_t> idx(S);
    std::vector<float> sc(S * G);
    for (int64_t task = s; task < e; ++task) {
      const int64_t kh = task / nrb, rb = task % nrb;
      for (int64_t r = rb * R; r < std::min(Mo, (rb + 1) * R); ++r) {
        const int64_t m = row(r);
        const int64_t n = visible(mp ? mp + m * S : nullptr, S, idx.data());
        const float* kb = kvp + (m / T) * s_b + kh * s_h;
        attend(qkv.data() + m * nqkv + kh * G * D, D, kb, kb + s_kv, s_s, idx.data(), n, G, D, scale, sc.data(),
               buf.data() + r * qsz + kh * G * D, D);
      }
    }
  });
  // y = x + W_o att
  at::Tensor y = at::empty({B, To, H}, opt);
  float* yp = y.data_ptr<float>();
  quantize_rows(buf.data(), Mo, qsz, qx);
  linear_q(qx, Mo, wo, yp, H);
  if (post_attn) rms_rows(yp, Mo, H, eps, post_attn->data_ptr<float>(), yp);
  for (int64_t r = 0; r < Mo; ++r) {
    const float* xr = xp + row(r) * H;
    float* yr = yp + r * H;
    for (int64_t i = 0; i < H; ++i) yr[i] = yr[i] + xr[i];
  }
  // out = y + W_down (silu(gate) * up),  gate|up = W_gu RMSNorm(y)  (Gemma: gelu_tanh; RMSNorm on W_down's output)
  rms_rows(yp, Mo, H, eps, s_mlp ? s_mlp->data_ptr<float>() : nullptr, buf.data());
  quantize_rows(buf.data(), Mo, H, qx);
  std::vector<float> gu(Mo * 2 * inter);
  linear_q(qx, Mo, wgu, gu.data(), 2 * inter);
  act_rows(gu.data(), Mo, inter, buf.data(), gelu);
  quantize_rows(buf.data(), Mo, inter, qx);
  at::Tensor out = at::empty({B, To, H}, opt);
  float* op = out.data_ptr<float>();
  linear_q(qx, Mo, wd, op, H);
  if (post_mlp) rms_rows(op, Mo, H, eps, post_mlp->data_ptr<float>(), op);
  for (int64_t i = 0; i < Mo * H; ++i) op[i] = op[i] + yp[i];
  return out;
}


static inline bool any_above16(const float* x, float t) {  // whether any of x[0 .. 15] > t
#if FAST_ISA == 2
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif FAST_ISA == 1
  const __m256 tt = _mm256_set1_ps(t);
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), tt, _CMP_GT_OQ),
                                         _mm256_cmp_ps(_mm256_loadu_ps(x + 8), tt, _CMP_GT_OQ))) != 0;
#else
  for (int l = 0; l < 16; ++l)
    if (x[l] > t) return true;
  return false;
#endif
}

// Log-softmax top-k of logits rows [M, V]: per row the k largest, descending (equal values: the lower index
// first), as log-probabilities x_i - (max + log sum_j exp(x_j - max)); the sum in 16 lanes by index, then
// reduce16.  (values [M, k], indices [M, k] int64.)  For drafters, which need a few candidates per row and
// never the whole distribution: one pass over the row, no V-sized temporaries.
static void topk_rows(const float* lp, int64_t M, int64_t V, int64_t k, float* vp, int64_t* ip) {
  at::parallel_for(0, M, 1, [&](int64_t s, int64_t e) {
    std::vector<float> tv(k);
    std::vector<int64_t> ti(k);
    for (int64_t m = s; m < e; ++m) {
      const float* x = lp + m * V;
      int64_t n = 0;  // kept so far, tv sorted descending
      float mx = -INFINITY;
      auto take = [&](int64_t i) {
        const float v = x[i];
        mx = std::max(mx, v);
        if (n == k && !(v > tv[k - 1])) return;
        int64_t j = n < k ? n++ : k - 1;
        for (; j > 0 && v > tv[j - 1]; --j) { tv[j] = tv[j - 1]; ti[j] = ti[j - 1]; }
        tv[j] = v;
        ti[j] = i;
      };
      int64_t i0 = 0;
      for (; i0 < std::min(V, k); ++i0) take(i0);
      for (; i0 + 16 <= V; i0 += 16) {  // 16 at a time: most chunks hold nothing above the k-th kept
        if (!any_above16(x + i0, tv[k - 1])) continue;  // (nor above the max, which is tv[0])
        for (int64_t i = i0; i < i0 + 16; ++i) take(i);
      }
      for (; i0 < V; ++i0) take(i0);
      float acc[16] = {0.f};
      int64_t i = 0;
#if FAST_ISA == 2
      __m512 a = _mm512_setzero_ps();
      for (; i + 16 <= V; i += 16) a = _mm512_add_ps(a, exp_v(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(mx))));
      _mm512_storeu_ps(acc, a);
#elif FAST_ISA == 1
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (; i + 16 <= V; i += 16) {
        lo = _mm256_add_ps(lo, exp_v8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(mx))));
        hi = _mm256_add_ps(hi, exp_v8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), _mm256_set1_ps(mx))));
      }
      _mm256_storeu_ps(acc, lo);
      _mm256_storeu_ps(acc + 8, hi);
#endif
      for (; i + 16 <= V; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] = acc[l] + exp_s(x[i + l] - mx);
      for (int l = 0; i < V; ++i, ++l) acc[l] = acc[l] + exp_s(x[i] - mx);
      const float lse = mx + std::log(reduce16(acc));
      for (int64_t j = 0; j < k; ++j) {
        vp[m * k + j] = tv[j] - lse;
        ip[m * k + j] = ti[j];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> logp_topk(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat, "fast logp_topk: logits [M, V] fp32");
  at::Tensor lc = logits.contiguous();
  const int64_t M = lc.size(0), V = lc.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "fast logp_topk: 1 <= k <= V");
  at::Tensor val = at::empty({M, k}, lc.options()), ind = at::empty({M, k}, lc.options().dtype(at::kLong));
  topk_rows(lc.data_ptr<float>(), M, V, k, val.data_ptr<float>(), ind.data_ptr<int64_t>());
  return {val, ind};
}

// A drafter's scores and their top-k in one call: rows x [M, K] (RMS-normed first with norm_w [K] where given,
// as ``head`` does), times the head's weight rows [V', K], then ``logp_topk`` of each row: (values [M, k],
// indices [M, k], through ``ids`` [V'] where given), the same bits as those three steps one by one, without the [M, V'] scores leaving C++.
std::tuple<at::Tensor, at::Tensor> linear_topk(const at::Tensor& x, const std::optional<at::Tensor>& norm_w, double eps,
                                               at::TensorList w_t, at::IntArrayRef w_meta, int64_t k,
                                               const std::optional<at::Tensor>& ids) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat, "fast linear_topk: x [M, K] fp32 on the CPU");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const float* src = xc.data_ptr<float>();
  at::Tensor normed;
  if (norm_w.has_value() && norm_w->defined()) {
    TORCH_CHECK(norm_w->is_cpu() && norm_w->scalar_type() == at::kFloat && norm_w->numel() == K,
                "fast linear_topk: norm_w [K] fp32");
    normed = at::empty_like(xc);
    rms_rows(src, M, K, eps, norm_w->contiguous().data_ptr<float>(), normed.data_ptr<float>());
    src = normed.data_ptr<float>();
  }
  const WSet w = weights(w_t, w_meta, K);
  TORCH_CHECK(k >= 1 && k <= w.N, "fast linear_topk: 1 <= k <= the weight's rows");
  std::vector<float> y(M * w.N);
  project(src, M, w, y.data());
  at::Tensor val = at::empty({M, k}, xc.options()), ind = at::empty({M, k}, xc.options().dtype(at::kLong));
  int64_t* ip = ind.data_ptr<int64_t>();
  topk_rows(y.data(), M, w.N, k, val.data_ptr<float>(), ip);
  if (ids.has_value() && ids->defined()) {  // row numbers -> the ids they stand for (a draft vocabulary's target ids)
    TORCH_CHECK(ids->is_cpu() && ids->scalar_type() == at::kLong && ids->is_contiguous() && ids->numel() == w.N,
                "fast linear_topk: ids [rows] int64, contiguous");
    const int64_t* map = ids->data_ptr<int64_t>();
    for (int64_t i = 0; i < M * k; ++i) ip[i] = map[ip[i]];
  }
  return {val, ind};
}

// A hybrid drafter's fused feature in one call: rows ``rows`` (R ints) of n target layers (feats, each [T, H] fp32),
// each RMS-normed over its H (no weight: it is folded into the projection's columns), side by side [R, n H],
// times the fusing projection: [R, N].  One op for the pick, the join, the norms and the matmul.
at::Tensor norms_linear(at::TensorList feats, at::IntArrayRef rows, double eps, at::TensorList w_t,
                        at::IntArrayRef w_meta) {
  const int64_t n = (int64_t)feats.size();
  TORCH_CHECK(n >= 1, "fast norms_linear: at least one layer");
  const int64_t T = feats[0].size(0), H = feats[0].size(1), R = (int64_t)rows.size();
  std::vector<at::Tensor> fc(n);
  std::vector<const float*> fp(n);
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(feats[j].is_cpu() && feats[j].dim() == 2 && feats[j].scalar_type() == at::kFloat &&
                    feats[j].size(0) == T && feats[j].size(1) == H, "fast norms_linear: every layer [T, H] fp32, alike");
    fc[j] = feats[j].contiguous();
    fp[j] = fc[j].data_ptr<float>();
  }
  const int64_t* rp = rows.data();
  std::vector<float> x(R * n * H);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_INDEX(rp[r] >= 0 && rp[r] < T, "row ", rp[r], " out of range [0, ", T, ")");
    for (int64_t j = 0; j < n; ++j) rms_rows(fp[j] + rp[r] * H, 1, H, eps, nullptr, x.data() + (r * n + j) * H);
  }
  const WSet w = weights(w_t, w_meta, n * H);
  at::Tensor y = at::empty({R, w.N}, feats[0].options());
  project(x.data(), R, w, y.data_ptr<float>());
  return y;
}

// A small MLP and the top-k of its output in one call (the phrase drafter's head): rows x [M, K] through layers
// l = 0 .. L-1, y = W_l q(y) + b_l (each W_l one part: 4 tensors and (kind, rows); an empty bias: none), SiLU
// between the layers (not after the last), then ``logp_topk`` of the last layer's rows: (values [M, k],
// indices [M, k]).  One op for what is otherwise a dozen, each paying its own dispatch with cold caches.
std::tuple<at::Tensor, at::Tensor> mlp_topk(const at::Tensor& x, at::TensorList w_t, at::IntArrayRef w_meta,
                                            at::TensorList bias, int64_t k) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat, "fast mlp_topk: x [M, K] fp32 on the CPU");
  const int64_t L = (int64_t)bias.size();
  TORCH_CHECK(L >= 1 && (int64_t)w_t.size() == 4 * L && (int64_t)w_meta.size() == 2 * L,
              "fast mlp_topk: per layer 4 weight tensors, (kind, rows) and a bias");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  int64_t K = xc.size(1);
  std::vector<float> cur(xc.data_ptr<float>(), xc.data_ptr<float>() + M * K), nxt;
  for (int64_t l = 0; l < L; ++l) {
    const WSet w = weights(w_t.slice(4 * l, 4), w_meta.slice(2 * l, 2), K);
    nxt.assign(M * w.N, 0.f);
    project(cur.data(), M, w, nxt.data());
    if (bias[l].defined() && bias[l].numel()) add_bias(nxt.data(), M, w.N, bias[l], "fast mlp_topk");
    if (l + 1 < L)
      for (float& v : nxt) v = v / (1.f + exp_s(-v));
    cur.swap(nxt);
    K = w.N;
  }
  TORCH_CHECK(k >= 1 && k <= K, "fast mlp_topk: 1 <= k <= the last layer's rows");
  at::Tensor val = at::empty({M, k}, xc.options()), ind = at::empty({M, k}, xc.options().dtype(at::kLong));
  topk_rows(cur.data(), M, K, k, val.data_ptr<float>(), ind.data_ptr<int64_t>());
  return {val, ind};
}

// Rows ids [n] of a Q8_0 table as GGUF stores it (data [rows, K/32 * 34] bytes: per block an fp16 scale, then
// 32 int8 codes): [n, K] fp32, each value code * scale in fp32 (one rounding: gguf-py's dequantizer's values).
// An embedding lookup of a pass, without dequantizing the table.
at::Tensor rows_q8(const at::Tensor& data, const at::Tensor& ids) {
  TORCH_CHECK(data.is_cpu() && data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous() &&
                  data.size(1) % 34 == 0, "fast rows_q8: data [rows, K/32 * 34] uint8, contiguous");
  TORCH_CHECK(ids.is_cpu() && ids.scalar_type() == at::kLong, "fast rows_q8: ids int64 on the CPU");
  at::Tensor ic = ids.contiguous();
  const int64_t n = ic.numel(), R = data.size(0), NB = data.size(1) / 34;
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < R, "token id ", ip[i], " out of range [0, ", R, ")");
  at::Tensor out = at::empty({n, NB * 32}, data.options().dtype(at::kFloat));
  const uint8_t* base = data.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = base + ip[i] * NB * 34;
    for (int64_t b = 0; b < NB; ++b) {
      uint16_t hs;
      std::memcpy(&hs, row + 34 * b, 2);
      const float d = h2f(hs);
      const int8_t* q = (const int8_t*)(row + 34 * b + 2);
      float* o = op + i * NB * 32 + 32 * b;
      for (int j = 0; j < 32; ++j) o[j] = (float)q[j] * d;
    }
  }
  return out;
}

}  // namespace FAST_NS
// FAST-BODY end

namespace fastk {
using fastk0::rms_rows;  // for model/quant.py (scalar code: the same in every copy)
using fastk0::rope_rows;

// The implementations this CPU can run: 2 = AVX-512 VNNI, 1 = AVX2, 0 = portable only.
static int64_t best_isa() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
      return (int64_t)2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return (int64_t)1;
    return (int64_t)0;
  }();
  return best;
}
static int64_t g_isa = -1;  // -1: the best; tests set 0 .. best_isa() to compare the implementations

static int64_t isa() { return g_isa < 0 ? best_isa() : g_isa; }

#define FAST_DISPATCH(fn, ...) \
  (isa() == 2 ? fastk2::fn(__VA_ARGS__) : isa() == 1 ? fastk1::fn(__VA_ARGS__) : fastk0::fn(__VA_ARGS__))

at::Tensor linear(const at::Tensor& x, at::TensorList w, at::IntArrayRef meta, const std::optional<at::Tensor>& bias) {
  return FAST_DISPATCH(linear, x, w, meta, bias);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x) { return FAST_DISPATCH(quantize, x); }
std::tuple<at::Tensor, at::Tensor> head(const at::Tensor& x, const at::Tensor& norm_w, double eps, at::TensorList w,
                                        at::IntArrayRef meta, bool want_logits) {
  return FAST_DISPATCH(head, x, norm_w, eps, w, meta, want_logits);
}
at::Tensor block(const at::Tensor& x, at::TensorList qkv, at::IntArrayRef qkv_meta, const std::optional<at::Tensor>& s_attn,
                 const std::optional<at::Tensor>& bqkv, at::TensorList o, at::IntArrayRef o_meta, at::TensorList gu,
                 at::IntArrayRef gu_meta, const std::optional<at::Tensor>& s_mlp, at::TensorList dn,
                 at::IntArrayRef dn_meta, const at::Tensor& rot, const std::optional<at::Tensor>& mask,
                 const at::Tensor& kv, int64_t start, double eps, int64_t hq, int64_t hkv, int64_t D,
                 const std::optional<at::Tensor>& qk_norm, int64_t out_rows, const std::optional<at::Tensor>& post_attn,
                 const std::optional<at::Tensor>& post_mlp, bool gelu, double attn_scale,
                 const std::optional<at::Tensor>& x_attn) {
  return FAST_DISPATCH(block, x, qkv, qkv_meta, s_attn, bqkv, o, o_meta, gu, gu_meta, s_mlp, dn, dn_meta, rot, mask, kv,
                       start, eps, hq, hkv, D, qk_norm, out_rows, post_attn, post_mlp, gelu, attn_scale, x_attn);
}
std::tuple<at::Tensor, at::Tensor> logp_topk(const at::Tensor& logits, int64_t k) { return FAST_DISPATCH(logp_topk, logits, k); }
std::tuple<at::Tensor, at::Tensor> linear_topk(const at::Tensor& x, const std::optional<at::Tensor>& norm_w, double eps,
                                               at::TensorList w, at::IntArrayRef meta, int64_t k,
                                               const std::optional<at::Tensor>& ids) {
  return FAST_DISPATCH(linear_topk, x, norm_w, eps, w, meta, k, ids);
}
at::Tensor rows_q8(const at::Tensor& data, const at::Tensor& ids) { return FAST_DISPATCH(rows_q8, data, ids); }
at::Tensor norms_linear(at::TensorList feats, at::IntArrayRef rows, double eps, at::TensorList w, at::IntArrayRef meta) {
  return FAST_DISPATCH(norms_linear, feats, rows, eps, w, meta);
}
std::tuple<at::Tensor, at::Tensor> mlp_topk(const at::Tensor& x, at::TensorList w, at::IntArrayRef meta, at::TensorList bias,
                                            int64_t k) {
  return FAST_DISPATCH(mlp_topk, x, w, meta, bias, k);
}
void set_isa(int64_t which) {
  TORCH_CHECK(which >= -1 && which <= best_isa(), "fast_set_isa: -1 (the best) or 0 .. ", best_isa(), " on this CPU");
  g_isa = which;
}
void set_portable(bool on) { g_isa = on ? 0 : -1; }
int64_t current_isa() { return isa(); }

}  // namespace fastk

TORCH_LIBRARY_FRAGMENT(specdraft_quant, lib) {
  lib.def("fast_linear(Tensor x, Tensor[] w, int[] meta, Tensor? bias=None) -> Tensor", &fastk::linear);
  lib.def("fast_quantize(Tensor x) -> (Tensor, Tensor, Tensor)", &fastk::quantize);
  lib.def("fast_head(Tensor x, Tensor norm_w, float eps, Tensor[] w, int[] meta, bool want_logits) -> (Tensor, Tensor)",
          &fastk::head);
  lib.def("fast_block(Tensor x, Tensor[] qkv, int[] qkv_meta, Tensor? s_attn, Tensor? bqkv, Tensor[] o, int[] o_meta, "
          "Tensor[] gu, int[] gu_meta, Tensor? s_mlp, Tensor[] dn, int[] dn_meta, Tensor rot, Tensor? mask, "
          "Tensor(a!) kv, int start, float eps, int hq, int hkv, int d, Tensor? qk_norm=None, int out_rows=-1, "
          "Tensor? post_attn=None, Tensor? post_mlp=None, bool gelu=False, float scale=0.0, Tensor? x_attn=None) -> Tensor",
          &fastk::block);
  lib.def("fast_logp_topk(Tensor logits, int k) -> (Tensor, Tensor)", &fastk::logp_topk);
  lib.def("fast_linear_topk(Tensor x, Tensor? norm_w, float eps, Tensor[] w, int[] meta, int k, Tensor? ids=None) -> (Tensor, Tensor)",
          &fastk::linear_topk);
  lib.def("fast_rows_q8(Tensor data, Tensor ids) -> Tensor", &fastk::rows_q8);
  lib.def("fast_norms_linear(Tensor[] feats, int[] rows, float eps, Tensor[] w, int[] meta) -> Tensor", &fastk::norms_linear);
  lib.def("fast_mlp_topk(Tensor x, Tensor[] w, int[] meta, Tensor[] bias, int k) -> (Tensor, Tensor)", &fastk::mlp_topk);
  lib.def("fast_set_isa(int which) -> ()", &fastk::set_isa);
  lib.def("fast_set_portable(bool on) -> ()", &fastk::set_portable);
  lib.def("fast_isa() -> int", &fastk::current_isa);
  lib.def("fast_best_isa() -> int", &fastk::best_isa);
}
