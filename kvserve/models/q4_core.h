// kvserve's 4-bit x int8 VNNI dot products (see q4_cpu.cpp for the weight layout), shared by
// the q4_mm op (q4_cpu.cpp) and the native decode step (decode_cpu.cpp).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>

namespace kvserve_q4 {

inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, float* xsum) {
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


// y [M, N] = x [M, K] (float32, contiguous) @ W.T; scratch: xq [M * K] int8, xs, xsum [M * K / 32].
// A row's result does not depend on M or on the other rows (groups of 4, the same operations).
inline void q4_mm_raw(const float* x, int64_t M, int64_t K, const uint8_t* W, const uint16_t* D, const uint16_t* Mn,
                      int64_t N, float* Y, int8_t* XQ, float* XS, float* XM) {
  const int64_t G = K / 32;
  quantize_rows(x, M, K, XQ, XS, XM);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = W + n * (K / 2);
      const uint16_t* drow = D + n * G;
      const uint16_t* mrow = Mn + n * G;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4)
        rows_dot<4>(wrow, drow, mrow, K, XQ + r * K, XS + r * G, XM + r * G, Y + r * N + n, N);
      switch (M - r) {
        case 3: rows_dot<3>(wrow, drow, mrow, K, XQ + r * K, XS + r * G, XM + r * G, Y + r * N + n, N); break;
        case 2: rows_dot<2>(wrow, drow, mrow, K, XQ + r * K, XS + r * G, XM + r * G, Y + r * N + n, N); break;
        case 1: rows_dot<1>(wrow, drow, mrow, K, XQ + r * K, XS + r * G, XM + r * G, Y + r * N + n, N); break;
        default: break;
      }
    }
  });
}

}  // namespace kvserve_q4
