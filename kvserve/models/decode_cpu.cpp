// kvserve's native decode step (CPU, x86-64 with AVX512-VNNI or AVX2 + FMA + F16C): one call runs every layer of a llama-family
// model for B single-token queries over the paged KV cache. Built at run time by
// kvserve/models/decode_native.py (torch's C++ extension tooling, in a background process) and
// used by ModelRunner for decode-only steps once built.
//
// Per layer, for the B rows: RMSNorm, the fused q|k|v projection (4-bit weights x int8 activations,
// q4_core.h), RoPE on interleaved pairs, the K/V write into the cache rows (rounded to the cache's
// float type), attention of each query head over its sequence's cache rows, the output projection
// and residual, RMSNorm, gate|up, SwiGLU, down and residual. The caller applies the output norm and
// head. Every row is computed with the same operations in the same order whatever the other rows of
// the step are (no reduction crosses rows), so a sequence's logits do not depend on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <unordered_map>
#include <memory>
#include <type_traits>
#include <vector>
#include <sys/mman.h>
#include <cstdlib>
#include <cstring>
#include "ggml_cpu.h"
#include "q4_core.h"
#include "thread_pool.h"

namespace {

struct PoolFor {  // kvserve_pool::parallel_for as a callable (q4_core.h's q4_mm_raw)
  template <typename F>
  void operator()(int64_t b, int64_t e, int64_t grain, const F& f) const { kvserve_pool::parallel_for(b, e, grain, f); }
};

// The vector layer: 16 float lanes (AVX512) or 8 (AVX2 + FMA + F16C), picked by q4_core.h from
// the compiler's target (-march=native). The same operations in the same order per row either way.
#ifdef KVSERVE_AVX512
using vf = __m512;
constexpr int64_t W = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vld(const float* p) { return _mm512_loadu_ps(p); }
inline void vst(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }

inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
// lane bits: a == b (ordered: false where either is NaN), and lanes holding a NaN
inline unsigned veq_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline unsigned vnan_mask(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
// exp's range reduction: x clamped to [-103.9, 88.72], n = round(x / ln 2); 2^n by vscalefps
inline vf exp_clamp(vf x) { return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.9f)), _mm512_set1_ps(88.72f)); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2n(vf y, vf n) { return _mm512_scalef_ps(y, n); }

// W cache values as float32
template <typename T> inline vf vload(const T* p);
template <> inline vf vload<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline vf vload<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <> inline vf vload<c10::BFloat16>(const c10::BFloat16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

// p[0:k] = e^(p[0:k] - mx) for the last k < W scores; returns their sum as a vector (0 elsewhere)
inline vf vexp(vf x);  // below, shared by both builds
inline vf exp_tail(float* p, int64_t k, vf mv) {
  const __mmask16 mk = static_cast<__mmask16>((1u << k) - 1);
  const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, p), mv));
  _mm512_mask_storeu_ps(p, mk, e);
  return _mm512_maskz_mov_ps(mk, e);
}
#else
using vf = __m256;
constexpr int64_t W = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vld(const float* p) { return _mm256_loadu_ps(p); }
inline void vst(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(vf v) { return kvserve_q4::hsum256(v); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float hmax(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
// lane bits: a == b (ordered: false where either is NaN), and lanes holding a NaN
inline unsigned veq_mask(vf a, vf b) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ))); }
inline unsigned vnan_mask(vf a) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q))); }
// 2^n built in the exponent bits, so x is clamped to [-87, 88] (normal results)
inline vf exp_clamp(vf x) { return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f)); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2n(vf y, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

template <typename T> inline vf vload(const T* p);
template <> inline vf vload<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline vf vload<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <> inline vf vload<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

inline vf vexp(vf x);  // below, shared by both builds
inline vf exp_tail(float* p, int64_t k, vf mv) {
  alignas(32) float buf[8];
  for (int64_t i = 0; i < 8; ++i) buf[i] = i < k ? p[i] : 0.f;
  const __m256 e = vexp(_mm256_sub_ps(_mm256_load_ps(buf), mv));
  _mm256_store_ps(buf, e);
  for (int64_t i = 0; i < 8; ++i) {
    if (i < k) p[i] = buf[i];
    else buf[i] = 0.f;
  }
  return _mm256_load_ps(buf);
}
#endif

// v, kept in a register: the compiler otherwise folds a load that several FMAs share into each of
// them as a memory operand (one load per FMA: attention's loops were bound by loads, not FMAs)
inline vf in_reg(vf v) {
  asm("" : "+v"(v));
  return v;
}

// r[0..W-1] (W rows of W floats) transposed in place: r[i] lane j = the old r[j] lane i. Attention
// stores a chunk's keys this way (W keys side by side per dimension), so a score is one FMA chain
// over the dimensions and needs no horizontal sum.
#ifdef KVSERVE_AVX512
inline void transpose_w(vf* r) {
  __m512 a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  // b[4 k + c], 128-bit lane l: rows 4 k .. 4 k + 3 of column 4 l + c
  for (int k = 0; k < 4; ++k) {
    const __m512d a0 = _mm512_castps_pd(a[4 * k]), a1 = _mm512_castps_pd(a[4 * k + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * k + 2]), a3 = _mm512_castps_pd(a[4 * k + 3]);
    b[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 e0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x88), e1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xDD);
    const __m512 e2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x88), e3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(e0, e2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(e1, e3, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(e0, e2, 0xDD);
    r[12 + c] = _mm512_shuffle_f32x4(e1, e3, 0xDD);
  }
}
#else
inline void transpose_w(vf* r) {
  __m256 a[8], b[8];
  for (int k = 0; k < 4; ++k) {
    a[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    const __m256d a0 = _mm256_castps_pd(a[4 * k]), a1 = _mm256_castps_pd(a[4 * k + 1]);
    const __m256d a2 = _mm256_castps_pd(a[4 * k + 2]), a3 = _mm256_castps_pd(a[4 * k + 3]);
    b[4 * k] = _mm256_castpd_ps(_mm256_unpacklo_pd(a0, a2));
    b[4 * k + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a0, a2));
    b[4 * k + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(a1, a3));
    b[4 * k + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(a1, a3));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x31);
  }
}
#endif

// e^x, Cephes' single-precision polynomial (relative error ~2e-7), scaled by 2^n (vscale2n)
inline vf vexp(vf x) {
  x = exp_clamp(x);
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  vf y = vset1(1.9875691500e-4f);
  y = vfma(y, r, vset1(1.3981999507e-3f));
  y = vfma(y, r, vset1(8.3334519073e-3f));
  y = vfma(y, r, vset1(4.1665795894e-2f));
  y = vfma(y, r, vset1(1.6666665459e-1f));
  y = vfma(y, r, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), vadd(r, vset1(1.f)));
  return vscale2n(y, n);
}

// x [n] -> out [n] = x * rsqrt(mean(x^2) + eps) * w  (n a multiple of 16)
inline void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  vf acc = vzero();
  for (int64_t i = 0; i < n; i += W) {
    const vf v = vld(x + i);
    acc = vfma(v, v, acc);
  }
  const float r = 1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
  const vf rv = vset1(r);
  for (int64_t i = 0; i < n; i += W) vst(out + i, vmul(vmul(vld(x + i), rv), vld(w + i)));
}

// The output head: int8 weights per block of 32 (GGUF Q8_0's form, w = d * q), stored in the q4
// kernel's pair order (each 32-bit lane 4 weights of one block, blocks alternating lane by lane)
// and offset to unsigned (q + 128); activations quantized per block of 32 as for the q4 kernel.
#ifdef KVSERVE_AVX512
// The AVX512 build's tile layout (LAYOUT "tile16"; decode_native.py packs the weights in it, from
// the pair order with q4_kernel.to_tiles). Output rows go in tiles of 16, lane i of every 64-byte
// weight vector belonging to row 16 T + i of tile T, and each vpdpbusd takes 4 activation bytes
// broadcast to all lanes ({1to16}: a load, not an ALU operation). So the int32 lanes hold the
// 16 rows' dot products of one block of 32 (exact), one conversion, scale product and FMA per block
// serve 16 rows, the 16 lanes are stored as they are (no horizontal sums) and K need not be a
// multiple of 512. The weights of a tile are unpacked once for every MR activation rows. On the
// 2-core Xeon this did 2x the multiply-adds per cycle of the earlier group layout (which summed
// blocks within a row's lanes: a tail of pairs and a tree of shuffles per output).
//   tile T = bytes [T 16 (K / 2), (T + 1) 16 (K / 2)) (4-bit) or [T 16 K, (T + 1) 16 K) (int8);
//   block b of the tile at 256 b (4-bit) or 512 b (int8), in it vector t at 64 t, lane i (4 bytes):
//     4-bit: low nibbles values 4 t .. 4 t + 3 of row 16 T + i's block b, high nibbles values
//       16 + 4 t .. 16 + 4 t + 3 (t = 0..3);
//     int8: values 4 t .. 4 t + 3 (t = 0..7), plus 128;
//   scales d (and m) [T][G][16]: block b of row 16 T + i at (T G + b) 16 + i.
// The activations stay in the pair order (quantize_rows): values 4 t .. 4 t + 3 of block b are
// its pair's 32-bit word 2 t + b % 2, word (b / 2) 16 + 2 t + b % 2 of the row.
// Every output is computed with the same operations in the same order whatever M, the row block
// or the tile's other rows are (batch invariance).
constexpr const char* LAYOUT = "tile16";
constexpr int64_t ROW_MULTIPLE = 16;  // the head's rows are packed up to a multiple of this (whole tiles)
// the weights stream from memory (each thread's tiles are contiguous): a software prefetch this far
// ahead of the block being read. A one-row pass over 53 MB of 4-bit weights (2 threads, harness):
// 20 GB/s without, 24-25 with 1-2 KiB, 27-28.5 with 4 KiB, 25-29 with 8 KiB; 8 rows 5.0 -> 3.8-4.0 ms
constexpr int64_t PREFETCH = 4096;

// 4 activation bytes as one 32-bit word in every lane (memcpy: the bytes are int8_t storage)
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MR activation rows (xq: int8 in the pair order, row stride xstride bytes) against tile
// wt of 4-bit weights: out[r] lane i = row 16 T + i's dot product with activation row r
template <int MR>
inline void q4_tile(const uint8_t* wt, const uint16_t* dt, const uint16_t* mt, int64_t G, const int8_t* xq,
                    int64_t xstride, const float* xs, const float* xsum, __m512* out) {
  __m512 acc[MR], accm[MR];
  for (int r = 0; r < MR; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < G; ++b) {
    const uint8_t* w = wt + b * 256;
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 64 * c), _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(w + 64 * t);
      lo[t] = _mm512_and_si512(v, low4);
      hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const int8_t* xb = xq + 64 * (b / 2) + 4 * (b % 2);  // word 2 t + b % 2 of the pair at 8 t
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + 16 * b)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mt + 16 * b)));
    for (int r = 0; r < MR; ++r) {
      const int8_t* xr = xb + r * xstride;
      __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        ia = _mm512_dpbusd_epi32(ia, lo[t], bcast4(xr + 8 * t));
        ib = _mm512_dpbusd_epi32(ib, hi[t], bcast4(xr + 8 * t + 32));
      }
      // w = q d + m: d dx sum(q xq) + m (dx sum(xq)), the m terms in their own sum
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)),
                               _mm512_mul_ps(dw, _mm512_set1_ps(xs[r * G + b])), acc[r]);
      accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[r * G + b]), accm[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = _mm512_add_ps(acc[r], accm[r]);
}

// the head's int8 tile (values + 128): per block the dot product minus 128 sum(xq) (cs), then d dx
template <int MR>
inline void q8_tile(const uint8_t* wt, const uint16_t* dt, int64_t G, const int8_t* xq, int64_t xstride,
                    const float* xs, const int32_t* cs, __m512* out) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < G; ++b) {
    const uint8_t* w = wt + b * 512;
    for (int c = 0; c < 8; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + 64 * c), _MM_HINT_T0);
    __m512i wv[8];
    for (int t = 0; t < 8; ++t) wv[t] = _mm512_loadu_si512(w + 64 * t);
    const int8_t* xb = xq + 64 * (b / 2) + 4 * (b % 2);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + 16 * b)));
    for (int r = 0; r < MR; ++r) {
      const int8_t* xr = xb + r * xstride;
      __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        ia = _mm512_dpbusd_epi32(ia, wv[t], bcast4(xr + 8 * t));
        ib = _mm512_dpbusd_epi32(ib, wv[t + 1], bcast4(xr + 8 * t + 8));
      }
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(ia, ib), _mm512_set1_epi32(cs[r * G + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(xs[r * G + b])), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = acc[r];
}

// row blocks of 8, then one of 4, 3, 2 or 1 (the tile kernels' MR)
template <typename F>
inline void for_row_blocks8(int64_t M, const F& f) {
  int64_t r = 0;
  for (; r + 8 <= M; r += 8) f(std::integral_constant<int, 8>{}, r);
  if (r + 4 <= M) {
    f(std::integral_constant<int, 4>{}, r);
    r += 4;
  }
  switch (M - r) {
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// the tiles [t0, t1) of Y [M, N] (row stride N, N up to a multiple of 16: the last tile's missing
// outputs are not stored): tile(T, mr, r, out) leaves rows r .. r + MR - 1's 16 outputs in out
template <typename Tile>
inline void store_tiles(int64_t t0, int64_t t1, int64_t M, int64_t N, float* Y, const Tile& tile) {
  for (int64_t T = t0; T < t1; ++T) {
    const int64_t nn = std::min<int64_t>(16, N - 16 * T);
    const __mmask16 mk = static_cast<__mmask16>((1u << nn) - 1u);
    for_row_blocks8(M, [&](auto mr, int64_t r) {
      constexpr int MR = decltype(mr)::value;
      __m512 o[MR];
      tile(T, mr, r, o);
      for (int q = 0; q < MR; ++q) _mm512_mask_storeu_ps(Y + (r + q) * N + 16 * T, mk, o[q]);
    });
  }
}

// y [M, N] = x [M, K] float32 @ W.T, W 4-bit in tiles (N up to a multiple of 16 rows packed);
// scratch xq [M * K] int8, xs, xsum [M * K / 32] float32
inline void q4_mm_t(const float* x, int64_t M, int64_t K, const uint8_t* W, const uint16_t* D, const uint16_t* Mn,
                    int64_t N, float* Y, int8_t* XQ, float* XS, float* XM) {
  const int64_t G = K / 32;
  kvserve_q4::quantize_rows(x, M, K, XQ, XS, XM);
  kvserve_pool::parallel_for(0, (N + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
    store_tiles(t0, t1, M, N, Y, [&](int64_t T, auto mr, int64_t r, __m512* o) {
      q4_tile<decltype(mr)::value>(W + T * 16 * (K / 2), D + T * 16 * G, Mn + T * 16 * G, G, XQ + r * K, K,
                                   XS + r * G, XM + r * G, o);
    });
  });
}

// y [M, N] = x [M, K] @ head.T with the q8 weights in tiles (see above)
void q8_mm(const float* x, int64_t M, int64_t K, const uint8_t* W, const uint16_t* D, int64_t N, float* Y) {
  const int64_t G = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * G), xm(M * G);
  kvserve_q4::quantize_rows(x, M, K, xq.data(), xs.data(), xm.data());
  std::vector<int32_t> cs(M * G);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {  // block g: the words g % 2, g % 2 + 2, ... of pair g / 2
      const int8_t* pb = xq.data() + r * K + (g / 2) * 64 + 4 * (g % 2);
      int32_t sum = 0;
      for (int w = 0; w < 8; ++w)
        for (int b = 0; b < 4; ++b) sum += pb[8 * w + b];
      cs[r * G + g] = 128 * sum;
    }
  kvserve_pool::parallel_for(0, (N + 15) / 16, 4, [&](int64_t t0, int64_t t1) {
    store_tiles(t0, t1, M, N, Y, [&](int64_t T, auto mr, int64_t r, __m512* o) {
      q8_tile<decltype(mr)::value>(W + T * 16 * K, D + T * 16 * G, G, xq.data() + r * K, K, xs.data() + r * G,
                                   cs.data() + r * G, o);
    });
  });
}
#else
constexpr const char* LAYOUT = "pair";  // the AVX2 build keeps the pair order everywhere
constexpr int64_t ROW_MULTIPLE = 1;

// Per pair of blocks (vpmaddubsw, u8 x s8, on |q| and xq * sign(q): |127 * 127 * 2| fits int16),
// the two halves summed in int32: exact.
template <int MR>
inline void q8_rows_dot(const uint8_t* wrow, const uint16_t* drow, int64_t K, const int8_t* xq, const float* xs,
                        float* out, int64_t ldo) {
  const int64_t P = K / 64, G = K / 32;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i k128 = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t pr = 0; pr < P; ++pr) {
    _mm_prefetch(reinterpret_cast<const char*>(wrow + pr * 64 + 4096), _MM_HINT_T0);  // streams from memory
    const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + pr * 64)), k128);
    const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + pr * 64 + 32)), k128);
    const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
    int32_t dpair;
    std::memcpy(&dpair, drow + 2 * pr, 4);
    const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi32(dpair));  // d0 d1 d0 d1 ...
    for (int r = 0; r < MR; ++r) {
      const int8_t* a = xq + r * K + pr * 64;
      const __m256i a0 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), w0);
      const __m256i a1 = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)), w1);
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u0, a0), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(u1, a1), ones));
      double xspair;
      std::memcpy(&xspair, xs + r * G + 2 * pr, 8);
      const __m256 xsp = _mm256_castpd_ps(_mm256_set1_pd(xspair));  // dx0 dx1 dx0 dx1 ...
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, xsp), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(acc[r]);
}

void q8_mm(const float* x, int64_t M, int64_t K, const uint8_t* W, const uint16_t* D, int64_t N, float* Y) {
  const int64_t G = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * G), xm(M * G);
  kvserve_q4::quantize_rows(x, M, K, xq.data(), xs.data(), xm.data());
  const int8_t* XQ = xq.data();
  const float* XS = xs.data();
  kvserve_pool::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = W + n * K;
      const uint16_t* drow = D + n * G;
      kvserve_q4::for_row_blocks(M, [&](auto mr, int64_t r) {
        q8_rows_dot<decltype(mr)::value>(wrow, drow, K, XQ + r * K, XS + r * G, Y + r * N + n, N);
      });
    }
  });
}
#endif

// One projection of the step: 4-bit weights in the step's own layout (q, d, m: Q4_0/Q4_1 packed by
// decode_native.py) or a matrix of the GGUF file's blocks (mat: ggml_cpu.cpp's per-type products).
struct Proj {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int64_t n, k;
  const float* bias;  // [n] or null
  const kvserve_ggml::Matrix* mat;  // or null
};

// A mixture-of-experts FFN (qwen3moe; kvserve/models/moe.py): a float32 router [n_expert, E], softmax
// over the experts, the top_k chosen (their weights renormalised to sum 1 where norm), each chosen
// expert's SiLU-gated MLP on the GGUF file's blocks (gate|up [2 F, E] and down [E, F] per expert).
struct Moe {
  const float* router = nullptr;
  int64_t n_expert = 0, top_k = 0, F = 0;
  bool norm = true;
  std::vector<const kvserve_ggml::Matrix*> gate_up, down;
};

struct Layer {
  const float* attn_norm;
  const float* ffn_norm;
  Proj qkv, wo, gate_up, down;
  bool dense_ffn = true;  // false: the FFN is moe (set_moe)
  const float* q_norm = nullptr;  // qwen3's per-head RMSNorm of q and k before RoPE ([head_dim], or null)
  const float* k_norm = nullptr;
  std::unique_ptr<Moe> moe;
};

// LoRA (kvserve/lora/apply.py): one adapter's delta on one projection of one layer. a [R, k] float32 holds
// the A of every fused part it targets (q|k|v, gate|up), stacked; each part adds, to its output columns
// [out0, out0 + n_out), B^T times its rank slice [r0, r1) of (a x) * scale, B^T [r1 - r0, n_out] float32
// (B transposed, the module scale folded in) stored in column panels of LORA_PW columns: panel p (columns
// [p PW, p PW + w), w = min(PW, n_out - p PW)) at bt + p PW (r1 - r0), row-major [r1 - r0, w], so the
// expand reads each part front to back (punica's shrink, then expand). A and B^T are stored in the adapter's
// dtype (vLLM's --lora-dtype: float32, bfloat16 or float16; `dt`), read as float32 vectors (vload), so a
// narrow adapter is half the bytes per step; the arithmetic stays float32
constexpr int64_t LORA_PW = 4 * W;
struct LoraPart {
  int64_t out0, n_out, r0, r1;
  const void* bt;  // elements of the projection's dt
};
struct LoraProj {
  const void* a = nullptr;  // null: the adapter leaves this projection alone
  int64_t R = 0, k = 0;
  at::ScalarType dt = at::kFloat;  // kFloat, kBFloat16 or kHalf: A's and every B^T's
  std::vector<LoraPart> parts;
};
// where an adapter's A and B live: 2 MiB-aligned chunks (transparent huge pages where the kernel
// gives them, MADV_HUGEPAGE), filled in registration order (layer by layer, qkv, wo, gate_up, down: the
// order a step reads them), so a step streams each adapter's weights front to back
struct LoraArena {
  // Chunks grow geometrically from kFirst to kChunk bytes (a larger piece gets a chunk of its own size), so
  // a small adapter costs about its size; chunks of 2 MiB and more are 2 MiB-aligned and advised as huge pages.
  static constexpr size_t kFirst = size_t(64) << 10;
  static constexpr size_t kChunk = size_t(4) << 20;
  static constexpr size_t kHuge = size_t(2) << 20;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<float, Free>> chunks;
  size_t used = 0, cap = 0;  // floats used of / in the last chunk
  size_t bytes = 0;          // allocated in all
  float* take(size_t n) {  // n floats, 64-byte aligned
    n = (n + 15) & ~size_t(15);
    if (chunks.empty() || used + n > cap) {
      const size_t step = std::min(kChunk, std::max(kFirst, bytes));  // doubles the arena, up to kChunk
      const size_t sz = std::max(step, (n * sizeof(float) + step - 1) / step * step);
      const bool huge = sz >= kHuge && sz % kHuge == 0;
      float* p = static_cast<float*>(std::aligned_alloc(huge ? kHuge : size_t(64), sz));
      TORCH_CHECK(p != nullptr, "decode_cpu: out of memory for a LoRA adapter");
#ifdef MADV_HUGEPAGE
      if (huge) madvise(p, sz, MADV_HUGEPAGE);
#endif
      chunks.emplace_back(p);
      used = 0;
      cap = sz / sizeof(float);
      bytes += sz;
    }
    float* p = chunks.back().get() + used;
    used += n;
    return p;
  }
};
// one adapter: per layer, its deltas on qkv, wo, gate_up, down (in that order)
struct LoraAdapter {
  std::vector<std::array<LoraProj, 4>> layers;
  LoraArena arena;  // owns what the raw pointers read
};

void set_bias(Proj& p, const at::Tensor& bias) {
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == p.n, "decode_cpu: bad bias");
    p.bias = bias.data_ptr<float>();
  }
}

Proj proj_of(const std::vector<at::Tensor>& t, size_t i, const at::Tensor& bias, const kvserve_ggml::Matrix* mat = nullptr) {
  if (mat != nullptr) {
    Proj p{nullptr, nullptr, nullptr, mat->rows(), mat->cols(), nullptr, mat};
    set_bias(p, bias);
    return p;
  }
  const at::Tensor& q = t[i];
  const at::Tensor& d = t[i + 1];
  const at::Tensor& m = t[i + 2];
  TORCH_CHECK(q.scalar_type() == at::kByte && d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf &&
                  q.is_contiguous() && d.is_contiguous() && m.is_contiguous() && q.size(1) % 32 == 0,
              "decode_cpu: bad packed weights");
  Proj p{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
         reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), q.size(0), q.size(1) * 2, nullptr, nullptr};
  TORCH_CHECK(d.size(0) == p.n && d.size(1) == p.k / 32, "decode_cpu: bad scales");
  set_bias(p, bias);
  return p;
}

// attention's per (query, chunk) pieces: max score, sum of e^(score - max), unnormalized output [D]
struct Pieces {
  std::vector<float> m, s, o;
};

class Decoder {
 public:
  // layers: per layer [attn_norm, ffn_norm, qkv q/d/m, wo q/d/m, gate_up q/d/m, down q/d/m, qkv bias (may be empty)];
  // mats: per layer the four projections' GGUF block matrices (qkv, wo, gate_up, down; None where the
  // projection is given as q/d/m, whose tensors are ignored (may be empty) where a matrix is given).
  // The matrices are owned by the caller and must outlive the decoder.
  Decoder(std::vector<std::vector<at::Tensor>> layers, std::vector<std::vector<kvserve_ggml::Matrix*>> mats,
          int64_t n_head, int64_t n_head_kv, int64_t head_dim, double eps)
      : keep_(std::move(layers)), nh_(n_head), nkv_(n_head_kv), hd_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(hd_ % 32 == 0 && nh_ % nkv_ == 0, "decode_cpu: head_dim must be a multiple of 32");
    TORCH_CHECK(mats.empty() || mats.size() == keep_.size(), "decode_cpu: one list of matrices per layer");
    for (size_t li = 0; li < keep_.size(); ++li) {
      const auto& t = keep_[li];
      TORCH_CHECK(t.size() == 15, "decode_cpu: 15 tensors per layer");
      std::vector<kvserve_ggml::Matrix*> mt = mats.empty() ? std::vector<kvserve_ggml::Matrix*>(4, nullptr) : mats[li];
      TORCH_CHECK(mt.size() == 4, "decode_cpu: 4 matrices (or None) per layer");
      Layer l;
      l.attn_norm = t[0].data_ptr<float>();
      l.ffn_norm = t[1].data_ptr<float>();
      l.qkv = proj_of(t, 2, t[14], mt[0]);
      l.wo = proj_of(t, 5, at::Tensor(), mt[1]);
      // no gate|up and down (no matrices, empty tensors): a layer whose FFN set_moe gives
      l.dense_ffn = mt[2] != nullptr || mt[3] != nullptr || t[8].numel() || t[11].numel();
      E_ = l.qkv.k;
      if (l.dense_ffn) {
        l.gate_up = proj_of(t, 8, at::Tensor(), mt[2]);
        l.down = proj_of(t, 11, at::Tensor(), mt[3]);
        F_ = std::max(F_, l.down.k);
        TORCH_CHECK(l.gate_up.k == E_ && l.gate_up.n == 2 * l.down.k && l.down.n == E_ && l.down.k % 64 == 0,
                    "decode_cpu: projection shapes do not match the model");
      }
      TORCH_CHECK(l.qkv.n == (nh_ + 2 * nkv_) * hd_ && l.wo.k == nh_ * hd_ && l.wo.n == E_ && E_ % 64 == 0 &&
                      (nh_ * hd_) % 64 == 0,
                  "decode_cpu: projection shapes do not match the model");
      layers_.push_back(std::move(l));
    }
  }

  // qwen3's q/k norms of layer li: RMSNorm weights [head_dim] float32 applied per head to q and k
  // (after the q|k|v projection and its bias, before RoPE); kept alive by the decoder
  void set_qk_norm(int64_t li, const at::Tensor& q_norm, const at::Tensor& k_norm) {
    TORCH_CHECK(li >= 0 && li < static_cast<int64_t>(layers_.size()), "decode_cpu: layer out of range");
    for (const at::Tensor* t : {&q_norm, &k_norm})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == hd_,
                  "decode_cpu: q/k norm weights must be float32 [head_dim]");
    extra_.push_back(q_norm);
    extra_.push_back(k_norm);
    layers_[li].q_norm = q_norm.data_ptr<float>();
    layers_[li].k_norm = k_norm.data_ptr<float>();
  }

  // layer li's FFN as a mixture of experts: router [n_expert, E] float32, per expert its gate|up
  // matrix [2 F, E] and down matrix [E, F] (GGUF blocks; owned by the caller, alive while used),
  // top_k experts per row, their weights renormalised to sum 1 where norm
  void set_moe(int64_t li, const at::Tensor& router, std::vector<kvserve_ggml::Matrix*> gate_up,
               std::vector<kvserve_ggml::Matrix*> down, int64_t top_k, bool norm) {
    TORCH_CHECK(li >= 0 && li < static_cast<int64_t>(layers_.size()), "decode_cpu: layer out of range");
    const int64_t NE = router.dim() == 2 ? router.size(0) : 0;
    TORCH_CHECK(router.scalar_type() == at::kFloat && router.is_contiguous() && NE > 0 && router.size(1) == E_ &&
                    static_cast<int64_t>(gate_up.size()) == NE && static_cast<int64_t>(down.size()) == NE &&
                    top_k >= 1 && top_k <= NE,
                "decode_cpu: bad router or expert lists");
    auto m = std::make_unique<Moe>();
    m->F = down[0] != nullptr ? down[0]->cols() : 0;
    for (int64_t e = 0; e < NE; ++e)
      TORCH_CHECK(gate_up[e] != nullptr && down[e] != nullptr && gate_up[e]->cols() == E_ &&
                      gate_up[e]->rows() == 2 * m->F && down[e]->cols() == m->F && down[e]->rows() == E_ && m->F > 0 &&
                      m->F % 32 == 0,
                  "decode_cpu: expert shapes do not match the model");
    extra_.push_back(router);
    m->router = router.data_ptr<float>();
    m->n_expert = NE;
    m->top_k = top_k;
    m->norm = norm;
    m->gate_up.assign(gate_up.begin(), gate_up.end());
    m->down.assign(down.begin(), down.end());
    layers_[li].moe = std::move(m);
  }

  // the output norm [E] float32 and head: q [Vp, E] uint8 (see q8_mm), d [Vp, E/32] float16, Vp the
  // vocabulary V rounded up to the layout's row multiple (16 in tiles, 1 in the pair order)
  void set_head(const at::Tensor& norm, const at::Tensor& q, const at::Tensor& d, int64_t n_vocab) {
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == E_ && q.scalar_type() == at::kByte &&
                    q.dim() == 2 && q.size(1) == E_ && d.scalar_type() == at::kHalf && d.size(0) == q.size(0) &&
                    d.size(1) == E_ / 32 && q.is_contiguous() && d.is_contiguous() && norm.is_contiguous(),
                "decode_cpu: bad head");
    TORCH_CHECK(n_vocab >= 1 && q.size(0) == (n_vocab + ROW_MULTIPLE - 1) / ROW_MULTIPLE * ROW_MULTIPLE,
                "decode_cpu: head rows do not match the vocabulary");
    head_ = {norm, q, d};
    head_mat_ = nullptr;
    n_vocab_ = n_vocab;
  }

  // the output norm [E] float32 and a head of GGUF blocks [V, E] (owned by the caller, alive while used)
  void set_head_matrix(const at::Tensor& norm, kvserve_ggml::Matrix* mat) {
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == E_ && norm.is_contiguous() && mat != nullptr &&
                    mat->cols() == E_,
                "decode_cpu: bad head");
    head_ = {norm};
    head_mat_ = mat;
    n_vocab_ = mat->rows();
  }

  // x [B, E] hidden states -> logits [B, V] float32 (output norm, then the q8 head)
  at::Tensor logits(const at::Tensor& x) {
    TORCH_CHECK(head_.size() == 3 || head_mat_ != nullptr, "decode_cpu: no head set");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == E_,
                "decode_cpu: x must be a contiguous float32 [B, n_embd]");
    const int64_t B = x.size(0), V = n_vocab_;
    std::vector<float> h(B * E_);
    for (int64_t b = 0; b < B; ++b) rms_norm(x.data_ptr<float>() + b * E_, head_[0].data_ptr<float>(), h.data() + b * E_, E_, eps_);
    at::Tensor y = at::empty({B, V}, x.options());
    if (head_mat_ != nullptr) {
      kvserve_ggml::Scratch s;
      head_mat_->mm_raw(h.data(), B, y.data_ptr<float>(), s);
      return y;
    }
    q8_mm(h.data(), B, E_, head_[1].data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(head_[2].data_ptr<at::Half>()),
          V, y.data_ptr<float>());
    return y;
  }

  // LoRA adapter `id`'s delta on projection `proj` (0 qkv, 1 wo, 2 gate_up, 3 down) of layer li:
  // a [R, k] float32, bfloat16 or float16 (k the projection's input size), per part bts[i] [r1 - r0, n_out]
  // of the same dtype (B^T, module scale folded in) and spec[4 i .. 4 i + 3] = out0, n_out, r0, r1 (see LoraPart). Registered
  // once per adapter, layer by layer in projection order (kvserve/models/decode_native.py); copied into
  // the adapter's arena (A as given, each B^T in column panels), the tensors are not kept.
  void set_lora(int64_t id, int64_t li, int64_t proj, const at::Tensor& a, const std::vector<at::Tensor>& bts,
                const std::vector<int64_t>& spec) {
    TORCH_CHECK(li >= 0 && li < static_cast<int64_t>(layers_.size()) && proj >= 0 && proj < 4,
                "decode_cpu: LoRA layer or projection out of range");
    const Layer& l = layers_[li];
    const Proj& p = proj == 0 ? l.qkv : proj == 1 ? l.wo : proj == 2 ? l.gate_up : l.down;
    TORCH_CHECK(proj < 2 || l.dense_ffn, "decode_cpu: LoRA on a mixture-of-experts layer's FFN");
    const at::ScalarType dt = a.scalar_type();
    TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && a.dim() == 2 && a.is_contiguous() &&
                    a.size(1) == p.k && spec.size() == 4 * bts.size(),
                "decode_cpu: bad LoRA A or parts");
    const size_t es = a.element_size();
    LoraProj lp;
    lp.R = a.size(0);
    lp.k = a.size(1);
    lp.dt = dt;
    for (size_t i = 0; i < bts.size(); ++i) {
      const at::Tensor& bt = bts[i];
      LoraPart part{spec[4 * i], spec[4 * i + 1], spec[4 * i + 2], spec[4 * i + 3], nullptr};
      TORCH_CHECK(bt.scalar_type() == dt && bt.dim() == 2 && bt.is_contiguous() && part.out0 >= 0 &&
                      part.n_out >= 1 && part.out0 + part.n_out <= p.n && part.r0 >= 0 && part.r1 > part.r0 &&
                      part.r1 <= lp.R && bt.size(0) == part.r1 - part.r0 && bt.size(1) == part.n_out,
                  "decode_cpu: bad LoRA B");
      lp.parts.push_back(part);
    }
    LoraAdapter& ad = lora_[id];
    if (ad.layers.empty()) ad.layers.resize(layers_.size());
    auto take = [&](int64_t n) {  // n elements of dt (the arena counts floats)
      return reinterpret_cast<char*>(ad.arena.take((static_cast<size_t>(n) * es + sizeof(float) - 1) / sizeof(float)));
    };
    char* ac = take(lp.R * lp.k);
    std::memcpy(ac, a.data_ptr(), es * lp.R * lp.k);
    lp.a = ac;
    for (size_t i = 0; i < bts.size(); ++i) {  // B^T [Rp, n_out] into column panels
      LoraPart& part = lp.parts[i];
      const int64_t Rp = part.r1 - part.r0, n_out = part.n_out;
      const char* src = static_cast<const char*>(bts[i].data_ptr());
      char* dst = take(Rp * n_out);
      for (int64_t c0 = 0; c0 < n_out; c0 += LORA_PW) {
        const int64_t w = std::min(LORA_PW, n_out - c0);
        for (int64_t r = 0; r < Rp; ++r)
          std::memcpy(dst + (c0 * Rp + r * w) * es, src + (r * n_out + c0) * es, es * w);
      }
      part.bt = dst;
    }
    ad.layers[li][proj] = std::move(lp);
  }

  // forget adapter `id` (no-op when unknown)
  void remove_lora(int64_t id) { lora_.erase(id); }

  // the registered adapters' ids
  std::vector<int64_t> lora_ids() const {
    std::vector<int64_t> out;
    for (const auto& kv : lora_) out.push_back(kv.first);
    std::sort(out.begin(), out.end());
    return out;
  }

  // x [B, E] float32 (the token embeddings; overwritten with the last layer's hidden states and
  // returned), cos/sin [B, D/2] float32, slots [B] long (cache row of each query's K/V),
  // kv_index [B, L] long (the rows each query reads, valid up to lens[b]), lens [B] long,
  // k_caches/v_caches: per layer [rows, n_head_kv, head_dim] float32/float16/bfloat16.
  at::Tensor step(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                  const at::Tensor& kv_index, const at::Tensor& lens, const std::vector<at::Tensor>& k_caches,
                  const std::vector<at::Tensor>& v_caches) {
    return run(std::move(x), cos, sin, slots, kv_index, lens, k_caches, v_caches, nullptr);
  }

  // step, with LoRA deltas on the rows that carry adapters: row b applies the entries
  // [row_off[b], row_off[b + 1]) of ids (registered adapter ids, long) and scales (float32, the
  // request's scale); row_off [B + 1] long. Each projection's output row gets, after the base product
  // and bias, sum over its entries of scale * B (A x) (kvserve/lora/apply.py's math); rows without
  // entries are computed exactly as step computes them.
  at::Tensor step_lora(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                       const at::Tensor& kv_index, const at::Tensor& lens, const std::vector<at::Tensor>& k_caches,
                       const std::vector<at::Tensor>& v_caches, const at::Tensor& row_off, const at::Tensor& ids,
                       const at::Tensor& scales) {
    const int64_t B = x.size(0);
    TORCH_CHECK(row_off.scalar_type() == at::kLong && row_off.is_contiguous() && row_off.numel() == B + 1 &&
                    ids.scalar_type() == at::kLong && ids.is_contiguous() && scales.scalar_type() == at::kFloat &&
                    scales.is_contiguous() && ids.numel() == scales.numel(),
                "decode_cpu: bad LoRA rows");
    const int64_t* off = row_off.data_ptr<int64_t>();
    const int64_t* id = ids.data_ptr<int64_t>();
    const float* sc = scales.data_ptr<float>();
    TORCH_CHECK(off[0] == 0 && off[B] == ids.numel(), "decode_cpu: bad LoRA row offsets");
    std::map<int64_t, LoraRows> by_id;  // ascending ids: a row's adapters are added in the same order in any step
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(off[b + 1] >= off[b], "decode_cpu: bad LoRA row offsets");
      for (int64_t e = off[b]; e < off[b + 1]; ++e) {
        auto it = lora_.find(id[e]);
        TORCH_CHECK(it != lora_.end(), "decode_cpu: LoRA adapter ", id[e], " is not registered");
        LoraRows& g = by_id[id[e]];
        g.ad = &it->second;
        g.rows.push_back(b);
        g.scales.push_back(sc[e]);
      }
    }
    std::vector<LoraRows> groups;
    for (auto& kv : by_id) groups.push_back(std::move(kv.second));
    return run(std::move(x), cos, sin, slots, kv_index, lens, k_caches, v_caches, &groups);
  }

 private:
  // the step's rows of one adapter (step_lora): row indices and their scales
  struct LoraRows {
    const LoraAdapter* ad = nullptr;
    std::vector<int64_t> rows;
    std::vector<float> scales;
  };

  // one projection's LoRA deltas: o [B, n] += scale * B (A in[b]) for each row b of each group. Grouped
  // by adapter so each A and B row is read once per step for all of its rows (punica's batching);
  // a row's result depends only on its own input and adapters (ascending ids, parts, ranks in order;
  // fused multiply-adds lane by lane, so the column blocks do not change it)
  void lora_delta(size_t li, int pi, const float* in, float* o, int64_t n, const std::vector<LoraRows>& groups) const {
    const int64_t G = static_cast<int64_t>(groups.size());
    std::vector<std::vector<float>> hs(G);  // per group [rows, R]: (A x) * scale
    kvserve_pool::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const LoraProj& lp = groups[g].ad->layers[li][pi];
        if (lp.a == nullptr) continue;
        const auto& rows = groups[g].rows;
        const int64_t nr = static_cast<int64_t>(rows.size());
        hs[g].assign(nr * lp.R, 0.f);
        for (int64_t i0 = 0; i0 < nr; i0 += LRB) {
          const int64_t* ri = rows.data() + i0;
          const float* si = groups[g].scales.data() + i0;
          const int64_t m = std::min(LRB, nr - i0);
          float* hi = hs[g].data() + i0 * lp.R;
          if (lp.dt == at::kBFloat16) lora_shrink<c10::BFloat16>(lp, in, ri, si, m, hi);
          else if (lp.dt == at::kHalf) lora_shrink<c10::Half>(lp, in, ri, si, m, hi);
          else lora_shrink<float>(lp, in, ri, si, m, hi);
        }
      }
    });
    constexpr int64_t CB = LORA_PW;  // output columns per task of the expand
    kvserve_pool::parallel_for(0, (n + CB - 1) / CB, 1, [&](int64_t t0, int64_t t1) {
      const int64_t c0 = t0 * CB, c1 = std::min(n, t1 * CB);
      for (int64_t g = 0; g < G; ++g) {  // each group's parts front to back over this task's columns
        const LoraProj& lp = groups[g].ad->layers[li][pi];
        if (lp.a == nullptr) continue;
        const auto& rows = groups[g].rows;
        const int64_t nr = static_cast<int64_t>(rows.size());
        for (const LoraPart& pt : lp.parts) {  // expand: y[part] += B_part h[part's ranks]
          const int64_t lo = std::max(c0, pt.out0) - pt.out0, hi = std::min(c1, pt.out0 + pt.n_out) - pt.out0;
          for (int64_t p0 = lo - lo % LORA_PW; p0 < hi; p0 += LORA_PW) {  // the panels (part's columns)
            const int64_t w = std::min(LORA_PW, pt.n_out - p0);
            const int64_t j0 = std::max(lo, p0), j1 = std::min(hi, p0 + w);
            for (int64_t i0 = 0; i0 < nr; i0 += LRB) {  // the panel stays in L1 for the next rows
              float* y0 = o + pt.out0 + p0;
              const int64_t* ri = rows.data() + i0;
              const int64_t m = std::min(LRB, nr - i0);
              const float* hi = hs[g].data() + i0 * lp.R;
              if (lp.dt == at::kBFloat16)
                lora_expand(pt, static_cast<const c10::BFloat16*>(pt.bt) + p0 * (pt.r1 - pt.r0), w, y0, n, ri, m, hi,
                            lp.R, j0 - p0, j1 - p0);
              else if (lp.dt == at::kHalf)
                lora_expand(pt, static_cast<const c10::Half*>(pt.bt) + p0 * (pt.r1 - pt.r0), w, y0, n, ri, m, hi,
                            lp.R, j0 - p0, j1 - p0);
              else
                lora_expand(pt, static_cast<const float*>(pt.bt) + p0 * (pt.r1 - pt.r0), w, y0, n, ri, m, hi, lp.R,
                            j0 - p0, j1 - p0);
            }
          }
        }
      }
    });
  }

  // rows of one LoRA delta at a time (register blocking: each A and B vector loaded once for them)
  static constexpr int64_t LRB = W == 16 ? 4 : 2;

  // h[i * R + r] = (A_r . x_{rows[i]}) * scales[i] for nr <= LRB rows; each row's dot product in the same
  // order (two accumulators over alternate vectors of k) whatever the other rows
  // (A's elements of type T: float, c10::BFloat16 or c10::Half, read as float32)
  template <typename T>
  static void lora_shrink(const LoraProj& lp, const float* in, const int64_t* rows, const float* scales, int64_t nr,
                          float* h) {
    const int64_t k = lp.k;
    for (int64_t r = 0; r < lp.R; ++r) {
      const T* ar = static_cast<const T*>(lp.a) + r * k;
      vf acc0[LRB], acc1[LRB];
      const float* x[LRB];
      for (int64_t i = 0; i < nr; ++i) {
        acc0[i] = vzero();
        acc1[i] = vzero();
        x[i] = in + rows[i] * k;
      }
      int64_t c = 0;
      for (; c + 2 * W <= k; c += 2 * W) {
        const vf a0 = vload<T>(ar + c), a1 = vload<T>(ar + c + W);
        for (int64_t i = 0; i < nr; ++i) {
          acc0[i] = vfma(a0, vld(x[i] + c), acc0[i]);
          acc1[i] = vfma(a1, vld(x[i] + c + W), acc1[i]);
        }
      }
      for (; c + W <= k; c += W) {
        const vf a0 = vload<T>(ar + c);
        for (int64_t i = 0; i < nr; ++i) acc0[i] = vfma(a0, vld(x[i] + c), acc0[i]);
      }
      for (int64_t i = 0; i < nr; ++i) {
        float sum = hsum(vadd(acc0[i], acc1[i]));
        for (int64_t cc = c; cc < k; ++cc) sum = std::fma(static_cast<float>(ar[cc]), x[i][cc], sum);
        h[i * lp.R + r] = sum * scales[i];
      }
    }
  }

  // one column panel of a part (panel [r1 - r0, w], see LoraPart; y0 = o + its first output column, o's
  // rows n wide): y0[rows[i], lo:hi] += sum over the part's ranks r (in order) of panel[r, lo:hi] *
  // h[i * R + r], nr <= LRB rows, 0 <= lo < hi <= w; each output element's fused multiply-adds in rank
  // order, so the blocking does not change it
  // (B^T's elements of type T: float, c10::BFloat16 or c10::Half, read as float32)
  template <typename T>
  static void lora_expand(const LoraPart& pt, const T* panel, int64_t w, float* y0, int64_t n, const int64_t* rows,
                          int64_t nr, const float* h, int64_t R, int64_t lo, int64_t hi) {
    auto brow = [&](int64_t r, int64_t j) { return panel + (r - pt.r0) * w + j; };  // B^T[r, panel column j]
    float* y[LRB];
    for (int64_t i = 0; i < nr; ++i) y[i] = y0 + rows[i] * n;
    int64_t j = lo;
    for (; j + 4 * W <= hi; j += 4 * W) {
      vf acc[LRB][4];
      for (int64_t i = 0; i < nr; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = vld(y[i] + j + v * W);
      for (int64_t r = pt.r0; r < pt.r1; ++r) {
        const T* br = brow(r, j);
        const vf b0 = vload<T>(br), b1 = vload<T>(br + W), b2 = vload<T>(br + 2 * W), b3 = vload<T>(br + 3 * W);
        for (int64_t i = 0; i < nr; ++i) {
          const vf hv = vset1(h[i * R + r]);
          acc[i][0] = vfma(b0, hv, acc[i][0]);
          acc[i][1] = vfma(b1, hv, acc[i][1]);
          acc[i][2] = vfma(b2, hv, acc[i][2]);
          acc[i][3] = vfma(b3, hv, acc[i][3]);
        }
      }
      for (int64_t i = 0; i < nr; ++i)
        for (int v = 0; v < 4; ++v) vst(y[i] + j + v * W, acc[i][v]);
    }
    for (; j + W <= hi; j += W)
      for (int64_t i = 0; i < nr; ++i) {
        vf acc = vld(y[i] + j);
        for (int64_t r = pt.r0; r < pt.r1; ++r) acc = vfma(vload<T>(brow(r, j)), vset1(h[i * R + r]), acc);
        vst(y[i] + j, acc);
      }
    for (; j < hi; ++j)
      for (int64_t i = 0; i < nr; ++i) {
        float acc = y[i][j];
        for (int64_t r = pt.r0; r < pt.r1; ++r) acc = std::fma(static_cast<float>(*brow(r, j)), h[i * R + r], acc);
        y[i][j] = acc;
      }
  }

  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                 const at::Tensor& kv_index, const at::Tensor& lens, const std::vector<at::Tensor>& k_caches,
                 const std::vector<at::Tensor>& v_caches, const std::vector<LoraRows>* lora) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == E_,
                "decode_cpu: x must be a contiguous float32 [B, n_embd]");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "decode_cpu: caches");
    TORCH_CHECK(kv_index.scalar_type() == at::kLong && kv_index.is_contiguous() && slots.scalar_type() == at::kLong &&
                    lens.scalar_type() == at::kLong && cos.is_contiguous() && sin.is_contiguous(),
                "decode_cpu: index types");
    const int64_t B = x.size(0), L = kv_index.size(1), D = hd_, H = nh_, HKV = nkv_;
    const int64_t QKV = (H + 2 * HKV) * D, KMAX = std::max(E_, F_);
    for (const Layer& l : layers_) TORCH_CHECK(l.dense_ffn || l.moe, "decode_cpu: a layer without its FFN (set_moe)");
    std::vector<float> h(B * E_), qkv(B * QKV), att(B * H * D), gu(B * 2 * F_), act(B * F_), out(B * E_);
    MoeBuffers mb;  // the experts' work buffers, reused across layers
    std::vector<int8_t> xq(B * KMAX);
    Pieces pieces;  // attention's per-chunk pieces, reused across layers (per call: the step is reentrant)
    std::vector<float> xs(B * KMAX / 32), xm(B * KMAX / 32);
    float* X = x.data_ptr<float>();
    const float* C = cos.data_ptr<float>();
    const float* S = sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* idx = kv_index.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    const int64_t rows = k_caches.empty() ? 0 : k_caches[0].size(0);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(len[b] >= 1 && len[b] <= L, "decode_cpu: lens out of range");
      for (int64_t j = 0; j < len[b]; ++j)
        TORCH_CHECK(idx[b * L + j] >= 0 && idx[b * L + j] < rows, "decode_cpu: cache row out of range");
    }
    // row groups for attention (see attend): row b joins b - 1's when its cache rows begin with all of b - 1's
    std::vector<int64_t> gb{0};
    for (int64_t b = 1; b < B; ++b)
      if (!(len[b] >= len[b - 1] &&
            std::memcmp(idx + b * L, idx + (b - 1) * L, static_cast<size_t>(len[b - 1]) * sizeof(int64_t)) == 0))
        gb.push_back(b);
    gb.push_back(B);
    kvserve_ggml::Scratch gs;  // the block products' quantized activations, reused across layers
    size_t cur = 0;  // the layer being computed (the LoRA deltas' layer)
    auto mm = [&](const Proj& p, const float* in, float* o, int pi) {
      if (p.mat != nullptr) {
        p.mat->mm_raw(in, B, o, gs);
      } else {
#ifdef KVSERVE_AVX512
      q4_mm_t(in, B, p.k, p.q, p.d, p.m, p.n, o, xq.data(), xs.data(), xm.data());
#else
      kvserve_q4::q4_mm_raw(in, B, p.k, p.q, p.d, p.m, p.n, o, xq.data(), xs.data(), xm.data(), PoolFor());
#endif
      }
      if (p.bias)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = 0; j < p.n; ++j) o[b * p.n + j] += p.bias[j];
      if (lora != nullptr) lora_delta(cur, pi, in, o, p.n, *lora);
    };
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      cur = li;
      for (int64_t b = 0; b < B; ++b) rms_norm(X + b * E_, l.attn_norm, h.data() + b * E_, E_, eps_);
      mm(l.qkv, h.data(), qkv.data(), 0);
      if (l.q_norm != nullptr)  // qwen3: RMSNorm of each q and k head (in place), before RoPE
        for (int64_t b = 0; b < B; ++b) {
          float* r = qkv.data() + b * QKV;
          for (int64_t hh = 0; hh < H; ++hh) rms_norm(r + hh * D, l.q_norm, r + hh * D, D, eps_);
          for (int64_t hh = H; hh < H + HKV; ++hh) rms_norm(r + hh * D, l.k_norm, r + hh * D, D, eps_);
        }
      // RoPE on the q and k heads: pair (2i, 2i+1) times (cos_i + i sin_i)
      for (int64_t b = 0; b < B; ++b) {
        float* r = qkv.data() + b * QKV;
        const float* c = C + b * (D / 2);
        const float* s = S + b * (D / 2);
        for (int64_t hh = 0; hh < H + HKV; ++hh)
          for (int64_t i = 0; i < D / 2; ++i) {
            float* p = r + hh * D + 2 * i;
            const float a = p[0], e = p[1];
            p[0] = a * c[i] - e * s[i];
            p[1] = a * s[i] + e * c[i];
          }
      }
      const at::Tensor& kc = k_caches[li];
      const at::Tensor& vc = v_caches[li];
      TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && kc.is_contiguous() && vc.is_contiguous() &&
                      kc.size(0) == rows && kc.size(1) == HKV && kc.size(2) == D && vc.size(0) == rows,
                  "decode_cpu: caches must be contiguous [rows, n_head_kv, head_dim] of one float type");
      switch (kc.scalar_type()) {
        case at::kFloat: attend<float>(kc, vc, qkv.data(), att.data(), B, L, slot, idx, len, gb, pieces); break;
        case at::kHalf: attend<c10::Half>(kc, vc, qkv.data(), att.data(), B, L, slot, idx, len, gb, pieces); break;
        case at::kBFloat16: attend<c10::BFloat16>(kc, vc, qkv.data(), att.data(), B, L, slot, idx, len, gb, pieces); break;
        default: TORCH_CHECK(false, "decode_cpu: cache type");
      }
      mm(l.wo, att.data(), out.data(), 1);
      for (int64_t i = 0; i < B * E_; ++i) X[i] += out[i];
      for (int64_t b = 0; b < B; ++b) rms_norm(X + b * E_, l.ffn_norm, h.data() + b * E_, E_, eps_);
      if (!l.dense_ffn) {
        moe_ffn(*l.moe, h.data(), out.data(), B, mb);
        for (int64_t i = 0; i < B * E_; ++i) X[i] += out[i];
        continue;
      }
      mm(l.gate_up, h.data(), gu.data(), 2);
      const int64_t FF = l.down.k;
      for (int64_t b = 0; b < B; ++b) swiglu(gu.data() + b * 2 * FF, act.data() + b * FF, FF);
      mm(l.down, act.data(), out.data(), 3);
      for (int64_t i = 0; i < B * E_; ++i) X[i] += out[i];
    }
    return x;
  }

  // keys per attention task: a query's keys are cut at the multiples of CHUNK of their position (not
  // of the batch), each piece's softmax sum and weighted values computed on their own and merged in
  // order, so a row's result is the same in any step; the pieces let 2 threads share one sequence
  static constexpr int64_t CHUNK = 256;
  // query heads of one row handled together (their keys and values loaded once: GQA)
  static constexpr int QB = W == 16 ? 4 : 2;
  // key blocks (of W) scored at once per head (attention's heads: QB x KT accumulators)
  static constexpr int64_t KT = 4;
  static_assert(CHUNK % (W * KT) == 0, "a chunk is whole tiles of KT key blocks");

  // write each row's k/v (after RoPE) into the cache, then attention of every query head.
  // gb: the step's row groups [gb[i], gb[i+1]) (rows whose cache rows begin with all of the previous
  // row's: a verification chunk's positions of one sequence), so a group's keys and values are read
  // once for all its rows and heads; the arithmetic of a row does not depend on its group.
  template <typename T>
  void attend(const at::Tensor& kc, const at::Tensor& vc, const float* qkv, float* att, int64_t B, int64_t L,
              const int64_t* slot, const int64_t* idx, const int64_t* len, const std::vector<int64_t>& gb,
              Pieces& pc) {
    const int64_t D = hd_, H = nh_, HKV = nkv_, G = H / HKV, QKV = (H + 2 * HKV) * D, rows = kc.size(0);
    T* K = kc.data_ptr<T>();
    T* V = vc.data_ptr<T>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(slot[b] >= 0 && slot[b] < rows, "decode_cpu: slot out of range");
      const float* k = qkv + b * QKV + H * D;
      const float* v = k + HKV * D;
      for (int64_t i = 0; i < HKV * D; ++i) {
        K[slot[b] * HKV * D + i] = static_cast<T>(k[i]);  // round to nearest even, as torch's casts
        V[slot[b] * HKV * D + i] = static_cast<T>(v[i]);
      }
    }
    const float scale = 1.f / std::sqrt(static_cast<float>(D));
    const int64_t NC = (L + CHUNK - 1) / CHUNK;
    // per (query, chunk): the chunk's max score, sum of e^(score - max), and unnormalized output [D]
    pc.m.resize(B * H * NC);
    pc.s.resize(B * H * NC);
    pc.o.resize(B * H * NC * D);
    struct Task { int64_t g, kvh, c; };
    std::vector<Task> tasks;
    for (int64_t g = 0; g + 1 < static_cast<int64_t>(gb.size()); ++g) {
      const int64_t lg = len[gb[g + 1] - 1];
      for (int64_t kvh = 0; kvh < HKV; ++kvh)
        for (int64_t c = 0; c * CHUNK < lg; ++c) tasks.push_back({g, kvh, c});
    }
    kvserve_pool::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
      // kt: the chunk's keys as float32 in blocks of W keys, [block][d][W] (zero past the chunk's keys, up
      // to a whole tile of KT blocks); vfl: its values [key][d]
      // per thread and kept between steps (every value read is written first): fresh zeroed buffers per
      // task (2 x 128 KiB at head_dim 128) were ~4% of a short-context qwen3moe step (memset, page faults)
      thread_local std::vector<float> kt, vfl, sc;
      if (static_cast<int64_t>(kt.size()) < CHUNK * D) kt.resize(CHUNK * D);
      if (static_cast<int64_t>(vfl.size()) < CHUNK * D) vfl.resize(CHUNK * D);
      if (static_cast<int64_t>(sc.size()) < QB * (CHUNK + W)) sc.resize(QB * (CHUNK + W));
      for (int64_t t = t0; t < t1; ++t) {
        const Task tk = tasks[t];
        const int64_t blast = gb[tk.g + 1] - 1, j0 = tk.c * CHUNK;
        const int64_t j1 = std::min(j0 + CHUNK, len[blast]), n = j1 - j0;
        const int64_t* rix = idx + blast * L + j0;
        const int64_t nblk = (n + W - 1) / W, nblk_t = (nblk + KT - 1) / KT * KT;
        for (int64_t kb = 0; kb < nblk; ++kb) {
          const T* kr[W];
          for (int64_t u = 0; u < W; ++u)
            kr[u] = kb * W + u < n ? K + (rix[kb * W + u] * HKV + tk.kvh) * D : nullptr;
          for (int64_t d = 0; d < D; d += W) {
            vf r[W];
            for (int64_t u = 0; u < W; ++u) r[u] = kr[u] ? vload(kr[u] + d) : vzero();
            transpose_w(r);
            for (int64_t u = 0; u < W; ++u) vst(kt.data() + (kb * D + d + u) * W, r[u]);
          }
        }
        std::fill(kt.begin() + nblk * D * W, kt.begin() + nblk_t * D * W, 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const T* vr = V + (rix[j] * HKV + tk.kvh) * D;
          for (int64_t d = 0; d < D; d += W) vst(vfl.data() + j * D + d, vload(vr + d));
        }
        for (int64_t b = gb[tk.g]; b <= blast; ++b) {
          const int64_t nb = std::min(j1, len[b]) - j0;
          if (nb <= 0) continue;
          for (int64_t h0 = tk.kvh * G; h0 < (tk.kvh + 1) * G; h0 += QB) {
            const int qn = static_cast<int>(std::min<int64_t>(QB, (tk.kvh + 1) * G - h0));
            switch (qn) {
              case 1: heads<1>(qkv + b * QKV + h0 * D, kt.data(), vfl.data(), nb, scale, sc.data(), b * H + h0, tk.c, NC, pc); break;
              case 2: heads<2>(qkv + b * QKV + h0 * D, kt.data(), vfl.data(), nb, scale, sc.data(), b * H + h0, tk.c, NC, pc); break;
              case 3: heads<3>(qkv + b * QKV + h0 * D, kt.data(), vfl.data(), nb, scale, sc.data(), b * H + h0, tk.c, NC, pc); break;
              default: heads<4>(qkv + b * QKV + h0 * D, kt.data(), vfl.data(), nb, scale, sc.data(), b * H + h0, tk.c, NC, pc); break;
            }
          }
        }
      }
    });
    // merge each query's chunks in order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c
    kvserve_pool::parallel_for(0, B * H, 4, [&](int64_t q0, int64_t q1) {
      for (int64_t qi = q0; qi < q1; ++qi) {
        const int64_t nc = (len[qi / H] + CHUNK - 1) / CHUNK;
        float* o = att + qi * D;
        const float* pm = pc.m.data() + qi * NC;
        const float* ps = pc.s.data() + qi * NC;
        const float* po = pc.o.data() + qi * NC * D;
        if (nc == 1) {
          const float inv = 1.f / ps[0];
          for (int64_t d = 0; d < D; d += W) vst(o + d, vmul(vld(po + d), vset1(inv)));
          continue;
        }
        float mx = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, pm[c]);
        float sum = 0.f;
        for (int64_t d = 0; d < D; d += W) vst(o + d, vzero());
        for (int64_t c = 0; c < nc; ++c) {
          const float w = std::exp(pm[c] - mx);
          sum += w * ps[c];
          for (int64_t d = 0; d < D; d += W) vst(o + d, vfma(vset1(w), vld(po + c * D + d), vld(o + d)));
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; d += W) vst(o + d, vmul(vld(o + d), vset1(inv)));
      }
    });
  }

  // QN query heads (q: QN consecutive heads of one row, [QN, D]) over nb keys of one chunk (kt: the
  // keys [block][d][W], zero past them; vfl [nb, D]), float32: scores, the chunk's softmax pieces and
  // weighted values -> pc (m, s, o) at query qi0 + i, chunk c
  template <int QN>
  void heads(const float* q, const float* kt, const float* vfl, int64_t nb, float scale, float* sc, int64_t qi0,
             int64_t c, int64_t NC, Pieces& pc) {
    const int64_t D = hd_, S = CHUNK + W;
    const vf vs = vset1(scale);
    // scores KT blocks of W keys at a time: lane u of acc[i][k] is key (b0 + k) W + u's score for head i,
    // one FMA per dimension in order (a key's score depends on nothing else: not its block, the other
    // keys, heads or rows); blocks past nb's are zero keys, their scores ignored
    const int64_t nblk = (nb + W - 1) / W;
    for (int64_t b0 = 0; b0 < nblk; b0 += KT) {
      vf acc[QN][KT];
      for (int i = 0; i < QN; ++i)
        for (int k = 0; k < KT; ++k) acc[i][k] = vzero();
      const float* kb = kt + b0 * D * W;
      for (int64_t d = 0; d < D; ++d) {
        vf kv[KT];
        for (int k = 0; k < KT; ++k) kv[k] = in_reg(vld(kb + (k * D + d) * W));
        for (int i = 0; i < QN; ++i) {
          const vf qd = vset1(q[i * D + d]);
          for (int k = 0; k < KT; ++k) acc[i][k] = vfma(qd, kv[k], acc[i][k]);
        }
      }
      for (int i = 0; i < QN; ++i)
        for (int k = 0; k < KT; ++k) vst(sc + i * S + (b0 + k) * W, vmul(acc[i][k], vs));
    }
    for (int i = 0; i < QN; ++i) {
      float* p = sc + i * S;
      vf mv = vset1(-INFINITY);
      int64_t j = 0;
      for (; j + W <= nb; j += W) mv = vmax(mv, vld(p + j));
      float mx = hmax(mv);
      for (; j < nb; ++j) mx = std::max(mx, p[j]);
      mv = vset1(mx);
      vf sv = vzero();
      for (j = 0; j + W <= nb; j += W) {
        const vf e = vexp(vsub(vld(p + j), mv));
        vst(p + j, e);
        sv = vadd(sv, e);
      }
      if (j < nb) sv = vadd(sv, exp_tail(p + j, nb - j, mv));
      pc.m[(qi0 + i) * NC + c] = mx;
      pc.s[(qi0 + i) * NC + c] = hsum(sv);
    }
    // the weighted sum of the values, 64 (or the last 32) output values per pass over the keys
    auto pass = [&](auto nv_tag, int64_t d0) {
      constexpr int64_t NV = decltype(nv_tag)::value;
      vf a[QN][NV];
      for (int i = 0; i < QN; ++i)
        for (int64_t u = 0; u < NV; ++u) a[i][u] = vzero();
      for (int64_t j = 0; j < nb; ++j) {
        const float* vr = vfl + j * D + d0;
        vf v[NV];
        for (int64_t u = 0; u < NV; ++u) v[u] = in_reg(vld(vr + u * W));
        for (int i = 0; i < QN; ++i) {
          const vf w = vset1(sc[i * S + j]);
          for (int64_t u = 0; u < NV; ++u) a[i][u] = vfma(w, v[u], a[i][u]);
        }
      }
      for (int i = 0; i < QN; ++i)
        for (int64_t u = 0; u < NV; ++u) vst(pc.o.data() + ((qi0 + i) * NC + c) * D + d0 + u * W, a[i][u]);
    };
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pass(std::integral_constant<int64_t, 64 / W>{}, d0);
    if (d0 < D) pass(std::integral_constant<int64_t, 32 / W>{}, d0);  // D is a multiple of 32
  }

  // the experts' per-step work buffers
  struct MoeBuffers {
    std::vector<float> logits, xg, gu, yd;
    std::vector<kvserve_ggml::Scratch> scratch;
  };

  // SiLU(gate) * up: g [2 F] (gate then up) -> a [F] (a may alias g's first half)
  static void swiglu(const float* g, float* a, int64_t F) {
    for (int64_t j = 0; j < F; j += W) {
      const vf gv = vld(g + j);
      const vf sg = vdiv(gv, vadd(vset1(1.f), vexp(vsub(vzero(), gv))));
      vst(a + j, vmul(sg, vld(g + F + j)));
    }
  }

  // out [B, E] = the mixture of experts of h [B, E] (kvserve/models/moe.py's MoE, llama.cpp's
  // build_moe_ffn with softmax gating): per row the router's logits, their softmax, the top_k experts
  // (the larger index loses a tie), weights renormalised to sum 1 (norm); the chosen experts' rows
  // grouped by expert (an expert is read once per step, idle ones never), gate|up of every chosen
  // expert in one pass of the pool, SiLU * up, every down product in a second pass, then each row's
  // weighted outputs added one by one in expert-id order (as combine_experts). A row's arithmetic does
  // not depend on the other rows (each product row has the one-row kernels' bits).
  void moe_ffn(const Moe& m, const float* h, float* out, int64_t B, MoeBuffers& mb) const {
    const int64_t NE = m.n_expert, k = m.top_k, F = m.F, E = E_;
    mb.logits.resize(B * NE);
    float* lg = mb.logits.data();
    kvserve_pool::parallel_for(0, B * NE, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float* x = h + (i / NE) * E;
        const float* w = m.router + (i % NE) * E;
        vf acc[4] = {vzero(), vzero(), vzero(), vzero()};  // 4 chains: the router streams at memory speed
        int64_t j = 0;
        for (; j + 4 * W <= E; j += 4 * W)
          for (int u = 0; u < 4; ++u) acc[u] = vfma(vld(x + j + u * W), vld(w + j + u * W), acc[u]);
        for (; j < E; j += W) acc[0] = vfma(vld(x + j), vld(w + j), acc[0]);
        lg[i] = hsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
      }
    });
    // per row: the chosen experts in id order and their weights
    std::vector<int64_t> sel(B * k);
    std::vector<float> wsel(B * k);
    std::vector<int64_t> order(NE);
    for (int64_t b = 0; b < B; ++b) {
      float* p = lg + b * NE;
      float mx = -INFINITY;
      for (int64_t e = 0; e < NE; ++e) mx = std::max(mx, p[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < NE; ++e) {
        p[e] = std::exp(p[e] - mx);
        sum += p[e];
      }
      for (int64_t e = 0; e < NE; ++e) p[e] /= sum;
      for (int64_t e = 0; e < NE; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t a, int64_t c) { return p[a] > p[c] || (p[a] == p[c] && a < c); });
      float ws = 0.f;
      for (int64_t j = 0; j < k; ++j) ws += p[order[j]];  // in the top-k order, as torch's sum of topk's values
      std::sort(order.begin(), order.begin() + k);
      for (int64_t j = 0; j < k; ++j) {
        sel[b * k + j] = order[j];
        wsel[b * k + j] = m.norm ? p[order[j]] / ws : p[order[j]];
      }
    }
    // the (row, choice) pairs grouped by expert: slot s of the grouped order is pair pairs[s]
    std::vector<int64_t> cnt(NE + 1, 0);
    for (int64_t i = 0; i < B * k; ++i) ++cnt[sel[i] + 1];
    for (int64_t e = 0; e < NE; ++e) cnt[e + 1] += cnt[e];
    std::vector<int64_t> pairs(B * k), slot_of(B * k);
    {
      std::vector<int64_t> fill(cnt.begin(), cnt.end() - 1);
      for (int64_t i = 0; i < B * k; ++i) {  // rows ascending within an expert
        const int64_t s = fill[sel[i]]++;
        pairs[s] = i;
        slot_of[i] = s;
      }
    }
    const int64_t S = B * k;
    mb.gu.resize(S * 2 * F);
    mb.yd.resize(S * E);
    mb.xg.resize(B > 1 ? S * E : 0);
    std::vector<kvserve_ggml::Matrix::Job> jobs;
    for (int64_t e = 0; e < NE; ++e) {
      const int64_t s0 = cnt[e], n = cnt[e + 1] - cnt[e];
      if (n == 0) continue;
      const float* x = h + (pairs[s0] / k) * E;  // one row: read in place (a one-row step's experts share it)
      if (n > 1) {
        for (int64_t s = s0; s < s0 + n; ++s) std::memcpy(mb.xg.data() + s * E, h + (pairs[s] / k) * E, E * sizeof(float));
        x = mb.xg.data() + s0 * E;
      }
      jobs.push_back({m.gate_up[e], x, n, mb.gu.data() + s0 * 2 * F});
    }
    kvserve_ggml::Matrix::mm_jobs(jobs, mb.scratch);
    // SiLU(gate) * up of every slot, into the first half of its gate|up row (row stride 2 F)
    kvserve_pool::parallel_for(0, S, 4, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) swiglu(mb.gu.data() + s * 2 * F, mb.gu.data() + s * 2 * F, F);
    });
    // the down products read each expert's activated rows: packed [n, F] per expert (in place, forward)
    std::vector<kvserve_ggml::Matrix::Job> down;
    for (int64_t e = 0; e < NE; ++e) {
      const int64_t s0 = cnt[e], n = cnt[e + 1] - cnt[e];
      if (n == 0) continue;
      float* a = mb.gu.data() + s0 * 2 * F;
      for (int64_t r = 1; r < n; ++r) std::memmove(a + r * F, a + r * 2 * F, F * sizeof(float));
      down.push_back({m.down[e], a, n, mb.yd.data() + s0 * E});
    }
    kvserve_ggml::Matrix::mm_jobs(down, mb.scratch);
    // each row's k weighted outputs, added one by one in expert-id order: (y w) rounded, then added
    for (int64_t b = 0; b < B; ++b) {
      float* o = out + b * E;
      for (int64_t j = 0; j < k; ++j) {
        const float* y = mb.yd.data() + slot_of[b * k + j] * E;
        const vf wv = vset1(wsel[b * k + j]);
        for (int64_t i = 0; i < E; i += W) {
          const vf t = in_reg(vmul(vld(y + i), wv));
          vst(o + i, j == 0 ? t : vadd(vld(o + i), t));
        }
      }
    }
  }

  std::unordered_map<int64_t, LoraAdapter> lora_;  // the registered LoRA adapters by id (set_lora)
  std::vector<at::Tensor> extra_;  // owns the q/k norms' and routers' weights
  std::vector<at::Tensor> head_;
  kvserve_ggml::Matrix* head_mat_ = nullptr;
  std::vector<std::vector<at::Tensor>> keep_;  // owns the weights the raw pointers read
  std::vector<Layer> layers_;
  int64_t nh_, nkv_, hd_, E_ = 0, F_ = 0, n_vocab_ = 0;
  float eps_;
};

// The step's kernels alone (tests): x [M, K] float32 @ the 4-bit weights q, d, m in LAYOUT
// ([N, K/2] uint8, [N, K/32] float16 twice) -> [M, N]; and @ the head's int8 weights q, d in LAYOUT
// ([Np, K] uint8, [Np, K/32] float16, Np the n outputs rounded up as set_head takes them) -> [M, n]
at::Tensor proj_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 64 == 0,
              "decode_cpu: x must be a contiguous float32 [M, K], K a multiple of 64");
  const Proj p = proj_of({q, d, m}, 0, at::Tensor());
  TORCH_CHECK(p.k == x.size(1), "decode_cpu: weights do not match x");
  const int64_t M = x.size(0), K = p.k;
  at::Tensor y = at::empty({M, p.n}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * K / 32), xm(M * K / 32);
#ifdef KVSERVE_AVX512
  q4_mm_t(x.data_ptr<float>(), M, K, p.q, p.d, p.m, p.n, y.data_ptr<float>(), xq.data(), xs.data(), xm.data());
#else
  kvserve_q4::q4_mm_raw(x.data_ptr<float>(), M, K, p.q, p.d, p.m, p.n, y.data_ptr<float>(), xq.data(), xs.data(),
                        xm.data(), PoolFor());
#endif
  return y;
}

at::Tensor head_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 64 == 0,
              "decode_cpu: x must be a contiguous float32 [M, K], K a multiple of 64");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.size(1) == K && q.is_contiguous() &&
                  d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == q.size(0) && d.size(1) == K / 32 &&
                  n >= 1 && q.size(0) == (n + ROW_MULTIPLE - 1) / ROW_MULTIPLE * ROW_MULTIPLE,
              "decode_cpu: bad head weights");
  at::Tensor y = at::empty({M, n}, x.options());
  q8_mm(x.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), n,
        y.data_ptr<float>());
  return y;
}

// x [M, K] float32 (K a multiple of 64) -> (xq [M, K] int8 in the pair order, xs, xsum [M, K/32]):
// the activations' quantization every projection runs, vectorized or (scalar) the reference (tests)
std::vector<at::Tensor> quantize(const at::Tensor& x, bool scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 64 == 0,
              "decode_cpu: x must be a contiguous float32 [M, K], K a multiple of 64");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({M, K / 32}, x.options()), xm = at::empty({M, K / 32}, x.options());
  (scalar ? kvserve_q4::quantize_rows_scalar : kvserve_q4::quantize_rows)(
      x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xm.data_ptr<float>());
  return {xq, xs, xm};
}

// Rows of a token embedding kept as GGUF blocks, dequantized for the native step's input:
// raw [n_rows, row_bytes] uint8 (the file's blocks of type `qtype`: "Q4_K", "Q6_K" or "Q8_0"),
// ids [B] int64 in [0, n_rows) -> float32 [B, K]. The values of gguf.quants.dequantize (the
// Python package's float32 arithmetic, operation for operation: d * sc then (d * sc) * q - dmin * m
// for Q4_K, (d * scale) * q for Q6_K, q * d for Q8_0; no fused multiply-add), so the embedding is
// bit for bit the one the eager path looks up. ~1 us a row against ~50-300 us through numpy.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor embed_rows(const at::Tensor& raw, const at::Tensor& ids, const std::string& qtype, int64_t K) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1, "decode_cpu: raw must be uint8 [rows, bytes]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "decode_cpu: ids must be int64 [B]");
  const int64_t QK = qtype == "Q8_0" ? 32 : 256;
  const int64_t BS = qtype == "Q4_K" ? 144 : qtype == "Q6_K" ? 210 : qtype == "Q8_0" ? 34 : 0;
  TORCH_CHECK(BS > 0, "decode_cpu: embed_rows takes Q4_K, Q6_K or Q8_0 rows");
  TORCH_CHECK(K > 0 && K % QK == 0 && raw.size(1) == K / QK * BS, "decode_cpu: row bytes do not match the type");
  const int64_t B = ids.size(0), R = raw.size(0), NB = K / QK;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK_INDEX(id[b] >= 0 && id[b] < R, "token id out of range [0, ", R, ")");
  at::Tensor out = at::empty({B, K}, at::TensorOptions().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  auto f16 = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  };
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* row = raw.data_ptr<uint8_t>() + id[b] * raw.stride(0);
    float* yr = y + b * K;
    for (int64_t nb = 0; nb < NB; ++nb) {
      const uint8_t* blk = row + nb * BS;
      float* yb = yr + nb * QK;
      if (BS == 34) {  // Q8_0: d, 32 x int8
        const float d = f16(blk);
        for (int l = 0; l < 32; ++l) yb[l] = static_cast<float>(static_cast<int8_t>(blk[2 + l])) * d;
      } else if (BS == 144) {  // Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        const float d = f16(blk), dmin = f16(blk + 2);
        const uint8_t* sc = blk + 4;
        const uint8_t* qs = blk + 16;
        float dd[8], dm[8];
        for (int j = 0; j < 4; ++j) {
          const int s0 = sc[j] & 0x3F, m0 = sc[4 + j] & 0x3F;
          const int s1 = (sc[8 + j] & 0x0F) | ((sc[j] >> 2) & 0x30), m1 = (sc[8 + j] >> 4) | ((sc[4 + j] >> 2) & 0x30);
          dd[j] = d * static_cast<float>(s0);
          dm[j] = dmin * static_cast<float>(m0);
          dd[j + 4] = d * static_cast<float>(s1);
          dm[j + 4] = dmin * static_cast<float>(m1);
        }
        for (int c = 0; c < 4; ++c)  // 32 bytes: low nibbles are sub-block 2c, high ones 2c + 1
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * c + h;
            for (int l = 0; l < 32; ++l) {
              const float q = static_cast<float>((qs[c * 32 + l] >> (4 * h)) & 0x0F);
              const float t = dd[j] * q;
              yb[j * 32 + l] = t - dm[j];
            }
          }
      } else {  // Q6_K: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = f16(blk + 208);
        float ds[16];
        for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(scales[i]);
        for (int e = 0; e < 256; ++e) {
          const int h = e / 128, r = e % 128;
          const int lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
          const int hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
          const int q = static_cast<int8_t>(static_cast<uint8_t>(lo | (hi << 4))) - 32;
          yb[e] = ds[e / 16] * static_cast<float>(q);
        }
      }
    }
  }
  return out;
}
#pragma GCC pop_options

// the maximum of x[a, e) (-inf when empty); NaN lanes as vmax leaves them (callers flag a NaN row)
inline float range_max(const float* x, int64_t a, int64_t e) {
  vf mv = vset1(-INFINITY);
  int64_t i = a;
  for (; i + W <= e; i += W) mv = vmax(mv, vld(x + i));
  float m = hmax(mv);
  for (; i < e; ++i) m = std::max(m, x[i]);
  return m;
}

// the first index (into `first`, when still -1) and the count (added to n) of the entries of x[a, e) equal to m
inline void range_ties(const float* x, int64_t a, int64_t e, float m, int64_t& first, int64_t& n) {
  const vf mb = vset1(m);
  int64_t i = a;
  for (; i + W <= e; i += W) {
    const unsigned eq = veq_mask(vld(x + i), mb);
    if (eq) {
      if (first < 0) first = i + __builtin_ctz(eq);
      n += __builtin_popcount(eq);
    }
  }
  for (; i < e; ++i)
    if (x[i] == m) {
      if (first < 0) first = i;
      ++n;
    }
}

// Greedy sampling's statistics of logits [B, V] float32 (the sampler's batch fast path,
// kvserve/engine/sampler.py; torch needed 6-7 ops of ~0.15-0.3 ms each at V = 49152): per row the
// index of the first maximum with the ``ban`` token ids (int64 [n], any order, repeats allowed)
// taken as -inf (int64), that maximum, how many entries (banned ones as -inf) equal it (ties; -1
// when the row holds a NaN: the caller uses torch then), and log(sum(exp(x))) over the whole row
// (all tokens: the logprob's normalizer; the vectorized exp's relative error ~2e-7). Three
// vectorized reads of a row (maximum and NaN lanes, sum of exp, ties with their first index), the
// banned ids skipped in place: 69 -> ~20 us a row at V = 49152 on one Zen 4 core (the scalar
// NaN and tie loops and a copy of the row for the ban were most of it).
std::vector<at::Tensor> greedy_stats(const at::Tensor& logits, const at::Tensor& ban) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "decode_cpu: logits must be a contiguous float32 [B, V]");
  TORCH_CHECK(ban.dim() == 1 && ban.scalar_type() == at::kLong, "decode_cpu: ban must be int64 [n]");
  const int64_t B = logits.size(0), V = logits.size(1), NB = ban.numel();
  const int64_t* bp = ban.data_ptr<int64_t>();
  for (int64_t i = 0; i < NB; ++i) TORCH_CHECK(bp[i] >= 0 && bp[i] < V, "decode_cpu: ban id out of range");
  std::vector<int64_t> banned(bp, bp + NB);  // ascending, once each: the rows are scanned between them
  std::sort(banned.begin(), banned.end());
  banned.erase(std::unique(banned.begin(), banned.end()), banned.end());
  at::Tensor tok = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor best = at::empty({B}, logits.options()), lse = at::empty({B}, logits.options());
  at::Tensor ties = at::empty({B}, logits.options().dtype(at::kLong));
  const float* L = logits.data_ptr<float>();
  int64_t* T = tok.data_ptr<int64_t>();
  int64_t* C = ties.data_ptr<int64_t>();
  float* Bv = best.data_ptr<float>();
  float* S = lse.data_ptr<float>();
  kvserve_pool::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = L + b * V;
      // the maximum over all tokens (for the normalizer) and NaN detection
      vf mv = vset1(-INFINITY);
      unsigned nanbits = 0;
      int64_t i = 0;
      for (; i + W <= V; i += W) {
        const vf v = vld(x + i);
        mv = vmax(mv, v);
        nanbits |= vnan_mask(v);
      }
      float mall = hmax(mv);
      bool nan = nanbits != 0;
      for (; i < V; ++i) {
        mall = std::max(mall, x[i]);
        nan |= std::isnan(x[i]);
      }
      // sum exp(x - max)
      vf sv = vzero();
      const vf mb = vset1(mall);
      for (i = 0; i + W <= V; i += W) sv = vadd(sv, vexp(vsub(vld(x + i), mb)));
      float sum = hsum(sv);
      for (; i < V; ++i) sum += std::exp(x[i] - mall);
      S[b] = nan ? NAN : std::isfinite(mall) ? mall + std::log(sum) : mall;
      // the greedy pick with the banned ids at -inf: the maximum between them, then its ties
      float m = mall;
      if (!banned.empty()) {
        m = -INFINITY;
        int64_t a = 0;
        for (int64_t id : banned) {
          m = std::max(m, range_max(x, a, id));
          a = id + 1;
        }
        m = std::max(m, range_max(x, a, V));
      }
      int64_t first = -1, n = 0, a = 0;
      for (int64_t id : banned) {
        range_ties(x, a, id, m, first, n);
        if (m == -INFINITY) {  // a banned entry is -inf, equal to an all -inf row's maximum
          if (first < 0) first = id;
          ++n;
        }
        a = id + 1;
      }
      range_ties(x, a, V, m, first, n);
      T[b] = first < 0 ? 0 : first;
      Bv[b] = m;
      C[b] = nan ? -1 : n;
    }
  });
  return {tok, best, lse, ties};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto gg = m.def_submodule("ggml", "products with GGUF weights as the file stores them (ggml_cpu.cpp)");
  kvserve_ggml::register_module(gg);
  m.def("greedy_stats", &greedy_stats, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("embed_rows", &embed_rows);
  m.def("quantize", &quantize);
  m.def("proj_mm", &proj_mm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("head_mm", &head_mm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("ISA") = W == 16 ? "avx512" : "avx2";
  m.attr("LAYOUT") = LAYOUT;  // the weights' layout the step reads: "tile16" (AVX512) or "pair"
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, std::vector<std::vector<kvserve_ggml::Matrix*>>,
                          int64_t, int64_t, int64_t, double>())
      .def("step", &Decoder::step, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("step_lora", &Decoder::step_lora, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_lora", &Decoder::set_lora)
      .def("remove_lora", &Decoder::remove_lora)
      .def("lora_ids", &Decoder::lora_ids)
      .def("set_head", &Decoder::set_head)
      .def("set_qk_norm", &Decoder::set_qk_norm)
      .def("set_moe", &Decoder::set_moe)
      .def("set_head_matrix", &Decoder::set_head_matrix)
      .def("logits", &Decoder::logits, pybind11::call_guard<pybind11::gil_scoped_release>());
}
