// Prefill-sized products on GGUF blocks: y[M, N] = x[M, K] @ W[N, K]^T for large M, on the file's
// blocks as they are (no repacked or dense copy of W), with AVX512-BF16 dot products.
//
// Included by ggml_cpu.cpp inside its namespace, after the block types (it uses their unpacking
// helpers: h2f, nibbles, bits32, table16, scales_mins_k4, e8m0_half, the BQ* structs). Compiled only
// where the build has AVX512-BF16 (GG_GEMM defined); elsewhere Matrix::mm keeps its per-row kernels
// at every row count.
//
// Arithmetic (differs from the per-row kernels, whose activations are q8_0 / q8_K):
//   * each activation rounded to bfloat16 (round to nearest even);
//   * each weight dequantized in float32 (w = scale * q - offset, one fused multiply-add, the scale
//     and offset of its block / sub-block as llama.cpp's dequantize_row_* forms them) and rounded to
//     bfloat16 (BF16 weights are taken as they are);
//   * y[m, n] = the float32 sum of the products over k in one fixed order (vdpbf16ps: k pairs
//     (2p, 2p + 1) in turn, in one lane), the same whatever M is and whatever the other rows are:
//     row i of any product of this path equals the one-row product of this path bit for bit.
// F16 weights are not taken here (rounding them to bfloat16 would lose 3 bits): they stay on the
// per-row kernels.
//
// Layout: per call, x is converted once to bfloat16 tiles of 32 rows, [K/2][32] pairs (row m's
// (x[m, 2p], x[m, 2p + 1]) at [p][m]); rows past M are zeros (M x K x 2 bytes, like x's own size).
// Work is split over groups of up to 4 panels of NR = 12 weight rows on kvserve's pool; a thread
// dequantizes a group's rows into a buffer of bfloat16 values (at most 48 x K: 192 KiB at K = 2048,
// 768 KiB at K = 8192) and runs the micro-kernel, 32 rows (two 16-lane accumulators) x NR weight rows,
// each weight pair broadcast to every lane, block of K by block of K over every tile, the partial
// sums in a buffer of 48 x M floats (96 KiB at M = 512).

#if defined(__AVX512BF16__) && defined(GG_VNNI)
#define GG_GEMM 1

namespace gemm {

constexpr int NR = 12;  // weight rows per panel (24 accumulators + 2 activation registers)
constexpr int MT = 32;  // activation rows per tile

// 32 values (int8 when SIGNED, else uint8) times s0 (values 0-15) / s1 (16-31), minus o0 / o1 ->
// 32 bfloat16 at out
template <bool SIGNED>
inline void put32(__m256i v, float s0, float s1, float o0, float o1, uint16_t* out) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m512i a = SIGNED ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
  const __m512i b = SIGNED ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
  const __m512 f0 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(s0), _mm512_set1_ps(o0));
  const __m512 f1 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(s1), _mm512_set1_ps(o1));
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}

template <class T>
void deq32(const uint8_t* w, int64_t K, uint16_t* out) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float d, m = 0.f;
    const __m256i v = T::vals(w + b * T::BYTES, d, m);
    put32<T::SIGNED>(v, d, d, -m, -m, out + 32 * b);
  }
}

template <bool FIVE>
void deq_q45k(const uint8_t* w, int64_t K, uint16_t* out) {
  constexpr int BYTES = FIVE ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < K / 256; ++b, out += 256) {
    const uint8_t* blk = w + b * BYTES;
    const float d = h2f(blk), dmin = h2f(blk + 2);
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    uint8_t sc[8], mn[8];
    scales_mins_k4(blk + 4, sc, mn);
    const __m256i qh = FIVE ? load32(blk + 16) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i q = load32(qs + 32 * p);
      __m256i u0 = _mm256_and_si256(q, m4), u1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (FIVE) {
        u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
        u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
      }
      const float s0 = d * sc[2 * p], o0 = dmin * mn[2 * p], s1 = d * sc[2 * p + 1], o1 = dmin * mn[2 * p + 1];
      put32<false>(u0, s0, s0, o0, o0, out + 64 * p);
      put32<false>(u1, s1, s1, o1, o1, out + 64 * p + 32);
    }
  }
}

void deq_q6k(const uint8_t* w, int64_t K, uint16_t* out) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < K / 256; ++b, out += 256) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h2f(blk + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), qh = load32(blk + 128 + 32 * h);
      __m256i u[4];  // values 0..63 of elements 128 h + 32 j ..
      u[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      u[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * h + j;
        const float s0 = d * sc[2 * k], s1 = d * sc[2 * k + 1];
        put32<false>(u[j], s0, s1, 32.f * s0, 32.f * s1, out + 32 * k);
      }
    }
  }
}

void deq_q2k(const uint8_t* w, int64_t K, uint16_t* out) {
  const __m256i m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < K / 256; ++b, out += 256) {
    const uint8_t* blk = w + b * 84;
    const float d = h2f(blk + 80), dmin = h2f(blk + 82);
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(blk + 16 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * n + j;
        const uint8_t sa = blk[2 * k], sb = blk[2 * k + 1];
        put32<false>(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m2), d * (sa & 0xF), d * (sb & 0xF),
                     dmin * (sa >> 4), dmin * (sb >> 4), out + 32 * k);
      }
    }
  }
}

void deq_q3k(const uint8_t* w, int64_t K, uint16_t* out) {
  const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < K / 256; ++b, out += 256) {
    const uint8_t* blk = w + b * 110;
    const uint8_t* s = blk + 96;
    const float d = h2f(blk + 108);
    float sc[16];
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? (s[g] & 0xF) : (s[g - 8] >> 4);
      const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
      sc[g] = d * static_cast<float>((low | (high << 4)) - 32);
    }
    const __m256i hm = load32(blk);
    for (int n = 0; n < 2; ++n) {
      const __m256i q = load32(blk + 32 + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * n + j;
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * n + j), one);
        const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m2), _mm256_slli_epi16(hb, 2));
        put32<false>(u, sc[2 * k], sc[2 * k + 1], 4.f * sc[2 * k], 4.f * sc[2 * k + 1], out + 32 * k);
      }
    }
  }
}

void deq_iq4xs(const uint8_t* w, int64_t K, uint16_t* out) {
  const __m256i tab = table16(kIQ4NL);
  for (int64_t b = 0; b < K / 256; ++b, out += 256) {
    const uint8_t* blk = w + b * 136;
    const float d = h2f(blk);
    uint16_t sh;
    std::memcpy(&sh, blk + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const float s = d * static_cast<float>((((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32);
      put32<true>(_mm256_shuffle_epi8(tab, nibbles(blk + 8 + 16 * j)), s, s, 0.f, 0.f, out + 32 * j);
    }
  }
}

// true for the types this path dequantizes (every type of type_info but F16)
inline bool has_type(int t) {
  switch (t) {
    case T_BF16: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_IQ4_NL: case T_MXFP4:
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS:
      return true;
    default:
      return false;
  }
}

// one weight row of type t (K values) -> K bfloat16 at out
void dequantize_row(int t, const uint8_t* w, int64_t K, uint16_t* out) {
  switch (t) {
    case T_BF16: std::memcpy(out, w, 2 * K); return;
    case T_Q4_0: return deq32<BQ4_0>(w, K, out);
    case T_Q4_1: return deq32<BQ4_1>(w, K, out);
    case T_Q5_0: return deq32<BQ5_0>(w, K, out);
    case T_Q5_1: return deq32<BQ5_1>(w, K, out);
    case T_Q8_0: return deq32<BQ8_0>(w, K, out);
    case T_IQ4_NL: return deq32<BIQ4_NL>(w, K, out);
    case T_MXFP4: return deq32<BMXFP4>(w, K, out);
    case T_Q2_K: return deq_q2k(w, K, out);
    case T_Q3_K: return deq_q3k(w, K, out);
    case T_Q4_K: return deq_q45k<false>(w, K, out);
    case T_Q5_K: return deq_q45k<true>(w, K, out);
    case T_Q6_K: return deq_q6k(w, K, out);
    case T_IQ4_XS: return deq_iq4xs(w, K, out);
    default: throw std::runtime_error("ggml_cpu gemm: no dequantization for ggml type " + std::to_string(t));
  }
}

// rows [m0, m0 + 32) of x (float32 [M, K], K even) -> one tile, uint32 [K/2][32] of bfloat16 pairs
void pack_tile(const float* x, int64_t M, int64_t K, int64_t m0, uint32_t* tile) {
  const int64_t K2 = K / 2;
  constexpr int64_t PC = 64;  // pairs per pass: 64 lines of the tile (8 KiB) stay in L1 while 32 rows write them
  alignas(64) uint32_t buf[16];
  for (int64_t p0 = 0; p0 < K2; p0 += PC) {
    const int64_t p1 = std::min(K2, p0 + PC);
    for (int64_t i = 0; i < MT; ++i) {
      const int64_t m = m0 + i;
      if (m >= M) {
        for (int64_t p = p0; p < p1; ++p) tile[p * MT + i] = 0;
        continue;
      }
      const float* xr = x + m * K;
      int64_t p = p0;
      for (; p + 16 <= p1; p += 16) {
        const __m512 a = _mm512_loadu_ps(xr + 2 * p), b = _mm512_loadu_ps(xr + 2 * p + 16);
        _mm512_store_si512(buf, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        for (int j = 0; j < 16; ++j) tile[(p + j) * MT + i] = buf[j];
      }
      for (; p < p1; ++p) {
        const __m512 a = _mm512_maskz_loadu_ps(0x3, xr + 2 * p);
        _mm512_store_si512(buf, (__m512i)_mm512_cvtne2ps_pbh(a, a));
        tile[p * MT + i] = buf[0];
      }
    }
  }
}

// one tile's pairs [p0, p0 + K2) (uint32 [K2][32], row stride 32) x NR_ weight rows (bfloat16,
// row n at w + n * ldw, the same K range) -> c float [NR_][32]; with `add` the sums continue from
// c's values (a float32 store and load: the same sums as one pass over K)
template <int NR_>
void micro(const uint32_t* tile, const uint16_t* w, int64_t ldw, int64_t K, float* c, bool add) {
  __m512 acc[NR_][2];
  for (int n = 0; n < NR_; ++n) {
    acc[n][0] = add ? _mm512_loadu_ps(c + n * MT) : _mm512_setzero_ps();
    acc[n][1] = add ? _mm512_loadu_ps(c + n * MT + 16) : _mm512_setzero_ps();
  }
  const int64_t K2 = K / 2;
  for (int64_t p = 0; p < K2; ++p) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(tile + p * MT);
    const __m512bh x1 = (__m512bh)_mm512_loadu_si512(tile + p * MT + 16);
    for (int n = 0; n < NR_; ++n) {
      int32_t wp;
      std::memcpy(&wp, w + n * ldw + 2 * p, 4);
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(wp);
      acc[n][0] = _mm512_dpbf16_ps(acc[n][0], x0, wb);
      acc[n][1] = _mm512_dpbf16_ps(acc[n][1], x1, wb);
    }
  }
  for (int n = 0; n < NR_; ++n) {
    _mm512_storeu_ps(c + n * MT, acc[n][0]);
    _mm512_storeu_ps(c + n * MT + 16, acc[n][1]);
  }
}

void micro_n(int nr, const uint32_t* tile, const uint16_t* w, int64_t ldw, int64_t K, float* c, bool add) {
  switch (nr) {
    case 12: return micro<12>(tile, w, ldw, K, c, add);
    case 11: return micro<11>(tile, w, ldw, K, c, add);
    case 10: return micro<10>(tile, w, ldw, K, c, add);
    case 9: return micro<9>(tile, w, ldw, K, c, add);
    case 8: return micro<8>(tile, w, ldw, K, c, add);
    case 7: return micro<7>(tile, w, ldw, K, c, add);
    case 6: return micro<6>(tile, w, ldw, K, c, add);
    case 5: return micro<5>(tile, w, ldw, K, c, add);
    case 4: return micro<4>(tile, w, ldw, K, c, add);
    case 3: return micro<3>(tile, w, ldw, K, c, add);
    case 2: return micro<2>(tile, w, ldw, K, c, add);
    default: return micro<1>(tile, w, ldw, K, c, add);
  }
}

// a row block of W: rows [first, first + rows) of the matrix, each row_bytes long, of ggml type
struct Rows {
  const uint8_t* data;
  int type;
  int64_t first, rows, row_bytes;
};

// y [M, N] = x [M, K] @ W^T, W's rows in `parts` (each type has_type; K a multiple of the types'
// blocks, even). A thread takes groups of G panels (G x NR rows, dequantized once); for each block of
// KC values of K, each tile's chunk of pairs (32 KiB) serves the G panels while in L1, so the
// activations stream from L3 once per group rather than once per panel.
void mm(const std::vector<Rows>& parts, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  constexpr int64_t KC = 512;
  const int64_t tiles = (M + MT - 1) / MT, K2 = K / 2;
  std::vector<uint32_t> xt(static_cast<size_t>(tiles) * MT * K2);
  kvserve_pool::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) pack_tile(x, M, K, t * MT, xt.data() + t * MT * K2);
  });
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t G = std::clamp<int64_t>(panels / (8 * std::max(1, at::get_num_threads())), 1, 4);
  const int64_t groups = (panels + G - 1) / G;
  kvserve_pool::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    // rows K + 32 values apart: at K a multiple of 2048 the NR rows' lines would share L1 sets
    // (4 KiB apart), and 12 streams in 8 ways evict each other at every pair
    const int64_t ldw = K + 32;
    std::vector<uint16_t> wbuf(static_cast<size_t>(G * NR) * ldw);
    std::vector<float> cbuf(static_cast<size_t>(G * tiles) * NR * MT);
    size_t pi = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t qb = g * G, qe = std::min(panels, qb + G);
      const int64_t nb = qb * NR, ne = std::min(N, qe * NR);
      for (int64_t n = nb; n < ne; ++n) {
        while (n >= parts[pi].first + parts[pi].rows) ++pi;
        const Rows& p = parts[pi];
        dequantize_row(p.type, p.data + (n - p.first) * p.row_bytes, K, wbuf.data() + (n - nb) * ldw);
      }
      for (int64_t kc = 0; kc < K; kc += KC) {
        const int64_t kl = std::min(KC, K - kc);
        for (int64_t t = 0; t < tiles; ++t)
          for (int64_t q = qb; q < qe; ++q) {
            const int nr = static_cast<int>(std::min<int64_t>(NR, N - q * NR));
            micro_n(nr, xt.data() + t * MT * K2 + kc / 2 * MT, wbuf.data() + (q - qb) * NR * ldw + kc, ldw, kl,
                    cbuf.data() + ((q - qb) * tiles + t) * NR * MT, kc > 0);
          }
      }
      for (int64_t q = qb; q < qe; ++q) {
        const int64_t n0 = q * NR, nr = std::min<int64_t>(NR, N - n0);
        for (int64_t t = 0; t < tiles; ++t) {
          const float* c = cbuf.data() + ((q - qb) * tiles + t) * NR * MT;
          const int64_t mv = std::min<int64_t>(MT, M - t * MT);
          for (int64_t i = 0; i < mv; ++i) {
            float* yr = y + (t * MT + i) * N + n0;
            for (int64_t n = 0; n < nr; ++n) yr[n] = c[n * MT + i];
          }
        }
      }
    }
  });
}

}  // namespace gemm

#endif
