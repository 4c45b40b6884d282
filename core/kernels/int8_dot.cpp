// 4-bit and 8-bit weights times 8-bit activations with integer dot products
// (specdec.kernels.int8_dot, whose torch reference these results equal bit for bit).
//
// Activations are quantized per token in blocks of 32 columns (llama.cpp's Q8 blocks):
// a = round(x * 127 / amax), s = amax / 127. Weights come in groups of 16 output rows: a
// block's 16 x 32 codes are laid out so that one 512-bit register holds four consecutive
// codes of each of the 16 rows, one int32 lane per row; a token's four activations are
// broadcast to every lane and `vpdpbusd` (AVX-512 VNNI) adds their products into the lane
// (u8 codes times s8 activations). Without VNNI, AVX2's `vpmaddubsw` and `vpmaddwd` compute
// the same integers in two 8-row halves. A block's integer dot is exact; the float work that
// follows is written out operation by operation, never contracted into fused multiply-adds
// (the pragma below), in a fixed order per output:
//
//   4-bit (w = q * d + m per row and block):  y = y + float(dot) * (d * s);  y = y + m * (s * sum(a))
//   8-bit (w = (u - 128) * scale per row):    y = y + float(dot - 128 * sum(a)) * s;  at the end y = y * scale
//   8-bit blocks (w = (u - 128) * d per row and 32 or 16 columns):  y = y + float(dot - 128 * sum(a)) * (d * s)
//
// so an output depends on its token's activations and its weight row alone: the kernel is
// row-invariant by construction, whatever the row count, tiling, thread split or ISA.

#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // input columns per scale (activations and 4-bit weights)
constexpr int64_t GROUP = 16;  // output rows per interleaved weight group
constexpr int TOKEN_TILE = 8;  // tokens sharing one pass over a group's weights

// -- activations -------------------------------------------------------------------------

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {  // a bfloat16 is the high half of a float32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// One block of 32 inputs: codes into `a`, returns the code sum; `scale` gets amax / 127.
template <typename T>
inline int32_t quantize_block(const T* x, int8_t* a, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *scale = amax / 127.0f;
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));  // nearest, ties to even
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  // int32 -> int16 -> int8 with saturation (values are within -127..127), lanes back in order
  __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
  __m256i z16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  __m256i b8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, z16), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), b8);
  return _mm_cvtsi128_si32(s4);
}

// A call's activations, quantized: per token and block the codes, the scale s, the code
// sum and s * sum (the 4-bit minimum's factor). Kept per calling thread and reused, so a
// call allocates nothing but its output.
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scales, scaled_sums;
  std::vector<int32_t> sums, half_sums;  // half_sums: per 16 columns, for 8-bit rows of two scales a block
};

template <typename T>
void quantize_rows(const T* x, int64_t tokens, int64_t k, Activations& act) {
  const int64_t blocks = tokens * (k / BLOCK);
  act.codes.resize(tokens * k);
  act.scales.resize(blocks);
  act.scaled_sums.resize(blocks);
  act.sums.resize(blocks);
  act.half_sums.resize(2 * blocks);
  at::parallel_for(0, blocks, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int8_t* codes = act.codes.data() + i * BLOCK;
      act.sums[i] = quantize_block(x + i * BLOCK, act.codes.data() + i * BLOCK, &act.scales[i]);
      act.scaled_sums[i] = act.scales[i] * static_cast<float>(act.sums[i]);
      int32_t low = 0;
      for (int j = 0; j < BLOCK / 2; ++j) low += codes[j];
      act.half_sums[2 * i] = low;
      act.half_sums[2 * i + 1] = act.sums[i] - low;
    }
  });
}

void quantize_tensor(const at::Tensor& rows, Activations& act) {
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
              "the integer-dot kernels take float32 or bfloat16 inputs, not ", rows.scalar_type());
  if (rows.scalar_type() == at::kFloat)
    quantize_rows(rows.data_ptr<float>(), rows.size(0), rows.size(1), act);
  else
    quantize_rows(rows.data_ptr<c10::BFloat16>(), rows.size(0), rows.size(1), act);
}

void check_input(const at::Tensor& x, const char* name);

// x [T, K] -> codes [T, K] int8, scales [T, K/32] float, code sums [T, K/32] int32
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  check_input(x, "quantize_q8");
  TORCH_CHECK(x.dim() == 2, "quantize_q8: x must be 2-D [tokens, features], got shape ", x.sizes());
  const at::Tensor rows = x.contiguous();
  Activations act;
  quantize_tensor(rows, act);
  const int64_t t = rows.size(0), k = rows.size(1);
  at::Tensor codes = at::empty({t, k}, rows.options().dtype(at::kChar));
  at::Tensor scales = at::empty({t, k / BLOCK}, rows.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({t, k / BLOCK}, rows.options().dtype(at::kInt));
  std::copy(act.codes.begin(), act.codes.end(), codes.data_ptr<int8_t>());
  std::copy(act.scales.begin(), act.scales.end(), scales.data_ptr<float>());
  std::copy(act.sums.begin(), act.sums.end(), sums.data_ptr<int32_t>());
  return {codes, scales, sums};
}

// -- outputs ----------------------------------------------------------------------------

// Eight results (bias added, if any) in the output's dtype: bfloat16 rounded to nearest,
// ties to even, as torch rounds (NaN stays NaN).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// One token's results for a group's `count` rows (16 but in a last, partial group).
template <typename Out>
inline void store_group(const float* y, const float* bias, Out* out, int64_t count) {
  if (count == GROUP) {
    for (int h = 0; h < GROUP; h += 8) {
      __m256 v = _mm256_loadu_ps(y + h);
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + h));
      store8(out + h, v);
    }
    return;
  }
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<Out>(bias != nullptr ? y[i] + bias[i] : y[i]);
}

// -- integer dot products of one group of 16 rows with one token's block ------------------

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using IntVec = __m512i;  // 16 int32 lanes: one per row of the group
using FloatVec = __m512;
constexpr int HALVES = 1;
inline IntVec bcast(const int8_t* a) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a)); }
inline IntVec dot4(IntVec acc, IntVec codes, IntVec acts) { return _mm512_dpbusd_epi32(acc, codes, acts); }
inline IntVec load_codes(const uint8_t* p, int) { return _mm512_loadu_si512(p); }
inline IntVec nibbles_low(IntVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline IntVec nibbles_high(IntVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline IntVec int_zero() { return _mm512_setzero_si512(); }
inline IntVec int_sub(IntVec a, IntVec b) { return _mm512_sub_epi32(a, b); }
inline IntVec int_add(IntVec a, IntVec b) { return _mm512_add_epi32(a, b); }
inline IntVec int_set(int32_t v) { return _mm512_set1_epi32(v); }
inline FloatVec load_halves(const at::Half* p, int) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline FloatVec load_floats(const float* p, int) { return _mm512_loadu_ps(p); }
inline FloatVec to_float(IntVec v) { return _mm512_cvtepi32_ps(v); }
inline FloatVec fzero() { return _mm512_setzero_ps(); }
inline FloatVec fset(float v) { return _mm512_set1_ps(v); }
inline FloatVec fadd(FloatVec a, FloatVec b) { return _mm512_add_ps(a, b); }
inline FloatVec fmul(FloatVec a, FloatVec b) { return _mm512_mul_ps(a, b); }
inline void fstore(float* p, FloatVec v) { _mm512_storeu_ps(p, v); }
// 4 x u8 by 4 x s8 into each lane; the 8-bit codes are stored offset by 128 (u8)
inline IntVec dot4_s8(IntVec acc, IntVec codes, IntVec acts) { return _mm512_dpbusd_epi32(acc, codes, acts); }
constexpr bool CODES_OFFSET_SUBTRACTED = false;
#else
using IntVec = __m256i;  // 8 int32 lanes: one per row of half a group
using FloatVec = __m256;
constexpr int HALVES = 2;
inline IntVec bcast(const int8_t* a) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a)); }
inline IntVec dot4(IntVec acc, IntVec codes, IntVec acts) {  // codes 0..15: the int16 pairs cannot saturate
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, acts), _mm256_set1_epi16(1)));
}
inline IntVec load_codes(const uint8_t* p, int half) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
}
inline IntVec nibbles_low(IntVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline IntVec nibbles_high(IntVec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline IntVec int_zero() { return _mm256_setzero_si256(); }
inline IntVec int_sub(IntVec a, IntVec b) { return _mm256_sub_epi32(a, b); }
inline IntVec int_add(IntVec a, IntVec b) { return _mm256_add_epi32(a, b); }
inline IntVec int_set(int32_t v) { return _mm256_set1_epi32(v); }
inline FloatVec load_halves(const at::Half* p, int half) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * half)));
}
inline FloatVec load_floats(const float* p, int half) { return _mm256_loadu_ps(p + 8 * half); }
inline FloatVec to_float(IntVec v) { return _mm256_cvtepi32_ps(v); }
inline FloatVec fzero() { return _mm256_setzero_ps(); }
inline FloatVec fset(float v) { return _mm256_set1_ps(v); }
inline FloatVec fadd(FloatVec a, FloatVec b) { return _mm256_add_ps(a, b); }
inline FloatVec fmul(FloatVec a, FloatVec b) { return _mm256_mul_ps(a, b); }
inline void fstore(float* p, FloatVec v) { _mm256_storeu_ps(p, v); }
// signed codes (stored + 128, flipped back) times signed activations: |w| * (a signed like w),
// whose int16 pairs stay within 2 * 128 * 127
inline IntVec dot4_s8(IntVec acc, IntVec codes, IntVec acts) {
  const IntVec w = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  const IntVec p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(acts, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
constexpr bool CODES_OFFSET_SUBTRACTED = true;  // dot4_s8 already gives sum(w * a)
#endif
constexpr int LANES = GROUP / HALVES;

// A model's weights do not stay in cache from one step to the next: each call streams its
// layer's groups from memory. With one or two tokens the hardware's prefetcher keeps up;
// with a tile of three or more (a verified draft, a batch) each block's arithmetic is long
// enough that it does not, and a tile asks for the weights PREFETCH_BYTES ahead itself
// (from one or two tokens it only costs). The tiles keep their tokens' accumulators in
// registers (the token loop unrolled, the block loop not), and split each block's integer
// dot over two chains: integer sums, exact in any order, so the float work after them is
// the same.
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int PREFETCH_MIN_TOKENS = 3;
template <int LINES>
inline void prefetch_ahead(const uint8_t* p) {
  for (int c = 0; c < LINES; ++c) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES + 64 * c), _MM_HINT_T0);
}

// Q4: a group's block is 4 chunks of 64 bytes; chunk c holds columns 8c..8c+7, byte 4r+i
// of it row r's column 8c+i (low nibble) and 8c+4+i (high nibble). dm: per block 16 d then
// 16 m, float16 (GGUF's Q4_0 / Q4_1) or float32 (Q4_K, whose super-block scale times a
// 6-bit sub-block scale float16 cannot hold).
inline FloatVec load_scales(const at::Half* p, int half) { return load_halves(p, half); }
inline FloatVec load_scales(const float* p, int half) { return load_floats(p, half); }

template <int TT, typename S>
inline void q4_tile(const int8_t* a, const float* s, const float* sa, int64_t k, const uint8_t* w,
                    const S* dm, float* out) {
  const int64_t blocks = k / BLOCK;
  for (int half = 0; half < HALVES; ++half) {
    FloatVec y[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) y[t] = fzero();
#pragma GCC unroll 1
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * (GROUP * BLOCK / 2);
      if (half == 0 && TT >= PREFETCH_MIN_TOKENS) prefetch_ahead<4>(wb);
      IntVec q[8];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const IntVec v = load_codes(wb + 64 * c, half);
        q[2 * c] = nibbles_low(v);
        q[2 * c + 1] = nibbles_high(v);
      }
      const FloatVec d = load_scales(dm + b * 2 * GROUP, half);
      const FloatVec m = load_scales(dm + b * 2 * GROUP + GROUP, half);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* ab = a + t * k + b * BLOCK;
        IntVec acc0 = int_zero(), acc1 = int_zero();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
          acc0 = dot4(acc0, q[j], bcast(ab + 4 * j));
          acc1 = dot4(acc1, q[j + 1], bcast(ab + 4 * j + 4));
        }
        const IntVec acc = int_add(acc0, acc1);
        y[t] = fadd(y[t], fmul(to_float(acc), fmul(d, fset(s[t * blocks + b]))));
        y[t] = fadd(y[t], fmul(m, fset(sa[t * blocks + b])));
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) fstore(out + t * GROUP + half * LANES, y[t]);
  }
}

// Q8: a group's block is 8 chunks of 64 bytes; chunk c holds columns 4c..4c+3, byte 4r+i
// of it row r's column 4c+i, stored as code + 128. scale: 16 floats per group.
template <int TT>
inline void q8_tile(const int8_t* a, const float* s, const int32_t* sums, int64_t k, const uint8_t* w,
                    const float* scale, float* out) {
  const int64_t blocks = k / BLOCK;
  for (int half = 0; half < HALVES; ++half) {
    FloatVec y[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) y[t] = fzero();
#pragma GCC unroll 1
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * (GROUP * BLOCK);
      if (half == 0 && TT >= PREFETCH_MIN_TOKENS) prefetch_ahead<8>(wb);
      IntVec q[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) q[c] = load_codes(wb + 64 * c, half);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* ab = a + t * k + b * BLOCK;
        IntVec acc0 = int_zero(), acc1 = int_zero();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
          acc0 = dot4_s8(acc0, q[j], bcast(ab + 4 * j));
          acc1 = dot4_s8(acc1, q[j + 1], bcast(ab + 4 * j + 4));
        }
        IntVec acc = int_add(acc0, acc1);
        if (!CODES_OFFSET_SUBTRACTED) acc = int_sub(acc, int_set(128 * sums[t * blocks + b]));
        y[t] = fadd(y[t], fmul(to_float(acc), fset(s[t * blocks + b])));
      }
    }
    const FloatVec sc = load_floats(scale, half);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) fstore(out + t * GROUP + half * LANES, fmul(y[t], sc));
  }
}

// Q8B: q8's layout with SUBS float32 scales per row and block (one per 32 or per 16
// columns), per block SUBS runs of 16 (GGUF's Q5_0 and Q8_0: one; Q6_K: two). The codes'
// offset of 128 comes off with the activations' sums of each scale's columns.
template <int TT, int SUBS>
inline void q8b_tile(const int8_t* a, const float* s, const int32_t* half_sums, int64_t k, const uint8_t* w,
                     const float* scales, float* out) {
  const int64_t blocks = k / BLOCK;
  constexpr int CHUNKS = 8 / SUBS;  // 4-column chunks per scale
  for (int half = 0; half < HALVES; ++half) {
    FloatVec y[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) y[t] = fzero();
#pragma GCC unroll 1
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * (GROUP * BLOCK);
      if (half == 0 && TT >= PREFETCH_MIN_TOKENS) prefetch_ahead<8>(wb);
      IntVec q[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) q[c] = load_codes(wb + 64 * c, half);
      FloatVec d[SUBS];
      for (int u = 0; u < SUBS; ++u) d[u] = load_floats(scales + (b * SUBS + u) * GROUP, half);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* ab = a + t * k + b * BLOCK;
        const int32_t* hs = half_sums + 2 * (t * blocks + b);
        const FloatVec st = fset(s[t * blocks + b]);
        for (int u = 0; u < SUBS; ++u) {
          IntVec acc0 = int_zero(), acc1 = int_zero();
#pragma GCC unroll 4
          for (int j = u * CHUNKS; j < (u + 1) * CHUNKS; j += 2) {
            acc0 = dot4_s8(acc0, q[j], bcast(ab + 4 * j));
            acc1 = dot4_s8(acc1, q[j + 1], bcast(ab + 4 * j + 4));
          }
          IntVec acc = int_add(acc0, acc1);
          if (!CODES_OFFSET_SUBTRACTED) acc = int_sub(acc, int_set(128 * (SUBS == 1 ? hs[0] + hs[1] : hs[u])));
          y[t] = fadd(y[t], fmul(to_float(acc), fmul(d[u], st)));
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) fstore(out + t * GROUP + half * LANES, y[t]);
  }
}

// Per kind: the per-token, per-block term its tiles read beside the activation scales
// (4-bit: s * sum(a), the minimum's factor; 8-bit rows: the code sums; 8-bit blocks: the
// code sums of each 16 columns, AUX_PER_BLOCK to a block) and the tiles themselves.
template <typename S>
struct Q4 {
  using Aux = float;
  static constexpr int64_t AUX_PER_BLOCK = 1;
  static const Aux* aux(const Activations& act) { return act.scaled_sums.data(); }
  template <int TT>
  static void tile(const int8_t* a, const float* s, const Aux* sa, int64_t k, const uint8_t* w, const void* scales,
                   float* out) {
    q4_tile<TT>(a, s, sa, k, w, static_cast<const S*>(scales), out);
  }
};
template <int SUBS>
struct Q8B {
  using Aux = int32_t;
  static constexpr int64_t AUX_PER_BLOCK = 2;
  static const Aux* aux(const Activations& act) { return act.half_sums.data(); }
  template <int TT>
  static void tile(const int8_t* a, const float* s, const Aux* hs, int64_t k, const uint8_t* w, const void* scales,
                   float* out) {
    q8b_tile<TT, SUBS>(a, s, hs, k, w, static_cast<const float*>(scales), out);
  }
};
struct Q8 {
  using Aux = int32_t;
  static constexpr int64_t AUX_PER_BLOCK = 1;
  static const Aux* aux(const Activations& act) { return act.sums.data(); }
  template <int TT>
  static void tile(const int8_t* a, const float* s, const Aux* sums, int64_t k, const uint8_t* w, const void* scales,
                   float* out) {
    q8_tile<TT>(a, s, sums, k, w, static_cast<const float*>(scales), out);
  }
};

// Up to TOKEN_TILE tokens against one group: TT a template argument, so that the tile's
// accumulators stay in registers.
template <typename Kind>
void tile_of(int64_t tt, const int8_t* a, const float* s, const typename Kind::Aux* aux, int64_t k,
             const uint8_t* w, const void* scales, float* out) {
  switch (tt) {
    case 8: Kind::template tile<8>(a, s, aux, k, w, scales, out); break;
    case 7: Kind::template tile<7>(a, s, aux, k, w, scales, out); break;
    case 6: Kind::template tile<6>(a, s, aux, k, w, scales, out); break;
    case 5: Kind::template tile<5>(a, s, aux, k, w, scales, out); break;
    case 4: Kind::template tile<4>(a, s, aux, k, w, scales, out); break;
    case 3: Kind::template tile<3>(a, s, aux, k, w, scales, out); break;
    case 2: Kind::template tile<2>(a, s, aux, k, w, scales, out); break;
    default: Kind::template tile<1>(a, s, aux, k, w, scales, out);
  }
}

// multiply-adds a task gets at least: a small product runs on one thread, without the
// fork and join
constexpr int64_t TASK_WORK = 1 << 18;

// (tokens and k are positive: linear() returns before calling it otherwise)
template <typename Kind, typename Out>
void run(const Activations& act, int64_t tokens, int64_t k, const uint8_t* packed, int64_t group_bytes,
         const char* scales, int64_t scale_bytes, const float* bias, Out* out, int64_t n) {
  const int64_t groups = (n + GROUP - 1) / GROUP, blocks = k / BLOCK;
  const typename Kind::Aux* aux = Kind::aux(act);
  const int64_t grain = std::max<int64_t>(1, TASK_WORK / (GROUP * k * tokens));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[TOKEN_TILE * GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t rows = std::min<int64_t>(GROUP, n - g * GROUP);
      for (int64_t t = 0; t < tokens; t += TOKEN_TILE) {
        const int64_t tt = std::min<int64_t>(TOKEN_TILE, tokens - t);
        tile_of<Kind>(tt, act.codes.data() + t * k, act.scales.data() + t * blocks, aux + t * blocks * Kind::AUX_PER_BLOCK, k,
                      packed + g * group_bytes, scales + g * scale_bytes, buf);
        for (int64_t i = 0; i < tt; ++i)
          store_group(buf + i * GROUP, bias == nullptr ? nullptr : bias + g * GROUP, out + (t + i) * n + g * GROUP,
                      rows);
      }
    }
  });
}

// What every entry point checks before touching memory: a bad argument is a RuntimeError
// naming the kernel and the shape, never a signal or a read out of bounds.
void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, name, ": x must have at least one dimension (its last one the input features)");
  TORCH_CHECK(x.size(-1) > 0 && x.size(-1) % BLOCK == 0, name, ": x has ", x.size(-1),
              " input features; the kernel takes a positive multiple of ", BLOCK, " (shape ", x.sizes(), ")");
}

template <typename Kind>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                  const c10::optional<at::Tensor>& bias, int64_t group_bytes_per_column, const char* name) {
  check_input(x, name);
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu(), name, ": the weights must be CPU tensors");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) > 0 && packed.size(1) == GROUP * k * group_bytes_per_column / 2,
              name, ": packed weights of shape ", packed.sizes(), " do not match an input of ", k, " columns");
  TORCH_CHECK(scales.is_contiguous(), name, ": scales must be contiguous");
  const int64_t groups = packed.size(0);
  TORCH_CHECK(n <= groups * GROUP && n > (groups - 1) * GROUP, name, ": ", n, " outputs in ", groups, " groups of ",
              GROUP);
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->numel() == n, name, ": the bias has ", bias->numel(),
                " values for ", n, " outputs");
    bias_f = bias->reshape({-1}).to(at::kFloat).contiguous();  // no copy for a float32 bias; a last,
                                                                 // partial group reads only its rows
  }
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t tokens = rows.size(0);
  at::Tensor out = at::empty({tokens, n}, rows.options());
  if (tokens == 0) return out.view(out_shape);  // a step that keeps no logits: nothing to multiply
  thread_local Activations act;
  quantize_tensor(rows, act);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const char* scp = static_cast<const char*>(scales.data_ptr());
  const int64_t scale_bytes = scales.numel() * scales.element_size() / groups;
  if (rows.scalar_type() == at::kFloat)
    run<Kind>(act, tokens, k, packed.data_ptr<uint8_t>(), packed.size(1), scp, scale_bytes, bp,
              out.data_ptr<float>(), n);
  else
    run<Kind>(act, tokens, k, packed.data_ptr<uint8_t>(), packed.size(1), scp, scale_bytes, bp,
              out.data_ptr<c10::BFloat16>(), n);
  return out.view(out_shape);
}

// packed [groups, K/2 * 16] uint8, dm [groups, K/32 * 32] float16 or float32 (per block 16 d, 16 m)
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  check_input(x, "q4_linear");
  TORCH_CHECK((dm.scalar_type() == at::kHalf || dm.scalar_type() == at::kFloat) &&
                  dm.numel() == packed.size(0) * x.size(-1) / BLOCK * 2 * GROUP,
              "q4_linear: dm must hold float16 or float32 d and m per group and block, got ", dm.scalar_type(),
              " of shape ", dm.sizes(), " for packed weights of shape ", packed.sizes());
  if (dm.scalar_type() == at::kFloat) return linear<Q4<float>>(x, packed, dm, n, bias, 1, "q4_linear");
  return linear<Q4<at::Half>>(x, packed, dm, n, bias, 1, "q4_linear");
}

// packed [groups, K * 16] uint8 (codes + 128), scales [groups, K/32 * subs * 16] float32 (subs 1 or 2)
at::Tensor q8b_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                      const c10::optional<at::Tensor>& bias) {
  check_input(x, "q8b_linear");
  const int64_t per_sub = packed.size(0) * x.size(-1) / BLOCK * GROUP;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && (scales.numel() == per_sub || scales.numel() == 2 * per_sub),
              "q8b_linear: scales must hold one or two float32 scales per row and block, got ", scales.scalar_type(),
              " of shape ", scales.sizes(), " for packed weights of shape ", packed.sizes());
  if (scales.numel() == per_sub) return linear<Q8B<1>>(x, packed, scales, n, bias, 2, "q8b_linear");
  return linear<Q8B<2>>(x, packed, scales, n, bias, 2, "q8b_linear");
}

// packed [groups, K * 16] uint8 (codes + 128), scale [groups * 16] float32
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == packed.size(0) * GROUP,
              "q8_linear: scale must hold one float32 per row of every group, got ", scale.scalar_type(),
              " of shape ", scale.sizes(), " for packed weights of shape ", packed.sizes());
  return linear<Q8>(x, packed, scale, n, bias, 2, "q8_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_cpu, m) {
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("q4_linear(Tensor x, Tensor packed, Tensor dm, int n, Tensor? bias) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias) -> Tensor");
  m.def("q8b_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("quantize_q8", &quantize_q8);
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("q8b_linear", &q8b_linear);
}

#endif  // AVX2 and F16C: elsewhere the operators are not defined and the torch path serves
