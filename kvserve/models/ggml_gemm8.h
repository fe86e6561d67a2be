// Prefill-sized products on GGUF blocks with integer dot products: y[M, N] = x[M, K] @ W[N, K]^T for
// large M, the file's blocks unpacked a panel of 32 weight rows at a time into a per-thread buffer,
// AVX512-VNNI vpdpbusd (64 u8 x s8 products per instruction, twice vdpbf16ps's rate).
//
// Included by ggml_cpu.cpp inside its namespace, after the block types (it uses h2f, nibbles, table16,
// scales_mins_k4, the BQ* structs) and q8_quant.h (the activations' quantization). Compiled
// in every AVX512-VNNI build (GG_VNNI: AVX512F/BW/VL + VNNI; it needs no AVX512-BF16, unlike the
// bfloat16 path: Cascade Lake and Ice Lake have it too); Matrix::mm picks this one where every part's
// type has it (has_type: all but F16 and BF16).
//
// Arithmetic: llama.cpp's. Activations quantized by the per-row kernels' own functions (q8_quant.h:
// q8_K for Q2_K..Q6_K and IQ4_XS, q8_0 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4), with the
// blocks' integer sums this path also needs (q8_0's sums, q8_K's sums of 32).
// Per block (32 values) or super-block (256), the sum of weight quant x activation quant times the
// block's integer sub-scales is the integer llama.cpp's vec_dot forms (exact in int32; for Q5_K, Q6_K
// and IQ4_XS summed over sub-blocks in float32, exact below 2^24: see kernk), then
//   32-value blocks:  y += float(sumi) * (d_w * d_x)            [+ m_w * s_x for Q4_1 / Q5_1]
//   super-blocks:     y += float(sumi) * (d_w * d_x)            [- float(summs) * (dmin_w * d_x)]
// (summs = sum over sub-blocks of min x the activations' sums, Q2_K / Q4_K / Q5_K), each y[m, n]
// summed over its blocks in order, one float32 chain: the same whatever M is and whatever the other
// rows are (row i of any product of this path equals its one-row product of this path bit for bit).
// Not bit-equal to the per-row kernels (they sum 8 or 16 lanes of partial integers per block, then a
// horizontal sum): the same integers, another float order (differences of a few float32 ulps), except
// for Q8_0 (its decode kernels, q80_x8 / q80_rows below, form this chain: the same bits) and Q4_K
// (panel_exact / KChain's order).
//
// Layout: lanes are weight rows. A panel of NP = 32 rows of one part is unpacked per thread into
//   w  uint8 [K/4][32][4]: each weight's quant made non-negative (signed types + 128, Q6_K's 0..63,
//      Q3_K's 0..7): one 64-byte load gives 16 rows x 4 values, the u8 operand of vpdpbusd;
//   per (super-)block: d (and dmin / m) float [32], integer sub-scales int32 [groups][32], Q2_K/Q4_K/
//      Q5_K's mins as int16 pairs [pairs][32].
// The offsets taken out of the quants (128, 32, 4) return through the accumulators' start values
// (-offset x the activations' sums of the group). The micro-kernel: MR = 4 activation rows x 32 weight
// rows, each 4 activation bytes broadcast from the q8 row ({1to16}), two vpdpbusd per broadcast; per
// sub-block an int32 accumulator, multiplied by the sub-block's scale into the super-block's sum.
// Measured on one Zen 4 core at 512 x 2048 x 2048 (CPU time): Q4_K 277 GFLOP/s, Q6_K 290, Q8_0 296,
// Q4_0 305; the bfloat16 path 185-198 on the same shapes. With kernk's sums in y and the panel's
// vectors pinned (below), best of 4 interleaved runs on a shared machine, 512 rows: Q4_K 268 (2048 x
// 2048), 285 (8192 x 2048), 286 (2048 x 8192) against 258, 278, 271 before. vpdpbusd's own rate here
// is 3.6 G/s (464 GOPS): Q6_K's 16-value sub-blocks (a convert and an FMA per 4 vpdpbusd) bound it
// near 300.

#ifdef GG_VNNI
#define GG_GEMM8 1

namespace gemm8 {


constexpr int NP = 32;  // weight rows per panel (two 16-lane vectors)
constexpr int MR = 4;   // activation rows per micro-kernel call

// the quantized activations of one product (row-major, the per-row kernels' layout)
struct Acts {
  int64_t K = 0;
  // q8_0: q [M, K], d [M, K/32] (float16 values), s [M, K/32] (q8_1's float16 s), sum int32 [M, K/32]
  std::vector<int8_t> q0;
  std::vector<float> d0, s0;
  std::vector<int32_t> sum0;
  // q8_K: q [M, K], d [M, K/256], bs int16 [M, K/16], bsp int16 [M, K/32] (sums of 32)
  std::vector<int8_t> qk;
  std::vector<float> dk;
  std::vector<int16_t> bs, bsp;
};

// how a type's panel is laid out and summed (see the file's comment)
enum Kind { K32, KK };
struct Traits {
  Kind kind;
  int group;   // KK: values per integer sub-scale (16 or 32)
  int off;     // subtracted from every stored quant (the accumulators start at -off x the group's sum)
  int mins;    // KK: 0, or the values per min (32: Q4_K/Q5_K, 16: Q2_K); K32: 1 for Q4_1/Q5_1's m
};

inline bool traits(int t, Traits& tr) {
  switch (t) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL: case T_MXFP4: tr = {K32, 32, 128, 0}; return true;
    case T_Q4_1: case T_Q5_1: tr = {K32, 32, 0, 1}; return true;
    case T_Q4_K: case T_Q5_K: tr = {KK, 32, 0, 32}; return true;
    case T_Q6_K: tr = {KK, 16, 32, 0}; return true;
    case T_Q2_K: tr = {KK, 16, 0, 16}; return true;
    case T_Q3_K: tr = {KK, 16, 4, 0}; return true;
    case T_IQ4_XS: tr = {KK, 32, 128, 0}; return true;
    default: return false;
  }
}

inline bool has_type(int t) {
  Traits tr;
  return traits(t, tr);
}

// one thread's unpacked panel
struct Panel {
  std::vector<uint8_t> w;       // [K/4][NP][4]
  std::vector<float> d, dm;     // [blocks][NP]
  std::vector<int32_t> sc, mn;  // [blocks][groups][NP], [blocks][pairs][NP]
  std::vector<uint8_t> row;     // the rows' quants, [NP][K]
};

// ---------------------------------------------------------------- unpacking one weight row (lane n)

inline void store32(uint8_t* row, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), v); }

template <class T>
void row32(const uint8_t* w, int64_t K, int n, Panel& p) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < K / 32; ++b) {
    float d, m = 0.f;
    const __m256i v = T::vals(w + b * T::BYTES, d, m);
    store32(p.row.data() + n * K + 32 * b, T::SIGNED ? _mm256_xor_si256(v, flip) : v);
    p.d[b * NP + n] = d;
    if (T::MIN) p.dm[b * NP + n] = m;
  }
}

template <bool FIVE>
void row_q45k(const uint8_t* w, int64_t K, int n, Panel& p) {
  constexpr int BYTES = FIVE ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = w + b * BYTES;
    p.d[b * NP + n] = h2f(blk);
    p.dm[b * NP + n] = h2f(blk + 2);
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    uint8_t sc[8], mn[8];
    scales_mins_k4(blk + 4, sc, mn);
    for (int j = 0; j < 8; ++j) p.sc[(b * 8 + j) * NP + n] = sc[j];
    for (int j = 0; j < 4; ++j) p.mn[(b * 4 + j) * NP + n] = mn[2 * j] | (static_cast<int32_t>(mn[2 * j + 1]) << 16);
    const __m256i qh = FIVE ? load32(blk + 16) : _mm256_setzero_si256();
    uint8_t* out = p.row.data() + n * K + 256 * b;
    for (int q = 0; q < 4; ++q) {
      const __m256i v = load32(qs + 32 * q);
      __m256i u0 = _mm256_and_si256(v, m4), u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (FIVE) {
        u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * q), one), 4));
        u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * q + 1), one), 4));
      }
      store32(out + 64 * q, u0);
      store32(out + 64 * q + 32, u1);
    }
  }
}

void row_q6k(const uint8_t* w, int64_t K, int n, Panel& p) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    p.d[b * NP + n] = h2f(blk + 208);
    for (int g = 0; g < 16; ++g) p.sc[(b * 16 + g) * NP + n] = sc[g];
    uint8_t* out = p.row.data() + n * K + 256 * b;
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), qh = load32(blk + 128 + 32 * h);
      store32(out + 128 * h, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)));
      store32(out + 128 * h + 32, _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                  _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)));
      store32(out + 128 * h + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                  _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)));
      store32(out + 128 * h + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                  _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)));
    }
  }
}

void row_q2k(const uint8_t* w, int64_t K, int n, Panel& p) {
  const __m256i m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = w + b * 84;
    p.d[b * NP + n] = h2f(blk + 80);
    p.dm[b * NP + n] = h2f(blk + 82);
    for (int g = 0; g < 16; ++g) p.sc[(b * 16 + g) * NP + n] = blk[g] & 0xF;
    for (int j = 0; j < 8; ++j) p.mn[(b * 8 + j) * NP + n] = (blk[2 * j] >> 4) | (static_cast<int32_t>(blk[2 * j + 1] >> 4) << 16);
    uint8_t* out = p.row.data() + n * K + 256 * b;
    for (int h = 0; h < 2; ++h) {
      const __m256i q = load32(blk + 16 + 32 * h);
      for (int j = 0; j < 4; ++j) store32(out + 32 * (4 * h + j), _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m2));
    }
  }
}

void row_q3k(const uint8_t* w, int64_t K, int n, Panel& p) {
  const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = w + b * 110;
    const uint8_t* s = blk + 96;
    p.d[b * NP + n] = h2f(blk + 108);
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? (s[g] & 0xF) : (s[g - 8] >> 4);
      const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
      p.sc[(b * 16 + g) * NP + n] = (low | (high << 4)) - 32;
    }
    const __m256i hm = load32(blk);
    uint8_t* out = p.row.data() + n * K + 256 * b;
    for (int h = 0; h < 2; ++h) {
      const __m256i q = load32(blk + 32 + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one);
        store32(out + 32 * (4 * h + j),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m2), _mm256_slli_epi16(hb, 2)));
      }
    }
  }
}

void row_iq4xs(const uint8_t* w, int64_t K, int n, Panel& p) {
  const __m256i tab = table16(kIQ4NL), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = w + b * 136;
    p.d[b * NP + n] = h2f(blk);
    uint16_t sh;
    std::memcpy(&sh, blk + 2, 2);
    uint8_t* out = p.row.data() + n * K + 256 * b;
    for (int j = 0; j < 8; ++j) {
      p.sc[(b * 8 + j) * NP + n] = (((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
      store32(out + 32 * j, _mm256_xor_si256(_mm256_shuffle_epi8(tab, nibbles(blk + 8 + 16 * j)), flip));
    }
  }
}

void unpack_row(int t, const uint8_t* w, int64_t K, int n, Panel& p) {
  switch (t) {
    case T_Q4_0: return row32<BQ4_0>(w, K, n, p);
    case T_Q4_1: return row32<BQ4_1>(w, K, n, p);
    case T_Q5_0: return row32<BQ5_0>(w, K, n, p);
    case T_Q5_1: return row32<BQ5_1>(w, K, n, p);
    case T_Q8_0: return row32<BQ8_0>(w, K, n, p);
    case T_IQ4_NL: return row32<BIQ4_NL>(w, K, n, p);
    case T_MXFP4: return row32<BMXFP4>(w, K, n, p);
    case T_Q4_K: return row_q45k<false>(w, K, n, p);
    case T_Q5_K: return row_q45k<true>(w, K, n, p);
    case T_Q6_K: return row_q6k(w, K, n, p);
    case T_Q2_K: return row_q2k(w, K, n, p);
    case T_Q3_K: return row_q3k(w, K, n, p);
    case T_IQ4_XS: return row_iq4xs(w, K, n, p);
    default: throw std::runtime_error("ggml_cpu gemm8: no unpacking for ggml type " + std::to_string(t));
  }
}

// rows [0, nr) of a panel from `w` (row_bytes apart); rows nr..NP-1 zero (scales 0: they add nothing)
// 16 vectors of 16 uint32 (rows) -> their transpose, in place (vector c: element c of every row)
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xDD);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
  }
}

// rows [0, nr) of a panel from `w` (row_bytes apart); rows nr..NP-1 zero (scales 0: they add nothing).
// Each row's quants are unpacked to p.row [NP][K], then moved to the [K/4][NP][4] layout 16 rows x 16
// groups of 4 at a time (a 16 x 16 transpose of uint32: 64 shuffles for 256 values; one scattered
// 4-byte store per value took ~5% of a 512-row Q4_K product)
void unpack_panel(int t, const Traits& tr, const uint8_t* w, int64_t row_bytes, int nr, int64_t K, Panel& p) {
  const int64_t nb = tr.kind == K32 ? K / 32 : K / 256;
  const int groups = tr.kind == K32 ? 0 : 256 / tr.group;
  const int pairs = tr.mins == 32 ? 4 : tr.mins == 16 ? 8 : 0;
  p.w.resize(static_cast<size_t>(K) * NP);
  p.row.resize(static_cast<size_t>(K) * NP);
  p.d.assign(nb * NP, 0.f);
  p.dm.assign(nb * NP, 0.f);
  p.sc.assign(nb * groups * NP, 0);
  p.mn.assign(nb * pairs * NP, 0);
  for (int n = 0; n < nr; ++n) unpack_row(t, w + n * row_bytes, K, n, p);
  if (nr < NP) std::memset(p.row.data() + nr * K, 0, (NP - nr) * K);
  for (int h = 0; h < NP / 16; ++h)
    for (int64_t j = 0; j < K / 64; ++j) {  // 64 bytes of 16 rows -> 16 groups of 4 x 16 rows
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(p.row.data() + (16 * h + i) * K + 64 * j);
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(p.w.data() + ((16 * j + c) * NP + 16 * h) * 4, r[c]);
    }
  uint32_t* wq = reinterpret_cast<uint32_t*>(p.w.data());
  for (int n = 0; n < NP; ++n) {  // K not a multiple of 64 (32-value types): the last 8 groups of 4
    const uint32_t* r = reinterpret_cast<const uint32_t*>(p.row.data() + n * K);
    for (int64_t k4 = K / 64 * 16; k4 < K / 4; ++k4) wq[k4 * NP + n] = r[k4];
  }
}

// ---------------------------------------------------------------- the micro-kernels

inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// the panel's vectors stay in registers once loaded: without this GCC reloads them from L2 before
// every vpdpbusd (8 512-bit loads per 8 vpdpbusd of 4 rows: load-bound at ~0.65 of vpdpbusd's rate)
inline void pin(__m512i& a, __m512i& b) { asm("" : "+v"(a), "+v"(b)); }

// R activation rows (m0 ..) x the panel's 32 rows, 32-value blocks -> y rows (stride ldy), lanes < nr
template <int R, int OFF, bool MIN>
void kern32(const Panel& p, const Acts& a, const int32_t* ini, int64_t m0, float* y, int64_t ldy, __mmask16 k0,
            __mmask16 k1) {
  const int64_t K = a.K, nb = K / 32;
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint8_t* w = p.w.data();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[R][2];
    for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = OFF ? _mm512_set1_epi32(ini[(m0 + i) * nb + b]) : _mm512_setzero_si512();
    const uint8_t* wb = w + b * 32 * NP;
    for (int t = 0; t < 8; ++t) {
      __m512i w0 = _mm512_loadu_si512(wb + t * 4 * NP), w1 = _mm512_loadu_si512(wb + t * 4 * NP + 64);
      pin(w0, w1);
      for (int i = 0; i < R; ++i) {
        const __m512i x = bcast(a.q0.data() + (m0 + i) * K + b * 32 + 4 * t);
        s[i][0] = _mm512_dpbusd_epi32(s[i][0], w0, x);
        s[i][1] = _mm512_dpbusd_epi32(s[i][1], w1, x);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(p.d.data() + b * NP), d1 = _mm512_loadu_ps(p.d.data() + b * NP + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(a.d0[(m0 + i) * nb + b]);
      acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][0]), _mm512_mul_ps(d0, dx), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][1]), _mm512_mul_ps(d1, dx), acc[i][1]);
      if (MIN) {
        const __m512 sx = _mm512_set1_ps(a.s0[(m0 + i) * nb + b]);
        acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(p.dm.data() + b * NP), sx, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(p.dm.data() + b * NP + 16), sx, acc[i][1]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(y + (m0 + i) * ldy, k0, acc[i][0]);
    _mm512_mask_storeu_ps(y + (m0 + i) * ldy + 16, k1, acc[i][1]);
  }
}

// the same over super-blocks of 256: G values per integer sub-scale, OFF taken out of the quants
// (ini: -OFF x the activations' sums of G values, int32 [M, K/G]), MINS values per min (0: none).
// DP: a group's sum fits int16 in chunks of 16 values (|sum| <= 16 x max quant x 127 < 32768: Q2_K,
// Q3_K, Q4_K), so vpdpwssd multiplies it by the scale and adds it into the super-block's int32 sum in
// one instruction (the scale in the low int16 of its lane; the sum's sign-extension half times 0).
// Else (Q5_K, Q6_K, IQ4_XS) each group's int32 sum is converted to float and multiplied by its scale
// into a float sum of the super-block (vpmulld held these at about 0.75x): the products sc x sum are
// integers below 2^24, so this equals the integer sum wherever the partial sums stay below 2^24 too
// (else it differs by float32 rounding of those sums).
// Registers: the float sums of y live in y itself (read and written once per super-block, in L1), so
// the loop over a super-block holds only the group sums and the super-block's sums (4R vectors) with
// the panel's two weight vectors: with them in registers too (6R) the compiler spilled and reloaded
// the weights (Q4_K at 0.8x of Q6_K)
template <int R, int G, int OFF, int MINS, bool DP>
__attribute__((noinline)) void kernk(const Panel& p, const Acts& a, const int32_t* ini, int64_t m0, float* y, int64_t ldy, __mmask16 k0,
           __mmask16 k1) {
  constexpr int NG = 256 / G, NPAIR = MINS == 32 ? 4 : MINS == 16 ? 8 : 0, CH = DP ? 16 : G;
  static_assert(!DP || OFF == 0 || G == 16, "an offset's start value is per group");
  const int64_t K = a.K, nb = K / 256;
  const uint8_t* const w = p.w.data();
  const int32_t* const scp = p.sc.data();
  const int32_t* const mnp = p.mn.data();
  const float* const dp = p.d.data();
  const float* const dmp = p.dm.data();
  const int8_t* const xq = a.qk.data() + m0 * K;
  const float* const dk = a.dk.data() + m0 * nb;
  const int16_t* const sums = MINS == 32 ? a.bsp.data() + m0 * (K / 32) : a.bs.data() + m0 * (K / 16);
  const int64_t lds = MINS == 32 ? K / 32 : K / 16;
  const int32_t* const iv = OFF ? ini + m0 * (K / G) : nullptr;
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(y + (m0 + i) * ldy, k0, _mm512_setzero_ps());
    _mm512_mask_storeu_ps(y + (m0 + i) * ldy + 16, k1, _mm512_setzero_ps());
  }
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i tot[R][2];
    __m512 totf[R][2];
    for (int i = 0; i < R; ++i) {
      if (DP) tot[i][0] = tot[i][1] = _mm512_setzero_si512();
      else totf[i][0] = totf[i][1] = _mm512_setzero_ps();
    }
    for (int g = 0; g < NG; ++g) {
      const __m512i sc0 = _mm512_loadu_si512(scp + (b * NG + g) * NP);
      const __m512i sc1 = _mm512_loadu_si512(scp + (b * NG + g) * NP + 16);
      for (int c = 0; c < G; c += CH) {
        __m512i s[R][2];
        for (int i = 0; i < R; ++i)
          s[i][0] = s[i][1] = OFF ? _mm512_set1_epi32(iv[i * (K / G) + b * NG + g]) : _mm512_setzero_si512();
        const uint8_t* wg = w + (b * 256 + g * G + c) * NP;
        const int8_t* xg = xq + b * 256 + g * G + c;
        for (int t = 0; t < CH / 4; ++t) {
          __m512i w0 = _mm512_loadu_si512(wg + t * 4 * NP), w1 = _mm512_loadu_si512(wg + t * 4 * NP + 64);
          pin(w0, w1);
          for (int i = 0; i < R; ++i) {
            const __m512i x = bcast(xg + i * K + 4 * t);
            s[i][0] = _mm512_dpbusd_epi32(s[i][0], w0, x);
            s[i][1] = _mm512_dpbusd_epi32(s[i][1], w1, x);
          }
        }
        for (int i = 0; i < R; ++i) {
          if (DP) {
            tot[i][0] = _mm512_dpwssd_epi32(tot[i][0], s[i][0], _mm512_and_si512(sc0, lo16));
            tot[i][1] = _mm512_dpwssd_epi32(tot[i][1], s[i][1], _mm512_and_si512(sc1, lo16));
          } else {
            totf[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][0]), _mm512_cvtepi32_ps(sc0), totf[i][0]);
            totf[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][1]), _mm512_cvtepi32_ps(sc1), totf[i][1]);
          }
        }
      }
    }
    const __m512 d0 = _mm512_loadu_ps(dp + b * NP), d1 = _mm512_loadu_ps(dp + b * NP + 16);
    for (int i = 0; i < R; ++i) {
      float* yi = y + (m0 + i) * ldy;
      const __m512 dx = _mm512_set1_ps(dk[i * nb + b]);
      const __m512 t0 = DP ? _mm512_cvtepi32_ps(tot[i][0]) : totf[i][0];
      const __m512 t1 = DP ? _mm512_cvtepi32_ps(tot[i][1]) : totf[i][1];
      __m512 acc0 = _mm512_fmadd_ps(t0, _mm512_mul_ps(d0, dx), _mm512_maskz_loadu_ps(k0, yi));
      __m512 acc1 = _mm512_fmadd_ps(t1, _mm512_mul_ps(d1, dx), _mm512_maskz_loadu_ps(k1, yi + 16));
      if (MINS) {
        // summs: the mins (int16 pairs) times the activations' sums of MINS values (int16 pairs)
        const int16_t* si = sums + i * lds + b * (256 / MINS);
        __m512i ms0 = _mm512_setzero_si512(), ms1 = _mm512_setzero_si512();
        for (int j = 0; j < NPAIR; ++j) {
          int32_t pr;
          std::memcpy(&pr, si + 2 * j, 4);
          const __m512i xs = _mm512_set1_epi32(pr);
          ms0 = _mm512_dpwssd_epi32(ms0, _mm512_loadu_si512(mnp + (b * NPAIR + j) * NP), xs);
          ms1 = _mm512_dpwssd_epi32(ms1, _mm512_loadu_si512(mnp + (b * NPAIR + j) * NP + 16), xs);
        }
        const __m512 dm0 = _mm512_loadu_ps(dmp + b * NP), dm1 = _mm512_loadu_ps(dmp + b * NP + 16);
        acc0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms0), _mm512_mul_ps(dm0, dx), acc0);
        acc1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms1), _mm512_mul_ps(dm1, dx), acc1);
      }
      _mm512_mask_storeu_ps(yi, k0, acc0);
      _mm512_mask_storeu_ps(yi + 16, k1, acc1);
    }
  }
}

// the types the small-batch path takes (panel_exact, below)
inline bool exact_type(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }

// ---------------------------------------------------------------- the small-batch path, a super-block at a time
//
// The decode step's batched products (6..16 rows) read every weight once per step, so unpacking is
// paid once per weight and per step, not amortized over hundreds of rows as in prefill. Here a panel
// of NP rows is unpacked one super-block at a time (NP x 256 values: an 8 KiB Tile that stays in L1)
// straight from the file's blocks into the [64][NP][4] layout: 16 rows' packed bytes are transposed
// as uint32 first (transpose16 on the packed nibbles: half the shuffles of transposing the unpacked
// bytes) and split into quants after; the 16 rows' scales and mins come from gathers of the blocks'
// headers and are split with vector shifts (no per-row scalar stores). Every activation row then runs
// against the tile (ksb), with every super-block's sums kept in int32 (a group's sum times its scale
// with vpmulld; exact, |sum| < 2^31) and the float steps of the per-row kernels (ggml_cpu.cpp, KChain):
//   y = fma(float(tot), d_w d_x, y);  y = fma(float(summs), -(dmin_w d_x), y)
// so that row i of any product here equals the one-row product of the per-row kernels bit for bit. Meanwhile the next panel's bytes (contiguous: NP rows of the part) are
// prefetched in order into L2, spread over this panel's calls of ksb: the weights stream from memory
// once a step, and without it the unpacking waited on them (32 rows' super-blocks fetched ahead as 32
// separate streams were slower).

// one super-block of a panel: quants [64 k4][NP][4] (u8), integer sub-scales [groups][NP], Q4_K / Q5_K's
// mins as int16 pairs [4][NP], the super-block scales d, dmin [NP]
struct Tile {
  alignas(64) uint8_t w[64 * NP * 4];
  alignas(64) int32_t sc[16 * NP];
  alignas(64) int32_t mn[4 * NP];
  alignas(64) float d[NP];
  alignas(64) float dm[NP];
};

inline void tile_store(Tile& t, int k4, int h, __m512i v) {
  _mm512_store_si512(reinterpret_cast<__m512i*>(t.w + (k4 * NP + 16 * h) * 4), v);
}

// 16 rows' 64 bytes at offset `off` of their super-block -> r[c]: bytes 4c .. 4c + 3 of every row
inline void load_t16(const uint8_t* const* rp, int off, __m512i* r) {
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rp[i] + off);
  transpose16(r);
}

// Q4_K (FIVE: Q5_K) super-block of rows rp[0..15] -> lanes 16 h .. 16 h + 15 of the tile; idx: the
// rows' byte offsets from rp[0] (int32), for the header gathers
template <bool FIVE>
inline void tile_q45k(const uint8_t* const* rp, __m512i idx, int h, Tile& t) {
  const __m512i g0 = _mm512_i32gather_epi32(idx, rp[0], 1), g1 = _mm512_i32gather_epi32(idx, rp[0] + 4, 1);
  const __m512i g2 = _mm512_i32gather_epi32(idx, rp[0] + 8, 1), g3 = _mm512_i32gather_epi32(idx, rp[0] + 12, 1);
  _mm512_store_ps(t.d + 16 * h, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g0)));
  _mm512_store_ps(t.dm + 16 * h, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g0, 16))));
  // scales_mins_k4 on 16 rows at once (a row's u[0..2] in g1..g3)
  const __m512i m3f = _mm512_set1_epi32(0x3f3f3f3f), m0f = _mm512_set1_epi32(0x0f0f0f0f), m03 = _mm512_set1_epi32(0x03030303);
  const __m512i s[2] = {_mm512_and_si512(g1, m3f),
                        _mm512_or_si512(_mm512_and_si512(g3, m0f), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g1, 6), m03), 4))};
  const __m512i m[2] = {_mm512_and_si512(g2, m3f),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(g3, 4), m0f),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g2, 6), m03), 4))};
  const __m512i ff = _mm512_set1_epi32(0xFF), ff00 = _mm512_set1_epi32(0xFF00);
  for (int j = 0; j < 8; ++j)
    _mm512_store_si512(reinterpret_cast<__m512i*>(t.sc + j * NP + 16 * h),
                       _mm512_and_si512(_mm512_srli_epi32(s[j / 4], 8 * (j % 4)), ff));
  for (int j = 0; j < 4; ++j) {  // mins 2 j, 2 j + 1 as an int16 pair
    const __m512i v = _mm512_srli_epi32(m[j / 2], 16 * (j % 2));
    _mm512_store_si512(reinterpret_cast<__m512i*>(t.mn + j * NP + 16 * h),
                       _mm512_or_si512(_mm512_and_si512(v, ff), _mm512_slli_epi32(_mm512_and_si512(v, ff00), 8)));
  }
  const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
  __m512i qh[16];
  if (FIVE) {
    for (int i = 0; i < 16; ++i) qh[i] = _mm512_zextsi256_si512(load32(rp[i] + 16));
    transpose16(qh);  // qh[c], c < 8: the high-bit bytes 4c .. 4c + 3
  }
  for (int hh = 0; hh < 2; ++hh) {  // 64 packed bytes: chunks q = 2 hh, 2 hh + 1 of 32 bytes
    __m512i r[16];
    load_t16(rp, (FIVE ? 48 : 16) + 64 * hh, r);
    for (int c = 0; c < 16; ++c) {
      const int q = 2 * hh + c / 8, c8 = c % 8;
      __m512i lo = _mm512_and_si512(r[c], m4), hi = _mm512_and_si512(_mm512_srli_epi16(r[c], 4), m4);
      if (FIVE) {
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[c8], 2 * q), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[c8], 2 * q + 1), one), 4));
      }
      tile_store(t, 16 * q + c8, h, lo);      // values 64 q + 4 c8 ..
      tile_store(t, 16 * q + 8 + c8, h, hi);  // values 64 q + 32 + 4 c8 ..
    }
  }
}

inline void tile_q6k(const uint8_t* const* rp, __m512i idx, int h, Tile& t) {
  // d: the float16 at 208 (read as the upper half of the word at 206: nothing past the block)
  const __m512i gd = _mm512_i32gather_epi32(idx, rp[0] + 206, 1);
  _mm512_store_ps(t.d + 16 * h, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(gd, 16))));
  for (int w = 0; w < 4; ++w) {  // the 16 int8 scales at 192
    const __m512i g = _mm512_i32gather_epi32(idx, rp[0] + 192 + 4 * w, 1);
    for (int j = 0; j < 4; ++j)
      _mm512_store_si512(reinterpret_cast<__m512i*>(t.sc + (4 * w + j) * NP + 16 * h),
                         _mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 8 * j), 24));
  }
  const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
  __m512i qh[16];
  load_t16(rp, 128, qh);  // qh[c]: high-bit bytes 4c .. 4c + 3 (c < 8: the first half's)
  for (int hf = 0; hf < 2; ++hf) {
    __m512i r[16];
    load_t16(rp, 64 * hf, r);  // r[c]: l0's bytes 4c.. (c < 8), l1's bytes 4 (c - 8).. (c >= 8)
    for (int c = 0; c < 8; ++c) {
      const __m512i l0 = r[c], l1 = r[8 + c], hb = qh[8 * hf + c];
      const auto hi2 = [&](int sh) { return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, sh), m3), 4); };
      tile_store(t, 32 * hf + c, h, _mm512_or_si512(_mm512_and_si512(l0, m4), hi2(0)));
      tile_store(t, 32 * hf + 8 + c, h, _mm512_or_si512(_mm512_and_si512(l1, m4), hi2(2)));
      tile_store(t, 32 * hf + 16 + c, h, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), hi2(4)));
      tile_store(t, 32 * hf + 24 + c, h, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), hi2(6)));
    }
  }
}

// R activation rows (m0 ..) x the tile of super-block b -> y's running sums (each output's chain of
// super-blocks in order: the per-row kernels' bits)
template <int R, int G, int OFF, int MINS>
inline void ksb(const Tile& tl, const Acts& a, const int32_t* ini, int64_t m0, int64_t b, float* y, int64_t ldy,
                __mmask16 k0, __mmask16 k1, const char* pf, int64_t npf) {
  constexpr int NG = 256 / G, NPAIR = MINS == 32 ? 4 : 0;
  const int64_t K = a.K, nb = K / 256;
  const int8_t* const xq = a.qk.data() + m0 * K + b * 256;
  __m512i tot[R][2];
  for (int i = 0; i < R; ++i) tot[i][0] = tot[i][1] = _mm512_setzero_si512();
  for (int g = 0; g < NG; ++g) {
    __m512i s[R][2];
    for (int i = 0; i < R; ++i)
      s[i][0] = s[i][1] = OFF ? _mm512_set1_epi32(ini[(m0 + i) * (K / G) + b * NG + g]) : _mm512_setzero_si512();
    const uint8_t* wg = tl.w + g * G * NP;
    const int8_t* xg = xq + g * G;
    for (int t = 0; t < G / 4; ++t) {
      __m512i w0 = _mm512_load_si512(wg + t * 4 * NP), w1 = _mm512_load_si512(wg + t * 4 * NP + 64);
      pin(w0, w1);
      for (int i = 0; i < R; ++i) {
        const __m512i x = bcast(xg + i * K + 4 * t);
        s[i][0] = _mm512_dpbusd_epi32(s[i][0], w0, x);
        s[i][1] = _mm512_dpbusd_epi32(s[i][1], w1, x);
      }
    }
    for (int64_t l = g * npf / NG; l < (g + 1) * npf / NG; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    const __m512i sc0 = _mm512_load_si512(tl.sc + g * NP), sc1 = _mm512_load_si512(tl.sc + g * NP + 16);
    for (int i = 0; i < R; ++i) {
      tot[i][0] = _mm512_add_epi32(tot[i][0], _mm512_mullo_epi32(s[i][0], sc0));
      tot[i][1] = _mm512_add_epi32(tot[i][1], _mm512_mullo_epi32(s[i][1], sc1));
    }
  }
  const __m512 d0 = _mm512_load_ps(tl.d), d1 = _mm512_load_ps(tl.d + 16);
  for (int i = 0; i < R; ++i) {
    float* yi = y + (m0 + i) * ldy;
    const __m512 dx = _mm512_set1_ps(a.dk[(m0 + i) * nb + b]);
    __m512 acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[i][0]), _mm512_mul_ps(d0, dx), _mm512_maskz_loadu_ps(k0, yi));
    __m512 acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[i][1]), _mm512_mul_ps(d1, dx), _mm512_maskz_loadu_ps(k1, yi + 16));
    if (MINS) {
      const int16_t* si = a.bsp.data() + (m0 + i) * (K / 32) + b * 8;
      __m512i ms0 = _mm512_setzero_si512(), ms1 = _mm512_setzero_si512();
      for (int j = 0; j < NPAIR; ++j) {
        int32_t pr;
        std::memcpy(&pr, si + 2 * j, 4);
        const __m512i xs = _mm512_set1_epi32(pr);
        ms0 = _mm512_dpwssd_epi32(ms0, _mm512_load_si512(tl.mn + j * NP), xs);
        ms1 = _mm512_dpwssd_epi32(ms1, _mm512_load_si512(tl.mn + j * NP + 16), xs);
      }
      const __m512 dm0 = _mm512_load_ps(tl.dm), dm1 = _mm512_load_ps(tl.dm + 16);
      acc0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms0), _mm512_mul_ps(dm0, dx), acc0);
      acc1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms1), _mm512_mul_ps(dm1, dx), acc1);
    }
    _mm512_mask_storeu_ps(yi, k0, acc0);
    _mm512_mask_storeu_ps(yi + 16, k1, acc1);
  }
}

// rows [0, nr) of one part's panel (row_bytes apart, type T_Q4_K / T_Q5_K / T_Q6_K) x every activation
// row -> y (rows nr .. NP - 1 read row nr - 1 again; their lanes are never stored)
template <int TYPE>
__attribute__((noinline)) void panel_exact(const uint8_t* w, int64_t row_bytes, int nr, const Acts& a,
                                           const int32_t* ini, int64_t M, float* y, int64_t ldy, Tile& tl) {
  constexpr int BYTES = TYPE == T_Q4_K ? 144 : TYPE == T_Q5_K ? 176 : 210;
  constexpr int G = TYPE == T_Q6_K ? 16 : 32, OFF = TYPE == T_Q6_K ? 32 : 0, MINS = TYPE == T_Q6_K ? 0 : 32;
  const int64_t nb = a.K / 256;
  const __mmask16 k0 = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
  const __mmask16 k1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : static_cast<__mmask16>((1u << (nr - 16)) - 1);
  for (int64_t i = 0; i < M; ++i) {
    _mm512_mask_storeu_ps(y + i * ldy, k0, _mm512_setzero_ps());
    _mm512_mask_storeu_ps(y + i * ldy + 16, k1, _mm512_setzero_ps());
  }
  const uint8_t* rows[NP];
  for (int n = 0; n < NP; ++n) rows[n] = w + std::min(n, nr - 1) * row_bytes;
  __m512i idx[2];
  for (int h = 0; h < 2; ++h) {
    alignas(64) int32_t o[16];
    for (int i = 0; i < 16; ++i) o[i] = static_cast<int32_t>((rows[16 * h + i] - rows[16 * h]));
    idx[h] = _mm512_load_si512(o);
  }
  // what to prefetch two super-blocks ahead: this panel's rows, then (the last two steps) the next
  // panel's first super-blocks (the thread's next job, as parallel_for's ranges are contiguous)
  const char* const next = reinterpret_cast<const char*>(w + NP * row_bytes);
  const int64_t lines = NP * row_bytes / 64, calls = nb * ((M + MR - 1) / MR);
  int64_t call = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rp[NP];
    for (int n = 0; n < NP; ++n) rp[n] = rows[n] + b * BYTES;
    for (int h = 0; h < 2; ++h) {
      if (TYPE == T_Q6_K) tile_q6k(rp + 16 * h, idx[h], h, tl);
      else tile_q45k<TYPE == T_Q5_K>(rp + 16 * h, idx[h], h, tl);
    }
    int64_t m = 0;
    for (; m + MR <= M; m += MR, ++call)
      ksb<MR, G, OFF, MINS>(tl, a, ini, m, b, y, ldy, k0, k1, next + 64 * (call * lines / calls),
                            (call + 1) * lines / calls - call * lines / calls);
    // the remainder (M not a multiple of MR) takes the last share of the prefetches
    const char* pf = next + 64 * (call * lines / calls);
    const int64_t npf = (call + 1) * lines / calls - call * lines / calls;
    switch (M - m) {
      case 3: ksb<3, G, OFF, MINS>(tl, a, ini, m, b, y, ldy, k0, k1, pf, npf); ++call; break;
      case 2: ksb<2, G, OFF, MINS>(tl, a, ini, m, b, y, ldy, k0, k1, pf, npf); ++call; break;
      case 1: ksb<1, G, OFF, MINS>(tl, a, ini, m, b, y, ldy, k0, k1, pf, npf); ++call; break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------- the small-batch path of the 32-value blocks
//
// Q5_0, IQ4_NL and MXFP4 (the signed 32-value types the per-row kernels take with dot32; Q4_0 has
// its own route, q4_core.h; Q8_0 its own arithmetic, q80_x8 / q80_rows below, since it read the most
// float work per byte here). dot32's arithmetic per output (weight row n, activation row m):
// 8 float32 lanes, lane l of block b adding float(S) x (d_w d_x), S = the exact integer sum of
// the block's values 4 l .. 4 l + 3 times the activations', then hsum's fixed tree of the 8 lanes.
// Here one 512-bit vector holds two weight rows' 8 lanes (n: lanes 0-7, n + 1: lanes 8-15): the two
// rows' 32 quants of a block side by side are already vpdpbusd's operand (lane (n, l) sums bytes
// 4 l .. 4 l + 3; no transpose), made unsigned (+128: xor 0x80) once for every activation row, whose
// 32 quants are broadcast to both halves, each sum starting at -128 x the sum of its 4 activation
// quants (Acts32) so that it ends at S exactly; then per activation row one conversion, one multiply
// (d_w d_x, the product dot32 rounds) and one fused multiply-add. A pair of weight rows keeps up to
// MC32 activation rows' accumulators in registers over a chunk of CB32 blocks (its weights' 2 x CB32
// blocks in L1, the chunk's activations in L1 for every pair of the panel), the accumulators of the
// panel's 16 pairs kept in a per-thread buffer between chunks. Each output then has dot32's
// operations in dot32's order: row i of any product equals the one-row product bit for bit.
// Measured (CPU time at one thread, 16 rows, the 1B shapes all Q8_0, medians of 3 runs alternating
// with the per-row kernels' build): the step's products 500 -> 305 ms. dot32's lanes bound it: a
// conversion, a multiply and an FMA per vpdpbusd (64 products) where panel_exact's Q4_K needs about
// one per 8; a Q8_0 product here cost about 2x a Q4_K one. Tried and no faster on this shared
// machine: the scales d_w d_x formed 16 at a time and broadcast from memory as pairs (weights' and
// activations' dwords interleaved, the offset on the activations), and two pairs per activation load.
// Hence Q8_0's other arithmetic (kern32's: one float chain per output) at every row count, below:
// the lanes-are-rows tile (q80_rows) for 2+ rows, and for one row a kernel that reads 8 weight rows'
// blocks as they lie and sums each row's lanes after (q80_x8; a lanes-are-rows one-row kernel, 16
// rows transposed per 2 blocks, read memory at about half dot32's rate). The 1B Q8_0 step's products
// at 16 rows: 305 -> about 205 ms.

inline bool exact32_type(int t) { return t == T_Q8_0 || t == T_Q5_0 || t == T_IQ4_NL || t == T_MXFP4; }

constexpr int MC32 = 16;  // activation rows per pass (their accumulators in registers)
constexpr int CB32 = 8;   // blocks per chunk

// panel32's activations, block-major so that a block's rows lie at fixed offsets: per (block b, row m)
// 128 bytes, the start values (-128 x the sum of each 4 activation quants: dot32's lanes, int32 x 8)
// twice, then the block's 32 quants twice (both halves of a vector: its two weight rows); d [nb][M]
struct Acts32 {
  std::vector<int32_t> cx;  // [nb][M][32] (int32 words; the quants' 64 bytes are the last 16)
  std::vector<float> d;     // [nb][M]
};

inline void acts32(const Acts& a, int64_t M, Acts32& r) {
  const int64_t nb = a.K / 32;
  r.cx.resize(nb * M * 32);
  r.d.resize(nb * M);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i q = load32(a.q0.data() + (m * nb + b) * 32);
      const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(),
                                         _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), one, q), 7));
      int32_t* o = r.cx.data() + (b * M + m) * 32;
      _mm512_storeu_si512(o, _mm512_broadcast_i64x4(c));
      _mm512_storeu_si512(o + 16, _mm512_broadcast_i64x4(q));
      r.d[b * M + m] = a.d0[m * nb + b];
    }
}

// weight rows w0, w1 (type T) blocks [b0, b1) x activation rows m0 .. m0 + R - 1 -> acc [R] (in memory)
template <class T, int R>
void pair32(const uint8_t* w0, const uint8_t* w1, int64_t b0, int64_t b1, const Acts32& a, int64_t M, int64_t m0,
            __m512* accp) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_load_ps(reinterpret_cast<const float*>(accp + i));
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = b0; b < b1; ++b) {
    float d0, d1, m0_ = 0.f, m1_ = 0.f;
    const __m256i v0 = T::vals(w0 + b * T::BYTES, d0, m0_), v1 = T::vals(w1 + b * T::BYTES, d1, m1_);
    const __m512i w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1), off);
    const __m512 dw = _mm512_mask_mov_ps(_mm512_set1_ps(d0), 0xFF00, _mm512_set1_ps(d1));
    const int32_t* cx = a.cx.data() + (b * M + m0) * 32;
    const float* dx = a.d.data() + b * M + m0;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(cx + 32 * i), w, _mm512_loadu_si512(cx + 32 * i + 16));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx[i])), acc[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_store_ps(reinterpret_cast<float*>(accp + i), acc[i]);
}

template <class T>
using Pair32Fn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const Acts32&, int64_t, int64_t, __m512*);

template <class T, size_t... R>
constexpr std::array<Pair32Fn<T>, sizeof...(R)> pair32_table(std::index_sequence<R...>) {
  return {&pair32<T, static_cast<int>(R) + 1>...};
}

// rows [0, nr) of one part's panel (row_bytes apart, type T) x every activation row -> y; acc: the
// thread's buffer of NP / 2 x MC32 vectors
template <class T>
__attribute__((noinline)) void panel32(const uint8_t* w, int64_t row_bytes, int nr, const Acts32& a, int64_t K, int64_t M,
                                       float* y, int64_t ldy, __m512* acc) {
  static constexpr auto fns = pair32_table<T>(std::make_index_sequence<MC32>());
  const int64_t nb = K / 32;
  const int np = (nr + 1) / 2;
  // the next panel's bytes (contiguous), prefetched into L2 over this panel's calls (as panel_exact)
  const char* const next = reinterpret_cast<const char*>(w + NP * row_bytes);
  const int64_t lines = NP * row_bytes / 64, calls = ((M + MC32 - 1) / MC32) * ((nb + CB32 - 1) / CB32) * np;
  int64_t call = 0;
  for (int64_t mc = 0; mc < M; mc += MC32) {
    const int R = static_cast<int>(std::min<int64_t>(MC32, M - mc));
    for (int i = 0; i < np * MC32; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += CB32) {
      const int64_t b1 = std::min(nb, b0 + CB32);
      for (int p = 0; p < np; ++p, ++call) {
        fns[R - 1](w + 2 * p * row_bytes, w + std::min(2 * p + 1, nr - 1) * row_bytes, b0, b1, a, M, mc, acc + p * MC32);
        for (int64_t l = call * lines / calls; l < (call + 1) * lines / calls; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
      }
    }
    for (int p = 0; p < np; ++p)
      for (int i = 0; i < R; ++i) {
        const __m512 v = acc[p * MC32 + i];
        float* yi = y + (mc + i) * ldy + 2 * p;
        yi[0] = hsum(_mm512_castps512_ps256(v)) + 0.f;  // dot32's hsum(acc) + accm (0)
        if (2 * p + 1 < nr) yi[1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))) + 0.f;
      }
  }
}

// ---------------------------------------------------------------- Q8_0 at every row count: q80_x8, q80_rows
//
// In the AVX512-VNNI build Q8_0 has one arithmetic whatever the number of activation rows and the
// route (decode's one row: q80_x8; the batched step's 2..70 rows: q80_rows; prefill: kern32 above):
// per output y[m, n] ONE float32 chain over the blocks in order,
//   y = fma(float(S), d_w d_x, y)   from y = 0,
// S the block's whole integer sum of weight quant x activation quant (exact in int32), d_w d_x the
// float product of the two float16 scales (rounded once). vpdpbusd needs one unsigned operand: the
// weight quants + 128 (xor 0x80), the sum started at -128 x the activations' sum of its 4 bytes, so
// that it ends at S exactly. Every row of every product thus has the bits of the one-row product,
// and the int8 prefill path's (kern32 forms the same S and the same chain): prefill and decode agree.
// Against dot32 (8 float lanes per output and block, then a horizontal sum) an eighth of the float
// work per value, which bounded the batched step (panel32 below, still the route of Q5_0 / IQ4_NL /
// MXFP4).

// the Q8_0 row tree: s[r] (16 int32 lanes: lanes 0-7 the 8 partial sums of block b of row r, 8-15
// those of block b + 1) -> lanes 0-7: row r's S of block b, lanes 8-15: of block b + 1
inline __m512i q80_tree(const __m512i (&s)[8]) {
  __m512i t[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: (r0 a+c, r1 a+c, r0 b+d, r1 b+d) of dwords (a b c d)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
  // per 128-bit lane: rows 0-3 (u0), 4-7 (u1), each the sum of the lane's 4 dwords
  const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
  const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
  // 128-bit lanes 0, 1: dwords 0-3, 4-7 of block b; 2, 3: of block b + 1
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return _mm512_add_epi32(_mm512_permutex2var_epi32(u0, lo, u1), _mm512_permutex2var_epi32(u0, hi, u1));
}

// One activation row (decode) against nr (1..8) Q8_0 weight rows w + j rb (rows past nr read row
// nr - 1 again and are not stored) of nb blocks: q the row's quants [nb x 32], dx its scales [nb]
// -> out[0 .. nr). Two blocks a step: per row one 512-bit vector of its two blocks' quants (+128)
// and one vpdpbusd against the activations' two blocks (loaded once for the 8 rows, with their start
// values), the 8 rows' vectors summed to one (q80_tree: lane j row j's S of block b, lane 8 + j of
// b + 1), one conversion, the 16 scales d_w (one gather of the blocks' float16 words) times d_x, and
// the 8 rows' chains in one 256-bit vector: two fused multiply-adds. The group of 8 rows `ahead` bytes
// on is prefetched into L2 in order (prefetch_ahead8, as the K-quants' x8 kernels).
inline void q80_x8(const uint8_t* w, int64_t rb, int nr, int64_t nb, const int8_t* q, const float* dx, float* out,
                   int64_t ahead) {
  const uint8_t* rp[8];
  alignas(64) int32_t o[16];
  for (int r = 0; r < 8; ++r) {
    rp[r] = w + std::min(r, nr - 1) * rb;
    o[r] = static_cast<int32_t>(rp[r] - w);
    o[8 + r] = o[r] + 34;
  }
  const __m512i gidx = _mm512_load_si512(o);
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80)), one = _mm512_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    if (ahead) prefetch_ahead8<68>(w, ahead, b / 2);
    const __m512i x = _mm512_loadu_si512(q + b * 32);
    const __m512i c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), one, x), 7));
    __m512i s[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = rp[r] + b * 34;
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(load32(blk + 2)), load32(blk + 36), 1);
      s[r] = _mm512_dpbusd_epi32(c, _mm512_xor_si512(v, off), x);
    }
    const __m512 f = _mm512_cvtepi32_ps(q80_tree(s));
    const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(gidx, w + b * 34, 1)));
    const __m512 dd = _mm512_mul_ps(dw, _mm512_insertf32x8(_mm512_set1_ps(dx[b]), _mm256_set1_ps(dx[b + 1]), 1));
    acc = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm512_castps512_ps256(dd), acc);
    acc = _mm256_fmadd_ps(_mm512_extractf32x8_ps(f, 1), _mm512_extractf32x8_ps(dd, 1), acc);
  }
  if (b < nb) {  // an odd block count: the last block alone (lanes 8-15 zero; only its 8 sums used)
    const __m512i xz = _mm512_zextsi256_si512(load32(q + b * 32));
    const __m512i c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), one, xz), 7));
    __m512i s[8];
    for (int r = 0; r < 8; ++r)
      s[r] = _mm512_dpbusd_epi32(c, _mm512_xor_si512(_mm512_zextsi256_si512(load32(rp[r] + b * 34 + 2)), off), xz);
    const __m256 f = _mm512_castps512_ps256(_mm512_cvtepi32_ps(q80_tree(s)));
    const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_i32gather_epi32(reinterpret_cast<const int*>(w + b * 34), _mm512_castsi512_si256(gidx), 1)));
    acc = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(dx[b])), acc);
  }
  _mm256_mask_storeu_ps(out, static_cast<__mmask8>((1u << nr) - 1), acc);
}

// q80_rows' tile: 16 weight rows x 2 blocks, lanes are rows: vector 8 j + c holds dword c (values
// 4 c .. 4 c + 3, + 128) of block j of every row; d[j]: the rows' d_w of block j
struct Tile80 {
  alignas(64) uint8_t w[16][64];
  alignas(64) float d[2][16];
};

// R activation rows (quants xq, row stride K; ini: -128 x each block's quant sum, dx: scales, both
// [R][nb]) against blocks b, b + 1 (nblk of them) of the tile: y (64-byte aligned, row stride ldy)
// holds the chains, read and written once per tile
template <int R>
inline void q80_kern(const Tile80& t, int nblk, const int8_t* xq, int64_t K, const int32_t* ini, const float* dx,
                     int64_t nb, int64_t b, float* y, int64_t ldy) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_load_ps(y + i * ldy);
  for (int j = 0; j < nblk; ++j) {
    __m512i s[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) s[i] = _mm512_set1_epi32(ini[i * nb + b + j]);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_load_si512(t.w[8 * j + c]);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        int32_t xv;
        std::memcpy(&xv, xq + i * K + (b + j) * 32 + 4 * c, 4);
        s[i] = _mm512_dpbusd_epi32(s[i], v, _mm512_set1_epi32(xv));
      }
    }
    const __m512 dw = _mm512_load_ps(t.d[j]);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[i * nb + b + j])), acc[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_store_ps(y + i * ldy, acc[i]);
}

constexpr int MR80 = 8;  // activation rows per q80_kern call
constexpr int Q80_L1_AHEAD = 4;  // blocks ahead that q80_rows fetches into L1

// y [M, rows] (row stride ldy) = the activations (llama.cpp's q8_0: quants q int8 [M, K], scales d
// [M, K/32]; ini int32 [M, K/32]: -128 x each block's quant sum) x the Q8_0 weight rows w [rows]
// (row_bytes apart), 2+ activation rows: the weight rows in the lanes, 16 rows x 2 blocks transposed
// at a time (transpose16 of the rows' 64 quant bytes, + 128) into a 1 KiB tile in L1, their scales
// gathered; every activation row then runs against the tile, 8 vpdpbusd per block (the activation
// dword broadcast) and one conversion, multiply and fused multiply-add per block for 16 outputs:
// q80_x8's operations per output (see above), the same bits.
inline void q80_rows(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, const int8_t* q, const float* d,
                     const int32_t* ini, int64_t M, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  Tile80 t;
  // the chains of the 16 rows' outputs, [M][16] contiguous (rows of y lie N floats apart: at the 1B
  // model's 16384 all in one set of L1, evicted at every tile), copied to y after the group
  thread_local std::vector<__m512> accv;
  accv.resize(M);
  float* const acc = reinterpret_cast<float*>(accv.data());
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t n0 = 0; n0 < rows; n0 += 16) {
    const int nr = static_cast<int>(std::min<int64_t>(16, rows - n0));
    const __mmask16 k = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
    const uint8_t* rp[16];
    alignas(64) int32_t o[16];
    for (int r = 0; r < 16; ++r) {
      rp[r] = w + (n0 + std::min(r, nr - 1)) * row_bytes;
      o[r] = static_cast<int32_t>(rp[r] - rp[0]);
    }
    const __m512i idx = _mm512_load_si512(o);
    for (int64_t m = 0; m < M; ++m) _mm512_store_ps(acc + 16 * m, _mm512_setzero_ps());
    // the next 16 rows (contiguous), prefetched into L2 in order over this group's tiles: one stream
    // from memory (16 rows' blocks fetched as 16 streams ran at a quarter of the bandwidth)
    const char* const next = reinterpret_cast<const char*>(w + (n0 + 16) * row_bytes);
    const int64_t lines = n0 + 16 < rows ? std::min<int64_t>(16, rows - n0 - 16) * row_bytes / 64 : 0, tiles = (nb + 1) / 2;
    for (int64_t b = 0; b < nb; b += 2) {
      const int nblk = b + 1 < nb ? 2 : 1;
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const uint8_t* blk = rp[i] + b * 34;
        const __m256i lo = load32(blk + 2);
        const __m256i hi = nblk == 2 ? load32(blk + 36) : _mm256_setzero_si256();
        r[i] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), off);
      }
      for (int64_t l = (b / 2) * lines / tiles; l < (b / 2 + 1) * lines / tiles; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
      // the 16 rows' blocks two tiles on, from L2 into L1 (16 streams: more than L1's prefetcher follows)
      if (b + Q80_L1_AHEAD < nb)
        for (int i = 0; i < 16; ++i) {
          const char* pb = reinterpret_cast<const char*>(rp[i] + (b + Q80_L1_AHEAD) * 34);
          _mm_prefetch(pb, _MM_HINT_T0);
          _mm_prefetch(pb + 67, _MM_HINT_T0);
        }
      transpose16(r);
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) _mm512_store_si512(t.w[c], r[c]);
      for (int j = 0; j < nblk; ++j)
        _mm512_store_ps(t.d[j], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(idx, rp[0] + (b + j) * 34, 1))));
      int64_t m = 0;
      for (; m + MR80 <= M; m += MR80)
        q80_kern<MR80>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16);
      switch (M - m) {
        case 7: q80_kern<7>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        case 6: q80_kern<6>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        case 5: q80_kern<5>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        case 4: q80_kern<4>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        case 3: q80_kern<3>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        case 2: q80_kern<2>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        case 1: q80_kern<1>(t, nblk, q + m * K, K, ini + m * nb, d + m * nb, nb, b, acc + 16 * m, 16); break;
        default: break;
      }
    }
    for (int64_t m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ldy + n0, k, _mm512_load_ps(acc + 16 * m));
  }
}

// -128 x each block's quant sum of q int8 [n x 32] -> ini [n] (q80_rows' start values)
inline void q80_ini(const int8_t* q, int64_t n, int32_t* ini) {
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < n; ++i)
    ini[i] = -128 * kvserve_q8::hsum_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), one, load32(q + i * 32)));
}

// Q8_0 weight rows w [rows] (row_bytes apart) x M activation rows (q, d as q80_rows) -> y [M, rows]
// (row stride ldy): one row with q80_x8, 8 weight rows at a time; 2+ rows q80_rows (ini: as there, or
// null: formed here). Either way q80_x8's bits per output.
inline void q80_product(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, const int8_t* q, const float* d,
                        const int32_t* ini, int64_t M, float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  if (M == 1) {
    const int64_t ahead = x8_ahead(row_bytes);
    for (int64_t n = 0; n < rows; n += 8) {
      const int nr = static_cast<int>(std::min<int64_t>(8, rows - n));
      // prefetch the group ahead only where it lies within these rows (the thread's own range)
      q80_x8(w + n * row_bytes, row_bytes, nr, nb, q, d, y + n, n + 8 + ahead / row_bytes <= rows ? ahead : 0);
    }
    return;
  }
  if (ini) return q80_rows(w, row_bytes, rows, K, q, d, ini, M, y, ldy);
  thread_local std::vector<int32_t> own;
  own.resize(M * nb);
  q80_ini(q, M * nb, own.data());
  q80_rows(w, row_bytes, rows, K, q, d, own.data(), M, y, ldy);
}

// R activation rows against one unpacked panel of type t (ini: the start values, see start_values)
template <int R>
void kern(int t, const Panel& p, const Acts& a, const int32_t* ini, int64_t m0, float* y, int64_t ldy, __mmask16 k0,
          __mmask16 k1) {
  switch (t) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL: case T_MXFP4:
      return kern32<R, 128, false>(p, a, ini, m0, y, ldy, k0, k1);
    case T_Q4_1: case T_Q5_1: return kern32<R, 0, true>(p, a, ini, m0, y, ldy, k0, k1);
    case T_Q4_K: return kernk<R, 32, 0, 32, true>(p, a, ini, m0, y, ldy, k0, k1);
    case T_Q5_K: return kernk<R, 32, 0, 32, false>(p, a, ini, m0, y, ldy, k0, k1);
    case T_Q6_K: return kernk<R, 16, 32, 0, false>(p, a, ini, m0, y, ldy, k0, k1);
    case T_Q2_K: return kernk<R, 16, 0, 16, true>(p, a, ini, m0, y, ldy, k0, k1);
    case T_Q3_K: return kernk<R, 16, 4, 0, true>(p, a, ini, m0, y, ldy, k0, k1);
    case T_IQ4_XS: return kernk<R, 32, 128, 0, false>(p, a, ini, m0, y, ldy, k0, k1);
    default: throw std::runtime_error("ggml_cpu gemm8: no kernel for ggml type " + std::to_string(t));
  }
}

// ---------------------------------------------------------------- the product

// a row block of W (as gemm::Rows): rows [first, first + rows) of the matrix, each row_bytes long
struct Rows {
  const uint8_t* data;
  int type;
  int64_t first, rows, row_bytes;
};

// ---------------------------------------------------------------- the activations

// x [M, K] -> the activations every part's type needs (q8_0 and / or q8_K), on kvserve's pool
void quantize(const std::vector<Rows>& parts, const float* x, int64_t M, int64_t K, Acts& a) {
  bool q0 = false, qk = false;
  for (const Rows& r : parts) {
    Traits tr;
    traits(r.type, tr);
    (tr.kind == K32 ? q0 : qk) = true;
  }
  a.K = K;
  if (q0) {
    a.q0.resize(M * K);
    a.d0.resize(M * (K / 32));
    a.s0.resize(M * (K / 32));
    a.sum0.resize(M * (K / 32));
  }
  if (qk) {
    a.qk.resize(M * K);
    a.dk.resize(M * (K / 256));
    a.bs.resize(M * (K / 16));
    a.bsp.resize(M * (K / 32));
  }
  kvserve_pool::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (q0)
        quantize_q8_0_row(x + m * K, K, a.q0.data() + m * K, a.d0.data() + m * (K / 32), a.s0.data() + m * (K / 32),
                          a.sum0.data() + m * (K / 32));
      if (qk)
        quantize_q8_K_row(x + m * K, K, a.qk.data() + m * K, a.dk.data() + m * (K / 256), a.bs.data() + m * (K / 16),
                          a.bsp.data() + m * (K / 32));
    }
  });
}

// y [M, N] = x [M, K] @ W^T, W's rows in `parts` (each type has_type, K a multiple of its block).
// Work: panels of NP rows within a part, split over kvserve's pool; a thread unpacks a panel (K x 32
// bytes: 64 KiB at K = 2048, in L2) and runs every activation row against it, MR rows a call.
// the accumulators' start values of a type that takes an offset out of its quants: -off x the
// activations' sums of each group (int32 [M, K / group]); empty for the others
std::vector<int32_t> start_values(const Traits& tr, const Acts& a, int64_t M) {
  std::vector<int32_t> v;
  if (tr.off == 0) return v;
  const int64_t K = a.K, G = tr.group, ng = K / G;
  v.resize(M * ng);
  for (int64_t i = 0; i < M * ng; ++i)
    v[i] = -tr.off * (tr.kind == K32 ? a.sum0[i] : G == 16 ? static_cast<int32_t>(a.bs[i]) : static_cast<int32_t>(a.bsp[i]));
  return v;
}

// exact: every part exact_type or exact32_type, the small-batch path (panel_exact, panel32: the per-row
// kernels' bits)
void mm(const std::vector<Rows>& parts, int64_t N, int64_t K, const float* x, int64_t M, float* y, bool exact = false) {
  Acts a;
  quantize(parts, x, M, K, a);
  // start values per part (parts of one type share them)
  std::vector<std::vector<int32_t>> ini(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    Traits tr;
    traits(parts[i].type, tr);
    size_t same = 0;
    while (same < i && parts[same].type != parts[i].type) ++same;
    if (same < i) continue;
    ini[i] = start_values(tr, a, M);
  }
  std::vector<const int32_t*> inip(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    size_t same = 0;
    while (parts[same].type != parts[i].type) ++same;
    inip[i] = ini[same].data();
  }
  struct Job {
    size_t part;
    int64_t row;  // first row within the part
  };
  std::vector<Job> jobs;
  for (size_t i = 0; i < parts.size(); ++i)
    for (int64_t r = 0; r < parts[i].rows; r += NP) jobs.push_back({i, r});
  // panel32's start values (-128 x each 4 activation quants' sum) where a part takes it
  Acts32 a32;
  if (exact)
    for (const Rows& r : parts)
      if (exact32_type(r.type) && r.type != T_Q8_0) {
        acts32(a, M, a32);
        break;
      }
  kvserve_pool::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    Panel p;
    Tile tl;
    alignas(64) __m512 acc32[NP / 2 * MC32];  // panel32's accumulators (16 KiB)
    for (int64_t j = j0; j < j1; ++j) {
      const Rows& r = parts[jobs[j].part];
      Traits tr;
      traits(r.type, tr);
      const int nr = static_cast<int>(std::min<int64_t>(NP, r.rows - jobs[j].row));
      if (exact) {  // the small-batch path: a super-block at a time (panel_exact) or panel32
        const uint8_t* wp = r.data + jobs[j].row * r.row_bytes;
        float* yp = y + r.first + jobs[j].row;
        const int32_t* iv = inip[jobs[j].part];
        switch (r.type) {
          case T_Q4_K: panel_exact<T_Q4_K>(wp, r.row_bytes, nr, a, iv, M, yp, N, tl); break;
          case T_Q5_K: panel_exact<T_Q5_K>(wp, r.row_bytes, nr, a, iv, M, yp, N, tl); break;
          case T_Q6_K: panel_exact<T_Q6_K>(wp, r.row_bytes, nr, a, iv, M, yp, N, tl); break;
          case T_Q8_0: q80_product(wp, r.row_bytes, nr, K, a.q0.data(), a.d0.data(), iv, M, yp, N); break;
          case T_Q5_0: panel32<BQ5_0>(wp, r.row_bytes, nr, a32, K, M, yp, N, acc32); break;
          case T_IQ4_NL: panel32<BIQ4_NL>(wp, r.row_bytes, nr, a32, K, M, yp, N, acc32); break;
          case T_MXFP4: panel32<BMXFP4>(wp, r.row_bytes, nr, a32, K, M, yp, N, acc32); break;
          default: throw std::runtime_error("ggml_cpu gemm8: no small-batch kernel for ggml type " + std::to_string(r.type));
        }
        continue;
      }
      unpack_panel(r.type, tr, r.data + jobs[j].row * r.row_bytes, r.row_bytes, nr, K, p);
      const __mmask16 k0 = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
      const __mmask16 k1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : static_cast<__mmask16>((1u << (nr - 16)) - 1);
      float* yp = y + r.first + jobs[j].row;
      const int32_t* iv = inip[jobs[j].part];
      int64_t m = 0;
      for (; m + MR <= M; m += MR) kern<MR>(r.type, p, a, iv, m, yp, N, k0, k1);
      switch (M - m) {
        case 3: kern<3>(r.type, p, a, iv, m, yp, N, k0, k1); break;
        case 2: kern<2>(r.type, p, a, iv, m, yp, N, k0, k1); break;
        case 1: kern<1>(r.type, p, a, iv, m, yp, N, k0, k1); break;
        default: break;
      }
    }
  });
}

}  // namespace gemm8

#endif
