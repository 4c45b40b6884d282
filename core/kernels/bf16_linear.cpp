// bfloat16 linear layers on CPUs without bfloat16 instructions (specdec.kernels.cpu).
//
// Where the CPU has no bfloat16 dot products (AVX2 without AVX-512), torch 2.13 computes a
// bfloat16 F.linear one row at a time: a step of 16 tokens costs 16 decodes. This kernel
// widens each weight element to float32 once per call (a bfloat16 is the high half of a
// float32) and multiplies it by every row of the step with FMA instructions, so a product
// of many rows costs its arithmetic, and one row costs the weight's streaming.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), rounded to bfloat16 once. Every output is
// summed in the same order whatever the row count, the tiling and the thread split: element
// k goes into lane k % 8 of one accumulator, lanes added in k order by fused multiply-adds,
// then the eight lanes pairwise in a fixed order. So a row's result does not depend on the
// other rows of the call: the kernel is batch-invariant by construction.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t LANES = 8;  // floats per 256-bit register
constexpr int64_t ROW_TILE = 4;  // rows of x per micro-kernel
constexpr int64_t COL_TILE = 3;  // rows of w (outputs) per micro-kernel: 12 accumulators + 4 operands
constexpr int64_t DECODE_COL_TILE = 6;  // rows of w per micro-kernel for a single row of x

inline __m256 widen(const c10::BFloat16* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }

inline float lanes_sum(__m256 v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// MR rows of x (float32, row stride k) against NR rows of w (bfloat16, or float32 once
// widened), each output one accumulator: out[r * out_stride + c] = sum of its lanes.
template <int MR, int NR, typename W, bool PREFETCH = false>
inline void micro_kernel(const float* x, const W* w, int64_t k, float* out, int64_t out_stride) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += LANES) {
    if (PREFETCH && i % 32 == 0)  // the next block's rows, a cache line at a time
      for (int c = 0; c < NR; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + c) * k + i), _MM_HINT_T0);
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = widen(w + c * k + i);
    for (int r = 0; r < MR; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * k + i);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) out[r * out_stride + c] = lanes_sum(acc[r][c]);
}

template <int NR, typename W>
inline void rows_block(const float* x, int64_t m, const W* w, int64_t k, float* out, int64_t n_total) {
  if (m == 1) {  // a decode step: streaming the weight is the work
    micro_kernel<1, NR, W, true>(x, w, k, out, n_total);
    return;
  }
  int64_t r = 0;
  for (; r + ROW_TILE <= m; r += ROW_TILE)
    micro_kernel<ROW_TILE, NR>(x + r * k, w, k, out + r * n_total, n_total);
  if (m - r == 3) micro_kernel<3, NR>(x + r * k, w, k, out + r * n_total, n_total);
  if (m - r == 2) micro_kernel<2, NR>(x + r * k, w, k, out + r * n_total, n_total);
  if (m - r == 1) micro_kernel<1, NR>(x + r * k, w, k, out + r * n_total, n_total);
}

// Outputs [col, col + nr) for every row: with a single tile of rows the weight is widened
// as it is read; with more, the block is widened once into `scratch` and reread from cache.
template <int NR>
inline void column_block(const float* x, int64_t m, const c10::BFloat16* w, int64_t k, float* out, int64_t n_total,
                         std::vector<float>& scratch) {
  if (m <= ROW_TILE) {
    rows_block<NR>(x, m, w, k, out, n_total);
    return;
  }
  scratch.resize(NR * k);
  for (int64_t i = 0; i < NR * k; i += LANES) _mm256_storeu_ps(scratch.data() + i, widen(w + i));
  rows_block<NR>(x, m, scratch.data(), k, out, n_total);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_bf16: x and weight must be CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "linear_bf16: weight must be a contiguous 2-D bfloat16 tensor, got ", weight.scalar_type(), " of shape ",
              weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k > 0 && k % LANES == 0, "linear_bf16: the input dimension ", k, " must be a positive multiple of ",
              LANES);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "linear_bf16: x of shape ", x.sizes(), " against a weight of ", k,
              " input features");
  TORCH_CHECK(x.is_floating_point(), "linear_bf16: x must be a floating-point tensor, got ", x.scalar_type());
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->numel() == n, "linear_bf16: the bias has ", bias->numel(), " values for ", n, " outputs");
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor rows = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor acc = at::empty({m, n}, rows.options());
  const float* xp = rows.data_ptr<float>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  float* op = acc.data_ptr<float>();
  // one row (a decode step) streams the weight: more outputs at once keep more loads in flight
  const int64_t tile = m == 1 ? DECODE_COL_TILE : COL_TILE;
  const int64_t blocks = (n + tile - 1) / tile;
  // a few dozen blocks per task keep the threads streaming long runs of the weight
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t col = b * tile, nr = std::min<int64_t>(tile, n - col);
      const c10::BFloat16* w = wp + col * k;
      float* out = op + col;
      switch (nr) {
        case 6: column_block<6>(xp, m, w, k, out, n, scratch); break;
        case 5: column_block<5>(xp, m, w, k, out, n, scratch); break;
        case 4: column_block<4>(xp, m, w, k, out, n, scratch); break;
        case 3: column_block<3>(xp, m, w, k, out, n, scratch); break;
        case 2: column_block<2>(xp, m, w, k, out, n, scratch); break;
        default: column_block<1>(xp, m, w, k, out, n, scratch);
      }
    }
  });
  if (bias.has_value() && bias->defined()) acc.add_(bias->to(at::kFloat));
  return acc.to(at::kBFloat16).view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_cpu, m) { m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("linear_bf16", &linear_bf16); }

#endif  // AVX2 and FMA: elsewhere the operator is not defined and torch's product serves
