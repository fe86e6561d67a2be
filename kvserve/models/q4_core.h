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

}  // namespace kvserve_q4
