// Products with GGUF weights kept as the file stores them: y[M, N] = x[M, K] @ W[N, K]^T, W's rows
// in their ggml block format (ggml_kernel.py has the Python side and the list of types).
//
// Activations are quantized as llama.cpp quantizes them for each weight type:
//   * 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4): int8 per block of 32, d = max|x| / 127
//     rounded to float16, q = round half to even (x * 127 / max|x|) (llama.cpp's AVX quantize_row_q8_0);
//     for the types with a minimum (Q4_1, Q5_1) also s = float16(max|x| / 127 * sum(q)) per block (llama.cpp's
//     q8_1: the unrounded scale times the sum, rounded to float16).
//   * 256-value blocks (Q2_K .. Q6_K, IQ4_XS): llama.cpp's q8_K: the value of largest magnitude `max`,
//     q = min(127, round half to even (-127 / max * x)), d = 1 / (-127 / max) as float32, and the sum of
//     every 16 q (bsums).
//   * F16 / BF16 weights: float32 activations, the weights widened to float32 (fused multiply-adds).
// Every integer dot product of a block is exact; the float sums follow one fixed order per output
// value (8 lanes, then a fixed horizontal sum; in the AVX512 build's Q4_K / Q5_K / Q6_K kernels each
// super-block's exact integer sums into one float chain, KChain; its Q8_0 kernels each block's exact
// sum into one float chain, fma(float(S), d_w d_x, y)), the same whatever the other rows of
// the product are: row i of an M-row product equals the one-row product bit for bit. Small batches of
// Q4_K / Q5_K / Q6_K (6+ rows, the batched decode step) run ggml_gemm8.h's panel_exact, which
// keeps KChain's arithmetic: the same bits at 4-16x the weight reuse; those of Q5_0 / IQ4_NL /
// MXFP4 (2+ rows) its panel32, dot32's 8 lanes per output two weight rows to a vector (the same bits);
// Q8_0 at every row count its q80_x8 (one row) and q80_rows (2+ rows), the int8 prefill path's one
// chain per output (kern32: prefill and decode give Q8_0 the same bits).
// One-row products (decode) take the K-quants 8 weight rows at a time at every K (dot_q4k_x8,
// dot_q6k_x8: the 8 rows' chains in the lanes of one vector, KChain's steps per lane, the same bits
// again; the rows ahead prefetched into L2), and Q8_0 the same way (q80_x8).
//
// Two builds, picked by -march: AVX512-VNNI (the u8 x s8 block dot products with vpdpbusd on 256-bit
// vectors; Q4_K, Q5_K and Q6_K 64 values per 512-bit vector with vpmaddubsw + vpmaddwd) or AVX2 + FMA +
// F16C (vpmaddubsw + vpmaddwd, llama.cpp's AVX2 route). The integer results are the same; only the
// speed and the order of the float sums differ. Work is split over output rows on kvserve's pool
// (thread_pool.h, torch's thread count).
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <sys/mman.h>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml_cpu.h"
#include "q4_core.h"
#include "q4_repack.h"
#include "q8_quant.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GG_VNNI 1
#elif !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "ggml_cpu.cpp needs AVX512F/BW/VL + AVX512-VNNI, or AVX2 + FMA + F16C"
#endif

namespace {

// ggml type ids (gguf.GGMLQuantizationType)
enum : int {
  T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
  T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30, T_MXFP4 = 39
};

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

using kvserve_q8::round_f16;

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 32 unsigned bytes (each <= 128) times 32 signed bytes: int32 lane i = sum of bytes 4i..4i+3
inline __m256i dot_us(__m256i u, __m256i s) {
#ifdef GG_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// dot_us with lanes 0-3 (bytes 0-15) times sa and lanes 4-7 (bytes 16-31) times sb (|u * s| pairs
// within int16: u <= 63 or a sign-split |w| <= 128 with |s| <= 127)
inline __m256i dot_us_scaled(__m256i u, __m256i s, int sa, int sb) {
#ifdef GG_VNNI
  return _mm256_mullo_epi32(dot_us(u, s), _mm256_setr_epi32(sa, sa, sa, sa, sb, sb, sb, sb));
#else
  const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(sb)), _mm_set1_epi16(static_cast<int16_t>(sa)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc);
#endif
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 values: low nibbles first (values 0-15), then the high ones (16-31)
inline __m256i nibbles(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

// byte i = 0xFF where bit i of v is set
inline __m256i bits32(uint32_t v) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(v)), shuf), bit);
  return _mm256_cmpeq_epi8(b, bit);
}

inline __m256i table16(const int8_t* t) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
  return _mm256_set_m128i(v, v);
}

const int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t kMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---------------------------------------------------------------- activations

// q8_0 rows: q int8 [M, K], d float [M, K/32] (float16 values), s float [M, K/32] = d * sum(q)
struct Act32 {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
  // the AVX512 Q4_0 / Q4_1 kernel's (q4_acts_row): c8 int32 [M, K/32], -8 times each block's sum of q
  // (Q4_0's w = d (u - 8): vpdpbusd's u8 x s8 sums u q, this starts the sum at -8 sum(q), exact);
  // qt int8 [M, n16 * 32], q's whole groups of 16 blocks transposed (dword t of block j at 64 t + 4 j)
  const int32_t* c8 = nullptr;
  const int8_t* qt = nullptr;
  int64_t n16 = 0;
};

// q8_K rows: q int8 [M, K], d float [M, K/256], bs int16 [M, K/16]
struct ActK {
  const int8_t* q;
  const float* d;
  const int16_t* bs;
  int64_t K;
  // the AVX512 Q4_K / Q5_K kernel's (dot_q4k): q with each super-block's 32-value sub-blocks in the order
  // 0 2 1 3 4 6 5 7 (q4k_acts_row), so that one 64-byte load of Q4_K nibbles serves two vectors
  const int8_t* qp = nullptr;
};

// The activations' quantization (q8_0, q8_K): q8_quant.h, shared with the int8 prefill path
using kvserve_q8::hsum_epi32;
using kvserve_q8::quantize_q8_0_row;
using kvserve_q8::quantize_q8_K_row;

// ---------------------------------------------------------------- 32-value block types
// Each: BYTES per block; SIGNED (values in int8, multiplied through the sign split) or unsigned
// values with an optional float minimum m per block (w = d * u + m).

struct BQ8_0 {
  static constexpr int BYTES = 34;
  static constexpr bool SIGNED = true, MIN = false;
  static inline __m256i vals(const uint8_t* b, float& d, float&) { d = h2f(b); return load32(b + 2); }
};
struct BQ4_0 {
  static constexpr int BYTES = 18;
  static constexpr bool SIGNED = true, MIN = false;
  static inline __m256i vals(const uint8_t* b, float& d, float&) {
    d = h2f(b);
    return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
  }
};
struct BQ4_1 {
  static constexpr int BYTES = 20;
  static constexpr bool SIGNED = false, MIN = true;
  static inline __m256i vals(const uint8_t* b, float& d, float& m) {
    d = h2f(b);
    m = h2f(b + 2);
    return nibbles(b + 4);
  }
};
struct BQ5_0 {
  static constexpr int BYTES = 22;
  static constexpr bool SIGNED = true, MIN = false;
  static inline __m256i vals(const uint8_t* b, float& d, float&) {
    d = h2f(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m256i u = _mm256_or_si256(nibbles(b + 6), _mm256_and_si256(bits32(qh), _mm256_set1_epi8(16)));
    return _mm256_sub_epi8(u, _mm256_set1_epi8(16));
  }
};
struct BQ5_1 {
  static constexpr int BYTES = 24;
  static constexpr bool SIGNED = false, MIN = true;
  static inline __m256i vals(const uint8_t* b, float& d, float& m) {
    d = h2f(b);
    m = h2f(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    return _mm256_or_si256(nibbles(b + 8), _mm256_and_si256(bits32(qh), _mm256_set1_epi8(16)));
  }
};
struct BIQ4_NL {
  static constexpr int BYTES = 18;
  static constexpr bool SIGNED = true, MIN = false;
  static inline __m256i vals(const uint8_t* b, float& d, float&) {
    d = h2f(b);
    return _mm256_shuffle_epi8(table16(kIQ4NL), nibbles(b + 2));
  }
};
struct BMXFP4 {
  static constexpr int BYTES = 17;
  static constexpr bool SIGNED = true, MIN = false;
  static inline __m256i vals(const uint8_t* b, float& d, float&) {
    d = e8m0_half(b[0]);
    return _mm256_shuffle_epi8(table16(kMXFP4), nibbles(b + 1));
  }
};

// MR activation rows (r .. r + MR - 1) against one weight row of nb blocks: per output 8 float32 lanes,
// lane l of block b adding float(S_l) x (d_w d_x), S_l the exact integer sum of the block's values
// 4 l .. 4 l + 3 times the activations' (u = |w|, x's sign flipped where w < 0), then hsum's fixed
// tree. The route of every 32-value type in the AVX2 build, and of Q5_0 / Q5_1 / IQ4_NL / MXFP4 in the
// AVX512 one (its Q4_0 / Q4_1 take dot_q4 and q4_core.h; its Q8_0 one float chain per output instead:
// ggml_gemm8.h's q80_x8 / q80_rows, an eighth of this float work per value)
template <class T, int MR>
void dot32(const uint8_t* w, int64_t nb, const Act32& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, G = K / 32;
  __m256 acc[MR];
  float accm[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    accm[i] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * T::BYTES;
    if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    float d, m = 0.f;
    const __m256i v = T::vals(blk, d, m);
    const __m256i u = T::SIGNED ? _mm256_sign_epi8(v, v) : v;
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      __m256i xq = load32(a.q + row * K + b * 32);
      if (T::SIGNED) xq = _mm256_sign_epi8(xq, v);
      const __m256 p = _mm256_cvtepi32_ps(dot_us(u, xq));
      acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * a.d[row * G + b]), acc[i]);
      if (T::MIN) accm[i] += m * a.s[row * G + b];
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]) + accm[i];
}

#ifdef GG_VNNI
// Q4_0 / Q4_1 in the AVX512 build, on the file's blocks: 16 blocks (512 values) per step, transposed
// in registers so that int32 lane j of every vector belongs to block j. Four vpermt2w gather the 16
// blocks' nibbles (4 blocks, 16 bytes each, per vector: every block starts on an even byte), four
// 4 x 4 transposes of 128-bit lanes leave vector t with dword t (values 4 t .. 4 t + 3 in the low
// nibbles, 16 + 4 t .. in the high ones) of block j in lane j; the activations are laid out the same
// way once per product (Act32::qt). Per row the 8 vpdpbusd of a step add up each block's whole
// integer dot product in its own lane (Q4_0's -8 enters as the sum's start, Act32::c8: exactly
// llama.cpp's sum_j (u_j - 8) x_j), then one conversion and one multiply-add by d dx for 16 blocks:
// the tile kernel's arithmetic without its copy of the weights. Blocks past the last 16 take one
// 256-bit step each. A row's sums run in one order whatever the other rows are.
template <bool ONE>
struct Q4Blocks {
  static constexpr int BYTES = ONE ? 20 : 18;  // d (float16), Q4_1's m (float16), 16 bytes of nibbles
  static constexpr int QOFF = ONE ? 4 : 2;
};

// The vpermt2w indices of a group of 16 blocks, read as five 64-byte vectors L0..L4 (the last of
// Q4_0's one 32 bytes: no load past the group): nib[q] gathers blocks 4 q .. 4 q + 3 (they lie in
// L_q and L_q+1) so that 128-bit lane t holds dword t of each of them (dword c: block 4 q + c); the
// float16 words at byte offset 0 (d) and 2 (Q4_1's m) of the 16 blocks come from (L0, L1), (L2, L3)
// and L4 in three permutes merged by the masks, word j = block j.
template <int BYTES, int QOFF>
struct Q4Tab {
  alignas(64) int16_t nib[4][32] = {};
  alignas(64) int16_t half[2][3][32] = {};  // [d or m][source pair]
  uint32_t mask[3] = {};                    // words taken from each source pair (the same for d and m)
  constexpr Q4Tab() {
    for (int q = 0; q < 4; ++q)
      for (int w = 0; w < 32; ++w) {
        const int t = w / 8, c = (w / 2) % 4, h = w % 2;  // lane t, dword c, its half h
        nib[q][w] = static_cast<int16_t>((4 * q * BYTES - 64 * q + c * BYTES + QOFF + 4 * t + 2 * h) / 2);
      }
    for (int f = 0; f < 2; ++f)
      for (int j = 0; j < 16; ++j) {
        const int o = j * BYTES + 2 * f, i = o / 64, pair = i / 2;
        half[f][pair][j] = static_cast<int16_t>(32 * (i % 2) + (o - 64 * i) / 2);
        if (f == 0) mask[pair] |= 1u << j;
      }
  }
};
template <int BYTES, int QOFF>
inline constexpr Q4Tab<BYTES, QOFF> kQ4Tab{};

// the float16 words f (0: d, 1: m) of the 16 blocks as floats
template <int BYTES, int QOFF>
inline __m512 q4_halves16(const __m512i* L, int f) {
  const auto& T = kQ4Tab<BYTES, QOFF>;
  __m512i r = _mm512_permutex2var_epi16(L[0], _mm512_load_si512(T.half[f][0]), L[1]);
  r = _mm512_mask_mov_epi16(r, T.mask[1], _mm512_permutex2var_epi16(L[2], _mm512_load_si512(T.half[f][1]), L[3]));
  r = _mm512_mask_mov_epi16(r, T.mask[2], _mm512_permutexvar_epi16(_mm512_load_si512(T.half[f][2]), L[4]));
  return _mm512_cvtph_ps(_mm512_castsi512_si256(r));
}

constexpr int Q4_PREFETCH = 2048;  // bytes ahead of the 16 blocks being read

// U groups of 16 blocks from block b, group u into acc[(slot + u) % 2]: every stage for all U before
// the next. The groups are independent, and at one or two rows one group alone left the core waiting
// on its chain (permutes, shuffles, 8 dependent vpdpbusd): two in flight took a one-row product in L2
// from 4.1 to 2.9 us (2048 x 256; the 4-bit tile kernel 3.0), while at 3-4 rows they spill registers
// (8.6 -> 13.6 us), so those take one group at a time. Either way group g's sums go into acc[g % 2],
// the same operations in the same order: a row's result does not depend on U (batch invariance).
template <int MR, bool ONE, int U>
inline void q4_groups(const uint8_t* w, int64_t b, const Act32& a, int64_t r, __m512 (&acc)[2][MR], __m512 (&accm)[2][MR],
                      int slot) {
  using F = Q4Blocks<ONE>;
  constexpr int BY = F::BYTES;
  const int64_t G = a.K / 32;
  const auto& T = kQ4Tab<BY, F::QOFF>;
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512i L[U][5], g[U][4], lo[U][4], hi[U][4];
  __m512 d16[U], m16[U];
  for (int u = 0; u < U; ++u) {
    const uint8_t* blk = w + (b + 16 * u) * BY;
    for (int c = 0; c < 16 * BY; c += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_PREFETCH + c), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) L[u][c] = _mm512_loadu_si512(blk + 64 * c);
    L[u][4] = ONE ? _mm512_loadu_si512(blk + 256) : _mm512_zextsi256_si512(load32(blk + 256));
  }
  for (int u = 0; u < U; ++u)  // g[q], lane t: dword t of blocks 4 q .. 4 q + 3
    for (int q = 0; q < 4; ++q) g[u][q] = _mm512_permutex2var_epi16(L[u][q], _mm512_load_si512(T.nib[q]), L[u][q + 1]);
  for (int u = 0; u < U; ++u) {
    // 4 x 4 transpose of 128-bit lanes: v[t] lane q = g[q] lane t
    const __m512i t0 = _mm512_shuffle_i64x2(g[u][0], g[u][1], 0x44), t1 = _mm512_shuffle_i64x2(g[u][0], g[u][1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i64x2(g[u][2], g[u][3], 0x44), t3 = _mm512_shuffle_i64x2(g[u][2], g[u][3], 0xEE);
    const __m512i v[4] = {_mm512_shuffle_i64x2(t0, t2, 0x88), _mm512_shuffle_i64x2(t0, t2, 0xDD),
                          _mm512_shuffle_i64x2(t1, t3, 0x88), _mm512_shuffle_i64x2(t1, t3, 0xDD)};
    for (int t = 0; t < 4; ++t) {
      lo[u][t] = _mm512_and_si512(v[t], m4);
      hi[u][t] = _mm512_and_si512(_mm512_srli_epi16(v[t], 4), m4);
    }
  }
  for (int u = 0; u < U; ++u) {
    d16[u] = q4_halves16<BY, F::QOFF>(L[u], 0);
    m16[u] = ONE ? q4_halves16<BY, F::QOFF>(L[u], 1) : _mm512_setzero_ps();
  }
  for (int i = 0; i < MR; ++i) {
    const int64_t row = r + i;
    __m512i sa[U], sb[U];
    for (int u = 0; u < U; ++u) {
      sa[u] = ONE ? _mm512_setzero_si512() : _mm512_loadu_si512(a.c8 + row * G + b + 16 * u);
      sb[u] = _mm512_setzero_si512();
    }
    const int8_t* xt = a.qt + row * (a.n16 * 32) + b * 32;  // per group 8 vectors: values 4 t .. 4 t + 3 of each block
    for (int t = 0; t < 4; ++t)
      for (int u = 0; u < U; ++u) {
        sa[u] = _mm512_dpbusd_epi32(sa[u], lo[u][t], _mm512_loadu_si512(xt + 512 * u + 64 * t));
        sb[u] = _mm512_dpbusd_epi32(sb[u], hi[u][t], _mm512_loadu_si512(xt + 512 * u + 64 * (t + 4)));
      }
    for (int u = 0; u < U; ++u) {
      const __m512 s = _mm512_mul_ps(d16[u], _mm512_loadu_ps(a.d + row * G + b + 16 * u));
      const int k = (slot + u) & 1;
      acc[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sa[u], sb[u])), s, acc[k][i]);
      if (ONE) accm[k][i] = _mm512_fmadd_ps(m16[u], _mm512_loadu_ps(a.s + row * G + b + 16 * u), accm[k][i]);
    }
  }
}

template <int MR, bool ONE>
void dot_q4(const uint8_t* w, int64_t nb, const Act32& a, int64_t r, float* out, int64_t ldo) {
  using F = Q4Blocks<ONE>;
  constexpr int BY = F::BYTES;
  const int64_t K = a.K, G = K / 32, n16 = nb / 16 * 16;
  __m512 acc[2][MR], accm[2][MR];
  __m256 acct[MR];
  float tailm[MR];
  for (int i = 0; i < MR; ++i) {
    acc[0][i] = acc[1][i] = accm[0][i] = accm[1][i] = _mm512_setzero_ps();
    acct[i] = _mm256_setzero_ps();
    tailm[i] = 0.f;
  }
  int64_t b = 0;
  if constexpr (MR <= 2)
    for (; b + 32 <= n16; b += 32) q4_groups<MR, ONE, 2>(w, b, a, r, acc, accm, 0);
  for (; b < n16; b += 16) q4_groups<MR, ONE, 1>(w, b, a, r, acc, accm, static_cast<int>((b / 16) & 1));
  for (b = n16; b < nb; ++b) {  // the last nb % 16 blocks, one at a time
    const uint8_t* blk = w + b * BY;
    const float d = h2f(blk), m = ONE ? h2f(blk + 2) : 0.f;
    const __m256i u = nibbles(blk + F::QOFF);
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const __m256i start = ONE ? _mm256_setzero_si256() : _mm256_zextsi128_si256(_mm_cvtsi32_si128(a.c8[row * G + b]));
      const __m256i dot = _mm256_dpbusd_epi32(start, u, load32(a.q + row * K + b * 32));
      acct[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.d[row * G + b]), acct[i]);
      if (ONE) tailm[i] += m * a.s[row * G + b];
    }
  }
  for (int i = 0; i < MR; ++i)
    out[i * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][i], acc[1][i])) + hsum(acct[i]) +
                   (_mm512_reduce_add_ps(_mm512_add_ps(accm[0][i], accm[1][i])) + tailm[i]);
}

// Two weight rows at once (products of one or two activation rows: decode): one group of 16 blocks
// of each row in flight, each stage for both before the next, and every activation vector loaded
// once for both rows. The per-row overhead (the sums' reduction, the call) is shared too; a row's
// result is the same operations as dot_q4's (group g into acc[g % 2]), so pairing changes no bits.
template <int MR, bool ONE>
inline void q4_group_pair(const uint8_t* w0, const uint8_t* w1, int64_t b, const Act32& a, int64_t r,
                          __m512 (&acc)[2][2][MR], __m512 (&accm)[2][2][MR], int slot) {
  using F = Q4Blocks<ONE>;
  constexpr int BY = F::BYTES;
  const int64_t G = a.K / 32;
  const auto& T = kQ4Tab<BY, F::QOFF>;
  const __m512i m4 = _mm512_set1_epi8(15);
  const uint8_t* ws[2] = {w0, w1};
  __m512i L[2][5], g[2][4], lo[2][4], hi[2][4];
  __m512 d16[2], m16[2];
  for (int v = 0; v < 2; ++v) {
    const uint8_t* blk = ws[v] + b * BY;
    for (int c = 0; c < 16 * BY; c += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_PREFETCH + c), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) L[v][c] = _mm512_loadu_si512(blk + 64 * c);
    L[v][4] = ONE ? _mm512_loadu_si512(blk + 256) : _mm512_zextsi256_si512(load32(blk + 256));
  }
  for (int v = 0; v < 2; ++v)
    for (int q = 0; q < 4; ++q) g[v][q] = _mm512_permutex2var_epi16(L[v][q], _mm512_load_si512(T.nib[q]), L[v][q + 1]);
  for (int v = 0; v < 2; ++v) {
    const __m512i t0 = _mm512_shuffle_i64x2(g[v][0], g[v][1], 0x44), t1 = _mm512_shuffle_i64x2(g[v][0], g[v][1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i64x2(g[v][2], g[v][3], 0x44), t3 = _mm512_shuffle_i64x2(g[v][2], g[v][3], 0xEE);
    const __m512i vv[4] = {_mm512_shuffle_i64x2(t0, t2, 0x88), _mm512_shuffle_i64x2(t0, t2, 0xDD),
                           _mm512_shuffle_i64x2(t1, t3, 0x88), _mm512_shuffle_i64x2(t1, t3, 0xDD)};
    for (int t = 0; t < 4; ++t) {
      lo[v][t] = _mm512_and_si512(vv[t], m4);
      hi[v][t] = _mm512_and_si512(_mm512_srli_epi16(vv[t], 4), m4);
    }
  }
  for (int v = 0; v < 2; ++v) {
    d16[v] = q4_halves16<BY, F::QOFF>(L[v], 0);
    m16[v] = ONE ? q4_halves16<BY, F::QOFF>(L[v], 1) : _mm512_setzero_ps();
  }
  for (int i = 0; i < MR; ++i) {
    const int64_t row = r + i;
    const __m512i c8 = ONE ? _mm512_setzero_si512() : _mm512_loadu_si512(a.c8 + row * G + b);
    __m512i sa[2] = {c8, c8}, sb[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    const int8_t* xt = a.qt + row * (a.n16 * 32) + b * 32;
    for (int t = 0; t < 4; ++t) {
      const __m512i xl = _mm512_loadu_si512(xt + 64 * t), xh = _mm512_loadu_si512(xt + 64 * (t + 4));
      for (int v = 0; v < 2; ++v) {
        sa[v] = _mm512_dpbusd_epi32(sa[v], lo[v][t], xl);
        sb[v] = _mm512_dpbusd_epi32(sb[v], hi[v][t], xh);
      }
    }
    const __m512 dx = _mm512_loadu_ps(a.d + row * G + b);
    for (int v = 0; v < 2; ++v) {
      acc[v][slot][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sa[v], sb[v])), _mm512_mul_ps(d16[v], dx), acc[v][slot][i]);
      if (ONE) accm[v][slot][i] = _mm512_fmadd_ps(m16[v], _mm512_loadu_ps(a.s + row * G + b), accm[v][slot][i]);
    }
  }
}

// weight rows w0 and w1 (one Q4 type, nb blocks each) against activation rows r .. r + MR - 1 (MR 1 or
// 2): out0[i ldo] and out1[i ldo], each the bits dot_q4 gives
template <int MR, bool ONE>
void dot_q4_pair(const uint8_t* w0, const uint8_t* w1, int64_t nb, const Act32& a, int64_t r, float* out0, float* out1,
                 int64_t ldo) {
  const int64_t n16 = nb / 16 * 16;
  if (n16 < nb) {  // a tail: each row alone (rare shapes)
    dot_q4<MR, ONE>(w0, nb, a, r, out0, ldo);
    dot_q4<MR, ONE>(w1, nb, a, r, out1, ldo);
    return;
  }
  __m512 acc[2][2][MR], accm[2][2][MR];
  for (int v = 0; v < 2; ++v)
    for (int i = 0; i < MR; ++i) acc[v][0][i] = acc[v][1][i] = accm[v][0][i] = accm[v][1][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < n16; b += 16) q4_group_pair<MR, ONE>(w0, w1, b, a, r, acc, accm, static_cast<int>((b / 16) & 1));
  float* outs[2] = {out0, out1};
  for (int v = 0; v < 2; ++v)
    for (int i = 0; i < MR; ++i)
      outs[v][i * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[v][0][i], acc[v][1][i])) + hsum(_mm256_setzero_ps()) +
                         (_mm512_reduce_add_ps(_mm512_add_ps(accm[v][0][i], accm[v][1][i])) + 0.f);
}

// dot_q4_pair for a Q4 type t and 1 or 2 activation rows
inline void q4_pair(int t, const uint8_t* w0, const uint8_t* w1, int64_t nb, const Act32& a, int64_t m, float* out0,
                    float* out1, int64_t ldo) {
  if (t == T_Q4_0)
    return m == 1 ? dot_q4_pair<1, false>(w0, w1, nb, a, 0, out0, out1, ldo) : dot_q4_pair<2, false>(w0, w1, nb, a, 0, out0, out1, ldo);
  return m == 1 ? dot_q4_pair<1, true>(w0, w1, nb, a, 0, out0, out1, ldo) : dot_q4_pair<2, true>(w0, w1, nb, a, 0, out0, out1, ldo);
}

// the AVX512 Q4 kernel's activations of one q8_0 row q [K]: c8 [K/32] = -8 times each block's sum of
// q, and qt [n16 * 32] (n16 = the whole groups of 16 blocks) its groups transposed: in group g, dword
// t of block j at qt[g 512 + 64 t + 4 j]
inline void q4_acts_row(const int8_t* q, int64_t K, int32_t* c8, int8_t* qt) {
  const int64_t G = K / 32, n16 = G / 16 * 16;
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < G; ++b)
    c8[b] = -8 * hsum_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, load32(q + b * 32)));
  const __m512i ix = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
  for (int64_t b = 0; b < n16; b += 16)
    for (int t = 0; t < 8; ++t)
      _mm512_storeu_si512(qt + b * 32 + 64 * t, _mm512_i32gather_epi32(ix, reinterpret_cast<const int*>(q + b * 32 + 4 * t), 4));
}
#endif

// ---------------------------------------------------------------- 256-value block types (q8_K)

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// sum over the 16 groups of 16 of c[g] * bs[g]: c 16 int8 (signed), bs the row's 16 int16 sums
inline int dot_bsums_i8(const int8_t* c, const int16_t* bs) {
  const __m256i c16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  return hsum_i32(_mm256_madd_epi16(c16, load32(bs)));
}

// sum over the 8 sub-blocks of 32 of c[j] * (bs[2 j] + bs[2 j + 1]): c 8 uint8
inline int dot_bsums_pairs_u8(const uint8_t* c, const int16_t* bs) {
  const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  const __m256i c16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(c8, c8));  // c0 c0 c1 c1 ...
  return hsum_i32(_mm256_madd_epi16(c16, load32(bs)));
}

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> sc[0..7], mn[0..7] (bytes): llama.cpp's
// get_scale_min_k4 for all eight sub-blocks at once, on 32-bit words
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  const uint32_t s[2] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)};
  const uint32_t m[2] = {u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)};
  std::memcpy(sc, s, 8);
  std::memcpy(mn, m, 8);
}

#ifdef GG_VNNI
// One output value of the AVX512 build's Q4_K / Q5_K / Q6_K per-row kernels (dot_q4k, dot_q6k) and of
// the small-batch path (ggml_gemm8.h's panel_exact) alike: per super-block the integer sum of quant x
// activation quant x sub-scale (tot, exact in int32; Q6_K's -32 included) and of the mins x the
// activations' sums (ms, exact; Q4_K / Q5_K), then one float32 chain over the super-blocks in order:
//   y = fma(float(tot), d_w d_x, y);  y = fma(float(ms), -(dmin_w d_x), y)
// so an output's bits depend on its row alone, whichever path and batch computed it. The per-row
// kernels hand each super-block's partial sums here (push); the horizontal sums of 8 vectors are
// taken together (flush: a transposing tree, about a third of the instructions of 8 separate ones).
template <bool MINS>
struct KChain {
  __m256i v[8];  // entries: per super-block tot's lanes (then ms's lanes with MINS)
  float c[8];    // each entry's factor: d_w d_x (then -(dmin_w d_x))
  int n = 0;
  float y = 0.f;
  inline void push(__m512i tot, __m256i ms, float ddx, float dmdx) {
    v[n] = _mm256_add_epi32(_mm512_castsi512_si256(tot), _mm512_extracti64x4_epi64(tot, 1));
    c[n++] = ddx;
    if (MINS) {
      v[n] = ms;
      c[n++] = -dmdx;
    }
    if (n == 8) flush();
  }
  inline void flush() {
    if (n == 0) return;
    for (int k = n; k < 8; ++k) v[k] = _mm256_setzero_si256();
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    // lane k: the sum of v[k]'s lanes
    const __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
    alignas(32) float e[8];
    _mm256_store_ps(e, _mm256_cvtepi32_ps(t));
    for (int k = 0; k < n; ++k) y = std::fma(e[k], c[k], y);
    n = 0;
  }
  inline float result() {
    flush();
    return y;
  }
};
// The AVX512 build's K-quant products (Q4_K, Q5_K, Q6_K: the weights of a Q4_K_M file): 64 values of
// a super-block per 512-bit vector, vpmaddubsw (u8 x s8 -> pairs summed in int16, exact: |u| <= 63,
// |x| <= 127) then vpmaddwd by the sub-block's scale in both int16 halves of its 32-bit lanes (int32,
// exact; in dot_q4k, dot_q6k and the x8 kernels vpdpwssd, the same products added into the sum), so a
// super-block is 4 multiply pairs per row with no per-block horizontal sum; the mins
// (and Q6_K's -32) are vector products of the scales with q8_K's sums of 16, kept in vectors too.
// The order of every sum is fixed per output value (the same for any M or row block).

inline __m512i zbroadcast32(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// shift counts per 16-bit lane: lo in the low 256 bits, hi in the high 256 bits
inline __m512i zshift(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)), _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}

// the super-block's prefetch: its bytes PF ahead, whole lines
template <int BYTES>
inline void prefetch_sb(const uint8_t* blk) {
  constexpr int PF = 2048;
  for (int c = 0; c < BYTES; c += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + PF + c), _MM_HINT_T0);
}

template <int MR, bool FIVE>
void dot_q45k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  constexpr int BYTES = FIVE ? 176 : 144;
  const int64_t K = a.K, NB = K / 256;
  __m512 acc[MR];
  __m256 accm[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm512_setzero_ps();
    accm[i] = _mm256_setzero_ps();
  }
  const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1), sh4 = zshift(0, 4);
  // vector p's scales: its low half sub-block 2 p, high half 2 p + 1 (32-bit lanes of the 8 scales)
  __m512i pidx[4];
  for (int p = 0; p < 4; ++p)
    pidx[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  __m512i hsh[4];  // Q5_K: the fifth bit of sub-block j is bit j of qh's bytes
  for (int p = 0; p < 4; ++p) hsh[p] = zshift(2 * p, 2 * p + 1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    prefetch_sb<BYTES>(blk);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    uint8_t sc[8], mn[8];
    scales_mins_k4(blk + 4, sc, mn);
    const __m512i s32 = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
    const __m512i s16 = _mm512_or_si512(s32, _mm512_slli_epi32(s32, 16));  // the scale in both int16 halves
    const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  // mn[j] at lanes 2 j, 2 j + 1
    __m512i u[4], sv[4];
    const __m512i qh = FIVE ? zbroadcast32(blk + 16) : _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      u[p] = _mm512_and_si512(_mm512_srlv_epi16(zbroadcast32(qs + 32 * p), sh4), m4);
      if (FIVE)
        u[p] = _mm512_or_si512(u[p], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, hsh[p]), one), 4));
      sv[p] = _mm512_permutexvar_epi32(pidx[p], s16);
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      const __m256i bs = load32(a.bs + row * (K / 16) + b * 16);
      __m512i sumi = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i x = _mm512_loadu_si512(xq + 64 * p);
        sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(_mm512_maddubs_epi16(u[p], x), sv[p]));
      }
      const float dx = a.d[row * NB + b];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * dx), acc[i]);
      accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins, bs)), _mm256_set1_ps(dmin * dx), accm[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = _mm512_reduce_add_ps(acc[i]) - hsum(accm[i]);
}

// Q6_K in the AVX512 build (dot_q6k, dot_q6k_x8): a super-block's 6-bit values as 4 vectors of 64
// (vector p: values 64 p .. 64 p + 63, its 128-bit lane k sub-block 4 p + k), 6 operations per pair of
// vectors: qh's bit pairs for the lanes' quarters masked once (0x33 in the low 256 bits: pairs 0 and
// 2; 0xCC in the high: 1 and 3), shifted into bits 4-5 (16-bit shifts: whatever crosses into a
// neighbouring byte lands in bits 0-3, which the nibble select replaces), then merged with the nibbles
inline void q6k_unpack(const uint8_t* blk, __m512i (&u)[4]) {
  const __m512i m4 = _mm512_set1_epi8(15), sl42 = zshift(4, 2), sr02 = zshift(0, 2);
  const __m512i mab = _mm512_inserti64x4(_mm512_set1_epi8(0x33), _mm256_set1_epi8(static_cast<char>(0xCC)), 1);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(blk + 64 * h);
    const __m512i qa = _mm512_and_si512(zbroadcast32(blk + 128 + 32 * h), mab);
    u[2 * h] = _mm512_ternarylogic_epi32(l, _mm512_sllv_epi16(qa, sl42), m4, 0xE4);  // bitwise m4 ? l : qa << s
    u[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), _mm512_srlv_epi16(qa, sr02), m4, 0xE4);
  }
}

// Q6_K's scales for the packed sums: vpdpbusd gives each 4 values' sum in int32 (|.| <= 4 * 63 * 127,
// an int16), vpackssdw packs vectors 2 h and 2 h + 1 (exact: no value saturates), so 128-bit lane k
// of the pair holds 4 sums of sub-block 8 h + k, then 4 of 8 h + 4 + k; vpdpwssd multiplies them by
// their scale (this index picks it from the 16 int16 scales). Every product and sum is an exact
// integer: the same totals as any other order, the same bits.
struct Q6kIdx {
  alignas(64) int16_t ix[2][32];
  constexpr Q6kIdx() : ix{} {
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) ix[h][l] = static_cast<int16_t>(8 * h + l / 8 + 4 * ((l / 4) % 2));
  }
};
inline constexpr Q6kIdx kQ6kIdx{};

template <int MR>
void dot_q6k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, NB = K / 256;
  KChain<false> y[MR];
  const __m512i pidx0 = _mm512_load_si512(kQ6kIdx.ix[0]), pidx1 = _mm512_load_si512(kQ6kIdx.ix[1]);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    prefetch_sb<210>(blk);
    const float d = h2f(blk + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const __m512i scz = _mm512_castsi256_si512(sc16);
    const __m512i sv0 = _mm512_permutexvar_epi16(pidx0, scz), sv1 = _mm512_permutexvar_epi16(pidx1, scz);
    __m512i u[4];  // u[p]: values 0..63 of elements 64 p .. 64 p + 63
    q6k_unpack(blk, u);
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      const __m256i bs = load32(a.bs + row * (K / 16) + b * 16);
      __m512i dq[4];
      for (int p = 0; p < 4; ++p) dq[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p], _mm512_loadu_si512(xq + 64 * p));
      __m512i sumi = _mm512_madd_epi16(_mm512_packs_epi32(dq[0], dq[1]), sv0);
      sumi = _mm512_dpwssd_epi32(sumi, _mm512_packs_epi32(dq[2], dq[3]), sv1);
      // the -32 of every value: 32 sum_g sc_g bsum_g
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
      sumi = _mm512_sub_epi32(sumi, _mm512_zextsi256_si512(off));
      y[i].push(sumi, _mm256_setzero_si256(), d * a.d[row * NB + b], 0.f);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = y[i].result();
}

// Q4_K and Q5_K on the interleaved activations (ActK::qp): 64 bytes of nibbles per load give two vectors,
// the low nibbles (sub-blocks 2 j, 2 j + 2: bytes 0-31 and 32-63 of the load) and the high ones
// (2 j + 1, 2 j + 3), against qp's vectors in that order; each 128-bit lane's scale comes from a
// vpshufb of the 8 scale bytes (broadcast) instead of a cross-lane permute. Against dot_q45k: 5
// unpacking operations a super-block instead of 12, 4 in-lane shuffles instead of 4 vpermd
// (single thread, 2048 x 2048 in cache: see the commit). Every output's sums in one fixed order.
struct Q4kCtl {
  alignas(64) int8_t c[4][64];
  constexpr Q4kCtl() : c{} {
    // vector p's 128-bit lanes 0-1 take scale lo[p], lanes 2-3 hi[p]; each 32-bit lane (s, 0, s, 0)
    const int lo[4] = {0, 1, 4, 5}, hi[4] = {2, 3, 6, 7};
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 64; ++i) c[p][i] = static_cast<int8_t>(i % 2 ? -128 : (i < 32 ? lo[p] : hi[p]));
  }
};
inline constexpr Q4kCtl kQ4kCtl{};

// the 8 scales (6-bit) and mins of a Q4_K / Q5_K super-block as bytes of two 64-bit words
inline void scales_mins_k4_u64(const uint8_t* q, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  sc = (u[0] & 0x3f3f3f3fu) | static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
  mn = (u[1] & 0x3f3f3f3fu) | static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)) << 32;
}

template <int MR, bool FIVE>
void dot_q4k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, NB = K / 256;
  KChain<true> y[MR];
  constexpr int BYTES = FIVE ? 176 : 144;
  const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
  // Q5_K: the fifth bit of sub-block j is bit j of qh's bytes; vector 2 h + k holds sub-blocks
  // 4 h + k (its low 256 bits) and 4 h + k + 2 (high)
  __m512i hsh[4];
  for (int p = 0; p < 4; ++p) hsh[p] = zshift(4 * (p / 2) + p % 2, 4 * (p / 2) + p % 2 + 2);
  __m512i ctl[4];
  for (int p = 0; p < 4; ++p) ctl[p] = _mm512_load_si512(kQ4kCtl.c[p]);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    prefetch_sb<BYTES>(blk);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    uint64_t sc, mn;
    scales_mins_k4_u64(blk + 4, sc, mn);
    const __m512i scb = _mm512_set1_epi64(static_cast<int64_t>(sc));  // the 8 scale bytes in every 64-bit lane
    const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mn));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  // mn[j] at lanes 2 j, 2 j + 1
    __m512i u[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512(blk + (FIVE ? 48 : 16) + 64 * h);
      u[2 * h] = _mm512_and_si512(q, m4);
      u[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    }
    if (FIVE) {
      const __m512i qh = zbroadcast32(blk + 16);
      for (int p = 0; p < 4; ++p)
        u[p] = _mm512_or_si512(u[p], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, hsh[p]), one), 4));
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.qp + row * K + b * 256;
      const __m256i bs = load32(a.bs + row * (K / 16) + b * 16);
      __m512i sumi = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i x = _mm512_loadu_si512(xq + 64 * p);
        // the scales shuffled per use (in-lane, cheap): fewer live registers at MR = 4
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(u[p], x), _mm512_shuffle_epi8(scb, ctl[p]));
      }
      const float dx = a.d[row * NB + b];
      // the super-block's exact integer sums, then one float chain (KChain: the small-batch path's bits)
      y[i].push(sumi, _mm256_madd_epi16(mins, bs), d * dx, dmin * dx);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = y[i].result();
}

// q8_K row q [K] -> qp [K]: each super-block's sub-blocks of 32 in the order 0 2 1 3 4 6 5 7
inline void q4k_acts_row(const int8_t* q, int64_t K, int8_t* qp) {
  static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int64_t b = 0; b < K; b += 256)
    for (int j = 0; j < 8; ++j) std::memcpy(qp + b + 32 * j, q + b + 32 * order[j], 32);
}

// the x8 kernels' prefetch: the 8 rows [w, w + 8 rb) are read interleaved (8 streams, BYTES each a
// step), which the hardware prefetchers follow badly from memory, so the rows `ahead` bytes on
// (x8_ahead: whole groups of 8 rows) are fetched in order as one stream, 8 BYTES a super-block step
// (that whole group by the end of this one), into L2 (_MM_HINT_T1): a group is 9-94 KiB at K = 2048-14336,
// more than L1 holds beside the group being read. Against fetching the next group into L1, one thread
// from memory (benchmarks/matvec_dram.py, 2 MiB pages): Llama-3.1-8B's Q4_K 28672 x 4096 2.77 ms against
// 4.54 (23.8 against 14.5 GB/s), Q6_K 4096 x 14336 1.60 against 2.64; Llama-3.2-1B's Q4_K 16384 x 2048
// 0.78 ms against 0.96 (two groups ahead), its Q6_K head 128256 x 2048 7.1 against 7.8.
constexpr int64_t X8_AHEAD_MIN = 16384;
inline int64_t x8_ahead(int64_t rb) {
  const int64_t g = 8 * rb;
  return g * std::max<int64_t>(1, (X8_AHEAD_MIN + g - 1) / g);
}
template <int BYTES>
inline void prefetch_ahead8(const uint8_t* w, int64_t ahead, int64_t b) {
  const uint8_t* p = w + ahead + b * 8 * BYTES;
  for (int c = 0; c < 8 * BYTES; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p + c), _MM_HINT_T1);
}

// lane k: the sum of v[k]'s 8 int32 lanes (KChain's transposing tree)
inline __m256i tree8(const __m256i (&v)[8]) {
  const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// 512 -> 256 bits of int32 lanes (KChain::push's fold)
inline __m256i fold512(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// One activation row (decode) against 8 weight rows of Q4_K / Q5_K at once, w[j] = w + j rb: per super-block
// each row's exact integer sums as in dot_q4k, the 8 rows' sums transposed into one vector (lane j: row j)
// and KChain's float steps done for the 8 rows in one vector:
//   y_j = fma(float(tot_j), d_j dx, y_j);  y_j = fma(float(ms_j), -(dmin_j dx), y_j)
// the same operations in the same order per output as dot_q4k<1> and panel_exact (the same bits), with one
// tree per 8 rows instead of one per row and no scalar chain; every activation vector is loaded once
// for the 8 rows. out[0..7] (stride 1).
template <bool FIVE>
void dot_q4k_x8(const uint8_t* w, int64_t rb, int64_t nb, const ActK& a, int64_t row, float* out) {
  const __m256i rbx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(rb)));
  const int64_t K = a.K, NB = K / 256;
  constexpr int BYTES = FIVE ? 176 : 144;
  const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
  __m512i hsh[4];
  for (int p = 0; p < 4; ++p) hsh[p] = zshift(4 * (p / 2) + p % 2, 4 * (p / 2) + p % 2 + 2);
  __m512i ctl[4];
  for (int p = 0; p < 4; ++p) ctl[p] = _mm512_load_si512(kQ4kCtl.c[p]);
  const int8_t* xq0 = a.qp + row * K;
  const int16_t* bs0 = a.bs + row * (K / 16);
  const float* dk = a.d + row * NB;
  const int64_t ahead = x8_ahead(rb);
  __m256 y = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i x[4];
    for (int p = 0; p < 4; ++p) x[p] = _mm512_loadu_si512(xq0 + b * 256 + 64 * p);
    const __m256i bs = load32(bs0 + b * 16);
    prefetch_ahead8<BYTES>(w, ahead, b);
    // the 8 rows' d (low halves) and dmin (high halves) in one gather
    const __m256i ddm = _mm256_i32gather_epi32(reinterpret_cast<const int*>(w + b * BYTES), rbx, 1);
    __m256i tv[8], mv[8];
    for (int j = 0; j < 8; ++j) {
      const uint8_t* blk = w + j * rb + b * BYTES;
      uint64_t sc, mn;
      scales_mins_k4_u64(blk + 4, sc, mn);
      const __m512i scb = _mm512_set1_epi64(static_cast<int64_t>(sc));
      const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mn));
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
      __m512i u[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_loadu_si512(blk + (FIVE ? 48 : 16) + 64 * h);
        u[2 * h] = _mm512_and_si512(q, m4);
        u[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
      }
      if (FIVE) {
        const __m512i qh = zbroadcast32(blk + 16);
        for (int p = 0; p < 4; ++p)
          u[p] = _mm512_or_si512(u[p], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, hsh[p]), one), 4));
      }
      __m512i sumi = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(u[p], x[p]), _mm512_shuffle_epi8(scb, ctl[p]));
      tv[j] = fold512(sumi);
      mv[j] = _mm256_madd_epi16(mins, bs);
    }
    const __m256 dx = _mm256_set1_ps(dk[b]);
    const __m256 d8 = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(ddm));
    const __m256 dm8 = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(ddm, 16)));
    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tree8(tv)), _mm256_mul_ps(d8, dx), y);
    y = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(tree8(mv)), _mm256_mul_ps(dm8, dx), y);
  }
  _mm256_storeu_ps(out, y);
}

// dot_q4k_x8 for Q6_K (dot_q6k's integer totals, KChain<false>'s steps: y_j = fma(float(tot_j), d_j dx,
// y_j)). The -32 of every weight value enters as each vpdpbusd's starting value, -32 x the sums of 4
// activations (once a super-block for the 8 rows: |(u - 32) x| sums of 4 stay within int16), so a row
// pays no offset product; per row and super-block q6k_unpack, 4 vpdpbusd, 2 packs, 2 vpdpwssd.
inline void dot_q6k_x8(const uint8_t* w, int64_t rb, int64_t nb, const ActK& a, int64_t row, float* out) {
  const __m256i rbx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(rb)));
  const int64_t K = a.K, NB = K / 256;
  const __m512i pidx0 = _mm512_load_si512(kQ6kIdx.ix[0]), pidx1 = _mm512_load_si512(kQ6kIdx.ix[1]);
  const __m512i c32 = _mm512_set1_epi8(32);
  const int8_t* xq0 = a.q + row * K;
  const float* dk = a.d + row * NB;
  const int64_t ahead = x8_ahead(rb);
  __m256 y = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i x[4], nx[4];
    for (int p = 0; p < 4; ++p) {
      x[p] = _mm512_loadu_si512(xq0 + b * 256 + 64 * p);
      nx[p] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), c32, x[p]));
    }
    // the bytes prefetch_ahead8 would fetch at this step, 4 lines at each row below: spread among the
    // arithmetic rather than 27 at once (one thread from memory, 32768 x 2048: ~0.78x the time of the burst)
    const uint8_t* pf = w + ahead + b * 8 * 210;
    // the 8 rows' d: the high halves of the dwords at byte 206 (one gather; no read past the block)
    const __m256i dd = _mm256_i32gather_epi32(reinterpret_cast<const int*>(w + b * 210 + 206), rbx, 1);
    __m256i tv[8];
    for (int j = 0; j < 8; ++j) {
      const uint8_t* blk = w + j * rb + b * 210;
      for (int c = 256 * j; c < std::min(256 * j + 256, 8 * 210); c += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + c), _MM_HINT_T1);
      const __m512i scz = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
      __m512i u[4];
      q6k_unpack(blk, u);
      const __m512i p0 = _mm512_packs_epi32(_mm512_dpbusd_epi32(nx[0], u[0], x[0]), _mm512_dpbusd_epi32(nx[1], u[1], x[1]));
      const __m512i p1 = _mm512_packs_epi32(_mm512_dpbusd_epi32(nx[2], u[2], x[2]), _mm512_dpbusd_epi32(nx[3], u[3], x[3]));
      const __m512i s = _mm512_madd_epi16(p0, _mm512_permutexvar_epi16(pidx0, scz));
      tv[j] = fold512(_mm512_dpwssd_epi32(s, p1, _mm512_permutexvar_epi16(pidx1, scz)));
    }
    const __m256 d8 = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dd, 16)));
    y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tree8(tv)), _mm256_mul_ps(d8, _mm256_set1_ps(dk[b])), y);
  }
  _mm256_storeu_ps(out, y);
}

#else
template <int MR, bool FIVE>
void dot_q45k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  constexpr int BYTES = FIVE ? 176 : 144;
  const int64_t K = a.K, NB = K / 256;
  __m256 acc[MR];
  float accm[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    accm[i] = 0.f;
  }
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    uint8_t sc[8], mn[8];
    scales_mins_k4(blk + 4, sc, mn);
    __m256i u[8];
    const __m256i qh = FIVE ? load32(blk + 16) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i q = load32(qs + 32 * p);
      u[2 * p] = _mm256_and_si256(q, m4);
      u[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (FIVE) {
        u[2 * p] = _mm256_or_si256(u[2 * p], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
        u[2 * p + 1] = _mm256_or_si256(u[2 * p + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      const int16_t* bs = a.bs + row * (K / 16) + b * 16;
      __m256i sumi = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) sumi = _mm256_add_epi32(sumi, dot_us_scaled(u[j], load32(xq + 32 * j), sc[j], sc[j]));
      const int msum = dot_bsums_pairs_u8(mn, bs);
      const float dx = a.d[row * NB + b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * dx), acc[i]);
      accm[i] += dmin * dx * static_cast<float>(msum);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]) - accm[i];
}

template <int MR>
void dot_q6k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, NB = K / 256;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h2f(blk + 208);
    __m256i u[8];  // values 0..63 of elements 32 k .. 32 k + 31
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), qh = load32(blk + 128 + 32 * h);
      u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      const int16_t* bs = a.bs + row * (K / 16) + b * 16;
      __m256i sumi = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) sumi = _mm256_add_epi32(sumi, dot_us_scaled(u[k], load32(xq + 32 * k), sc[2 * k], sc[2 * k + 1]));
      const int off = dot_bsums_i8(sc, bs);  // the -32 of every value
      const __m256i tot = _mm256_sub_epi32(sumi, _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * a.d[row * NB + b]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]);
}
#endif

template <int MR>
void dot_q2k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, NB = K / 256;
  __m256 acc[MR];
  float accm[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    accm[i] = 0.f;
  }
  const __m256i m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 84;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    const uint8_t* scales = blk;
    const float d = h2f(blk + 80), dmin = h2f(blk + 82);
    int8_t mins[16];  // 0..15: int8 for dot_bsums_i8
    for (int g = 0; g < 16; ++g) mins[g] = static_cast<int8_t>(scales[g] >> 4);
    __m256i u[8];
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(blk + 16 + 32 * n);
      for (int j = 0; j < 4; ++j) u[4 * n + j] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m2);
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      const int16_t* bs = a.bs + row * (K / 16) + b * 16;
      __m256i sumi = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k)
        sumi = _mm256_add_epi32(sumi, dot_us_scaled(u[k], load32(xq + 32 * k), scales[2 * k] & 0xF, scales[2 * k + 1] & 0xF));
      const int msum = dot_bsums_i8(mins, bs);
      const float dx = a.d[row * NB + b];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * dx), acc[i]);
      accm[i] += dmin * dx * static_cast<float>(msum);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]) - accm[i];
}

template <int MR>
void dot_q3k(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, NB = K / 256;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 110;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    const uint8_t* s = blk + 96;
    const float d = h2f(blk + 108);
    int8_t sc[16];
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? (s[g] & 0xF) : (s[g - 8] >> 4);
      const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
      sc[g] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
    const __m256i hm = load32(blk);
    __m256i u[8];  // values 0..7 (w = u - 4)
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(blk + 32 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * n + j), one);
        u[4 * n + j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m2), _mm256_slli_epi16(hb, 2));
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      const int16_t* bs = a.bs + row * (K / 16) + b * 16;
      __m256i sumi = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) sumi = _mm256_add_epi32(sumi, dot_us_scaled(u[k], load32(xq + 32 * k), sc[2 * k], sc[2 * k + 1]));
      const int off = dot_bsums_i8(sc, bs);  // the -4 of every value
      const __m256i tot = _mm256_sub_epi32(sumi, _mm256_setr_epi32(4 * off, 0, 0, 0, 0, 0, 0, 0));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * a.d[row * NB + b]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]);
}

template <int MR>
void dot_iq4xs(const uint8_t* w, int64_t nb, const ActK& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = a.K, NB = K / 256;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i tab = table16(kIQ4NL);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 136;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    const float d = h2f(blk);
    uint16_t sh;
    std::memcpy(&sh, blk + 2, 2);
    int sc[8];
    __m256i v[8], u[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = (((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
      v[j] = _mm256_shuffle_epi8(tab, nibbles(blk + 8 + 16 * j));
      u[j] = _mm256_sign_epi8(v[j], v[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.q + row * K + b * 256;
      __m256i sumi = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        sumi = _mm256_add_epi32(sumi, dot_us_scaled(u[j], _mm256_sign_epi8(load32(xq + 32 * j), v[j]), sc[j], sc[j]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * a.d[row * NB + b]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]);
}

// ---------------------------------------------------------------- float16 / bfloat16 rows

inline __m256 widen(const uint8_t* p, bool bf16) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

template <int MR, bool BF>
void dot_half(const uint8_t* w, int64_t K, const float* x, int64_t r, float* out, int64_t ldo) {
  // two accumulators per row (values 16 j .. 16 j + 7 and 16 j + 8 .. 16 j + 15): one chain of
  // dependent multiply-adds held a one-row product to a quarter of the read rate
  __m256 acc[MR], acc2[MR];
  float tail[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = acc2[i] = _mm256_setzero_ps();
    tail[i] = 0.f;
  }
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = widen(w + 2 * k, BF), w1 = widen(w + 2 * k + 16, BF);
    for (int i = 0; i < MR; ++i) {
      acc[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (r + i) * K + k), acc[i]);
      acc2[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + (r + i) * K + k + 8), acc2[i]);
    }
  }
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_add_ps(acc[i], acc2[i]);
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = widen(w + 2 * k, BF);
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (r + i) * K + k), acc[i]);
  }
  for (; k < K; ++k) {
    uint16_t h;
    std::memcpy(&h, w + 2 * k, 2);
    float wf;
    if (BF) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(&wf, &bits, 4);
    } else {
      wf = _cvtsh_ss(h);
    }
    for (int i = 0; i < MR; ++i) tail[i] = std::fma(wf, x[(r + i) * K + k], tail[i]);
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]) + tail[i];
}

// ---------------------------------------------------------------- prefill-sized products

#include "ggml_gemm.h"
#include "ggml_gemm8.h"

// ---------------------------------------------------------------- the product

// activation rows from which Q4_0 takes q40_panels (q4_core.h: a tile of 32 weight rows per 8 blocks
// that every activation row runs against; below, q40_dot, with the same bits)
constexpr int64_t Q40_PANEL_MIN = 8;

// (a matrix with repacked Q4_0 parts, q4_repack.h, takes its own kernel at every row count: no prefill path,
// no small-batch path; its other parts the per-row kernels)

// rows from which Matrix::mm_raw takes the small-batch path (below: the per-row kernels, the same bits)
constexpr int64_t KB_MIN = 6;
// the same for the 32-value block types of panel32 and q80_rows (Q8_0, Q5_0, IQ4_NL, MXFP4)
constexpr int64_t KB32_MIN = 2;

enum class ActKind { F32, Q8_0, Q8_K };

struct TypeInfo {
  int block;   // values per block
  int bytes;   // bytes per block
  ActKind act;
};

TypeInfo type_info(int t) {
  switch (t) {
    case T_F16: return {1, 2, ActKind::F32};
    case T_BF16: return {1, 2, ActKind::F32};
    case T_Q4_0: return {32, 18, ActKind::Q8_0};
    case T_Q4_1: return {32, 20, ActKind::Q8_0};
    case T_Q5_0: return {32, 22, ActKind::Q8_0};
    case T_Q5_1: return {32, 24, ActKind::Q8_0};
    case T_Q8_0: return {32, 34, ActKind::Q8_0};
    case T_IQ4_NL: return {32, 18, ActKind::Q8_0};
    case T_MXFP4: return {32, 17, ActKind::Q8_0};
    case T_Q2_K: return {256, 84, ActKind::Q8_K};
    case T_Q3_K: return {256, 110, ActKind::Q8_K};
    case T_Q4_K: return {256, 144, ActKind::Q8_K};
    case T_Q5_K: return {256, 176, ActKind::Q8_K};
    case T_Q6_K: return {256, 210, ActKind::Q8_K};
    case T_IQ4_XS: return {256, 136, ActKind::Q8_K};
    default: return {0, 0, ActKind::F32};
  }
}

struct Acts {
  const float* x;
  Act32 a32;
  ActK ak;
};

// MR rows r.. of the product with weight row w (type t, K values)
template <int MR>
void dot_rows(int t, const uint8_t* w, const Acts& A, int64_t K, int64_t r, float* out, int64_t ldo) {
  const int64_t nb32 = K / 32, nbk = K / 256;
  switch (t) {
    case T_F16: return dot_half<MR, false>(w, K, A.x, r, out, ldo);
    case T_BF16: return dot_half<MR, true>(w, K, A.x, r, out, ldo);
#ifdef GG_VNNI
    case T_Q4_0: return dot_q4<MR, false>(w, nb32, A.a32, r, out, ldo);
    case T_Q4_1: return dot_q4<MR, true>(w, nb32, A.a32, r, out, ldo);
#else
    case T_Q4_0: return dot32<BQ4_0, MR>(w, nb32, A.a32, r, out, ldo);
    case T_Q4_1: return dot32<BQ4_1, MR>(w, nb32, A.a32, r, out, ldo);
#endif
    case T_Q8_0: return dot32<BQ8_0, MR>(w, nb32, A.a32, r, out, ldo);
    case T_Q5_0: return dot32<BQ5_0, MR>(w, nb32, A.a32, r, out, ldo);
    case T_Q5_1: return dot32<BQ5_1, MR>(w, nb32, A.a32, r, out, ldo);
    case T_IQ4_NL: return dot32<BIQ4_NL, MR>(w, nb32, A.a32, r, out, ldo);
    case T_MXFP4: return dot32<BMXFP4, MR>(w, nb32, A.a32, r, out, ldo);
    case T_Q2_K: return dot_q2k<MR>(w, nbk, A.ak, r, out, ldo);
    case T_Q3_K: return dot_q3k<MR>(w, nbk, A.ak, r, out, ldo);
#ifdef GG_VNNI
    case T_Q4_K: return A.ak.qp ? dot_q4k<MR, false>(w, nbk, A.ak, r, out, ldo) : dot_q45k<MR, false>(w, nbk, A.ak, r, out, ldo);
    case T_Q5_K: return A.ak.qp ? dot_q4k<MR, true>(w, nbk, A.ak, r, out, ldo) : dot_q45k<MR, true>(w, nbk, A.ak, r, out, ldo);
#else
    case T_Q4_K: return dot_q45k<MR, false>(w, nbk, A.ak, r, out, ldo);
    case T_Q5_K: return dot_q45k<MR, true>(w, nbk, A.ak, r, out, ldo);
#endif
    case T_Q6_K: return dot_q6k<MR>(w, nbk, A.ak, r, out, ldo);
    case T_IQ4_XS: return dot_iq4xs<MR>(w, nbk, A.ak, r, out, ldo);
    default: throw std::runtime_error("ggml_cpu: no kernel for ggml type " + std::to_string(t));
  }
}

}  // namespace

namespace kvserve_ggml {

Matrix::Matrix(std::vector<int64_t> ptrs, std::vector<int64_t> types, std::vector<int64_t> rows, int64_t K, bool repack)
    : K_(K) {
  if (ptrs.size() != types.size() || ptrs.size() != rows.size() || ptrs.empty())
    throw std::invalid_argument("ggml_cpu.Matrix: ptrs, types and rows must have one entry per part");
  int64_t n = 0;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const TypeInfo ti = type_info(static_cast<int>(types[i]));
    if (ti.block == 0) throw std::invalid_argument("ggml_cpu.Matrix: no kernel for ggml type " + std::to_string(types[i]));
    if (K % ti.block) throw std::invalid_argument("ggml_cpu.Matrix: K is not a multiple of the type's block");
    parts_.push_back({reinterpret_cast<const uint8_t*>(ptrs[i]), static_cast<int>(types[i]), n, rows[i],
                      K / ti.block * ti.bytes});
    if (ti.act == ActKind::Q8_0) q8_0_ = true;
    if (types[i] == T_Q4_1) q4_ = true;
    if (types[i] == T_Q4_K || types[i] == T_Q5_K) q4k_ = true;
    if (ti.act == ActKind::Q8_K) q8_k_ = true;
    n += rows[i];
  }
  N_ = n;
#ifdef GG_VNNI
  // Q4_0 parts of 16k rows: into one buffer of q4_repack.h's layout (2 MiB-aligned, transparent huge pages)
  int64_t total = 0;
  if (repack && K % 64 == 0)
    for (Part& p : parts_)
      if (p.type == T_Q4_0 && p.rows % kvserve_q4r::GROUP == 0 && p.rows > 0) {
        p.rp = true;
        total += p.rows * p.row_bytes;
      }
  // The buffer is an anonymous mapping of its own (munmap gives its pages back when the matrix goes),
  // its start 2 MiB-aligned where a whole huge page fits (those pieces madvised MADV_HUGEPAGE; the
  // partial last 2 MiB cannot take a huge page: the mapping ends there). A smaller one is one plain
  // mapping, no madvise: posix_memalign + MADV_HUGEPAGE / MADV_NOHUGEPAGE cost two VMAs per matrix,
  // and a Q4_0 MoE file's experts (Qwen3-30B-A3B: 12,288 matrices, with give_back's two per part
  // about 61,000) come near vm.max_map_count (65,530), past which every mmap in the process fails
  uint8_t* buf = nullptr;
  const size_t align = size_t(2) << 20, size = (static_cast<size_t>(total) + 4095) / 4096 * 4096;
  const size_t whole = static_cast<size_t>(total) / align * align;
  if (total > 0) {
    const size_t span = whole > 0 ? size + align : size;
    void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {  // no memory for it: the file's layout, as without repack
      for (Part& p : parts_) p.rp = false;
    } else {
      uint8_t* const base = static_cast<uint8_t*>(m);
      buf = base;
      if (whole > 0) {  // the 2 MiB-aligned start; the slack before and after it unmapped
        buf = base + (align - reinterpret_cast<uintptr_t>(base) % align) % align;
        if (buf > base) munmap(base, buf - base);
        if (base + span > buf + size) munmap(buf + size, base + span - (buf + size));
        madvise(buf, whole, MADV_HUGEPAGE);
      }
    }
  }
  if (buf != nullptr) {
    own_.reset(buf, [size](uint8_t* q) { munmap(q, size); });
    uint8_t* dst = own_.get();
    for (Part& p : parts_) {
      if (!p.rp) continue;
      const int64_t nb = K / 32, ng = p.rows / kvserve_q4r::GROUP;
      const uint8_t* src = p.data;
      kvserve_pool::parallel_for(0, ng, 16, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
          kvserve_q4r::repack_group(src + g * kvserve_q4r::GROUP * p.row_bytes, nb, dst + g * nb * kvserve_q4r::BLOCK);
      });
      p.data = dst;
      dst += p.rows * p.row_bytes;
    }
  }
#endif
  for (const Part& p : parts_) {
    if (p.type == T_Q4_0 && !p.rp) q40_ = true;
    if (p.rp) rq40_ = true;
  }
}

std::vector<bool> Matrix::repacked() const {
  std::vector<bool> r;
  for (const Part& p : parts_) r.push_back(p.rp);
  return r;
}

int64_t Matrix::nbytes() const {
  int64_t b = 0;
  for (const Part& p : parts_) b += p.rows * p.row_bytes;
  return b;
}

bool Matrix::gemm_ok() const {
  if (rq40_) return false;  // repacked Q4_0: its own kernel at every row count
  if (gemm8_ok()) return true;
#ifdef GG_GEMM
  for (const Part& p : parts_)
    if (!gemm::has_type(p.type) && !gemm8::has_type(p.type)) return false;
  return K_ % 2 == 0;
#else
  return false;
#endif
}

bool Matrix::gemm8_ok() const {
#ifdef GG_GEMM8
  if (rq40_) return false;
  for (const Part& p : parts_)
    if (!gemm8::has_type(p.type)) return false;
  return true;
#else
  return false;
#endif
}

at::Tensor Matrix::mm(const at::Tensor& x_in, int64_t gemm_min_rows, const std::string& path) const {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K_, "ggml_cpu.Matrix.mm: x must be [M, ", K_, "]");
  TORCH_CHECK(path == "auto" || path == "int8" || path == "bf16" || path == "rows",
              "ggml_cpu.Matrix.mm: path must be auto, int8, bf16 or rows");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N_}, x.options());
  if (M == 0) return y;
#ifdef GG_GEMM8
  if (gemm_min_rows > 0 && M >= gemm_min_rows && path != "rows" && gemm_ok()) {
    // the int8 path (ggml_gemm8.h: llama.cpp's q8 arithmetic; every AVX512-VNNI build) where every
    // part's type has it, unless path says bf16; else the bfloat16 path (ggml_gemm.h; AVX512-BF16)
    if (path != "bf16" && gemm8_ok()) {
      std::vector<gemm8::Rows> rows;
      for (const Part& p : parts_) rows.push_back({p.data, p.type, p.first, p.rows, p.row_bytes});
      gemm8::mm(rows, N_, K_, x.data_ptr<float>(), M, y.data_ptr<float>());
      return y;
    }
#ifdef GG_GEMM
    bool bf = K_ % 2 == 0;
    for (const Part& p : parts_) bf = bf && gemm::has_type(p.type);
    if (path != "int8" && bf) {
      std::vector<gemm::Rows> rows;
      for (const Part& p : parts_) rows.push_back({p.data, p.type, p.first, p.rows, p.row_bytes});
      gemm::mm(rows, N_, K_, x.data_ptr<float>(), M, y.data_ptr<float>());
      return y;
    }
#endif
  }
#endif
  Scratch s;
  mm_raw(x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), s, path != "rows");
  return y;
}

void Matrix::mm_raw(const float* xp, int64_t M, float* Y, Scratch& s, bool batch) const {
  if (M == 0) return;
#ifdef GG_GEMM8
  // KB_MIN or more rows of Q4_K / Q5_K / Q6_K, KB32_MIN or more of Q8_0 / Q5_0 / IQ4_NL / MXFP4, alone or
  // mixed: the small-batch path (ggml_gemm8.h's panel_exact, q80_rows and panel32: each row the one-row
  // kernels' bits)
  bool exact = batch && M >= KB32_MIN;
  for (const Part& p : parts_)
    exact = exact && ((gemm8::exact_type(p.type) && M >= KB_MIN) || gemm8::exact32_type(p.type));
  if (exact) {
    std::vector<gemm8::Rows> rows;
    for (const Part& p : parts_) rows.push_back({p.data, p.type, p.first, p.rows, p.row_bytes});
    gemm8::mm(rows, N_, K_, xp, M, Y, true);
    return;
  }
#endif
  quantize_acts(xp, M, K_, s, kinds());
  kvserve_pool::parallel_for(0, N_, 8, [&](int64_t n0, int64_t n1) { out_rows(xp, M, s, n0, n1, Y); });
}

int Matrix::kinds() const {
  return (q8_0_ ? 1 : 0) | (q4_ ? 2 : 0) | (q40_ ? 4 : 0) | (q8_k_ ? 8 : 0) | (q4k_ ? 16 : 0) | (rq40_ ? 32 : 0);
}

void Matrix::quantize_acts(const float* xp, int64_t M, int64_t K, Scratch& s, int kinds) {
  // each kind of activation quantized once per product (a fused q|k|v or gate|up shares it)
  if (kinds & 1) {
    s.q0.resize(M * K);
    s.d0.resize(M * (K / 32));
    s.s0.resize(M * (K / 32));
    kvserve_pool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_q8_0_row(xp + m * K, K, s.q0.data() + m * K, s.d0.data() + m * (K / 32), s.s0.data() + m * (K / 32));
    });
#ifdef GG_VNNI
    if (kinds & 2) {
      const int64_t n16 = K / 512 * 16;
      s.c8.resize(M * (K / 32));
      s.qt.resize(M * n16 * 32);
      for (int64_t m = 0; m < M; ++m)
        q4_acts_row(s.q0.data() + m * K, K, s.c8.data() + m * (K / 32), s.qt.data() + m * n16 * 32);
    }
    if (kinds & 4) {  // Q4_0 on the file's blocks (q4_core.h, kvserve_q4::q40_dot): its activation layout
      const int64_t ng = kvserve_q4::q40_groups(K);
      s.x7.resize(M * ng * 256);
      s.c7.resize(M * ng * 16);
      s.d7.resize(M * ng * 16);
      for (int64_t m = 0; m < M; ++m)
        kvserve_q4::q40_acts_row(s.q0.data() + m * K, s.d0.data() + m * (K / 32), K, s.x7.data() + m * ng * 256,
                                 s.c7.data() + m * ng * 16, s.d7.data() + m * ng * 16);
    }
    if (kinds & 32) {  // repacked Q4_0 (q4_repack.h): the activations in tiles of 16 rows
      const int64_t n = (M + 15) / 16 * 16 * (K / 32);
      s.xr.resize(n * 32);
      s.cr.resize(n);
      s.dr.resize(n);
      kvserve_q4r::rq40_acts(s.q0.data(), s.d0.data(), M, K, s.xr.data(), s.cr.data(), s.dr.data());
    }
#endif
  }
  if (kinds & 8) {
    s.qk.resize(M * K);
    s.dk.resize(M * (K / 256));
    s.bs.resize(M * (K / 16));
    kvserve_pool::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_q8_K_row(xp + m * K, K, s.qk.data() + m * K, s.dk.data() + m * (K / 256), s.bs.data() + m * (K / 16));
    });
#ifdef GG_VNNI
    if (kinds & 16) {
      s.qkp.resize(M * K);
      for (int64_t m = 0; m < M; ++m) q4k_acts_row(s.qk.data() + m * K, K, s.qkp.data() + m * K);
    }
#endif
  }
}

void Matrix::out_rows(const float* xp, int64_t M, const Scratch& s, int64_t n0, int64_t n1, float* Y) const {
  const int64_t K = K_, N = N_;
  Acts A{xp, {nullptr, nullptr, nullptr, K}, {nullptr, nullptr, nullptr, K}};
  if (q8_0_) {
    A.a32 = {s.q0.data(), s.d0.data(), s.s0.data(), K};
#ifdef GG_VNNI
    if (q4_) {
      A.a32.c8 = s.c8.data();
      A.a32.qt = s.qt.data();
      A.a32.n16 = K / 512 * 16;
    }
#endif
  }
  if (q8_k_) {
    A.ak = {s.qk.data(), s.dk.data(), s.bs.data(), K};
#ifdef GG_VNNI
    if (q4k_) A.ak.qp = s.qkp.data();
#endif
  }
  // rows of activations at a time: a chunk of quantized rows stays in the core's L2 while every
  // weight row of the thread's range passes by
  const int64_t MC = 64;
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t me = std::min(M, mc + MC);
    size_t pi = 0;
    for (int64_t n = n0; n < n1; ++n) {
      while (n >= parts_[pi].first + parts_[pi].rows) ++pi;
      const Part& p = parts_[pi];
      const uint8_t* w = p.data + (n - p.first) * p.row_bytes;
#ifdef GG_VNNI
      if (p.rp) {  // repacked Q4_0 (q4_repack.h): this part's rows n .. e - 1, every activation row of the chunk
        const int64_t e = std::min(n1, p.first + p.rows), nb = K / 32;
        const int64_t t0 = mc * nb;  // chunk mc (a multiple of 16 rows): its first tile (rq40_acts)
        kvserve_q4r::rq40_rows(p.data, nb, n - p.first, e - p.first, me - mc, s.xr.data() + 32 * t0, s.dr.data() + t0,
                               s.cr.data() + t0, Y + mc * N + n, N);
        n = e - 1;
        continue;
      }
      if (p.type == T_Q4_0) {  // this part's rows n .. e - 1, every activation row of the chunk
        const int64_t e = std::min(n1, p.first + p.rows), ng = kvserve_q4::q40_groups(K);
        const kvserve_q4::Q40Acts a7{s.x7.data() + mc * ng * 256, s.c7.data() + mc * ng * 16, s.d7.data() + mc * ng * 16, ng};
        if (me - mc >= Q40_PANEL_MIN) {  // the batched step: panels (the same bits, see q40_panels)
          const kvserve_q4::Q40Rows ar{s.q0.data() + mc * K, s.d0.data() + mc * (K / 32), a7.c, K, ng};
          kvserve_q4::q40_panels(w, p.row_bytes, e - n, me - mc, ar, Y + mc * N + n, N);
        } else {
          kvserve_q4::q40_rows(w, p.row_bytes, e - n, K, me - mc, a7, Y + mc * N + n, N);
        }
        n = e - 1;
        continue;
      }
      if (p.type == T_Q8_0) {  // this part's rows n .. e - 1 (ggml_gemm8.h's q80_product: q80_x8's bits)
        const int64_t e = std::min(n1, p.first + p.rows);
        gemm8::q80_product(w, p.row_bytes, e - n, K, A.a32.q + mc * K, A.a32.d + mc * (K / 32), nullptr, me - mc,
                           Y + mc * N + n, N);
        n = e - 1;
        continue;
      }
      // decode (1-2 rows): Q4 weight rows in pairs (dot_q4_pair: the same bits as one at a time)
      if (p.type == T_Q4_1 && M <= 2 && n + 1 < n1 && n + 1 < p.first + p.rows) {
        q4_pair(p.type, w, w + p.row_bytes, K / 32, A.a32, M, Y + n, Y + n + 1, N);
        ++n;
        continue;
      }
      // decode (one row): Q4_K / Q5_K / Q6_K weight rows 8 at a time (dot_q4k_x8: the same bits), at every
      // K: with the next rows prefetched into L2 (prefetch_ahead8) the 8 interleaved streams read from
      // memory faster than one row at a time at K = 4096-14336 too (one thread, Llama-3.1-8B's layer from
      // memory: Q4_K 28672 x 4096 2.77 ms against 3.74, Q6_K 4096 x 14336 1.60 against 2.89)
      if (M == 1 && (p.type == T_Q6_K || (A.ak.qp && (p.type == T_Q4_K || p.type == T_Q5_K)))) {
        const int64_t e = std::min(n1, p.first + p.rows);
        if (n + 8 <= e) {
          for (; n + 8 <= e; n += 8, w += 8 * p.row_bytes) {
            if (p.type == T_Q6_K) dot_q6k_x8(w, p.row_bytes, K / 256, A.ak, 0, Y + n);
            else if (p.type == T_Q4_K) dot_q4k_x8<false>(w, p.row_bytes, K / 256, A.ak, 0, Y + n);
            else dot_q4k_x8<true>(w, p.row_bytes, K / 256, A.ak, 0, Y + n);
          }
          --n;  // the loop's ++n; the rows left (fewer than 8) take the per-row kernels
          continue;
        }
      }
#endif
      int64_t r = mc;
      for (; r + 4 <= me; r += 4) dot_rows<4>(p.type, w, A, K, r, Y + r * N + n, N);
      switch (me - r) {
        case 3: dot_rows<3>(p.type, w, A, K, r, Y + r * N + n, N); break;
        case 2: dot_rows<2>(p.type, w, A, K, r, Y + r * N + n, N); break;
        case 1: dot_rows<1>(p.type, w, A, K, r, Y + r * N + n, N); break;
        default: break;
      }
    }
  }
}

void Matrix::mm_jobs(const std::vector<Job>& jobs, std::vector<Scratch>& scratch) {
  const size_t J = jobs.size();
  if (J == 0) return;
  // activation sets: one per distinct (x, M, K), quantized for the union of its jobs' kinds
  struct Set { const float* x; int64_t M, K; int kinds; };
  std::vector<Set> sets;
  std::vector<size_t> set_of(J);
  std::vector<int64_t> start(J + 1, 0);
  for (size_t j = 0; j < J; ++j) {
    const Job& jb = jobs[j];
    size_t i = 0;
    while (i < sets.size() && !(sets[i].x == jb.x && sets[i].M == jb.M && sets[i].K == jb.mat->K_)) ++i;
    if (i == sets.size()) sets.push_back({jb.x, jb.M, jb.mat->K_, 0});
    sets[i].kinds |= jb.mat->kinds();
    set_of[j] = i;
    start[j + 1] = start[j] + (jb.M > 0 ? jb.mat->N_ : 0);
  }
  if (scratch.size() < sets.size()) scratch.resize(sets.size());
  for (size_t i = 0; i < sets.size(); ++i)
    if (sets[i].M > 0) quantize_acts(sets[i].x, sets[i].M, sets[i].K, scratch[i], sets[i].kinds);
  // the jobs' output rows as one range [0, total): job j's rows at [start[j], start[j + 1])
  kvserve_pool::parallel_for(0, start[J], 8, [&](int64_t a, int64_t b) {
    size_t j = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), a) - start.begin()) - 1;
    while (a < b && j < J) {
      const int64_t e = std::min(b, start[j + 1]);
      if (e > a) jobs[j].mat->out_rows(jobs[j].x, jobs[j].M, scratch[set_of[j]], a - start[j], e - start[j], jobs[j].y);
      a = std::max(a, e);
      ++j;
    }
  });
}

}  // namespace kvserve_ggml

namespace {

// the activations' quantization alone (tests compare it with a numpy emulation):
// x [M, K] -> (q int8 [M, K], d float [M, K/32], s float [M, K/32]) for "q8_0", or
// (q int8 [M, K], d float [M, K/256], bsums int16 [M, K/16]) for "q8_K"
std::vector<at::Tensor> quantize(const at::Tensor& x_in, const std::string& kind) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(x.dim() == 2, "quantize: x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, at::kChar);
  if (kind == "q8_0") {
    TORCH_CHECK(K % 32 == 0, "quantize: K must be a multiple of 32");
    at::Tensor d = at::empty({M, K / 32}, at::kFloat), s = at::empty({M, K / 32}, at::kFloat);
    for (int64_t m = 0; m < M; ++m)
      quantize_q8_0_row(x.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K, d.data_ptr<float>() + m * (K / 32),
                        s.data_ptr<float>() + m * (K / 32));
    return {q, d, s};
  }
  TORCH_CHECK(kind == "q8_K" && K % 256 == 0, "quantize: kind q8_0 or q8_K (K a multiple of 256)");
  at::Tensor d = at::empty({M, K / 256}, at::kFloat), bs = at::empty({M, K / 16}, at::kShort);
  for (int64_t m = 0; m < M; ++m)
    quantize_q8_K_row(x.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K, d.data_ptr<float>() + m * (K / 256),
                      bs.data_ptr<int16_t>() + m * (K / 16));
  return {q, d, bs};
}

}  // namespace

void kvserve_ggml::register_module(pybind11::module_& m) {
  m.attr("ISA") =
#ifdef GG_VNNI
      "avx512";
#else
      "avx2";
#endif
  m.attr("TYPES") = std::vector<int>{T_F16, T_BF16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_IQ4_NL, T_MXFP4,
                                     T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K, T_IQ4_XS};
  // the prefill path's instruction set ("avx512bf16"), "" where this build has none
  m.attr("GEMM") =
#ifdef GG_GEMM
      "avx512bf16";
#else
      "";
#endif
  // the int8 prefill path's instruction set ("avx512vnni": ggml_gemm8.h), "" where this build has none
  m.attr("GEMM8") =
#ifdef GG_GEMM8
      "avx512vnni";
#else
      "";
#endif
  m.def("quantize", &quantize);
  pybind11::class_<kvserve_ggml::Matrix>(m, "Matrix")
      .def(pybind11::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t, bool>(),
           pybind11::arg("ptrs"), pybind11::arg("types"), pybind11::arg("rows"), pybind11::arg("K"),
           pybind11::arg("repack") = false,
           // the repack copies the parts (~200 ms for 72 MiB): other Python threads (the server's loop, other
           // models' engines) run meanwhile
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("repacked", &kvserve_ggml::Matrix::repacked)
      .def_property_readonly("rows", &kvserve_ggml::Matrix::rows)
      .def_property_readonly("cols", &kvserve_ggml::Matrix::cols)
      .def_property_readonly("gemm", &kvserve_ggml::Matrix::gemm_ok)
      .def_property_readonly("gemm8", &kvserve_ggml::Matrix::gemm8_ok)
      .def("mm", &kvserve_ggml::Matrix::mm, pybind11::arg("x"), pybind11::arg("gemm_min_rows") = 0,
           pybind11::arg("path") = "auto",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
