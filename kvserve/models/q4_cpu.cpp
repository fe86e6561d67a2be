// kvserve native CPU kernel: y = x @ W.T for 4-bit GGUF weights (Q4_0 / Q4_1 blocks of 32)
// and a few activation rows, on x86-64 with AVX512-VNNI. Built at run time by
// kvserve/models/q4_kernel.py (``kvserve serve --compile``) and registered as the torch op
// ``kvserve::q4_mm``.
//
// Weights: per output row, pairs of blocks (64 weights) in 32 bytes. Unpacking a pair gives
// 64 values u (low nibbles = u[0:32], high nibbles = u[32:64]); u[p] is weight idx of block
// blk with lane = p / 4, blk = lane % 2, idx = 4 * (lane / 2) + p % 4, so each 32-bit lane of
// the VNNI dot product covers 4 weights of one block, blocks alternating lane by lane.
// Weight w = q * d + m (q = 0..15, d and m float16 per block; Q4_0: m = -8 d).
//
// Activations are quantized per block of 32 to int8 with a float scale (llama.cpp's Q8_1
// scheme for its Q4_1 dot product), stored in the same pair order. Per block:
//   sum_j w_j x_j ~= d * dx * sum_j q_j xq_j + m * (dx * sum_j xq_j)
// with the integer dot product from vpdpbusd (u8 x s8, int32 lanes).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>

namespace {

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, float* xsum) {
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
  __m512 acc[MR], accm[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    accm[r] = _mm512_setzero_ps();
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t pr = 0; pr < P; ++pr) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + pr * 32));
    const __m256i lo = _mm256_and_si256(b, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    int32_t dpair, mpair;
    std::memcpy(&dpair, drow + 2 * pr, 4);
    std::memcpy(&mpair, mrow + 2 * pr, 4);
    const __m512 dw = _mm512_cvtph_ps(_mm256_set1_epi32(dpair));  // d0 d1 d0 d1 ...
    const __m512 mw = _mm512_cvtph_ps(_mm256_set1_epi32(mpair));
    for (int r = 0; r < MR; ++r) {
      double xspair, xmpair;
      std::memcpy(&xspair, xs + r * G + 2 * pr, 8);
      std::memcpy(&xmpair, xsum + r * G + 2 * pr, 8);
      const __m512i a = _mm512_loadu_si512(xq + r * K + pr * 64);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
      const __m512 xsp = _mm512_castpd_ps(_mm512_set1_pd(xspair));  // dx0 dx1 dx0 dx1 ...
      const __m512 xmp = _mm512_castpd_ps(_mm512_set1_pd(xmpair));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xsp), acc[r]);
      accm[r] = _mm512_fmadd_ps(mw, xmp, accm[r]);
    }
  }
  // every block's m term sits in 8 lanes
  for (int r = 0; r < MR; ++r) out[r * ldo] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(accm[r]) * 0.125f;
}

// x [M, K] float32 contiguous, wq [N, K/2] uint8, wd/wm [N, K/32] float16 -> [M, N] float32
at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wd, const at::Tensor& wm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_mm: x must be a 2-D float32 tensor");
  TORCH_CHECK(wq.scalar_type() == at::kByte && wd.scalar_type() == at::kHalf && wm.scalar_type() == at::kHalf,
              "q4_mm: weights must be uint8 / float16 / float16");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wq.size(0), G = K / 32;
  TORCH_CHECK(K % 64 == 0 && wq.size(1) == K / 2 && wd.size(0) == N && wd.size(1) == G && wm.size(0) == N &&
              wm.size(1) == G && wq.is_contiguous() && wd.is_contiguous() && wm.is_contiguous(),
              "q4_mm: shape mismatch");
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  at::Tensor xq = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor xs = at::empty({M, G}, xc.options());
  at::Tensor xsum = at::empty({M, G}, xc.options());
  quantize_rows(xc.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
  const uint8_t* W = wq.data_ptr<uint8_t>();
  const uint16_t* D = reinterpret_cast<const uint16_t*>(wd.data_ptr<at::Half>());
  const uint16_t* Mn = reinterpret_cast<const uint16_t*>(wm.data_ptr<at::Half>());
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* XS = xs.data_ptr<float>();
  const float* XM = xsum.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // rows are computed in groups of 4 and the result of a row does not depend on its group
  // (the same operations in the same order), so a sequence's logits do not depend on what
  // else runs in its step
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
  return y;
}

}  // namespace

TORCH_LIBRARY(kvserve, m) { m.def("q4_mm(Tensor x, Tensor wq, Tensor wd, Tensor wm) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("q4_mm", &q4_mm); }
