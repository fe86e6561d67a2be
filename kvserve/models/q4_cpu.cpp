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
#include "q4_core.h"

namespace {

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
  kvserve_q4::q4_mm_raw(xc.data_ptr<float>(), M, K, wq.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(wd.data_ptr<at::Half>()),
                        reinterpret_cast<const uint16_t*>(wm.data_ptr<at::Half>()), N, y.data_ptr<float>(),
                        xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(kvserve, m) { m.def("q4_mm(Tensor x, Tensor wq, Tensor wd, Tensor wm) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("q4_mm", &q4_mm); }
