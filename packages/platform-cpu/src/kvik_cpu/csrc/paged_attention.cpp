// Paged attention on the CPU, reading keys and values where they lie in the paged KV cache.
//
// kvik_cpu::paged_attention writes a step's new keys and values into the cache, then attends every
// query token over its request's context (causal, optionally within a sliding window). One work
// item is a (token, KV head) pair: the query heads sharing that KV head (GQA) are handled together,
// so each cached key and value row is read once per token. Scores and sums are fp32.
//
// Three paths for bf16 (ops.h's Isa; the caller passes the highest it may take): portable loops
// (plain, and every float32 call), AVX512-BF16 dot products and exp (avx512bf16), and the same
// with the query-key scores on AMX tiles (amx).
//
// An FP8 (e4m3) cache holds keys / k_scale and values / v_scale (kvik.attention.kv_quant): the
// write quantizes as torch does (clamp to +-448, round to nearest even), and the portable loops
// read it, with k_scale folded into the softmax scale and v_scale into the final normalisation.
//
// Built at run time by kvik_cpu.extension (torch.utils.cpp_extension), for the host's CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include "amx.h"
#include "ops.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) { return static_cast<float>(x); }
// An FP8 cache is read and written as its bytes, the e4m3 bits: GCC vectorises no loop over
// c10::Float8_e4m3fn values (nor over a struct wrapping the byte, where a loop stores elsewhere).
using E4m3 = uint8_t;

// e4m3 -> fp32 with integer operations and a select, which vectorise (c10's conversion branches),
// and with no fp32 subnormal on the way (one in a vector makes Intel CPUs take a slow microcode
// path for the whole instruction). Exponent e and mantissa m go to fp32's places, the exponent
// rebiased from 7 to 127: 2^(e - 7) (1 + m / 8); where e = 0 the value is m 2^-9 instead. (The
// NaN codes, which the cache never holds, read as +-480.)
inline float load(E4m3 bits) {
  const uint32_t magnitude = bits & 0x7F;
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80) << 24;
  const uint32_t subnormal =
      __builtin_bit_cast(uint32_t, static_cast<float>(magnitude) * 0x1p-9f);
  const uint32_t normal = (magnitude << 20) + (120u << 23);
  return __builtin_bit_cast(float, (magnitude < 8 ? subnormal : normal) | sign);
}

constexpr float kFp8Max = 448.f;  // e4m3's largest finite value

template <typename T>
T from_float(float x) {
  return static_cast<T>(x);
}

// Walks the cache slots of a request's positions first, first + 1, ... through its block table,
// without a division per position (a 64-bit division costs tens of cycles, as much as the math).
class SlotCursor {
 public:
  SlotCursor(const int32_t* table, int64_t first, int64_t block_size)
      : table_(table), block_(first / block_size), offset_(first % block_size),
        block_size_(block_size) {}
  int64_t next() {
    const int64_t slot = table_[block_] * block_size_ + offset_;
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
    return slot;
  }

 private:
  const int32_t* table_;
  int64_t block_, offset_, block_size_;
};

// A cache row as the loops below read it: in place, or for an FP8 cache widened to fp32 into
// `widened` once, for all the query heads that share it.
template <typename C>
const C* readable(const C* row, int64_t, float*) {
  return row;
}
inline const float* readable(const E4m3* row, int64_t head_size, float* widened) {
#pragma omp simd
  for (int64_t d = 0; d < head_size; ++d) widened[d] = load(row[d]);
  return widened;
}

// scores[h * n + j] = scale * (query head h . key first + j), for the KV head at head_offset.
template <typename T, typename C>
void score_keys(const T* qrow, const C* k_cache, const int32_t* table, int64_t first, int64_t n,
                int64_t block_size, int64_t row, int64_t head_offset, int64_t group,
                int64_t head_size, float scale, float* qf, float* widened, float* scores) {
  for (int64_t i = 0; i < group * head_size; ++i) qf[i] = load(qrow[i]) * scale;
  SlotCursor slot(table, first, block_size);
  for (int64_t j = 0; j < n; ++j) {
    const auto* krow = readable(k_cache + slot.next() * row + head_offset, head_size, widened);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qf + h * head_size;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_size; ++d) s += qh[d] * load(krow[d]);
      scores[h * n + j] = s;
    }
  }
}

// Each row of scores [group, n] -> exp(score - max); sums[h] = the row's sum.
inline void softmax_rows(float* scores, int64_t group, int64_t n, float* sums) {
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * n;
    float m = -std::numeric_limits<float>::max();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sh[j]);
    float sum = 0.f;
    // Vectorised expf (glibc's libmvec, declared for omp simd loops in vector_math.h).
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = std::exp(sh[j] - m);
      sum += sh[j];
    }
    sums[h] = sum;
  }
}

// acc[h] += weights[h * n + j] * value first + j, over the n values.
template <typename C>
void accumulate_values(const float* weights, const C* v_cache, const int32_t* table,
                       int64_t first, int64_t n, int64_t block_size, int64_t row,
                       int64_t head_offset, int64_t group, int64_t head_size, float* widened,
                       float* acc) {
  SlotCursor slot(table, first, block_size);
  for (int64_t j = 0; j < n; ++j) {
    const auto* vrow = readable(v_cache + slot.next() * row + head_offset, head_size, widened);
    for (int64_t h = 0; h < group; ++h) {
      const float w = weights[h * n + j];
      float* ah = acc + h * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; ++d) ah[d] += w * load(vrow[d]);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 with AVX512-BF16 (head_size a multiple of 32, at most 16 query heads per KV head): each
// product of a bf16 query and key element is exact in fp32 (vdpbf16ps), summed in fp32; values
// are widened to fp32 and accumulated with FMAs.
//
// Keys go 16 at a time: one accumulator per key, then one transposing reduction turns the 16
// accumulators into 16 scores (45 shuffles and adds instead of 16 horizontal sums of ~8 each).
// Values keep a tile of heads' sums in registers and widen each value row once for all of them.
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxChunks = 8;  // head_size up to 256

inline __m512 widen(const c10::BFloat16* x) {  // 16 bf16 -> 16 fp32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lane i of the result is the sum of v[i]'s 16 lanes.
inline __m512 sum_each(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit chunks: [v2i (q0+q2), v2i (q1+q3), v2i+1 ..., ...]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // chunk k: v(4i + k)'s 4 partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // chunk k: v(8i + k)'s 2 partials, v(8i + 4 + k)'s 2 partials
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Lane 4k + l: v(4l + k)'s total; the permutation puts v(i) in lane i.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, d);
}

// exp(x) for x <= 0 (scores minus their row's maximum): 2^(x log2 e) as 2^n times a degree-6
// Taylor polynomial of 2^f, |f| <= 1/2; relative error about 1e-7 plus 1e-5 from rounding x log2 e
// at large |x|, where the result is negligible beside the maximum's 1. libmvec's expf, which the
// portable loop gets, is a large share of the kernel's time at batch 32 (docs/benchmarks.md).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// softmax_rows with AVX512: each row of scores [group, n] -> exp(score - max), sums[h] its sum.
void softmax_rows_avx512(float* scores, int64_t group, int64_t n, float* sums) {
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * n;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::max());
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, sh + j));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + j), row_max));
      _mm512_mask_storeu_ps(sh + j, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    sums[h] = _mm512_reduce_add_ps(sum);
  }
}

// scores[h * n + j] = scale * (query head h . key j); keys[j] is key j's row (this KV head's part).
void score_keys_avx512(const c10::BFloat16* qrow, const c10::BFloat16* k_cache,
                       const int64_t* keys, int64_t n, int64_t group, int64_t head_size,
                       float scale, float* scores) {
  const int64_t chunks = head_size / 32;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    // The next 16 keys lie in another cache block, anywhere in memory: start fetching them now.
    for (int64_t i = j0 + 16; i < std::min<int64_t>(j0 + 32, n); ++i) {
      for (int64_t c = 0; c < head_size; c += 32) _mm_prefetch(k_cache + keys[i] + c, _MM_HINT_T0);
    }
    for (int64_t h = 0; h < group; ++h) {
      const c10::BFloat16* qh = qrow + h * head_size;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i >= count) continue;
        const c10::BFloat16* krow = k_cache + keys[j0 + i];
        for (int64_t c = 0; c < chunks; ++c) {
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(qh + 32 * c),
                                    (__m512bh)_mm512_loadu_si512(krow + 32 * c));
        }
      }
      const __mmask16 mask = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
      _mm512_mask_storeu_ps(scores + h * n + j0, mask, _mm512_mul_ps(sum_each(acc), scale_v));
    }
  }
}

#ifdef KVIK_HAVE_AMX
// score_keys_avx512 on AMX tiles: one instruction multiplies 16 keys by all the group's query
// heads over 32 dimensions. tmm0: the scores [16 keys, 16 heads] (fp32); tmm1: 16 key rows, 32
// dimensions (read straight from the cache where the 16 keys are consecutive slots, else from a
// staging copy); tmm2..: the query heads' 32-dimension chunks, transposed into dimension pairs
// (AMX's B layout), loaded once per item.
constexpr int64_t kMaxAmxChunks = 6;  // head_size up to 192

void configure_score_tiles() {
  kvik_cpu::TileConfig config;
  for (int t = 0; t < 8; ++t) config.set(t, 16, 64);
  _tile_loadconfig(&config);
}

void score_keys_amx(const c10::BFloat16* qrow, const c10::BFloat16* k_cache, const int64_t* keys,
                    int64_t n, int64_t group, int64_t head_size, int64_t key_stride, float scale,
                    float* scores) {
  const int64_t chunks = head_size / 32;
  alignas(64) c10::BFloat16 qt[kMaxAmxChunks][16][32];  // [chunk][dim pair][head * 2 + dim % 2]
  std::memset(qt, 0, sizeof(qt[0]) * chunks);
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t d = 0; d < head_size; ++d) qt[d / 32][(d % 32) / 2][h * 2 + d % 2] = qrow[h * head_size + d];
  }
  // Tile numbers are immediates: one line per possible chunk.
#define KVIK_LOAD_QUERY(c, tmm) \
  if (chunks > c) _tile_loadd(tmm, qt[c], 64);
  KVIK_LOAD_QUERY(0, 2) KVIK_LOAD_QUERY(1, 3) KVIK_LOAD_QUERY(2, 4) KVIK_LOAD_QUERY(3, 5)
  KVIK_LOAD_QUERY(4, 6) KVIK_LOAD_QUERY(5, 7)
#undef KVIK_LOAD_QUERY
  alignas(64) c10::BFloat16 staged[16 * 32 * kMaxAmxChunks];
  alignas(64) float tile[16 * 16];
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    for (int64_t i = j0 + 16; i < std::min<int64_t>(j0 + 32, n); ++i) {
      for (int64_t c = 0; c < head_size; c += 32) _mm_prefetch(k_cache + keys[i] + c, _MM_HINT_T0);
    }
    const c10::BFloat16* a;
    int64_t a_stride;  // bytes
    if (count == 16 && keys[j0 + 15] - keys[j0] == 15 * key_stride) {
      a = k_cache + keys[j0];
      a_stride = key_stride * 2;
    } else {  // the keys cross into a block elsewhere, or fewer than 16 remain
      for (int64_t i = 0; i < 16; ++i) {
        c10::BFloat16* dst = staged + i * head_size;
        if (i < count) {
          std::memcpy(dst, k_cache + keys[j0 + i], head_size * sizeof(c10::BFloat16));
        } else {
          std::memset(dst, 0, head_size * sizeof(c10::BFloat16));
        }
      }
      a = staged;
      a_stride = head_size * 2;
    }
    _tile_zero(0);
#define KVIK_MULTIPLY(c, tmm)             \
  if (chunks > c) {                       \
    _tile_loadd(1, a + 32 * c, a_stride); \
    _tile_dpbf16ps(0, 1, tmm);            \
  }
    KVIK_MULTIPLY(0, 2) KVIK_MULTIPLY(1, 3) KVIK_MULTIPLY(2, 4) KVIK_MULTIPLY(3, 5)
    KVIK_MULTIPLY(4, 6) KVIK_MULTIPLY(5, 7)
#undef KVIK_MULTIPLY
    _tile_stored(0, tile, 64);
    const __mmask16 mask = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
    for (int64_t h = 0; h < group; ++h) {  // head h's scores: column h of the tile
      const __m512 s = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(h)), tile, 4);
      _mm512_mask_storeu_ps(scores + h * n + j0, mask, _mm512_mul_ps(s, scale_v));
    }
  }
}
#endif

// acc[h] = sum_j weights[h * n + j] * value j, for head_size = 16 * V.
template <int V>
void accumulate_values_avx512(const float* weights, const c10::BFloat16* v_cache,
                              const int64_t* values, int64_t n, int64_t group, float* acc) {
  constexpr int kHeads = V >= 16 ? 1 : 16 / V;  // sums held in registers: kHeads * V <= 16
  for (int64_t h0 = 0; h0 < group; h0 += kHeads) {
    const int64_t heads = std::min<int64_t>(kHeads, group - h0);
    __m512 sums[kHeads][V];
    for (int h = 0; h < kHeads; ++h)
      for (int c = 0; c < V; ++c) sums[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const c10::BFloat16* vrow = v_cache + values[j];
      if (j + 16 < n) {  // as for the keys: values 16 ahead
        for (int c = 0; c < V; c += 2) _mm_prefetch(v_cache + values[j + 16] + 16 * c, _MM_HINT_T0);
      }
      __m512 vf[V];
      for (int c = 0; c < V; ++c) vf[c] = widen(vrow + 16 * c);
      for (int h = 0; h < kHeads; ++h) {
        if (h >= heads) break;
        const __m512 w = _mm512_set1_ps(weights[(h0 + h) * n + j]);
        for (int c = 0; c < V; ++c) sums[h][c] = _mm512_fmadd_ps(w, vf[c], sums[h][c]);
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + (h0 + h) * V * 16 + 16 * c, sums[h][c]);
  }
}

void accumulate_values_avx512(const float* weights, const c10::BFloat16* v_cache,
                              const int64_t* values, int64_t n, int64_t group, int64_t head_size,
                              float* acc) {
  switch (head_size / 16) {
    case 2: return accumulate_values_avx512<2>(weights, v_cache, values, n, group, acc);
    case 4: return accumulate_values_avx512<4>(weights, v_cache, values, n, group, acc);
    case 6: return accumulate_values_avx512<6>(weights, v_cache, values, n, group, acc);
    case 8: return accumulate_values_avx512<8>(weights, v_cache, values, n, group, acc);
    case 10: return accumulate_values_avx512<10>(weights, v_cache, values, n, group, acc);
    case 12: return accumulate_values_avx512<12>(weights, v_cache, values, n, group, acc);
    case 14: return accumulate_values_avx512<14>(weights, v_cache, values, n, group, acc);
    default: return accumulate_values_avx512<16>(weights, v_cache, values, n, group, acc);
  }
}
#endif

// x / scale into e4m3: clamped to its finite range, then c10's conversion (round to nearest even),
// the one torch's .to(torch.float8_e4m3fn) uses.
inline E4m3 quantize_fp8(float x, float scale) {
  return c10::Float8_e4m3fn(std::clamp(x / scale, -kFp8Max, kFp8Max)).x;
}

// T: queries, keys, values and output (float or bf16); C: the cache's elements (T, or E4m3 with
// k_scale and v_scale).
template <typename T, typename C>
void paged_attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          const at::Tensor& block_table, const at::Tensor& token_request,
                          const at::Tensor& token_position, double scale_d,
                          int64_t sliding_window, int64_t max_isa, at::Tensor& output,
                          float k_scale, float v_scale) {
  constexpr bool kFp8Cache = std::is_same_v<C, E4m3>;
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  const int64_t head_size = kv_cache.size(4);
  const int64_t heads = query.size(1) / head_size;
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * head_size;  // one token's keys (or values) in the cache
  const int64_t cache_half = kv_cache.size(1) * block_size * row;
  const int64_t max_blocks = block_table.size(1);
  // Scores are q . (k_q * k_scale) * scale: with an FP8 cache, k_scale joins the softmax scale.
  const float scale = static_cast<float>(scale_d) * (kFp8Cache ? k_scale : 1.f);

  C* k_cache = static_cast<C*>(kv_cache.data_ptr());
  C* v_cache = k_cache + cache_half;
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* out = output.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int32_t* requests = token_request.data_ptr<int32_t>();
  const int32_t* positions = token_position.data_ptr<int32_t>();
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0), v_stride = value.stride(0);
  const int64_t out_stride = output.stride(0);

  // 1. The new keys and values into their slots (a negative slot is padding: skipped).
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    if constexpr (kFp8Cache) {
      for (int64_t i = 0; i < row; ++i) {
        k_cache[slot * row + i] = quantize_fp8(load(k[t * k_stride + i]), k_scale);
        v_cache[slot * row + i] = quantize_fp8(load(v[t * v_stride + i]), v_scale);
      }
    } else {
      std::memcpy(k_cache + slot * row, k + t * k_stride, row * sizeof(T));
      std::memcpy(v_cache + slot * row, v + t * v_stride, row * sizeof(T));
    }
  }

  // 2. Attention, one (token, KV head) item at a time.
  using kvik_cpu::ops::kAmx;
  using kvik_cpu::ops::kAvx512Bf16;
  bool fast_bf16 = false;
#if defined(__AVX512BF16__)
  fast_bf16 = max_isa >= kAvx512Bf16 && std::is_same_v<T, c10::BFloat16> &&
              std::is_same_v<C, T> && head_size % 32 == 0 && head_size <= 32 * kMaxChunks &&
              group <= kMaxGroup;
#endif
  bool amx_scores = false;
#ifdef KVIK_HAVE_AMX
  amx_scores = max_isa >= kAmx && fast_bf16 && head_size <= 32 * kMaxAmxChunks &&
               kvik_cpu::request_amx();
#endif
  at::parallel_for(0, num_tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
#ifdef KVIK_HAVE_AMX
    if (amx_scores) configure_score_tiles();
#endif
    std::vector<float> qf(group * head_size), acc(group * head_size), sums(group), scores;
    std::vector<float> widened(kFp8Cache ? head_size : 0);  // an FP8 cache row, as fp32
    std::vector<int64_t> rows;  // cache offsets of the item's key (and value) rows
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, g = item % kv_heads;
      const int64_t request = requests[t], pos = positions[t];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
      const int64_t n = pos - first + 1;
      const int32_t* table = tables + request * max_blocks;
      const int64_t head_offset = g * head_size;
      scores.resize(group * n);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
        if (fast_bf16) {
          rows.resize(n);
          SlotCursor slot(table, first, block_size);
          for (int64_t j = 0; j < n; ++j) rows[j] = slot.next() * row + head_offset;
#ifdef KVIK_HAVE_AMX
          if (amx_scores) {
            score_keys_amx(q + t * q_stride + g * group * head_size, k_cache, rows.data(), n,
                           group, head_size, row, scale, scores.data());
          } else
#endif
          score_keys_avx512(q + t * q_stride + g * group * head_size, k_cache, rows.data(), n,
                            group, head_size, scale, scores.data());
        }
      }
#endif
      if (!fast_bf16) score_keys(q + t * q_stride + g * group * head_size, k_cache, table, first, n,
                                 block_size, row, head_offset, group, head_size, scale, qf.data(),
                                 widened.data(), scores.data());
#if defined(__AVX512BF16__)
      if (fast_bf16) softmax_rows_avx512(scores.data(), group, n, sums.data());
#endif
      if (!fast_bf16) softmax_rows(scores.data(), group, n, sums.data());
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
        if (fast_bf16) {
          accumulate_values_avx512(scores.data(), v_cache, rows.data(), n, group, head_size,
                                   acc.data());
        }
      }
#endif
      if (!fast_bf16) accumulate_values(scores.data(), v_cache, table, first, n, block_size, row,
                                        head_offset, group, head_size, widened.data(), acc.data());
      for (int64_t h = 0; h < group; ++h) {
        // The values' scale multiplies the weighted sum once, with the softmax's normalisation.
        const float inv = kFp8Cache ? v_scale / sums[h] : 1.f / sums[h];
        T* o = out + t * out_stride + (g * group + h) * head_size;
        for (int64_t d = 0; d < head_size; ++d) o[d] = from_float<T>(acc[h * head_size + d] * inv);
      }
    }
#ifdef KVIK_HAVE_AMX
    if (amx_scores) _tile_release();
#endif
  });
}

// A KV cache scale: one fp32 element, positive (the cache's keys or values are divided by it).
float cache_scale(const std::optional<at::Tensor>& scale, const char* name) {
  TORCH_CHECK(scale.has_value(), "paged_attention: an fp8 KV cache needs ", name);
  TORCH_CHECK(scale->numel() == 1 && scale->scalar_type() == at::kFloat && scale->is_cpu(),
              "paged_attention: ", name, " must be one float32 element on the CPU");
  const float value = *scale->data_ptr<float>();
  TORCH_CHECK(std::isfinite(value) && value > 0.f, "paged_attention: ", name, " is ", value,
              "; it must be positive");
  return value;
}

void paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& token_request,
                     const at::Tensor& token_position, double scale, int64_t sliding_window,
                     int64_t max_isa, at::Tensor& output, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(max_isa >= kvik_cpu::ops::kPlain && max_isa <= kvik_cpu::ops::built_isa(),
              "paged_attention: kernel path ", max_isa, " is not in this build (0 plain, ",
              "1 avx512bf16, 2 amx; this build and CPU run up to ", kvik_cpu::ops::built_isa(), ")");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_size]");
  const int64_t head_size = kv_cache.size(4), kv_heads = kv_cache.size(3);
  TORCH_CHECK(query.dim() == 2 && query.size(1) % (kv_heads * head_size) == 0,
              "query must be [tokens, heads * head_size] with heads a multiple of kv_heads");
  const bool fp8_cache = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  for (const at::Tensor* x : {&query, &key, &value, static_cast<const at::Tensor*>(&output)}) {
    TORCH_CHECK(x->dim() == 2 && x->stride(1) == 1, "rows of q, k, v and output must be dense");
    TORCH_CHECK(x->scalar_type() == query.scalar_type() &&
                    (fp8_cache || x->scalar_type() == kv_cache.scalar_type()),
                "q, k, v, output and cache differ in dtype (the cache may be float8_e4m3fn)");
  }
  TORCH_CHECK(key.size(1) == kv_heads * head_size && value.size(1) == kv_heads * head_size,
              "key and value must be [tokens, kv_heads * head_size]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  for (const at::Tensor* x : {&block_table, &token_request, &token_position}) {
    TORCH_CHECK(x->scalar_type() == at::kInt && x->is_contiguous(),
                "block_table, token_request and token_position must be contiguous int32");
  }
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "kvik_cpu::paged_attention supports float32 and bfloat16, not ", dtype);
  if (fp8_cache) {
    const float ks = cache_scale(k_scale, "k_scale"), vs = cache_scale(v_scale, "v_scale");
    if (dtype == at::kFloat) {
      paged_attention_impl<float, E4m3>(
          query, key, value, kv_cache, slot_mapping, block_table, token_request, token_position,
          scale, sliding_window, max_isa, output, ks, vs);
    } else {
      paged_attention_impl<c10::BFloat16, E4m3>(
          query, key, value, kv_cache, slot_mapping, block_table, token_request, token_position,
          scale, sliding_window, max_isa, output, ks, vs);
    }
  } else if (dtype == at::kFloat) {
    paged_attention_impl<float, float>(query, key, value, kv_cache, slot_mapping, block_table,
                                       token_request, token_position, scale, sliding_window,
                                       max_isa, output, 1.f, 1.f);
  } else {
    paged_attention_impl<c10::BFloat16, c10::BFloat16>(
        query, key, value, kv_cache, slot_mapping, block_table, token_request, token_position,
        scale, sliding_window, max_isa, output, 1.f, 1.f);
  }
}

}  // namespace

namespace kvik_cpu::ops {
void paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& token_request,
                     const at::Tensor& token_position, double scale, int64_t sliding_window,
                     int64_t max_isa, at::Tensor& output, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale) {
  ::paged_attention(query, key, value, kv_cache, slot_mapping, block_table, token_request,
                    token_position, scale, sliding_window, max_isa, output, k_scale, v_scale);
}
}  // namespace kvik_cpu::ops

TORCH_LIBRARY(kvik_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor token_request, Tensor token_position, "
      "float scale, int sliding_window, int max_isa, Tensor(b!) output, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(kvik_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
