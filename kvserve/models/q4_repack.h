// Q4_0 repacked at load for the AVX512-VNNI build (ggml_cpu.cpp's Matrix, repack=True): lanes are weight
// rows, one float chain per output. llama.cpp repacks Q4_0 the same way (q4_0_8x8 interleaved rows, the
// same size); this layout is our own.
//
// Layout: rows in groups of 16; group G (rows 16 G .. 16 G + 15, nb = K / 32 blocks each) takes nb * 288
// bytes (the file's 16 * nb * 18) at G * nb * 288: first the scales, block b's 16 fp16 d (row r at 2 r) at
// 32 b, then the quants from nb * 32: block b's 256 bytes at nb * 32 + 256 b, four 64-byte vectors, vector
// j's dword r = row r's quant bytes 4 j .. 4 j + 3 (the file's: low nibbles values 4 j .. 4 j + 3, high
// nibbles values 16 + 4 j .. 16 + 4 j + 3; u = w + 8, unsigned).
//
// Arithmetic (every row count, every MR: row i of an M-row product is the one-row product bit for bit):
// per output row and block b, S = sum_t u_t q_t - 8 sum_t q_t (exact int32: vpdpbusd's u8 x s8 sums, the
// -8 sum(q) the sum's start), then acc = fma(float(S), d_w * d_x, acc) over b in order from acc = +0.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvserve_q4r {

constexpr int64_t GROUP = 16;   // rows per group
constexpr int64_t BLOCK = 288;  // bytes per group and block (16 x 18)

// 16 file rows (src: row stride rb = nb * 18 bytes) -> one group (dst, nb * 288 bytes)
inline void repack_group(const uint8_t* src, int64_t nb, uint8_t* dst) {
  const int64_t rb = nb * 18;
  uint8_t* sc = dst;
  uint8_t* qs = dst + nb * 32;
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < 16; ++r) {
      const uint8_t* blk = src + r * rb + 18 * b;
      std::memcpy(sc + 32 * b + 2 * r, blk, 2);
      for (int j = 0; j < 4; ++j) std::memcpy(qs + 256 * b + 64 * j + 4 * r, blk + 2 + 4 * j, 4);
    }
  }
}

// the same group's file rows back (tests: the layout round-trips)
inline void unpack_group(const uint8_t* g, int64_t nb, uint8_t* dst) {
  const int64_t rb = nb * 18;
  const uint8_t* sc = g;
  const uint8_t* qs = g + nb * 32;
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < 16; ++r) {
      uint8_t* blk = dst + r * rb + 18 * b;
      std::memcpy(blk, sc + 32 * b + 2 * r, 2);
      for (int j = 0; j < 4; ++j) std::memcpy(blk + 2 + 4 * j, qs + 256 * b + 64 * j + 4 * r, 4);
    }
}

// prefetch distance (bytes) ahead in a group's quants, into L2
constexpr int64_t RQ_PREFETCH = 1536;

inline __m512i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// the activations in tiles of 16 rows (rq40_acts): tile t, block b, row r (of the tile) at (t nb + b) 16 + r:
// 32 q int8 at 32 x that, c (-8 sum q) and dx at that; the kernel's addresses are then a base per block
// and constant offsets (no register per row)
inline void rq40_acts(const int8_t* q, const float* d, int64_t M, int64_t K, int8_t* X, int32_t* C, float* D) {
  const int64_t nb = K / 32, T = (M + 15) / 16;
  std::memset(X, 0, T * nb * 16 * 32);
  std::memset(C, 0, T * nb * 16 * 4);
  std::memset(D, 0, T * nb * 16 * 4);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = ((m / 16) * nb + b) * 16 + m % 16;
      const int8_t* xb = q + m * K + 32 * b;
      std::memcpy(X + 32 * i, xb, 32);
      int t = 0;
      for (int k = 0; k < 32; ++k) t += xb[k];
      C[i] = -8 * t;
      D[i] = d[m * nb + b];
    }
}

// one group g (nb blocks) against MR activation rows of one tile (q, c, dx: the first row's entries of
// block 0 in rq40_acts' layout) -> out[r * ldo + lane] for the lanes in km (masked stores: the other
// lanes' memory is not written)
template <int MR>
inline void rq40_group(const uint8_t* g, int64_t nb, const int8_t* q, const float* dx, const int32_t* c,
                       float* out, int64_t ldo, __mmask16 km) {
  const uint8_t* sc = g;
  const uint8_t* qs = g + nb * 32;
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = qs + 256 * b;
    if constexpr (MR <= 2) {  // decode: the next group's same bytes, into L2 (see RQ_PREFETCH)
      const int64_t ahead = nb * BLOCK;
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 128), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 192), _MM_HINT_T1);
      if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(sc + 32 * b + ahead), _MM_HINT_T1);
    }
    const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
    const __m512i v2 = _mm512_loadu_si512(p + 128), v3 = _mm512_loadu_si512(p + 192);
    const __m512i l0 = _mm512_and_si512(v0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
    const __m512i l1 = _mm512_and_si512(v1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
    const __m512i l2 = _mm512_and_si512(v2, m4), h2 = _mm512_and_si512(_mm512_srli_epi16(v2, 4), m4);
    const __m512i l3 = _mm512_and_si512(v3, m4), h3 = _mm512_and_si512(_mm512_srli_epi16(v3, 4), m4);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32 * b)));
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = q + 512 * b + 32 * r;
      // S is an exact int32 sum: one chain or two (the latency of one row alone) give the same bits
      __m512i s0 = _mm512_set1_epi32(c[16 * b + r]);
      s0 = _mm512_dpbusd_epi32(s0, l0, bcast32(x));
      __m512i s1 = MR >= 4 ? s0 : _mm512_setzero_si512();
      s1 = _mm512_dpbusd_epi32(s1, h0, bcast32(x + 16));
      s0 = MR >= 4 ? s1 : s0;
      s0 = _mm512_dpbusd_epi32(s0, l1, bcast32(x + 4));
      s1 = MR >= 4 ? s0 : s1;
      s1 = _mm512_dpbusd_epi32(s1, h1, bcast32(x + 20));
      s0 = MR >= 4 ? s1 : s0;
      s0 = _mm512_dpbusd_epi32(s0, l2, bcast32(x + 8));
      s1 = MR >= 4 ? s0 : s1;
      s1 = _mm512_dpbusd_epi32(s1, h2, bcast32(x + 24));
      s0 = MR >= 4 ? s1 : s0;
      s0 = _mm512_dpbusd_epi32(s0, l3, bcast32(x + 12));
      s1 = MR >= 4 ? s0 : s1;
      s1 = _mm512_dpbusd_epi32(s1, h3, bcast32(x + 28));
      const __m512i S = MR >= 4 ? s1 : _mm512_add_epi32(s0, s1);
      const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(dx[16 * b + r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), d, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, km, acc[r]);
}

// groups of a repacked part (W: group 0; nb blocks) against M activation rows (rq40_acts' tiles, from
// the first): output rows [n, e) of the
// part (0-based in the part) -> Y[r * ldo + i - n] for row i. Activation rows 16 or 8 at a time per group
// (each loaded weight vector unpacked once for all of them), the last M % 8 together.
inline void rq40_rows(const uint8_t* W, int64_t nb, int64_t n, int64_t e, int64_t M, const int8_t* q,
                      const float* dx, const int32_t* c, float* Y, int64_t ldo) {
  for (int64_t G = n / GROUP; G * GROUP < e; ++G) {
    const int64_t g0 = G * GROUP, a = n > g0 ? n - g0 : 0, z = e < g0 + GROUP ? e - g0 : GROUP;
    const __mmask16 km = static_cast<__mmask16>(((1u << z) - 1) & ~((1u << a) - 1));
    const uint8_t* g = W + G * nb * BLOCK;
    float* y = Y + (g0 - n);  // lanes a .. z - 1 land on rows n .. e - 1 (the others masked)
    auto run = [&](auto mr, int64_t r) {
      constexpr int MR = decltype(mr)::value;
      const int64_t i = (r / 16) * nb * 16 + r % 16;  // row r's entry of block 0 (rq40_acts)
      rq40_group<MR>(g, nb, q + 32 * i, dx + i, c + i, y + r * ldo, ldo, km);
    };
    int64_t r = 0;  // 16 at a time: each weight vector unpacked once per 16 rows (8: 8% more CPU at M = 16)
    for (; r + 16 <= M; r += 16) run(std::integral_constant<int, 16>{}, r);
    for (; r + 8 <= M; r += 8) run(std::integral_constant<int, 8>{}, r);
    switch (M - r) {
      case 7: run(std::integral_constant<int, 7>{}, r); break;
      case 6: run(std::integral_constant<int, 6>{}, r); break;
      case 5: run(std::integral_constant<int, 5>{}, r); break;
      case 4: run(std::integral_constant<int, 4>{}, r); break;
      case 3: run(std::integral_constant<int, 3>{}, r); break;
      case 2: run(std::integral_constant<int, 2>{}, r); break;
      case 1: run(std::integral_constant<int, 1>{}, r); break;
      default: break;
    }
  }
}

}  // namespace kvserve_q4r
