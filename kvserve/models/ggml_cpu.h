// The GGUF block kernels' interface (ggml_cpu.cpp) for the other translation unit of kvserve's CPU
// extension (decode_cpu.cpp: the native decode step composes its projections from these products).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvserve_ggml {

// Work buffers of one product's quantized activations (reused across the products of a step).
struct Scratch {
  std::vector<int8_t> q0, qk;
  std::vector<float> d0, s0, dk;
  std::vector<int16_t> bs;
  std::vector<int32_t> c8;  // the AVX512 Q4_0 / Q4_1 kernel's block offsets and
  std::vector<int8_t> qt;   // transposed activations (ggml_cpu.cpp, Act32)
  std::vector<int8_t> qkp;
  std::vector<int8_t> x7;   // the AVX512 Q4_0 kernel's activations (q4_core.h, Q40Acts)
  std::vector<int32_t> c7;
  std::vector<float> d7;  // the AVX512 Q4_K / Q5_K kernel's q8_K activations, sub-blocks interleaved (ActK::qp)
  std::vector<int8_t> xr;   // repacked Q4_0's activations (q4_repack.h, rq40_acts: tiles of 16 rows)
  std::vector<int32_t> cr;
  std::vector<float> dr;
};

// A weight matrix [N, K] made of row blocks in ggml formats (a fused q|k|v or gate|up may mix
// types), each part's bytes owned by the caller (a view of the GGUF file's mapping) and alive
// while this object is used. y[M, N] = x[M, K] @ W^T (see ggml_cpu.cpp for the arithmetic; row i of
// an M-row product equals the one-row product bit for bit).
class Matrix {
 public:
  // repack: Q4_0 parts whose row count is a multiple of 16 are copied into a buffer this object owns,
  // in q4_repack.h's layout (AVX512-VNNI builds; elsewhere ignored); their caller bytes are no longer
  // read after construction (repacked() says which; the caller may give their pages back)
  Matrix(std::vector<int64_t> ptrs, std::vector<int64_t> types, std::vector<int64_t> rows, int64_t K,
         bool repack = false);
  // per part: true where it was repacked
  std::vector<bool> repacked() const;

  int64_t rows() const { return N_; }
  int64_t cols() const { return K_; }
  // bytes of weights one product reads
  int64_t nbytes() const;

  // true where mm's prefill paths (ggml_gemm8.h's int8 one, ggml_gemm.h's bfloat16 one) take this matrix:
  // the build has them (AVX512-BF16 + VNNI), every part's type is one of theirs and none is repacked
  bool gemm_ok() const;
  // true where the int8 prefill path (ggml_gemm8.h) takes this matrix
  bool gemm8_ok() const;
  // x [M, K] float32 -> [M, N] float32 (a new tensor); with gemm_min_rows > 0 and M >= gemm_min_rows
  // a prefill path where gemm_ok(): path "auto" the int8 one where gemm8_ok(), else the bfloat16 one;
  // "int8" / "bf16" only that one (where it does not take the matrix: the per-row kernels, mm_raw);
  // "rows": the per-row kernels in blocks of up to 4 rows alone (no prefill path, no small-batch
  // kernel: the route before those, for tests and benchmarks; the same bits as the small-batch one)
  at::Tensor mm(const at::Tensor& x, int64_t gemm_min_rows = 0, const std::string& path = "auto") const;
  // the same product on raw buffers: x [M, K] float32 (row stride K), y [M, N] (row stride N);
  // s: the activations' buffers, resized as needed. Runs on kvserve's pool (thread_pool.h). batch:
  // 6 rows or more of a matrix of Q4_K / Q5_K / Q6_K parts, 2 or more where the parts are Q8_0 / Q5_0 /
  // IQ4_NL / MXFP4 (or those mixed with the K-quants, from 6), take the small-batch path (AVX512-VNNI
  // builds: ggml_gemm8.h's panel_exact, q80_rows, panel32; each row's bits the one-row kernels'), else the per-row ones
  void mm_raw(const float* x, int64_t M, float* y, Scratch& s, bool batch = true) const;

  // One product of a batch run by mm_jobs: y [M, mat->rows()] = x [M, K] @ W^T (row strides K and rows()).
  struct Job {
    const Matrix* mat;
    const float* x;
    int64_t M;
    float* y;
  };
  // Several products in one pass of kvserve's pool: llama.cpp's mul_mat_id for a step's experts (each
  // chosen expert's gate|up on its rows, then each one's down on its own activated rows). Jobs with the
  // same x and M quantize their activations once (the k experts of a one-row step share the row); the
  // work is split over the jobs' output rows together, so k small products cost one dispatch. Every
  // output row has the bits of mm_raw's per-row kernels (row i of any product = the one-row product).
  // scratch: work buffers, resized as needed (one per distinct activation set). Every job's K must be
  // its matrix's cols(); the matrices may differ in shape and type.
  static void mm_jobs(const std::vector<Job>& jobs, std::vector<Scratch>& scratch);

 private:
  // the kinds of quantized activations this matrix's types read (bits: 1 q8_0, 2 the AVX512 Q4_1
  // layout, 4 the AVX512 Q4_0 layout, 8 q8_K, 16 the AVX512 Q4_K / Q5_K layout, 32 repacked Q4_0's sums)
  int kinds() const;
  // x [M, K] quantized into s as the kinds (a union of matrices' kinds()) ask
  static void quantize_acts(const float* x, int64_t M, int64_t K, Scratch& s, int kinds);
  // output columns [n0, n1) of y [M, N] (row stride N) for x [M, K], its activations in s (quantize_acts
  // with at least kinds()); runs on the calling thread
  void out_rows(const float* x, int64_t M, const Scratch& s, int64_t n0, int64_t n1, float* y) const;

  struct Part {
    const uint8_t* data;
    int type;
    int64_t first, rows, row_bytes;
    bool rp = false;  // repacked (q4_repack.h's layout in own_)
  };
  std::shared_ptr<uint8_t> own_;  // the repacked parts' bytes
  std::vector<Part> parts_;
  int64_t N_ = 0, K_ = 0;
  bool q8_0_ = false, q8_k_ = false, q4_ = false, q40_ = false, q4k_ = false, rq40_ = false;
};

// registers ISA, TYPES, quantize and Matrix in m (the extension's "ggml" submodule)
void register_module(pybind11::module_& m);

}  // namespace kvserve_ggml
