// The activations' quantization, llama.cpp's q8_0 and q8_K: one implementation for every product of
// ggml_cpu.cpp (the per-row kernels, Matrix::mm_raw and the ``quantize`` test hook) and for the int8
// prefill path (ggml_gemm8.h), in both builds (AVX2 + F16C vectors: the AVX512 build runs the same
// instructions, VEX-encoded). Optional outputs (nullptr: not computed) give each caller the sums it
// needs without a second pass over the row.
//
// Arithmetic: the scalar reference's float operations (tests/unit/test_ggml_kernel.py emulates it in
// numpy): max|x| is exact, x * (127 / max) one float product per value, vcvtps2dq rounds half to even
// as nearbyint does (default rounding mode); the sums are exact integer sums of the int8 values. At
// one row it runs on one thread before every product: the scalar loops took ~0.6 ms of a Llama-1B
// token (230k values).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvserve_q8 {

// float32 -> the nearest float16 value (round half to even), as a float32
inline float round_f16(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 32 int32 (4 vectors, each |v| <= 127) -> 32 int8 in order
inline void store_i8x32(int8_t* q, const __m256i* i) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// q8_0 (llama.cpp's AVX quantize_row_q8_0): x float [K] (K a multiple of 32) -> q int8 [K], per block of
// 32 d = float16(max|x| / 127) [K/32] and q = round half to even (x * 127 / max|x|); optional:
// s [K/32] = float16(max|x| / 127 * sum(q)) (llama.cpp's q8_1 s, for Q4_1 / Q5_1), sum int32 [K/32]
// = sum(q) (the int8 prefill path's offset corrections)
inline void quantize_q8_0_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* sum = nullptr) {
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xb + 8 * c);
      m = _mm256_max_ps(m, _mm256_and_ps(v[c], absm));
    }
    const float amax = hmax256(m);
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    __m256i iv[4];
    for (int c = 0; c < 4; ++c) iv[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(id)));
    const int sm = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3])));
    store_i8x32(q + b * 32, iv);
    d[b] = round_f16(amax / 127.f);
    if (s) s[b] = round_f16(amax / 127.f * static_cast<float>(sm));
    if (sum) sum[b] = sm;
  }
}

// q8_K (llama.cpp's quantize_row_q8_K): x float [K] (K a multiple of 256) -> per super-block of 256 the
// first value of largest magnitude `max`, q int8 [K] = min(127, round half to even (-127 / max * x)),
// d float32 [K/256] = 1 / (-127 / max), bs int16 [K/16] the sums of every 16 q (bsums); optional:
// bsp int16 [K/32], the sums of every 32 q (Q4_K / Q5_K's mins in the int8 prefill path)
inline void quantize_q8_K_row(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs, int16_t* bsp = nullptr) {
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + b * 256;
    __m256 m = _mm256_setzero_ps();
    for (int c = 0; c < 32; ++c) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * c), absm));
    const float amax = hmax256(m);
    int8_t* qb = q + b * 256;
    if (amax == 0.f) {
      std::memset(qb, 0, 256);
      std::memset(bs + b * 16, 0, 32);
      if (bsp) std::memset(bsp + b * 8, 0, 16);
      d[b] = 0.f;
      continue;
    }
    // the first value of that magnitude (llama.cpp's scan keeps the first maximum)
    float mx = 0.f;
    for (int c = 0; c < 32; ++c) {
      const __m256 xv = _mm256_loadu_ps(xb + 8 * c);
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(xv, absm), _mm256_set1_ps(amax), _CMP_EQ_OQ));
      if (hit) {
        mx = xb[8 * c + __builtin_ctz(static_cast<unsigned>(hit))];
        break;
      }
    }
    const float iscale = -127.f / mx;
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (int g = 0; g < 8; ++g) {  // 32 values: two groups of 16
      __m256i iv[4];
      for (int c = 0; c < 4; ++c)
        iv[c] = _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(xb + 32 * g + 8 * c))));
      store_i8x32(qb + 32 * g, iv);
      const int s0 = hsum_epi32(_mm256_add_epi32(iv[0], iv[1])), s1 = hsum_epi32(_mm256_add_epi32(iv[2], iv[3]));
      bs[b * 16 + 2 * g] = static_cast<int16_t>(s0);
      bs[b * 16 + 2 * g + 1] = static_cast<int16_t>(s1);
      if (bsp) bsp[b * 8 + g] = static_cast<int16_t>(s0 + s1);
    }
    d[b] = 1.f / iscale;
  }
}

}  // namespace kvserve_q8
