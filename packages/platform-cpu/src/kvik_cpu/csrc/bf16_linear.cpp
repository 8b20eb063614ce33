// bf16 matrix products in AVX512-BF16 over weights packed as for AMX (kvik_cpu::amx_pack), for
// the few rows a mixture-of-experts layer gives each expert in a decode step, and a decode step's
// dense layers on CPUs without AMX.
//
// y[M, N] = x[M, K] W[N, K]^T (+ bias), x bf16, fp32 accumulation, y bf16 (or the fp32 sums
// themselves: fp32_out, for the LM head's logits). amx_pack's layout holds
// each block of 16 output columns as K/2 runs of 64 bytes: 16 column pairs [k, k+1], exactly the
// operand of vdpbf16ps. So one instruction adds a row's pair x[k, k+1] times 16 columns' pair, and
// a 32-column panel of W (two such blocks) is one contiguous run of memory, streamed once per call
// for up to kRows rows at a time. oneDNN's kernels read such weights at about half the memory's
// speed at 1 to 8 rows on an AVX512-BF16 CPU without AMX (docs/benchmarks.md), which is what an
// expert's product in a decode step is bound by.
//
// Each row's sums run in the same order whatever the other rows are, so a row's result does not
// depend on how many rows share the call. Built at run time by kvik_cpu.extension for the host's
// CPU; where the compiler does not target AVX512-BF16, the op only raises.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per work item (two 16-column blocks)
constexpr int64_t kKStep = 32;  // amx_pack pads K to a multiple of this
constexpr int kRows = 8;        // rows per pass: 16 accumulators, 2 weight registers
// How far ahead of its reads each of a panel's two weight streams is prefetched into L2, in bf16
// values (4 KB). Streaming 96 MB of 1024 x 512 weights on one core of the 2-core EPYC of
// docs/benchmarks.md (a shared machine: alternated runs, noisy), the hardware prefetchers alone
// read 12-15 GB/s at 1 and 2 rows and 9-12 GB/s at 8; 4 KB ahead 17-18 and 14-15 GB/s; 1, 2, 6
// and 8 KB ahead less than 4 KB.
constexpr int64_t kPrefetchAhead = 2048;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if defined(__AVX512BF16__)

// Rows [0, R) of x (row stride K, K even) times one packed panel (b0: its first 16-column block,
// b1 the second; a run of 64 bytes per pair of K) -> fp32 c[R][32].
template <int R>
inline void panel_rows(const c10::BFloat16* x, int64_t K, const c10::BFloat16* b0,
                       const c10::BFloat16* b1, float* c) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  const int64_t pairs = K / 2;  // K is even (the caller pads odd K)
  for (int64_t p = 0; p < pairs; ++p) {
    // A prefetch never faults: past the weight's end it is only wasted.
    _mm_prefetch(reinterpret_cast<const char*>(b0 + p * 32 + kPrefetchAhead), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(b1 + p * 32 + kPrefetchAhead), _MM_HINT_T1);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b0 + p * 32));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b1 + p * 32));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, w0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * kPanel, acc0[r]);
    _mm512_storeu_ps(c + r * kPanel + 16, acc1[r]);
  }
}

// out[m, n0:n0+cols] = c[m, :cols] (+ bias) in bf16, rounded to nearest even as PyTorch rounds.
inline void store_rows(const float* c, int64_t rows, int64_t cols, const float* bias,
                       c10::BFloat16* out, int64_t ld_out) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF
                       : cols <= 16 ? 0
                                    : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + m * kPanel), bias0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + m * kPanel + 16), bias1);
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
    _mm512_mask_storeu_epi16(out + m * ld_out, (static_cast<__mmask32>(hi) << 16) | lo, packed);
  }
}

// The same in fp32, unrounded: the LM head's logits, where rounding to bf16 (a step of 0.125 at
// 16 to 32) ties logits that differ by less, and greedy argmax then takes the lower token id.
inline void store_rows(const float* c, int64_t rows, int64_t cols, const float* bias, float* out,
                       int64_t ld_out) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF
                       : cols <= 16 ? 0
                                    : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + m * kPanel), bias0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + m * kPanel + 16), bias1);
    _mm512_mask_storeu_ps(out + m * ld_out, lo, v0);
    _mm512_mask_storeu_ps(out + m * ld_out + 16, hi, v1);  // masked off: never touched
  }
}

// Out: c10::BFloat16 (rounded once) or float (the sums as they are).
template <typename Out>
void bf16_linear_kernel(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w,
                        int64_t Kp, int64_t N, const float* bias, Out* out) {
  const int64_t panels = round_up(N, kPanel) / kPanel;
  const int64_t panel_elems = kPanel * Kp;
  const int64_t block_elems = 16 * Kp;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kRows * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const c10::BFloat16* b0 = w + p * panel_elems;
      const c10::BFloat16* b1 = b0 + block_elems;
      const int64_t n0 = p * kPanel;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m0);
        const c10::BFloat16* a = x + m0 * K;
        switch (rows) {
          case 1: panel_rows<1>(a, K, b0, b1, c); break;
          case 2: panel_rows<2>(a, K, b0, b1, c); break;
          case 3: panel_rows<3>(a, K, b0, b1, c); break;
          case 4: panel_rows<4>(a, K, b0, b1, c); break;
          case 5: panel_rows<5>(a, K, b0, b1, c); break;
          case 6: panel_rows<6>(a, K, b0, b1, c); break;
          case 7: panel_rows<7>(a, K, b0, b1, c); break;
          default: panel_rows<8>(a, K, b0, b1, c); break;
        }
        store_rows(c, rows, std::min(kPanel, N - n0), bias ? bias + n0 : nullptr,
                   out + m0 * N + n0, N);
      }
    }
  });
}

#endif  // __AVX512BF16__

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias, bool fp32_out) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "bf16_linear: this build of kvik_cpu's ops has no AVX512-BF16");
#endif
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16,
              "bf16_linear: expected 2-D bfloat16 input and weight");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) * 16 == round_up(N, kPanel) &&
                  packed.size(1) * 2 == round_up(K, kKStep),
              "bf16_linear: packed weight ", packed.sizes(), " does not fit input ", x.sizes(),
              " and ", N, " output features");
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bf16_linear: the bias must be ", N, " contiguous float32 values");
  }
  at::Tensor input = x;
  if (K % 2 != 0) {  // pairs of K: pad the rows with a zero column (the packed weight has one)
    input = at::zeros({M, K + 1}, x.options());
    input.narrow(1, 0, K).copy_(x);
  } else {
    input = x.contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  const float* bias_ptr = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (fp32_out) {
    bf16_linear_kernel(input.data_ptr<c10::BFloat16>(), M, input.size(1),
                       packed.data_ptr<c10::BFloat16>(), packed.size(1) * 2, N, bias_ptr,
                       out.data_ptr<float>());
  } else {
    bf16_linear_kernel(input.data_ptr<c10::BFloat16>(), M, input.size(1),
                       packed.data_ptr<c10::BFloat16>(), packed.size(1) * 2, N, bias_ptr,
                       out.data_ptr<c10::BFloat16>());
  }
#endif
  return out;
}

// A mixture-of-experts layer's experts over their tokens, in one call: rows [P, H] holds the
// (token, expert) pairs' inputs grouped by expert, counts[e] of them for expert e in order; each
// expert's rows go through its gate/up product (gate_up[e], packed [2I, H]), silu(gate) * up, and
// its down product (down[e], packed [H, I]), into the same rows of the result [P, H]. The same
// kernels as the per-expert Python loop of kvik_cpu.moe, without its per-expert calls (a decode
// step gives each of 16 experts about two rows: the calls cost as much as the products).
at::Tensor bf16_moe_experts(const at::Tensor& rows, at::IntArrayRef counts, at::TensorList gate_up,
                            at::TensorList down, int64_t intermediate) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kBFloat16,
              "bf16_moe_experts: expected 2-D bfloat16 rows");
  const int64_t experts = static_cast<int64_t>(counts.size());
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == experts &&
                  static_cast<int64_t>(down.size()) == experts,
              "bf16_moe_experts: ", experts, " counts but ", gate_up.size(), " gate/up and ",
              down.size(), " down weights");
  const int64_t hidden = rows.size(1);
  at::Tensor out = at::empty({rows.size(0), hidden}, rows.options());
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = counts[e];
    if (count == 0) continue;
    TORCH_CHECK(count > 0 && start + count <= rows.size(0),
                "bf16_moe_experts: the counts overrun the ", rows.size(0), " rows");
    const at::Tensor act = kvik_cpu::ops::silu_and_mul(bf16_linear(
        rows.narrow(0, start, count), gate_up[e], 2 * intermediate, std::nullopt, false));
    out.narrow(0, start, count).copy_(bf16_linear(act, down[e], hidden, std::nullopt, false));
    start += count;
  }
  TORCH_CHECK(start == rows.size(0), "bf16_moe_experts: the counts cover ", start, " of ",
              rows.size(0), " rows");
  return out;
}

#if defined(__AVX512BF16__)
// acc[0:n] += float(r[0:n]) * w, the product rounded to fp32 before the add, as the reference's
// separate multiply and index_add_ round it: the empty asm keeps the compiler from fusing the two
// into one FMA (GCC contracts vector arithmetic by default), which would round once and differ.
inline void add_weighted_row(float* acc, const c10::BFloat16* r, float w, int64_t n) {
  const __m512 weight = _mm512_set1_ps(w);
  for (int64_t h = 0; h < n; h += 16) {
    const __mmask16 mask = n - h >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - h)) - 1);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, r + h);
    const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    __m512 product = _mm512_mul_ps(value, weight);
    asm("" : "+v"(product));
    _mm512_mask_storeu_ps(acc + h, mask,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(mask, acc + h), product));
  }
}
#endif

// A mixture-of-experts layer after its routing, in one call: hidden [T, H], the routing's
// weights [T, k] fp32 and expert ids [T, k] (kvik.ops.moe_routing) -> [T, H]. The same work and
// the same bits as kvik.ops.grouped_experts with bf16_moe_experts: the (token, k) pairs grouped
// by expert in a stable counting sort (torch.argsort(stable=True)'s order), their rows gathered,
// the experts' products, then each token's sum over its pairs in that order, in fp32, rounded
// once to bf16. Without the dozen PyTorch ops around the experts that cost a decode step of a
// small MoE about as much as one more layer's experts (docs/benchmarks.md).
at::Tensor bf16_moe(const at::Tensor& hidden, const at::Tensor& weights, const at::Tensor& ids,
                    at::TensorList gate_up, at::TensorList down, int64_t intermediate) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "bf16_moe: this build of kvik_cpu's ops has no AVX512-BF16");
#endif
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16,
              "bf16_moe: expected 2-D bfloat16 hidden states, got ", hidden.sizes(), " ",
              hidden.scalar_type());
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens && ids.scalar_type() == at::kLong &&
                  weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "bf16_moe: expected weights (float32) and ids (int64) of shape [", tokens,
              ", top_k], got ", weights.sizes(), " ", weights.scalar_type(), " and ", ids.sizes(),
              " ", ids.scalar_type());
  const int64_t experts = static_cast<int64_t>(gate_up.size());
  const int64_t pairs = ids.numel(), top_k = ids.size(1);
  if (tokens == 0) return at::empty({0, width}, hidden.options());
  const at::Tensor x = hidden.contiguous();
  const at::Tensor id = ids.contiguous();
  const at::Tensor w = weights.contiguous();
  const int64_t* id_ptr = id.data_ptr<int64_t>();
  std::vector<int64_t> counts(experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id_ptr[p] >= 0 && id_ptr[p] < experts, "bf16_moe: expert id ", id_ptr[p],
                " is not in [0, ", experts, ")");
    ++counts[id_ptr[p]];
  }
  std::vector<int64_t> next(experts, 0), order(pairs);
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t p = 0; p < pairs; ++p) order[next[id_ptr[p]]++] = p;
  at::Tensor rows = at::empty({pairs, width}, hidden.options());
  const auto* src = x.data_ptr<c10::BFloat16>();
  auto* dst = rows.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < pairs; ++i) {
    std::memcpy(dst + i * width, src + (order[i] / top_k) * width, width * sizeof(c10::BFloat16));
  }
  const at::Tensor results = bf16_moe_experts(rows, counts, gate_up, down, intermediate);
  at::Tensor acc = at::zeros({tokens, width}, hidden.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const auto* res = results.data_ptr<c10::BFloat16>();
  const float* w_ptr = w.data_ptr<float>();
  float* acc_ptr = acc.data_ptr<float>();
  for (int64_t i = 0; i < pairs; ++i) {
    add_weighted_row(acc_ptr + (order[i] / top_k) * width, res + i * width, w_ptr[order[i]],
                     width);
  }
#endif
  return acc.to(at::kBFloat16);
}

}  // namespace

// Schemas here, kernels for the CPU key below: torch.compile traces the ops through their fake
// implementations (kvik_cpu/extension.py), which an op defined with its kernel (a catch-all,
// CompositeImplicitAutograd) cannot have.
TORCH_LIBRARY_FRAGMENT(kvik_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias_fp32=None, "
        "bool fp32_out=False) -> Tensor");
  m.def("bf16_moe_experts(Tensor rows, int[] counts, Tensor[] gate_up, Tensor[] down, "
        "int intermediate) -> Tensor");
  m.def("bf16_moe(Tensor hidden, Tensor weights, Tensor ids, Tensor[] gate_up, Tensor[] down, "
        "int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvik_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_moe_experts", &bf16_moe_experts);
  m.impl("bf16_moe", &bf16_moe);
}
