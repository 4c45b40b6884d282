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
//
// so an output depends on its token's activations and its weight row alone: the kernel is
// row-invariant by construction, whatever the row count, tiling, thread split or ISA.

#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

#include <tuple>

namespace {

constexpr int64_t BLOCK = 32;  // input columns per scale (activations and 4-bit weights)
constexpr int64_t GROUP = 16;  // output rows per interleaved weight group
constexpr int TOKEN_TILE = 8;  // tokens sharing one pass over a group's weights

// -- activations -------------------------------------------------------------------------

// One block of 32 floats: codes into `a`, returns the code sum; `scale` gets amax / 127.
inline int32_t quantize_block(const float* x, int8_t* a, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
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

// x [T, K] -> codes [T, K] int8, scales [T, K/32] float, code sums [T, K/32] int32
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % BLOCK == 0, "quantize_q8: x must be 2-D with a multiple of ", BLOCK,
              " columns");
  at::Tensor rows = x.to(at::kFloat).contiguous();
  const int64_t t = rows.size(0), k = rows.size(1), blocks = k / BLOCK;
  at::Tensor codes = at::empty({t, k}, rows.options().dtype(at::kChar));
  at::Tensor scales = at::empty({t, blocks}, rows.options());
  at::Tensor sums = at::empty({t, blocks}, rows.options().dtype(at::kInt));
  const float* xp = rows.data_ptr<float>();
  int8_t* ap = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  int32_t* up = sums.data_ptr<int32_t>();
  at::parallel_for(0, t * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) up[i] = quantize_block(xp + i * BLOCK, ap + i * BLOCK, sp + i);
  });
  return {codes, scales, sums};
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

// Q4: a group's block is 4 chunks of 64 bytes; chunk c holds columns 8c..8c+7, byte 4r+i
// of it row r's column 8c+i (low nibble) and 8c+4+i (high nibble). dm: per block 16 d then
// 16 m, float16.
template <int TT>
inline void q4_tile(const int8_t* a, const float* s, const float* sa, int64_t k, const uint8_t* w,
                    const at::Half* dm, float* out, int64_t out_stride) {
  const int64_t blocks = k / BLOCK;
  for (int half = 0; half < HALVES; ++half) {
    FloatVec y[TT];
    for (int t = 0; t < TT; ++t) y[t] = fzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * (GROUP * BLOCK / 2);
      IntVec q[8];
      for (int c = 0; c < 4; ++c) {
        const IntVec v = load_codes(wb + 64 * c, half);
        q[2 * c] = nibbles_low(v);
        q[2 * c + 1] = nibbles_high(v);
      }
      const FloatVec d = load_halves(dm + b * 2 * GROUP, half);
      const FloatVec m = load_halves(dm + b * 2 * GROUP + GROUP, half);
      for (int t = 0; t < TT; ++t) {
        const int8_t* ab = a + t * k + b * BLOCK;
        IntVec acc = int_zero();
        for (int j = 0; j < 8; ++j) acc = dot4(acc, q[j], bcast(ab + 4 * j));
        y[t] = fadd(y[t], fmul(to_float(acc), fmul(d, fset(s[t * blocks + b]))));
        y[t] = fadd(y[t], fmul(m, fset(sa[t * blocks + b])));
      }
    }
    for (int t = 0; t < TT; ++t) fstore(out + t * out_stride + half * LANES, y[t]);
  }
}

// Q8: a group's block is 8 chunks of 64 bytes; chunk c holds columns 4c..4c+3, byte 4r+i
// of it row r's column 4c+i, stored as code + 128. scale: 16 floats per group.
template <int TT>
inline void q8_tile(const int8_t* a, const float* s, const int32_t* sums, int64_t k, const uint8_t* w,
                    const float* scale, float* out, int64_t out_stride) {
  const int64_t blocks = k / BLOCK;
  for (int half = 0; half < HALVES; ++half) {
    FloatVec y[TT];
    for (int t = 0; t < TT; ++t) y[t] = fzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * (GROUP * BLOCK);
      IntVec q[8];
      for (int c = 0; c < 8; ++c) q[c] = load_codes(wb + 64 * c, half);
      for (int t = 0; t < TT; ++t) {
        const int8_t* ab = a + t * k + b * BLOCK;
        IntVec acc = int_zero();
        for (int j = 0; j < 8; ++j) acc = dot4_s8(acc, q[j], bcast(ab + 4 * j));
        if (!CODES_OFFSET_SUBTRACTED) acc = int_sub(acc, int_set(128 * sums[t * blocks + b]));
        y[t] = fadd(y[t], fmul(to_float(acc), fset(s[t * blocks + b])));
      }
    }
    const FloatVec sc = load_floats(scale, half);
    for (int t = 0; t < TT; ++t) fstore(out + t * out_stride + half * LANES, fmul(y[t], sc));
  }
}

// Per kind: the per-token, per-block term its tiles read beside the activation scales
// (4-bit: s * sum(a), the minimum's factor; 8-bit: the code sums) and the tiles themselves.
struct Q4 {
  using Aux = float;
  static at::Tensor aux(const at::Tensor& scales, const at::Tensor& sums) { return scales * sums.to(at::kFloat); }
  template <int TT>
  static void tile(const int8_t* a, const float* s, const Aux* sa, int64_t k, const uint8_t* w, const void* scales,
                   float* out, int64_t stride) {
    q4_tile<TT>(a, s, sa, k, w, static_cast<const at::Half*>(scales), out, stride);
  }
};
struct Q8 {
  using Aux = int32_t;
  static at::Tensor aux(const at::Tensor&, const at::Tensor& sums) { return sums; }
  template <int TT>
  static void tile(const int8_t* a, const float* s, const Aux* sums, int64_t k, const uint8_t* w,
                   const void* scales, float* out, int64_t stride) {
    q8_tile<TT>(a, s, sums, k, w, static_cast<const float*>(scales), out, stride);
  }
};

// Every token of the call against one group: full tiles of TOKEN_TILE, then the rest.
template <typename Kind>
void group_rows(int64_t tokens, int64_t k, const int8_t* a, const float* s, const typename Kind::Aux* sums,
                const uint8_t* w,
                const void* scales, float* out, int64_t stride) {
  const int64_t blocks = k / BLOCK;
  int64_t t = 0;
  for (; t + TOKEN_TILE <= tokens; t += TOKEN_TILE)
    Kind::template tile<TOKEN_TILE>(a + t * k, s + t * blocks, sums + t * blocks, k, w, scales, out + t * stride,
                                    stride);
  const int64_t rest = tokens - t;
  const int8_t* at = a + t * k;
  const float* sp = s + t * blocks;
  const typename Kind::Aux* up = sums + t * blocks;
  float* op = out + t * stride;
  switch (rest) {
    case 7: Kind::template tile<7>(at, sp, up, k, w, scales, op, stride); break;
    case 6: Kind::template tile<6>(at, sp, up, k, w, scales, op, stride); break;
    case 5: Kind::template tile<5>(at, sp, up, k, w, scales, op, stride); break;
    case 4: Kind::template tile<4>(at, sp, up, k, w, scales, op, stride); break;
    case 3: Kind::template tile<3>(at, sp, up, k, w, scales, op, stride); break;
    case 2: Kind::template tile<2>(at, sp, up, k, w, scales, op, stride); break;
    case 1: Kind::template tile<1>(at, sp, up, k, w, scales, op, stride); break;
    default: break;
  }
}

template <typename Kind>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                  const c10::optional<at::Tensor>& bias, int64_t group_bytes_per_column, const char* name) {
  TORCH_CHECK(x.size(-1) % BLOCK == 0, name, ": the input dimension must be a multiple of ", BLOCK);
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(1) == GROUP * k * group_bytes_per_column / 2,
              name, ": packed weights do not match an input of ", k, " columns");
  TORCH_CHECK(scales.is_contiguous(), name, ": scales must be contiguous");
  const int64_t groups = packed.size(0);
  TORCH_CHECK(n <= groups * GROUP, name, ": ", n, " outputs but ", groups, " groups of ", GROUP);
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto [codes, act_scales, sums] = quantize_q8(x.reshape({-1, k}));
  const at::Tensor aux = Kind::aux(act_scales, sums);
  const int64_t tokens = codes.size(0);
  at::Tensor acc = at::empty({tokens, groups * GROUP}, act_scales.options());
  const int8_t* ap = codes.data_ptr<int8_t>();
  const float* sp = act_scales.data_ptr<float>();
  const typename Kind::Aux* up = aux.data_ptr<typename Kind::Aux>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const char* scp = static_cast<const char*>(scales.data_ptr());
  const int64_t scale_bytes = scales.numel() * scales.element_size() / groups;
  float* op = acc.data_ptr<float>();
  const int64_t row_bytes = packed.size(1);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      group_rows<Kind>(tokens, k, ap, sp, up, wp + g * row_bytes, scp + g * scale_bytes, op + g * GROUP,
                       groups * GROUP);
  });
  at::Tensor y = n == groups * GROUP ? acc : acc.narrow(1, 0, n);
  if (bias.has_value() && bias->defined()) y = y + bias->to(at::kFloat);
  return y.to(x.scalar_type()).view(out_shape);
}

// packed [groups, K/2 * 16] uint8, dm [groups, K/32 * 32] float16 (per block 16 d, 16 m)
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.numel() == packed.size(0) * x.size(-1) / BLOCK * 2 * GROUP,
              "q4_linear: dm must hold float16 d and m per group and block");
  return linear<Q4>(x, packed, dm, n, bias, 1, "q4_linear");
}

// packed [groups, K * 16] uint8 (codes + 128), scale [groups * 16] float32
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == packed.size(0) * GROUP,
              "q8_linear: scale must hold one float32 per row of every group");
  return linear<Q8>(x, packed, scale, n, bias, 2, "q8_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_cpu, m) {
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("q4_linear(Tensor x, Tensor packed, Tensor dm, int n, Tensor? bias) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("quantize_q8", &quantize_q8);
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}

#endif  // AVX2 and F16C: elsewhere the operators are not defined and the torch path serves
