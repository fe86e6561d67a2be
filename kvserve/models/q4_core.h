// kvserve's 4-bit x int8 dot products (see q4_cpu.cpp for the weight layout), shared by the
// q4_mm op (q4_cpu.cpp, AVX512-VNNI only) and the native decode step (decode_cpu.cpp).
//
// Two instruction sets, chosen at compile time (-march=native): AVX512-VNNI (vpdpbusd over 64
// weights, 16 int32 lanes) or AVX2 + FMA + F16C (vpmaddubsw + vpmaddwd over the same 64 weights,
// the low and high nibble lanes added in int16, 8 int32 lanes: llama.cpp's AVX2 route). Both give
// the same exact integer dot product per block; the float sums differ in order between the two.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVSERVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_AVX2 1
#else
#error "kvserve's native kernels need AVX512F/BW/VL + AVX512-VNNI, or AVX2 + FMA + F16C"
#endif
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvserve_q4 {

// x [M, K] float32 -> xq [M, K] int8 per block of 32 (scale d = max|x| / 127, q = round half to
// even of x / d), in the pair order above; xs [M, K/32] = d, xsum [M, K/32] = d * sum(q).
// K a multiple of 64. The scalar reference of this is quantize_rows_scalar (the same bytes).
inline void quantize_rows_scalar(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, float* xsum) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + r * K + g * 32;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* dst = xq + r * K + (g / 2) * 64;
      const int blk = static_cast<int>(g % 2);
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(xb[j] * id));
        sum += q;
        dst[(2 * (j / 4) + blk) * 4 + j % 4] = static_cast<int8_t>(q);
      }
      xs[r * G + g] = d;
      xsum[r * G + g] = d * static_cast<float>(sum);
    }
  }
}

// quantize_rows_scalar with AVX2 (both builds have it): the same float operations (max is exact,
// vcvtps2dq rounds half to even as nearbyint does in the default rounding mode), ~10x faster;
// it ran serially before each projection, 2-3 ms of a 16-row step
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, float* xsum) {
  const int64_t G = K / 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g2 = 0; g2 < G / 2; ++g2) {
      __m256i qb[2];
      for (int blk = 0; blk < 2; ++blk) {
        const int64_t g = 2 * g2 + blk;
        const float* xb = x + r * K + g * 32;
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        const int sum = _mm_cvtsi128_si32(s4);
        // 32 int8 in order (|q| <= 127: the saturating packs are exact)
        qb[blk] = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), perm);
        xs[r * G + g] = d;
        xsum[r * G + g] = d * static_cast<float>(sum);
      }
      // the pair order: 32-bit words of block 0 and block 1 alternating
      const __m256i lo = _mm256_unpacklo_epi32(qb[0], qb[1]);
      const __m256i hi = _mm256_unpackhi_epi32(qb[0], qb[1]);
      int8_t* dst = xq + r * K + g2 * 64;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
}

#ifdef KVSERVE_AVX512
// MR activation rows against one weight row: each unpacked weight pair is used MR times
template <int MR>
inline void rows_dot(const uint8_t* wrow, const uint16_t* drow, const uint16_t* mrow, int64_t K, const int8_t* xq,
                     const float* xs, const float* xsum, float* out, int64_t ldo) {
  const int64_t P = K / 64, G = K / 32;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t pr = 0; pr < P; ++pr) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + pr * 32));
    const __m256i lo = _mm256_and_si256(b, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    int32_t dpair;
    std::memcpy(&dpair, drow + 2 * pr, 4);
    const __m512 dw = _mm512_cvtph_ps(_mm256_set1_epi32(dpair));  // d0 d1 d0 d1 ...
    for (int r = 0; r < MR; ++r) {
      double xspair;
      std::memcpy(&xspair, xs + r * G + 2 * pr, 8);
      const __m512i a = _mm512_loadu_si512(xq + r * K + pr * 64);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
      const __m512 xsp = _mm512_castpd_ps(_mm512_set1_pd(xspair));  // dx0 dx1 dx0 dx1 ...
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xsp), acc[r]);
    }
  }
  // the m terms, sum_g m_g * (dx_g * sum xq_g): 16 blocks per vector, not one FMA per pair and row
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t left = G - g0 < 16 ? G - g0 : 16;
    const __mmask16 mk = static_cast<__mmask16>((1u << left) - 1u);
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, mrow + g0));
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mk, xsum + r * G + g0), acc[r]);
  }
  for (int r = 0; r < MR; ++r) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
}


#else
// the sum of a vector's 8 lanes, in a fixed order
inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// MR activation rows against one weight row: each unpacked weight pair is used MR times
template <int MR>
inline void rows_dot(const uint8_t* wrow, const uint16_t* drow, const uint16_t* mrow, int64_t K, const int8_t* xq,
                     const float* xs, const float* xsum, float* out, int64_t ldo) {
  const int64_t P = K / 64, G = K / 32;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t pr = 0; pr < P; ++pr) {
    // the weights stream from memory: a software prefetch 4 KiB ahead (one per 64-byte line)
    // took a one-row pass over SmolLM2-sized weights from 11 to 14-16 GB/s on the 2-core Zen 3 (2 KiB: 13)
    if ((pr & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(wrow + pr * 32 + 4096), _MM_HINT_T0);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + pr * 32));
    const __m256i lo = _mm256_and_si256(b, low4);                      // lanes 0-7 of the pair
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);  // lanes 8-15
    int32_t dpair;
    std::memcpy(&dpair, drow + 2 * pr, 4);
    const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi32(dpair));  // d0 d1 d0 d1 ...
    for (int r = 0; r < MR; ++r) {
      double xspair;
      std::memcpy(&xspair, xs + r * G + 2 * pr, 8);
      const int8_t* a = xq + r * K + pr * 64;
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
      // u8 x s8 pairs in int16 (|15 * 127 * 2| per pair, |7620| for lane l plus lane l + 8: no
      // saturation), then pairs of int16 into int32: lane l holds lanes l and l + 8 of the pair
      const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a0), _mm256_maddubs_epi16(hi, a1));
      const __m256i dot = _mm256_madd_epi16(s16, ones);
      const __m256 xsp = _mm256_castpd_ps(_mm256_set1_pd(xspair));  // dx0 dx1 dx0 dx1 ...
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, xsp), acc[r]);
    }
  }
  // the m terms, sum_g m_g * (dx_g * sum xq_g): 8 blocks per vector, the rest one by one
  float tail[MR];
  for (int r = 0; r < MR; ++r) tail[r] = 0.f;
  int64_t g0 = 0;
  for (; g0 + 8 <= G; g0 += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mrow + g0)));
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + r * G + g0), acc[r]);
  }
  for (; g0 < G; ++g0) {
    const float mg = _cvtsh_ss(mrow[g0]);
    for (int r = 0; r < MR; ++r) tail[r] += mg * xsum[r * G + g0];
  }
  for (int r = 0; r < MR; ++r) out[r * ldo] = hsum256(acc[r]) + tail[r];
}

#endif

// Row blocks of an M-row product: f(std::integral_constant<int, R>{}, r) for r = 0, 4, 8, ... with R = 4,
// then once with R = M % 4 (3, 2 or 1) for the rest. Every kernel that takes MR rows at once (q4 and q8,
// both layouts) is called through this, so a row's block size, and with it its rounding, follows M alone.
template <typename F>
inline void for_row_blocks(int64_t M, const F& f) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) f(std::integral_constant<int, 4>{}, r);
  switch (M - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// at::parallel_for as a callable (q4_mm_raw's default: the q4_mm op; the native step passes its pool's)
struct AtParallelFor {
  template <typename F>
  void operator()(int64_t b, int64_t e, int64_t grain, const F& f) const { at::parallel_for(b, e, grain, f); }
};

// y [M, N] = x [M, K] (float32, contiguous) @ W.T; scratch: xq [M * K] int8, xs, xsum [M * K / 32].
// A row's result does not depend on M or on the other rows (groups of 4, the same operations).
template <typename PFor = AtParallelFor>
inline void q4_mm_raw(const float* x, int64_t M, int64_t K, const uint8_t* W, const uint16_t* D, const uint16_t* Mn,
                      int64_t N, float* Y, int8_t* XQ, float* XS, float* XM, const PFor& pfor = PFor()) {
  const int64_t G = K / 32;
  quantize_rows(x, M, K, XQ, XS, XM);
  pfor(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = W + n * (K / 2);
      const uint16_t* drow = D + n * G;
      const uint16_t* mrow = Mn + n * G;
      for_row_blocks(M, [&](auto mr, int64_t r) {
        rows_dot<decltype(mr)::value>(wrow, drow, mrow, K, XQ + r * K, XS + r * G, XM + r * G, Y + r * N + n, N);
      });
    }
  });
}

#ifdef KVSERVE_AVX512
// ---------------------------------------------------------------- Q4_0 on the GGUF file's blocks
// GGUF Q4_0 rows multiplied where they lie (a view of the file's mapping: no repacked copy). A block
// is 18 bytes: d (float16), then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31
// (w = d (u - 8)). Seven blocks (126 bytes) fit one 128-byte window of two 64-byte loads, from which
// two vpermt2w give vectors V0, V1 with block j's 16 bytes in int32 lanes 2 j, 2 j + 1 (V0: bytes
// 0-7, V1: bytes 8-15; lanes 14, 15 unused, their activations 0), and a third its d in word lanes
// 2 j, 2 j + 1. Low and high nibbles of V0 and V1 are four vpdpbusd against activations laid out the
// same way once per product (q4_0_acts_row), the sum started at -8 sum(q) of the block (lane 2 j):
// lanes 2 j and 2 j + 1 add up to block j's exact integer dot product sum (u - 8) q (llama.cpp's). Per
// group one conversion and one multiply-add by d dx for seven blocks. Weight rows are taken NW at a
// time (each activation vector loaded once for them), activation rows MR at a time (each weight
// vector unpacked once for them); every (weight row, activation row) pair has its own accumulator
// and the same operations in the same order whatever MR and NW are: row i of an M-row product equals
// the one-row product bit for bit. The tile kernel (decode_cpu.cpp) needs a copy of the weights in
// its own layout; this reads the file's bytes (harness, 2-core EPYC Zen 4, one thread, 128 x 4096
// in L2: one row 7.9 us against the tiles' 6.2, 4-16 rows ~1.8x the tiles' time; from memory one row
// at 0.85-0.95x the tiles' time: 10% fewer bytes).

//! activations of one q8_0 row for q4_0_dot: x int8 [ng * 256], c int32 [ng * 16], dx float [ng * 16]
struct Q40Acts {
  const int8_t* x;
  const int32_t* c;
  const float* dx;
  int64_t ng;  // groups of 7 blocks: (K / 32 + 6) / 7
};

inline int64_t q40_groups(int64_t K) { return (K / 32 + 6) / 7; }

// one q8_0 row (q int8 [K], d float [K/32]) -> Q40Acts' buffers: group g (blocks 7 g .. 7 g + 6,
// block j = b % 7) at x + 256 g: four 64-byte vectors, int32 lane 2 j + h of vector 0 = q values
// 4 h .. 4 h + 3 of the block (V0's low nibbles), of vector 1 values 16 + 4 h .. (V0's high), of
// vector 2 values 8 + 4 h .. (V1's low), of vector 3 values 24 + 4 h .. (V1's high); c lane 2 j =
// -8 sum(q), lane 2 j + 1 = 0; dx lanes 2 j and 2 j + 1 = d. Everything else 0.
inline void q40_acts_row(const int8_t* q, const float* d, int64_t K, int8_t* X, int32_t* C, float* D) {
  const int64_t nb = K / 32, ng = q40_groups(K);
  std::memset(X, 0, ng * 256);
  std::memset(C, 0, ng * 64);
  std::memset(D, 0, ng * 64);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / 7, j = b % 7;
    const int8_t* xb = q + 32 * b;
    int8_t* xg = X + 256 * g + 8 * j;
    for (int h = 0; h < 2; ++h) {
      std::memcpy(xg + 4 * h, xb + 4 * h, 4);
      std::memcpy(xg + 64 + 4 * h, xb + 16 + 4 * h, 4);
      std::memcpy(xg + 128 + 4 * h, xb + 8 + 4 * h, 4);
      std::memcpy(xg + 192 + 4 * h, xb + 24 + 4 * h, 4);
    }
    int s = 0;
    for (int i = 0; i < 32; ++i) s += xb[i];
    C[16 * g + 2 * j] = -8 * s;
    D[16 * g + 2 * j] = D[16 * g + 2 * j + 1] = d[b];
  }
}

// the vpermt2w word indices into a 128-byte window of seven blocks (see above)
struct Q40Tab {
  alignas(64) int16_t v0[32], v1[32], d[32];
  constexpr Q40Tab() : v0(), v1(), d() {
    for (int l = 0; l < 16; ++l) {
      const int j = l / 2 < 7 ? l / 2 : 0, h = l % 2;  // lanes 14, 15: any words (activations 0)
      v0[2 * l] = static_cast<int16_t>(9 * j + 1 + 2 * h);
      v0[2 * l + 1] = static_cast<int16_t>(9 * j + 2 + 2 * h);
      v1[2 * l] = static_cast<int16_t>(9 * j + 5 + 2 * h);
      v1[2 * l + 1] = static_cast<int16_t>(9 * j + 6 + 2 * h);
      d[l] = static_cast<int16_t>(9 * j);
    }
  }
};
inline constexpr Q40Tab kQ40Tab{};
// software prefetch: with 4 weight rows a call (one or two activation rows: decode) the same bytes of
// the next 4 rows, into L2 (harness, one thread, 24576 x 2048 from memory: 2.04 ms against 2.14-2.4 on
// the tiles; 2 KiB ahead in each row, 3.0 ms: the four streams outran it); else 2 KiB ahead in the row
constexpr int64_t Q40_PREFETCH = 2048;

// NW weight rows (w, row stride rb bytes, nb blocks each) against MR activation rows (a: the first,
// the next at strides ng * 256 / ng * 16): out[r * ldo + v] = row v's dot product with row r
template <int MR, int NW>
inline void q40_dot(const uint8_t* w, int64_t rb, int64_t nb, const Q40Acts& a, float* out, int64_t ldo) {
  const int64_t ng = a.ng;
  const int64_t full = nb * 18 >= 128 ? (nb * 18 - 128) / 126 + 1 : 0;  // groups whose window lies in the row
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i i0 = _mm512_load_si512(kQ40Tab.v0), i1 = _mm512_load_si512(kQ40Tab.v1);
  const __m512i id = _mm512_load_si512(kQ40Tab.d);
  __m512 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NW; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i l0[NW], h0[NW], l1[NW], h1[NW];
    __m512 dw[NW];
    for (int v = 0; v < NW; ++v) {
      const uint8_t* p = w + v * rb + 126 * g;
      if constexpr (NW == 4) {  // the next 4 rows' same bytes (the rows lie back to back), into L2
        _mm_prefetch(reinterpret_cast<const char*>(p + 4 * rb), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(p + 4 * rb + 64), _MM_HINT_T1);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(p + Q40_PREFETCH), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + Q40_PREFETCH + 64), _MM_HINT_T0);
      }
      __m512i A, B;
      if (g < full) {
        A = _mm512_loadu_si512(p);
        B = _mm512_loadu_si512(p + 64);
      } else {  // the row's last bytes: no load past them
        const int64_t left = nb * 18 - 126 * g, la = left < 64 ? left : 64, lb = left - la;
        A = _mm512_maskz_loadu_epi8(la >= 64 ? ~0ULL : (1ULL << la) - 1, p);
        B = _mm512_maskz_loadu_epi8(lb <= 0 ? 0ULL : (1ULL << lb) - 1, p + 64);
      }
      const __m512i V0 = _mm512_permutex2var_epi16(A, i0, B), V1 = _mm512_permutex2var_epi16(A, i1, B);
      l0[v] = _mm512_and_si512(V0, m4);
      h0[v] = _mm512_and_si512(_mm512_srli_epi16(V0, 4), m4);
      l1[v] = _mm512_and_si512(V1, m4);
      h1[v] = _mm512_and_si512(_mm512_srli_epi16(V1, 4), m4);
      dw[v] = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(A, id, B)));
    }
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = a.x + (r * ng + g) * 256;
      const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 64);
      const __m512i x2 = _mm512_loadu_si512(x + 128), x3 = _mm512_loadu_si512(x + 192);
      const __m512i c = _mm512_loadu_si512(a.c + (r * ng + g) * 16);
      const __m512 dx = _mm512_loadu_ps(a.dx + (r * ng + g) * 16);
      for (int v = 0; v < NW; ++v) {
        __m512i s = _mm512_dpbusd_epi32(c, l0[v], x0);
        s = _mm512_dpbusd_epi32(s, h0[v], x1);
        s = _mm512_dpbusd_epi32(s, l1[v], x2);
        s = _mm512_dpbusd_epi32(s, h1[v], x3);
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[v], dx), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NW; ++v) out[r * ldo + v] = _mm512_reduce_add_ps(acc[r][v]);
}

// weight rows [0, n) of W (Q4_0, rb bytes each, K values) against activation rows [0, M) (a: row 0's
// buffers) -> Y[r * ldo + i] for weight row i. Weight rows 4 at a time (they stay in L1 while every
// activation row passes): activation rows 4 at a time with 2 weight rows per call, fewer with all 4
// (registers); the last n % 4 weight rows one at a time.
inline void q40_rows(const uint8_t* W, int64_t rb, int64_t n, int64_t K, int64_t M, const Q40Acts& a, float* Y,
                     int64_t ldo) {
  const int64_t nb = K / 32, ng = a.ng;
  // activation rows r .. r + MR - 1 against weight rows i .. i + NW - 1
  auto call = [&](auto mr, auto nw, int64_t r, int64_t i) {
    constexpr int MR = decltype(mr)::value, NW = decltype(nw)::value;
    const Q40Acts ar{a.x + r * ng * 256, a.c + r * ng * 16, a.dx + r * ng * 16, ng};
    q40_dot<MR, NW>(W + i * rb, rb, nb, ar, Y + r * ldo + i, ldo);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) {
      call(I4{}, I2{}, r, i);
      call(I4{}, I2{}, r, i + 2);
    }
    switch (M - r) {
      case 3: call(I3{}, I2{}, r, i); call(I3{}, I2{}, r, i + 2); break;
      case 2: call(I2{}, I4{}, r, i); break;
      case 1: call(I1{}, I4{}, r, i); break;
      default: break;
    }
  }
  for (; i < n; ++i) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) call(I4{}, I1{}, r, i);
    switch (M - r) {
      case 3: call(I3{}, I1{}, r, i); break;
      case 2: call(I2{}, I1{}, r, i); break;
      case 1: call(I1{}, I1{}, r, i); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------- Q4_0 panels: the batched step
// q40_dot's arithmetic with the weight rows in the lanes, for 8+ activation rows (Matrix::out_rows'
// Q40_PANEL_MIN): per output the same 14 float chains (chain 2 j + h: half h of block 7 g + j, i.e. the
// values 4 t .. 4 t + 3 with t even or odd, over g in order: acc = fma(float(sumi), d_w * d_x, acc)), then
// _mm512_reduce_add_ps's tree over them and two +0 lanes: row i of an M-row product equals its one-row
// product (q40_dot<1, 4>) bit for bit. q40_dot unpacked each weight group once per 4 activation rows
// and fed every vpdpbusd a whole activation vector; here a panel of Q40_NP = 32 weight rows is taken
// Q40_CB blocks at a time into an L1 tile (w: [CB][8][32 rows][4] nibbles as uint8, dword t of a row's
// lane = values 4 t .. 4 t + 3; d: [CB][32] floats), and every activation row, 2 at a time, runs against
// it: per 4 values a broadcast of the row's 4 quants and two vpdpbusd (32 rows), the even-t sum started
// at -8 sum(q) of the block, then per block and half a conversion and a multiply-add into its chain.
// A tile holds blocks of one slot j (j, j + 7, j + 14, ...), so that only chains 2 j and 2 j + 1 run
// in it (in registers; between tiles in a per-thread buffer, [M][14][32] floats). Measured (one thread, CPU time, 16 rows,
// 1B shapes, shared machine): 2048 x 2048 0.69-0.75 ms against q40_dot's 0.87-1.05, 16384 x 2048 6.0-6.6
// against 7.3-9.8 (4 activation rows a call spilled registers: 1.3 ms). One float chain per output (the
// int8 prefill path's) ran 0.56 ms, but its one-row kernel on the file's blocks cost 1.5x q40_dot's CPU
// in decode: not taken.
constexpr int Q40_NP = 32;  // weight rows per panel (two vectors of 16)
constexpr int Q40_CB = 8;   // blocks per tile (8 KiB of nibbles)

struct Q40Tile {
  alignas(64) uint8_t w[Q40_CB * 8 * Q40_NP * 4];
  alignas(64) float d[Q40_CB * Q40_NP];
};

//! q8_0 activations for q40_panels: q int8 [M, K] (row stride K), dx float [M, K/32], and Q40Acts' c
//! (-8 x each block's sum of q: block b of row m at c[(m ng + b / 7) 16 + 2 (b % 7)])
struct Q40Rows {
  const int8_t* q;
  const float* dx;
  const int32_t* c;
  int64_t K, ng;
};

// blocks b0 .. b0 + cb - 1 of the panel's 32 rows (rows[n]: row n's first byte) -> the tile. Per block and
// 16 rows, the 16 nibble bytes of each row as 128-bit lanes of 4 vectors (rows k, 4 + k, 8 + k,
// 12 + k in vector k), then a 4 x 4 transpose of dwords within the lanes: vector q, lane i = dword q
// of row i (4-byte gathers took 3x this: the one-row product at a third of its speed). The scales by
// scalar loads, then converted 16 at a time.
inline void q40_tile_build(const uint8_t* const* rows, int64_t b0, int64_t stride, int cb, Q40Tile& t) {
  const __m512i m4 = _mm512_set1_epi8(15);
  alignas(64) uint16_t dh[Q40_CB * Q40_NP];
  for (int j = 0; j < cb; ++j) {
    const int64_t off = (b0 + stride * j) * 18;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* const* rp = rows + 16 * h;
      __m512i z[4];
      for (int k = 0; k < 4; ++k) {
        z[k] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[k] + off + 2)));
        z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[4 + k] + off + 2)), 1);
        z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[8 + k] + off + 2)), 2);
        z[k] = _mm512_inserti32x4(z[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[12 + k] + off + 2)), 3);
      }
      const __m512i A = _mm512_unpacklo_epi32(z[0], z[1]), B = _mm512_unpackhi_epi32(z[0], z[1]);
      const __m512i C = _mm512_unpacklo_epi32(z[2], z[3]), D = _mm512_unpackhi_epi32(z[2], z[3]);
      const __m512i q[4] = {_mm512_unpacklo_epi64(A, C), _mm512_unpackhi_epi64(A, C), _mm512_unpacklo_epi64(B, D),
                            _mm512_unpackhi_epi64(B, D)};
      for (int c = 0; c < 4; ++c) {
        _mm512_store_si512(t.w + ((j * 8 + c) * Q40_NP + 16 * h) * 4, _mm512_and_si512(q[c], m4));
        _mm512_store_si512(t.w + ((j * 8 + 4 + c) * Q40_NP + 16 * h) * 4,
                           _mm512_and_si512(_mm512_srli_epi16(q[c], 4), m4));
      }
    }
    for (int n = 0; n < Q40_NP; ++n) std::memcpy(dh + j * Q40_NP + n, rows[n] + off, 2);
  }
  for (int i = 0; i < cb * 2; ++i)
    _mm512_store_ps(t.d + 16 * i, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh + 16 * i))));
}

inline void q40_pin(__m512i& a, __m512i& b) { asm("" : "+v"(a), "+v"(b)); }

// R activation rows (a's rows from r) against the tile (blocks b0, b0 + 7, ..., cb of them: all of one
// slot j = b0 % 7): the two chains of slot j (halves h = 0, 1) of each output, ch: row r's chain 2 j
// (then 2 j + 1, the next row 14 chains on), [32] floats each, read at the start and written back
template <int R>
inline void q40_tile_rows(const Q40Tile& tl, int cb, const Q40Rows& a, int64_t r, int64_t b0, float* ch) {
  // the fields in registers (the stores into ch could alias them: GCC reloaded them each block)
  const int64_t K = a.K, nb = K / 32, ng = a.ng;
  const int8_t* const aq = a.q;
  const float* const adx = a.dx;
  const int32_t* const ac = a.c;
  __m512 acc[R][2][2];  // [row][panel half][block half]
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 2; ++h) acc[i][p][h] = _mm512_load_ps(ch + (i * 14 + h) * Q40_NP + 16 * p);
  for (int j = 0; j < cb; ++j) {
    const int64_t b = b0 + 7 * j;
    __m512i s[R][2][2];  // [row][panel half][block half: values 4 t .. with t even, t odd]
    for (int i = 0; i < R; ++i) {
      s[i][0][0] = s[i][1][0] = _mm512_set1_epi32(ac[((r + i) * ng + b / 7) * 16 + 2 * (b % 7)]);
      s[i][0][1] = s[i][1][1] = _mm512_setzero_si512();
    }
    const uint8_t* wb = tl.w + j * 8 * Q40_NP * 4;
    const int8_t* xb = aq + r * K + 32 * b;
    for (int t = 0; t < 8; ++t) {
      __m512i w0 = _mm512_load_si512(wb + t * Q40_NP * 4), w1 = _mm512_load_si512(wb + t * Q40_NP * 4 + 64);
      q40_pin(w0, w1);
      for (int i = 0; i < R; ++i) {
        int32_t v;
        std::memcpy(&v, xb + i * K + 4 * t, 4);
        const __m512i x = _mm512_set1_epi32(v);
        s[i][0][t & 1] = _mm512_dpbusd_epi32(s[i][0][t & 1], w0, x);
        s[i][1][t & 1] = _mm512_dpbusd_epi32(s[i][1][t & 1], w1, x);
      }
    }
    const __m512 d0 = _mm512_load_ps(tl.d + j * Q40_NP), d1 = _mm512_load_ps(tl.d + j * Q40_NP + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(adx[(r + i) * nb + b]);
      const __m512 dd0 = _mm512_mul_ps(d0, dx), dd1 = _mm512_mul_ps(d1, dx);
      for (int h = 0; h < 2; ++h) {
        acc[i][0][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][0][h]), dd0, acc[i][0][h]);
        acc[i][1][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][1][h]), dd1, acc[i][1][h]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 2; ++h) _mm512_store_ps(ch + (i * 14 + h) * Q40_NP + 16 * p, acc[i][p][h]);
}

// one output row's 14 chains (ch [14][32]) -> its 32 sums, in _mm512_reduce_add_ps's order over the 16
// lanes of q40_dot's accumulator (lanes 14, 15: +0), lanes k0, k1 stored
inline void q40_chains_sum(const float* ch, float* y, __mmask16 k0, __mmask16 k1) {
  for (int h = 0; h < 2; ++h) {
    __m512 L[16];
    for (int l = 0; l < 14; ++l) L[l] = _mm512_load_ps(ch + l * Q40_NP + 16 * h);
    L[14] = L[15] = _mm512_setzero_ps();
    __m512 t3[8], t6[4];
    for (int i = 0; i < 8; ++i) t3[i] = _mm512_add_ps(L[i + 8], L[i]);
    for (int i = 0; i < 4; ++i) t6[i] = _mm512_add_ps(t3[i + 4], t3[i]);
    const __m512 r = _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
    _mm512_mask_storeu_ps(y + 16 * h, h ? k1 : k0, r);
  }
}

// weight rows [0, n) of W (Q4_0, rb bytes each, K values, back to back) against activation rows
// [0, M) of a -> Y[r * ldo + i] for weight row i: panels of 32 rows (the last one's missing rows read
// its last row again, their lanes never stored), a tile of Q40_CB blocks at a time, activation rows 2
// at a time (an odd last one alone) against it, then each output's chains summed (q40_chains_sum).
// While a panel runs, the next one's bytes are brought into L2.
inline void q40_panels(const uint8_t* W, int64_t rb, int64_t n, int64_t M, const Q40Rows& a, float* Y, int64_t ldo) {
  const int64_t nb = a.K / 32;
  Q40Tile tl;
  thread_local std::vector<__m512> chains;  // [M][14][32] floats
  if (static_cast<int64_t>(chains.size()) < M * 14 * 2) chains.resize(M * 14 * 2);
  float* const ch = reinterpret_cast<float*>(chains.data());
  for (int64_t p0 = 0; p0 < n; p0 += Q40_NP) {
    std::memset(ch, 0, M * 14 * Q40_NP * sizeof(float));
    const int nr = static_cast<int>(std::min<int64_t>(Q40_NP, n - p0));
    const uint8_t* const w = W + p0 * rb;
    const __mmask16 k0 = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
    const __mmask16 k1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : static_cast<__mmask16>((1u << (nr - 16)) - 1);
    const uint8_t* rows[Q40_NP];
    for (int i = 0; i < Q40_NP; ++i) rows[i] = w + std::min(i, nr - 1) * rb;
    // the next panel's lines (at most 32 rows; none past the n rows), spread over this panel's tiles
    const char* const next = reinterpret_cast<const char*>(w + nr * rb);
    const int64_t lines = p0 + nr < n ? (std::min<int64_t>(Q40_NP, n - p0 - nr) * rb) / 64 : 0;
    // slot by slot (blocks j, j + 7, ...: the chains 2 j, 2 j + 1), Q40_CB of the slot's blocks a tile
    int64_t tiles = 0;
    for (int64_t j = 0; j < 7 && j < nb; ++j) tiles += ((nb - j + 6) / 7 + Q40_CB - 1) / Q40_CB;
    int64_t ti = 0;
    for (int64_t j = 0; j < 7 && j < nb; ++j) {
      const int64_t nj = (nb - j + 6) / 7;
      for (int64_t g0 = 0; g0 < nj; g0 += Q40_CB, ++ti) {
        const int cb = static_cast<int>(std::min<int64_t>(Q40_CB, nj - g0));
        for (int64_t l = ti * lines / tiles; l < (ti + 1) * lines / tiles; ++l)
          _mm_prefetch(next + 64 * l, _MM_HINT_T1);
        const int64_t b0 = j + 7 * g0;
        q40_tile_build(rows, b0, 7, cb, tl);
        float* const cj = ch + 2 * j * Q40_NP;
        int64_t r = 0;
        for (; r + 2 <= M; r += 2) q40_tile_rows<2>(tl, cb, a, r, b0, cj + r * 14 * Q40_NP);
        if (r < M) q40_tile_rows<1>(tl, cb, a, r, b0, cj + r * 14 * Q40_NP);
      }
    }
    for (int64_t r = 0; r < M; ++r) q40_chains_sum(ch + r * 14 * Q40_NP, Y + r * ldo + p0, k0, k1);
  }
}
#endif

}  // namespace kvserve_q4
