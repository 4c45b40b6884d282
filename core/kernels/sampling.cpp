// Sampling distributions and draws on the CPU (specdec.kernels.cpu): the contracts of
// probs_from_logits (specdec.sampler.logits: temperature, top-k, top-p, min-p, then the
// kept mass normalized) and of sample_by_uniforms (specdec.sampler.acceptance: the inverse
// CDF over float64 sums in vocabulary order), a row in a few passes over the vocabulary.
//
// The torch versions take a dozen library operations a row, each a pass over the
// vocabulary, and a top-k selection of the likeliest tokens to find the top-p nucleus; a
// sampled step computes a row for each node it verifies and each token it drafts. Here
// the nucleus is looked for among the tokens at least a fixed fraction of the likeliest
// one's probability (a handful on real text), widening only where their mass falls short,
// with the torch version's rule: a token is in when the tokens strictly likelier hold less
// than top_p, so ties are in or out together. Each row depends on nothing but itself. The
// numbers are not the torch version's bits (a vectorized exp, sums in lanes); one of the
// two serves a process.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "vector_math.h"

namespace {

using namespace specdec_cpu;

// the tokens at least this fraction of the likeliest one are searched for the nucleus first,
// then the next fraction where their mass is short of top_p
constexpr float NUCLEUS_FRACTIONS[] = {1e-4f, 1e-8f, 0.0f};
// values summed in float lanes before their sum joins the row's float64 total
constexpr int64_t SUM_CHUNK = 1024;

// the sum of p[0, n): chunks in float lanes, their sums in float64
double sum_row(const float* p, int64_t n) {
  double sum = 0.0;
  int64_t i = 0;
  while (i + LANES <= n) {
    lanes_t chunk = {};
    for (const int64_t end = std::min(n - n % LANES, i + SUM_CHUNK); i < end; i += LANES) chunk += load_lanes(p + i);
    sum += reduce_lanes(chunk);
  }
  for (; i < n; ++i) sum += p[i];
  return sum;
}

// whether any of the LANES values at p is at least `least`
inline bool any_at_least(const float* p, float least) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(least), _CMP_GE_OQ) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(least), _CMP_GE_OQ)) != 0;
#else
  for (int64_t l = 0; l < LANES; ++l)
    if (p[l] >= least) return true;
  return false;
#endif
}

inline void push_if_above(std::vector<float>& heap, float value) {
  if (value <= heap.front()) return;
  std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
  heap.back() = value;
  std::push_heap(heap.begin(), heap.end(), std::greater<float>());
}

struct Token {
  float p;
  int64_t id;
};

// the tokens of p[0, n) at least `least`, likeliest first (ties by id)
void tokens_at_least(const float* p, int64_t n, float least, std::vector<Token>& out) {
  out.clear();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    if (any_at_least(p + i, least))
      for (int64_t j = i; j < i + LANES; ++j)
        if (p[j] >= least) out.push_back({p[j], j});
  for (; i < n; ++i)
    if (p[i] >= least) out.push_back({p[i], i});
  std::sort(out.begin(), out.end(), [](const Token& a, const Token& b) { return a.p > b.p || (a.p == b.p && a.id < b.id); });
}

// keep the row's top-p nucleus and the tokens at least min_p times the likeliest (pmax),
// normalized; the rest zero
void keep_nucleus(float* p, int64_t n, float pmax, float top_p, float min_p, std::vector<Token>& top) {
  for (float fraction : NUCLEUS_FRACTIONS) {
    tokens_at_least(p, n, pmax * fraction, top);
    double cumulative = 0.0;
    int64_t inside = 0;
    for (const Token& token : top) {
      cumulative += token.p;
      if (!(static_cast<float>(cumulative) - token.p < top_p)) break;
      ++inside;
    }
    // the nucleus does not end among these tokens: a token left out may be inside it
    if (inside == static_cast<int64_t>(top.size()) && fraction > 0.0f) continue;
    const float least = std::max(top[std::max<int64_t>(inside - 1, 0)].p, min_p * pmax);
    // every token left out is below `least`, so the kept ones are among these
    double kept = 0.0;
    for (const Token& token : top)
      if (token.p >= least) kept += token.p;
    std::fill(p, p + n, 0.0f);
    const float scale = static_cast<float>(1.0 / kept);
    for (const Token& token : top)
      if (token.p >= least) p[token.id] = token.p * scale;
    return;
  }
}

// the k-th largest of p[0, n) (0 < k < n): a min-heap of the k largest so far, which a
// block of LANES values enters only where one of them is above its least
float kth_largest(const float* p, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.assign(p, p + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  int64_t i = k;
  for (; i < n && i % LANES; ++i) push_if_above(heap, p[i]);
  for (; i + LANES <= n; i += LANES)
    if (any_at_least(p + i, heap.front()))
      for (int64_t j = i; j < i + LANES; ++j) push_if_above(heap, p[j]);
  for (; i < n; ++i) push_if_above(heap, p[i]);
  return heap.front();
}

void probs_row(const float* x, float* p, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
               std::vector<float>& scratch, std::vector<Token>& top) {
  const float inf = std::numeric_limits<float>::infinity();
  lanes_t highest = {};
  highest -= inf;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const lanes_t v = load_lanes(x + i) / temperature;
    store_lanes(p + i, v);
    highest = v > highest ? v : highest;
  }
  float m = -inf;
  for (int64_t l = 0; l < LANES; ++l) m = highest[l] > m ? highest[l] : m;
  for (; i < n; ++i) {
    p[i] = x[i] / temperature;
    m = p[i] > m ? p[i] : m;
  }
  const float kth = top_k > 0 && top_k < n ? kth_largest(p, n, top_k, scratch) : -inf;  // top-k
  for (i = 0; i < n; ++i) {
    const float d = p[i] - m;
    p[i] = (p[i] < kth || d < -87.0f) ? 0.0f : exp_nonpositive(d);
  }
  const float inv_total = static_cast<float>(1.0 / sum_row(p, n));
  for (i = 0; i < n; ++i) p[i] *= inv_total;
  const float pmax = inv_total;  // the likeliest token's exp is exactly 1
  if (top_p < 1.0f) {
    keep_nucleus(p, n, pmax, top_p, min_p, top);
  } else if (min_p > 0.0f) {
    const float least = min_p * pmax;
    for (i = 0; i < n; ++i) p[i] = p[i] < least ? 0.0f : p[i];
    const float inv_kept = static_cast<float>(1.0 / sum_row(p, n));
    for (i = 0; i < n; ++i) p[i] *= inv_kept;
  }
}

at::Tensor sampling_probs(const at::Tensor& logits, double temperature, int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sampling_probs: logits must be [rows, vocab] float32");
  TORCH_CHECK(temperature > 0.0, "sampling_probs: temperature must be positive");
  const at::Tensor rows = logits.contiguous();
  const int64_t count = rows.size(0), vocab = rows.size(1);
  at::Tensor out = at::empty_like(rows);
  const float* x = rows.data_ptr<float>();
  float* p = out.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<Token> top;
    for (int64_t r = begin; r < end; ++r)
      probs_row(x + r * vocab, p + r * vocab, vocab, static_cast<float>(temperature), top_k,
                static_cast<float>(top_p), static_cast<float>(min_p), scratch, top);
  });
  return out;
}

// row r's token by the inverse CDF at uniforms[r]: the first whose float64 running sum
// exceeds uniforms[r] times the row's sum; a zero-probability token is never drawn
at::Tensor inverse_cdf(const at::Tensor& probs, const at::Tensor& uniforms) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "inverse_cdf: probs must be [rows, vocab] float32");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == probs.size(0) && uniforms.scalar_type() == at::kDouble,
              "inverse_cdf: uniforms must be [rows] float64");
  const at::Tensor rows = probs.contiguous();
  const int64_t count = rows.size(0), vocab = rows.size(1);
  at::Tensor out = at::empty({count}, rows.options().dtype(at::kLong));
  const float* p = rows.data_ptr<float>();
  const double* u = uniforms.contiguous().data_ptr<double>();
  int64_t* token = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    const float* row = p + r * vocab;
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) total += row[i];
    const double at = u[r] * total;
    double cumulative = 0.0;
    int64_t pick = vocab - 1;
    for (int64_t i = 0; i < vocab; ++i) {
      cumulative += row[i];
      if (cumulative > at) {
        pick = i;
        break;
      }
    }
    token[r] = pick;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_cpu, m) {
  m.def("sampling_probs(Tensor logits, float temperature, int top_k, float top_p, float min_p) -> Tensor");
  m.def("inverse_cdf(Tensor probs, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("sampling_probs", &sampling_probs);
  m.impl("inverse_cdf", &inverse_cdf);
}
