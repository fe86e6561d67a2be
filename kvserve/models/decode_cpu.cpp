// kvserve's native decode step (CPU, x86-64 AVX512-VNNI): one call runs every layer of a llama-family
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
#include <vector>
#include "q4_core.h"

namespace {

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// e^x, Cephes' single-precision polynomial (relative error ~2e-7), scaled by 2^n with vscalefps
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.9f)), _mm512_set1_ps(88.72f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// 16 cache values as float32
template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <> inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

// x [n] -> out [n] = x * rsqrt(mean(x^2) + eps) * w  (n a multiple of 16)
inline void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv), _mm512_loadu_ps(w + i)));
}

// The output head: int8 weights per block of 32 (GGUF Q8_0's form, w = d * q), stored in the q4
// kernel's pair order (each 32-bit lane 4 weights of one block, blocks alternating lane by lane)
// and offset to unsigned (q + 128) for vpdpbusd (u8 x s8); activations quantized per block of 32
// as for the q4 kernel. Per pair of blocks: dot(q + 128, xq) - 128 * sum(xq), lane by lane, exact.
template <int MR>
inline void q8_rows_dot(const uint8_t* wrow, const uint16_t* drow, int64_t K, const int8_t* xq, const __m512i* corr,
                        const __m512* xsp, float* out, int64_t ldo) {
  const int64_t P = K / 64;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < P; ++pr) {
    const __m512i w = _mm512_loadu_si512(wrow + pr * 64);
    int32_t dpair;
    std::memcpy(&dpair, drow + 2 * pr, 4);
    const __m512 dw = _mm512_cvtph_ps(_mm256_set1_epi32(dpair));  // d0 d1 d0 d1 ...
    for (int r = 0; r < MR; ++r) {
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xq + r * K + pr * 64));
      dot = _mm512_sub_epi32(dot, corr[r * P + pr]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xsp[r * P + pr]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
}

// y [M, N] = x [M, K] @ head.T with the q8 weights above
void q8_mm(const float* x, int64_t M, int64_t K, const uint8_t* W, const uint16_t* D, int64_t N, float* Y) {
  const int64_t G = K / 32, P = K / 64;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * G), xm(M * G);
  kvserve_q4::quantize_rows(x, M, K, xq.data(), xs.data(), xm.data());
  std::vector<__m512i> corr(M * P);
  std::vector<__m512> xsp(M * P);
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t pr = 0; pr < P; ++pr) {
      corr[r * P + pr] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, _mm512_loadu_si512(xq.data() + r * K + pr * 64));
      double pair;
      std::memcpy(&pair, xs.data() + r * G + 2 * pr, 8);
      xsp[r * P + pr] = _mm512_castpd_ps(_mm512_set1_pd(pair));  // dx0 dx1 dx0 dx1 ...
    }
  const int8_t* XQ = xq.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = W + n * K;
      const uint16_t* drow = D + n * G;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) q8_rows_dot<4>(wrow, drow, K, XQ + r * K, &corr[r * P], &xsp[r * P], Y + r * N + n, N);
      switch (M - r) {
        case 3: q8_rows_dot<3>(wrow, drow, K, XQ + r * K, &corr[r * P], &xsp[r * P], Y + r * N + n, N); break;
        case 2: q8_rows_dot<2>(wrow, drow, K, XQ + r * K, &corr[r * P], &xsp[r * P], Y + r * N + n, N); break;
        case 1: q8_rows_dot<1>(wrow, drow, K, XQ + r * K, &corr[r * P], &xsp[r * P], Y + r * N + n, N); break;
        default: break;
      }
    }
  });
}

struct Proj {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int64_t n, k;
  const float* bias;  // [n] or null
};

struct Layer {
  const float* attn_norm;
  const float* ffn_norm;
  Proj qkv, wo, gate_up, down;
};

Proj proj_of(const std::vector<at::Tensor>& t, size_t i, const at::Tensor& bias) {
  const at::Tensor& q = t[i];
  const at::Tensor& d = t[i + 1];
  const at::Tensor& m = t[i + 2];
  TORCH_CHECK(q.scalar_type() == at::kByte && d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf &&
                  q.is_contiguous() && d.is_contiguous() && m.is_contiguous() && q.size(1) % 32 == 0,
              "decode_cpu: bad packed weights");
  Proj p{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
         reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), q.size(0), q.size(1) * 2, nullptr};
  TORCH_CHECK(d.size(0) == p.n && d.size(1) == p.k / 32, "decode_cpu: bad scales");
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == p.n, "decode_cpu: bad bias");
    p.bias = bias.data_ptr<float>();
  }
  return p;
}

class Decoder {
 public:
  // layers: per layer [attn_norm, ffn_norm, qkv q/d/m, wo q/d/m, gate_up q/d/m, down q/d/m, qkv bias (may be empty)]
  Decoder(std::vector<std::vector<at::Tensor>> layers, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
          double eps)
      : keep_(std::move(layers)), nh_(n_head), nkv_(n_head_kv), hd_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(hd_ % 32 == 0 && nh_ % nkv_ == 0, "decode_cpu: head_dim must be a multiple of 32");
    for (const auto& t : keep_) {
      TORCH_CHECK(t.size() == 15, "decode_cpu: 15 tensors per layer");
      Layer l;
      l.attn_norm = t[0].data_ptr<float>();
      l.ffn_norm = t[1].data_ptr<float>();
      l.qkv = proj_of(t, 2, t[14]);
      l.wo = proj_of(t, 5, at::Tensor());
      l.gate_up = proj_of(t, 8, at::Tensor());
      l.down = proj_of(t, 11, at::Tensor());
      E_ = l.qkv.k;
      F_ = l.down.k;
      TORCH_CHECK(l.qkv.n == (nh_ + 2 * nkv_) * hd_ && l.wo.k == nh_ * hd_ && l.wo.n == E_ && l.gate_up.k == E_ &&
                      l.gate_up.n == 2 * F_ && l.down.n == E_ && E_ % 64 == 0 && F_ % 64 == 0 && (nh_ * hd_) % 64 == 0,
                  "decode_cpu: projection shapes do not match the model");
      layers_.push_back(l);
    }
  }

  // the output norm [E] float32 and head: q [V, E] uint8 (see q8_rows_dot), d [V, E/32] float16
  void set_head(const at::Tensor& norm, const at::Tensor& q, const at::Tensor& d) {
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.numel() == E_ && q.scalar_type() == at::kByte &&
                    q.dim() == 2 && q.size(1) == E_ && d.scalar_type() == at::kHalf && d.size(0) == q.size(0) &&
                    d.size(1) == E_ / 32 && q.is_contiguous() && d.is_contiguous() && norm.is_contiguous(),
                "decode_cpu: bad head");
    head_ = {norm, q, d};
  }

  // x [B, E] hidden states -> logits [B, V] float32 (output norm, then the q8 head)
  at::Tensor logits(const at::Tensor& x) {
    TORCH_CHECK(head_.size() == 3, "decode_cpu: no head set");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == E_,
                "decode_cpu: x must be a contiguous float32 [B, n_embd]");
    const int64_t B = x.size(0), V = head_[1].size(0);
    std::vector<float> h(B * E_);
    for (int64_t b = 0; b < B; ++b) rms_norm(x.data_ptr<float>() + b * E_, head_[0].data_ptr<float>(), h.data() + b * E_, E_, eps_);
    at::Tensor y = at::empty({B, V}, x.options());
    q8_mm(h.data(), B, E_, head_[1].data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(head_[2].data_ptr<at::Half>()),
          V, y.data_ptr<float>());
    return y;
  }

  // x [B, E] float32 (the token embeddings; overwritten with the last layer's hidden states and
  // returned), cos/sin [B, D/2] float32, slots [B] long (cache row of each query's K/V),
  // kv_index [B, L] long (the rows each query reads, valid up to lens[b]), lens [B] long,
  // k_caches/v_caches: per layer [rows, n_head_kv, head_dim] float32/float16/bfloat16.
  at::Tensor step(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                  const at::Tensor& kv_index, const at::Tensor& lens, const std::vector<at::Tensor>& k_caches,
                  const std::vector<at::Tensor>& v_caches) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == E_,
                "decode_cpu: x must be a contiguous float32 [B, n_embd]");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "decode_cpu: caches");
    TORCH_CHECK(kv_index.scalar_type() == at::kLong && kv_index.is_contiguous() && slots.scalar_type() == at::kLong &&
                    lens.scalar_type() == at::kLong && cos.is_contiguous() && sin.is_contiguous(),
                "decode_cpu: index types");
    const int64_t B = x.size(0), L = kv_index.size(1), D = hd_, H = nh_, HKV = nkv_;
    const int64_t QKV = (H + 2 * HKV) * D, KMAX = std::max(E_, F_);
    std::vector<float> h(B * E_), qkv(B * QKV), att(B * H * D), gu(B * 2 * F_), act(B * F_), out(B * E_);
    std::vector<int8_t> xq(B * KMAX);
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
    auto mm = [&](const Proj& p, const float* in, float* o) {
      kvserve_q4::q4_mm_raw(in, B, p.k, p.q, p.d, p.m, p.n, o, xq.data(), xs.data(), xm.data());
      if (p.bias)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = 0; j < p.n; ++j) o[b * p.n + j] += p.bias[j];
    };
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      for (int64_t b = 0; b < B; ++b) rms_norm(X + b * E_, l.attn_norm, h.data() + b * E_, E_, eps_);
      mm(l.qkv, h.data(), qkv.data());
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
        case at::kFloat: attend<float>(kc, vc, qkv.data(), att.data(), B, L, slot, idx, len); break;
        case at::kHalf: attend<c10::Half>(kc, vc, qkv.data(), att.data(), B, L, slot, idx, len); break;
        case at::kBFloat16: attend<c10::BFloat16>(kc, vc, qkv.data(), att.data(), B, L, slot, idx, len); break;
        default: TORCH_CHECK(false, "decode_cpu: cache type");
      }
      mm(l.wo, att.data(), out.data());
      for (int64_t i = 0; i < B * E_; ++i) X[i] += out[i];
      for (int64_t b = 0; b < B; ++b) rms_norm(X + b * E_, l.ffn_norm, h.data() + b * E_, E_, eps_);
      mm(l.gate_up, h.data(), gu.data());
      for (int64_t b = 0; b < B; ++b) {
        const float* g = gu.data() + b * 2 * F_;
        float* a = act.data() + b * F_;
        for (int64_t j = 0; j < F_; j += 16) {
          const __m512 gv = _mm512_loadu_ps(g + j);
          const __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
          _mm512_storeu_ps(a + j, _mm512_mul_ps(sg, _mm512_loadu_ps(g + F_ + j)));
        }
      }
      mm(l.down, act.data(), out.data());
      for (int64_t i = 0; i < B * E_; ++i) X[i] += out[i];
    }
    return x;
  }

 private:
  // write each row's k/v (after RoPE) into the cache, then attention of every query head
  template <typename T>
  void attend(const at::Tensor& kc, const at::Tensor& vc, const float* qkv, float* att, int64_t B, int64_t L,
              const int64_t* slot, const int64_t* idx, const int64_t* len) {
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
    at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> p;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / H, hh = t % H, kvh = hh / G, n = len[b];
        const float* q = qkv + b * QKV + hh * D;
        const int64_t* rix = idx + b * L;
        p.resize(n);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t row = rix[j];
          const T* kr = K + (row * HKV + kvh) * D;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(kr + d), acc);
          p[j] = hsum(acc) * scale;
          mx = std::max(mx, p[j]);
        }
        const __m512 mv = _mm512_set1_ps(mx);
        __m512 sv = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
          const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p.data() + j), mv));
          _mm512_storeu_ps(p.data() + j, e);
          sv = _mm512_add_ps(sv, e);
        }
        if (j < n) {
          const __mmask16 mk = static_cast<__mmask16>((1u << (n - j)) - 1);
          const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, p.data() + j), mv));
          _mm512_mask_storeu_ps(p.data() + j, mk, e);
          sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(mk, e));
        }
        const float inv = 1.f / hsum(sv);
        float* o = att + (b * H + hh) * D;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
          __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
          for (int64_t jj = 0; jj < n; ++jj) {
            const T* vr = V + (rix[jj] * HKV + kvh) * D + d0;
            const __m512 w = _mm512_set1_ps(p[jj]);
            a0 = _mm512_fmadd_ps(w, load16(vr), a0);
            a1 = _mm512_fmadd_ps(w, load16(vr + 16), a1);
          }
          _mm512_storeu_ps(o + d0, _mm512_mul_ps(a0, _mm512_set1_ps(inv)));
          _mm512_storeu_ps(o + d0 + 16, _mm512_mul_ps(a1, _mm512_set1_ps(inv)));
        }
      }
    });
  }

  std::vector<at::Tensor> head_;
  std::vector<std::vector<at::Tensor>> keep_;  // owns the weights the raw pointers read
  std::vector<Layer> layers_;
  int64_t nh_, nkv_, hd_, E_ = 0, F_ = 0;
  float eps_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, int64_t, int64_t, int64_t, double>())
      .def("step", &Decoder::step, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_head", &Decoder::set_head)
      .def("logits", &Decoder::logits, pybind11::call_guard<pybind11::gil_scoped_release>());
}
