// Batch-invariant attention on the CPU (specdec.kernels.cpu): the contract of
// invariant_attention_triton, one key row per token (AttentionLayout.invariant_key_rows).
//
// Each query head of a token walks the token's own key row in column order, in chunks of
// KEY_CHUNK keys; scores, softmax and the weighted sum of values in float32, every addition
// in a fixed order (a dot product's element i into lane i % LANES, the lanes added pairwise;
// key j's weight into lane j % LANES; values summed in key order; the chunks added in
// order). A work item is a KV head of one token, or of a tile of consecutive tokens sharing
// one row (a prompt chunk's, a draft chain's), which widens that row to float once for all
// of them: the same numbers, since widening is exact; where the items are fewer than the
// threads, each chunk of them. The query heads of a KV head are attended together, each
// value loaded once for all of them (a head's sums are the ones it would get alone).
// Nothing a token computes depends on which or how many other tokens share the call, nor
// on how the work is split across threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "vector_math.h"

namespace {

using namespace specdec_cpu;
using specdec_cpu::load_lanes;  // overloaded below for 16-bit pools

typedef uint16_t half_lanes_t __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t wide_lanes_t __attribute__((vector_size(LANES * sizeof(uint32_t))));

// A pool's 16-bit elements widened to float (exact either way). With AVX-512, one widening
// instruction for the 16 lanes: GCC lowers the generic conversion through 8-lane halves
// and inserts, three times the instructions, which a decode's walk over its keys spent most
// of its time on.
inline lanes_t load_lanes(const c10::BFloat16* p) {  // bfloat16 is the high half of a float32
#if defined(__AVX512F__)
  return reinterpret_cast<lanes_t>(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  half_lanes_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<lanes_t>(__builtin_convertvector(bits, wide_lanes_t) << 16);
#endif
}

inline lanes_t load_lanes(const c10::Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes_t>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<lanes_t>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float wide[LANES];
  for (int64_t l = 0; l < LANES; ++l) wide[l] = static_cast<float>(p[l]);
  return load_lanes(wide);
#endif
}

// A token's key row is attended in chunks of KEY_CHUNK keys (whole blocks of LANES), each
// giving its own maximum score, sum of weights and weighted sum of values; the chunks are
// then added in order, each rescaled to the row's maximum. Chunk boundaries are fixed
// columns of the row, so a token's numbers do not depend on how the chunks are shared out
// to threads: a lone decode token's long row is split across threads, a batch's rows are not.
constexpr int64_t KEY_CHUNK = 256;
// the most query heads of one KV head attended at once
constexpr int64_t MAX_HEADS_AT_ONCE = 4;

// The scores of LANES keys (rows[key] -> DIM elements) against q: each key's products summed
// into LANES lanes, the lanes reduced as reduce_lanes does, for all LANES keys at once (a
// pair of shuffles and an addition per level and pair of vectors, key k ending in lane k).
template <int64_t DIM, typename T>
inline lanes_t block_scores(const float* q, const T* const* rows, int64_t dim) {
  const int64_t n = DIM ? DIM : dim;
  lanes_t acc[LANES];
  for (int64_t key = 0; key < LANES; ++key) {
    lanes_t sum = {};
    for (int64_t i = 0; i < n; i += LANES) sum += load_lanes(q + i) * load_lanes(rows[key] + i);
    acc[key] = sum;
  }
#if defined(__AVX512F__)
  const lane_index_t low8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const lane_index_t low4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const lane_index_t low2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const lane_index_t low1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  lanes_t by8[8], by4[4], by2[2];
  for (int64_t i = 0; i < 8; ++i)
    by8[i] = __builtin_shuffle(acc[2 * i], acc[2 * i + 1], low8) +
             __builtin_shuffle(acc[2 * i], acc[2 * i + 1], low8 + 8);
  for (int64_t i = 0; i < 4; ++i)
    by4[i] = __builtin_shuffle(by8[2 * i], by8[2 * i + 1], low4) +
             __builtin_shuffle(by8[2 * i], by8[2 * i + 1], low4 + 4);
#else
  const lane_index_t low4 = {0, 1, 2, 3, 8, 9, 10, 11};
  const lane_index_t low2 = {0, 1, 4, 5, 8, 9, 12, 13};
  const lane_index_t low1 = {0, 2, 4, 6, 8, 10, 12, 14};
  lanes_t by4[4], by2[2];
  for (int64_t i = 0; i < 4; ++i)
    by4[i] = __builtin_shuffle(acc[2 * i], acc[2 * i + 1], low4) +
             __builtin_shuffle(acc[2 * i], acc[2 * i + 1], low4 + 4);
#endif
  for (int64_t i = 0; i < 2; ++i)
    by2[i] = __builtin_shuffle(by4[2 * i], by4[2 * i + 1], low2) +
             __builtin_shuffle(by4[2 * i], by4[2 * i + 1], low2 + 2);
  return __builtin_shuffle(by2[0], by2[1], low1) + __builtin_shuffle(by2[0], by2[1], low1 + 1);
}

// a[h][d] = sum_k p[h][k] * rows[k][d], keys in order, LANES columns a vector, for NH heads
// (p's rows KEY_CHUNK apart) sharing the values: each loaded and widened once.
template <int64_t DIM, int NH, typename T>
inline void weigh_values(const float* p, const T* const* rows, int64_t n, int64_t dim_v, float* const* a) {
  if constexpr (DIM > 0) {
    constexpr int64_t C = DIM / LANES;
    lanes_t sums[NH][C] = {};
    for (int64_t k = 0; k < n; ++k) {
      lanes_t r[C];
#pragma GCC unroll 16
      for (int64_t c = 0; c < C; ++c) r[c] = load_lanes(rows[k] + c * LANES);
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
        for (int64_t c = 0; c < C; ++c) sums[h][c] += p[h * KEY_CHUNK + k] * r[c];
    }
    for (int h = 0; h < NH; ++h)
      for (int64_t c = 0; c < C; ++c) store_lanes(a[h] + c * LANES, sums[h][c]);
  } else {
    for (int64_t c = 0; c < dim_v; c += LANES) {
      lanes_t sum[NH] = {};
      for (int64_t k = 0; k < n; ++k) {
        const lanes_t r = load_lanes(rows[k] + c);
        for (int h = 0; h < NH; ++h) sum[h] += p[h * KEY_CHUNK + k] * r;
      }
      for (int h = 0; h < NH; ++h) store_lanes(a[h] + c, sum[h]);
    }
  }
}

// What one chunk of a query head's key row gives: the largest score (-inf where every key
// of the chunk weighs nothing), the sum of exp(score - max) and the values weighed by it.
struct ChunkPartial {
  float top;
  float total;
};

// NH query heads of one token over keys [lo, hi) of k_rows, a stretch of its key row from a
// chunk boundary on (padded with zero keys to whole blocks of LANES; v_rows its values,
// key_pos their positions), lo a multiple of LANES: each head's partial into part[h], its
// weighed values into acc[h], its scores in s[h * KEY_CHUNK ...]. Scores are a head at a
// time; the heads share the values' loads; each head's numbers are the ones it would get
// alone. R is the rows'
// element type: the pool's own, or float where a tile of tokens widened its shared row once
// (the same numbers: widening a bfloat16 or half is exact).
template <int64_t DIM, int NH, typename R>
inline void attend_chunk(const float* const* q, const R* const* k_rows, const R* const* v_rows, int64_t lo,
                         int64_t hi, int64_t dim, int64_t dim_v, float scale, float softcap, int64_t window,
                         int64_t query_pos, const int64_t* key_pos, float* s, float* const* acc, ChunkPartial* part) {
  const float inf = std::numeric_limits<float>::infinity();
  if (window > 0) {
    // whole blocks of keys before the first one inside the window weigh nothing: they are
    // not scored. A kept key stays in its lane, so every sum below is the one it was.
    int64_t first = lo;
    while (first < hi && query_pos - key_pos[first] >= window) ++first;
    lo = first / LANES * LANES;
  }
  if (lo >= hi) {
    for (int h = 0; h < NH; ++h) part[h] = {-inf, 0.0f};
    return;
  }
  const int64_t n = hi - lo, blocks = (n + LANES - 1) / LANES;
  k_rows += lo;
  v_rows += lo;
  key_pos += lo;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int h = 0; h < NH; ++h)
      store_lanes(s + h * KEY_CHUNK + b * LANES, block_scores<DIM>(q[h], k_rows + b * LANES, dim) * scale);
  }
  for (int h = 0; h < NH; ++h) {
    float* sh = s + h * KEY_CHUNK;
    if (softcap > 0.0f)
      for (int64_t j = 0; j < n; ++j) sh[j] = std::tanh(sh[j] / softcap) * softcap;
    // a key outside the sliding window weighs nothing (its place in the row stays the one
    // plain decoding gives it); nor do the last block's missing keys
    if (window > 0)
      for (int64_t j = 0; j < n; ++j)
        if (query_pos - key_pos[j] >= window) sh[j] = -inf;
    for (int64_t j = n; j < blocks * LANES; ++j) sh[j] = -inf;
    lanes_t top = load_lanes(sh);
    for (int64_t b = 1; b < blocks; ++b) {
      const lanes_t x = load_lanes(sh + b * LANES);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int64_t l = 1; l < LANES; ++l) m = top[l] > m ? top[l] : m;
    if (m == -inf) {  // every key weighs nothing: zero weights, its partial says so and is skipped
      for (int64_t j = 0; j < blocks * LANES; ++j) sh[j] = 0.0f;
      part[h] = {-inf, 0.0f};
      continue;
    }
    for (int64_t j = 0; j < blocks * LANES; ++j) {
      const float e = exp_nonpositive(sh[j] - m);
      sh[j] = sh[j] == -inf ? 0.0f : e;
    }
    lanes_t total = {};
    for (int64_t b = 0; b < blocks; ++b) total += load_lanes(sh + b * LANES);
    part[h] = {m, reduce_lanes(total)};
  }
  weigh_values<DIM, NH>(s, v_rows, n, dim_v, acc);
}

// A query head's result from its row's chunks, added in order at the row's maximum (one
// chunk: exp(0) = 1, its own numbers).
template <typename T>
inline void add_chunks(const ChunkPartial* parts, const float* accs, int64_t chunks, int64_t dim_v, float* sums,
                       T* out) {
  float m = -std::numeric_limits<float>::infinity(), total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) m = parts[c].top > m ? parts[c].top : m;
  for (int64_t d = 0; d < dim_v; ++d) sums[d] = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (parts[c].top == -std::numeric_limits<float>::infinity()) continue;
    const float w = exp_nonpositive(parts[c].top - m);
    total += parts[c].total * w;
    for (int64_t d = 0; d < dim_v; ++d) sums[d] += accs[c * dim_v + d] * w;
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < dim_v; ++d) out[d] = static_cast<T>(sums[d] * inv);
}

// Most tokens of a tile: the consecutive tokens that share one key row (a causal sequence's
// queries; each sees the row's first count[t] keys) are one work item, whose row is widened
// to float once for all of them and their query heads.
constexpr int64_t TILE = 16;

// How a call's work is shared out: with fewer tiles times KV heads than twice the threads
// (a lone decode, a short chain) each chunk of a tile's KV head is a work item, and a second
// pass adds each query head's chunks (`split`); otherwise a work item is a tile's KV head
// with all its chunks, added as they are made.
struct Plan {
  std::vector<int64_t> tiles;    // first token of each tile, then tokens
  std::vector<int64_t> order;    // tiles in zigzag order
  std::vector<char> repeats;     // per token: the same query, row and position as the token before
  int64_t chunks = 0;            // chunks of the longest row
  bool split = false;
};

template <typename T, int64_t DIM>
void attend(const float* query, const T* keys, const T* values, T* out, const int64_t* slots,
            const int64_t* key_pos, const int64_t* offset, const int64_t* count, const int64_t* query_pos,
            int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t dim_v, int64_t key_stride,
            int64_t value_stride, float scale, float softcap, int64_t window) {
  const int64_t rep = heads / kv_heads;
  Plan plan;
  plan.repeats.assign(tokens, 0);
  int64_t longest = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (t == 0 || offset[t] != offset[t - 1] || t - plan.tiles.back() == TILE) plan.tiles.push_back(t);
    // a token given twice (a decode step runs its token twice) takes the answer the token
    // before it got
    plan.repeats[t] = t > plan.tiles.back() && count[t] == count[t - 1] && query_pos[t] == query_pos[t - 1] &&
                      std::memcmp(query + t * heads * dim, query + (t - 1) * heads * dim, heads * dim * sizeof(float)) == 0;
    longest = count[t] > longest ? count[t] : longest;
  }
  const int64_t num_tiles = static_cast<int64_t>(plan.tiles.size());
  plan.tiles.push_back(tokens);
  // items in zigzag order over the tiles (first, last, second, second to last, ...): a
  // prompt chunk's later tiles have longer rows, and each thread takes a contiguous range
  plan.order.resize(num_tiles);
  for (int64_t i = 0; i < num_tiles; ++i) plan.order[i] = i % 2 ? num_tiles - 1 - i / 2 : i / 2;
  plan.chunks = (longest + KEY_CHUNK - 1) / KEY_CHUNK;
  plan.split = plan.chunks > 1 && num_tiles * kv_heads < 2 * at::get_num_threads();
  const int64_t chunk_items = plan.split ? plan.chunks : 1;
  // the query heads of a KV head attended together (sharing its keys' and values' loads)
  const int64_t heads_at_once =
      rep % MAX_HEADS_AT_ONCE == 0 ? MAX_HEADS_AT_ONCE : rep % 3 == 0 ? 3 : rep % 2 == 0 ? 2 : 1;
  // the split partials: [token][head][chunk] (each token's own chunks; the rest unused)
  std::vector<ChunkPartial> parts(plan.split ? tokens * heads * plan.chunks : 0);
  std::vector<float> part_accs(plan.split ? tokens * heads * plan.chunks * dim_v : 0);
  const std::vector<T> zeros(dim);  // the key of a block's missing columns
  const std::vector<float> zeros_wide(dim);
  at::parallel_for(0, num_tiles * kv_heads * chunk_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> k_rows, v_rows;
    std::vector<const float*> k_wide, v_wide;
    std::vector<float> scores(MAX_HEADS_AT_ONCE * KEY_CHUNK), sums(dim_v), k_buf, v_buf;
    std::vector<ChunkPartial> own(plan.split ? 0 : MAX_HEADS_AT_ONCE * plan.chunks);
    std::vector<float> own_accs(plan.split ? 0 : MAX_HEADS_AT_ONCE * plan.chunks * dim_v);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = plan.order[item / (kv_heads * chunk_items)], g = item / chunk_items % kv_heads;
      const int64_t first = plan.tiles[tile], last = plan.tiles[tile + 1];
      int64_t row = 0;  // the tile's longest row
      for (int64_t t = first; t < last; ++t) row = count[t] > row ? count[t] : row;
      const int64_t c_lo = plan.split ? item % chunk_items : 0;
      const int64_t c_hi = plan.split ? c_lo + 1 : (row + KEY_CHUNK - 1) / KEY_CHUNK;
      if (c_lo * KEY_CHUNK >= row) continue;
      const int64_t k_lo = c_lo * KEY_CHUNK, k_hi = std::min(c_hi * KEY_CHUNK, row);
      const int64_t* row_slots = slots + offset[first];
      int64_t distinct = 0;
      for (int64_t t = first; t < last; ++t) distinct += !plan.repeats[t];
      // a tile of one token and its copies reads the pool's rows as they are; a tile of
      // several widens the keys of its chunks to float once for all of them
      const bool widen = distinct > 1;
      // the item's keys [k_lo, k_hi), padded with zero keys to whole blocks
      const int64_t width = (k_hi - k_lo + LANES - 1) / LANES * LANES;
      if (!widen) {
        k_rows.assign(width, zeros.data());
        v_rows.resize(k_hi - k_lo);
        for (int64_t j = k_lo; j < k_hi; ++j) {
          k_rows[j - k_lo] = keys + row_slots[j] * key_stride + g * dim;
          v_rows[j - k_lo] = values + row_slots[j] * value_stride + g * dim_v;
        }
      } else {
        k_buf.resize((k_hi - k_lo) * dim);
        v_buf.resize((k_hi - k_lo) * dim_v);
        k_wide.assign(width, zeros_wide.data());
        v_wide.resize(k_hi - k_lo);
        for (int64_t j = k_lo; j < k_hi; ++j) {
          const T* k = keys + row_slots[j] * key_stride + g * dim;
          const T* v = values + row_slots[j] * value_stride + g * dim_v;
          float* kw = k_buf.data() + (j - k_lo) * dim;
          float* vw = v_buf.data() + (j - k_lo) * dim_v;
          for (int64_t d = 0; d < dim; d += LANES) store_lanes(kw + d, load_lanes(k + d));
          for (int64_t d = 0; d < dim_v; d += LANES) store_lanes(vw + d, load_lanes(v + d));
          k_wide[j - k_lo] = kw;
          v_wide[j - k_lo] = vw;
        }
      }
      // query heads [h0, h0 + NH) of token t over the item's chunks (n keys in its row)
      const auto attend_heads = [&]<int NH>(int64_t t, int64_t h0, int64_t n) {
        const int64_t t_chunks = (n + KEY_CHUNK - 1) / KEY_CHUNK;
        const int64_t* t_pos = key_pos + offset[t] + k_lo;
        ChunkPartial* p[NH];
        float* a[NH];
        const float* qs[NH];
        for (int i = 0; i < NH; ++i) {
          const int64_t h = h0 + i;
          p[i] = plan.split ? parts.data() + (t * heads + h) * plan.chunks : own.data() + i * plan.chunks;
          a[i] = plan.split ? part_accs.data() + (t * heads + h) * plan.chunks * dim_v
                            : own_accs.data() + i * plan.chunks * dim_v;
          qs[i] = query + (t * heads + h) * dim;
        }
        for (int64_t c = c_lo; c < c_hi && c < t_chunks; ++c) {
          const int64_t lo = c * KEY_CHUNK - k_lo, hi = std::min(c * KEY_CHUNK + KEY_CHUNK, n) - k_lo;
          ChunkPartial got[NH];
          float* ac[NH];
          for (int i = 0; i < NH; ++i) ac[i] = a[i] + c * dim_v;
          if (widen)
            attend_chunk<DIM, NH>(qs, k_wide.data(), v_wide.data(), lo, hi, dim, dim_v, scale, softcap, window,
                                  query_pos[t], t_pos, scores.data(), ac, got);
          else
            attend_chunk<DIM, NH>(qs, k_rows.data(), v_rows.data(), lo, hi, dim, dim_v, scale, softcap, window,
                                  query_pos[t], t_pos, scores.data(), ac, got);
          for (int i = 0; i < NH; ++i) p[i][c] = got[i];
        }
        if (!plan.split)
          for (int i = 0; i < NH; ++i)
            add_chunks(p[i], a[i], t_chunks, dim_v, sums.data(), out + (t * heads + h0 + i) * dim_v);
      };
      for (int64_t t = first; t < last; ++t) {
        if (plan.repeats[t]) continue;
        for (int64_t h0 = g * rep; h0 < (g + 1) * rep; h0 += heads_at_once) {
          switch (heads_at_once) {
            case 4: attend_heads.template operator()<4>(t, h0, count[t]); break;
            case 3: attend_heads.template operator()<3>(t, h0, count[t]); break;
            case 2: attend_heads.template operator()<2>(t, h0, count[t]); break;
            default: attend_heads.template operator()<1>(t, h0, count[t]);
          }
        }
      }
    }
  });
  if (plan.split)
    at::parallel_for(0, tokens * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sums(dim_v);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads;
        if (!plan.repeats[t])
          add_chunks(parts.data() + i * plan.chunks, part_accs.data() + i * plan.chunks * dim_v,
                     (count[t] + KEY_CHUNK - 1) / KEY_CHUNK, dim_v, sums.data(), out + i * dim_v);
      }
    });
  // a repeated token's answer is the token's before it (in token order: a run of copies)
  for (int64_t t = 0; t < tokens; ++t)
    if (plan.repeats[t]) std::memcpy(out + t * heads * dim_v, out + (t - 1) * heads * dim_v, heads * dim_v * sizeof(T));
}

at::Tensor invariant_attention(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                               const at::Tensor& slots, const at::Tensor& key_pos, const at::Tensor& offset,
                               const at::Tensor& count, const at::Tensor& query_pos, double scale, double softcap,
                               int64_t window) {
  // query [tokens, heads, dim] float32; pools [slots, kv_heads, dim] of one dtype, rows contiguous;
  // token t attends keys slots[offset[t] .. offset[t] + count[t]) at positions key_pos[same]
  for (const at::Tensor* t : {&query, &key_pool, &value_pool, &slots, &key_pos, &offset, &count, &query_pos})
    TORCH_CHECK(t->device().is_cpu(), "invariant_attention: every tensor must be on the CPU, got one on ",
                t->device());
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "invariant_attention: query must be a contiguous float32 [tokens, heads, dim], got ",
              query.scalar_type(), " of shape ", query.sizes());
  TORCH_CHECK(key_pool.dim() == 3 && value_pool.dim() == 3 && key_pool.size(0) == value_pool.size(0) &&
                  key_pool.size(1) == value_pool.size(1),
              "invariant_attention: key and value pools must be [slots, kv_heads, dim] alike, got ", key_pool.sizes(),
              " and ", value_pool.sizes());
  TORCH_CHECK(key_pool.scalar_type() == value_pool.scalar_type(), "invariant_attention: key and value pools of one "
              "dtype, got ", key_pool.scalar_type(), " and ", value_pool.scalar_type());
  TORCH_CHECK(key_pool.stride(2) == 1 && key_pool.stride(1) == key_pool.size(2) && value_pool.stride(2) == 1 &&
                  value_pool.stride(1) == value_pool.size(2),
              "invariant_attention: pools: each slot's heads contiguous");
  for (const at::Tensor* index : {&slots, &key_pos, &offset, &count, &query_pos})
    TORCH_CHECK(index->dim() == 1 && index->scalar_type() == at::kLong && index->is_contiguous(),
                "invariant_attention: indices must be contiguous 1-D int64, got ", index->scalar_type(), " of shape ",
                index->sizes());
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_pool.size(1), dim_v = value_pool.size(2), num_slots = key_pool.size(0);
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0, "invariant_attention: ", heads,
              " query heads are not a positive multiple of ", kv_heads, " KV heads");
  TORCH_CHECK(key_pool.size(2) == dim, "invariant_attention: queries of dimension ", dim, " against keys of ",
              key_pool.size(2));
  TORCH_CHECK(dim > 0 && dim_v > 0 && dim % LANES == 0 && dim_v % LANES == 0, "invariant_attention: head "
              "dimensions ", dim, " and ", dim_v, " must be positive multiples of ", LANES);
  TORCH_CHECK(offset.size(0) == tokens && count.size(0) == tokens && query_pos.size(0) == tokens,
              "invariant_attention: offset, count and query_pos need one entry per token (", tokens, "), got ",
              offset.size(0), ", ", count.size(0), " and ", query_pos.size(0));
  TORCH_CHECK(key_pos.size(0) == slots.size(0), "invariant_attention: ", slots.size(0), " slots but ",
              key_pos.size(0), " key positions");
  const int64_t *slot = slots.data_ptr<int64_t>(), *off = offset.data_ptr<int64_t>(), *cnt = count.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(cnt[t] > 0 && off[t] >= 0 && off[t] <= slots.size(0) - cnt[t], "invariant_attention: token ", t,
                "'s key row [", off[t], ", ", off[t] + cnt[t], ") is empty or outside the ", slots.size(0),
                " slots given");
  for (int64_t j = 0; j < slots.size(0); ++j)
    TORCH_CHECK(slot[j] >= 0 && slot[j] < num_slots, "invariant_attention: slot ", slot[j], " is outside the pool's ",
                num_slots);
  at::Tensor out = at::empty({tokens, heads, dim_v}, key_pool.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_pool.scalar_type(), "invariant_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 pools are not supported");
    } else {
      auto run = dim == 64 && dim_v == 64 ? attend<scalar_t, 64> : dim == 128 && dim_v == 128 ? attend<scalar_t, 128>
                                                                                                : attend<scalar_t, 0>;
      run(query.data_ptr<float>(), key_pool.data_ptr<scalar_t>(), value_pool.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), key_pos.data_ptr<int64_t>(),
                       offset.data_ptr<int64_t>(), count.data_ptr<int64_t>(), query_pos.data_ptr<int64_t>(),
                       tokens, heads, kv_heads, dim, dim_v, key_pool.stride(0), value_pool.stride(0),
                       static_cast<float>(scale), static_cast<float>(softcap), window);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_cpu, m) {
  m.def("invariant_attention(Tensor query, Tensor key_pool, Tensor value_pool, Tensor slots, Tensor key_pos, "
        "Tensor offset, Tensor count, Tensor query_pos, float scale, float softcap, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("invariant_attention", &invariant_attention); }
