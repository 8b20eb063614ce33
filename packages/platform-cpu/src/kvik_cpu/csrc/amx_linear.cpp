// bf16 matrix products on Intel AMX tiles, for the small row counts of decoding.
//
// y[M, N] = x[M, K] W[N, K]^T (+ bias), x and y bf16, fp32 accumulation. W is packed once
// (kvik_cpu::amx_pack) into AMX's "VNNI" layout: blocks of 16 output columns, each block K/2 rows
// of 16 column pairs [k, k+1] (64 bytes), zero-padded to N a multiple of 32 and K a multiple of 32.
// One 32-column panel of W is then one contiguous run of memory, which the hardware prefetchers
// stream at the memory's full speed: at batch 1 to 32 a decode step is bound by reading the weights
// once, and oneDNN's general kernels read them markedly more slowly (docs/benchmarks.md).
//
// Work is split over threads by 32-column panels. Each panel meets every row of x (in chunks of 32
// rows: two A tiles, two B tiles, four C tiles), so a row's result does not depend on how many other
// rows share the call: the same token gets the same bits at batch 1, 32 or in a prefill.
//
// Built at run time by kvik_cpu.extension for the host's CPU. Where the compiler does not target
// AMX, amx_linear only raises (built_isa(), csrc/isa.cpp, then says the amx path cannot run).

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

#include "amx.h"

namespace {

constexpr int64_t kPanel = 32;    // output columns per work item (two B tiles of 16)
constexpr int64_t kKStep = 32;    // bf16 values of K per tile row (64 bytes)
constexpr int64_t kRowChunk = 32; // rows of x per pass (two A tiles of 16)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifdef KVIK_HAVE_AMX

using kvik_cpu::request_amx;
using kvik_cpu::TileConfig;

// tmm0..3: C[a][b] for A tile a (rows m0 / m1) and B tile b; tmm4, tmm5: A0, A1; tmm6, tmm7: B0, B1.
void configure_tiles(int m0, int m1) {
  TileConfig config;
  const int rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
  for (int t = 0; t < 8; ++t) config.set(t, rows[t], 64);
  _tile_loadconfig(&config);
}

// out[m, n0:n0+cols] = c[m, :cols] (+ bias) in bf16; c is fp32 with a row stride of kPanel.
inline void store_rows(const float* c, int64_t rows, int64_t cols, const float* bias,
                       c10::BFloat16* out, int64_t ld_out) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF
                       : cols <= 16 ? 0
                                    : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + m * kPanel), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + m * kPanel + 16), b1);
    // vcvtne2ps2bf16 rounds to nearest even, as PyTorch's float -> bfloat16 conversion does.
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
    _mm512_mask_storeu_epi16(out + m * ld_out, (static_cast<__mmask32>(hi) << 16) | lo, packed);
  }
}

void amx_linear_kernel(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w,
                       int64_t N, const float* bias, c10::BFloat16* out) {
  const int64_t Kp = round_up(K, kKStep);
  const int64_t panels = round_up(N, kPanel) / kPanel;
  const int64_t panel_elems = kPanel * Kp;  // bf16 values per packed 32-column panel
  const int64_t block_elems = 16 * Kp;      // per 16-column B block
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kRowChunk * kPanel];
    int configured = -1;
    for (int64_t m_start = 0; m_start < M; m_start += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, M - m_start);
      const int m0 = static_cast<int>(std::min<int64_t>(rows, 16));
      const int m1 = static_cast<int>(rows - m0);
      if (configured != rows) {
        configure_tiles(m0, m1);
        configured = static_cast<int>(rows);
      }
      const c10::BFloat16* a0 = x + m_start * K;
      const c10::BFloat16* a1 = a0 + 16 * K;
      for (int64_t p = begin; p < end; ++p) {
        const c10::BFloat16* b = w + p * panel_elems;
        _tile_zero(0);
        _tile_zero(1);
        if (m1) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t k = 0; k < Kp; k += kKStep) {
          // B rows are K pairs: a 32-value step of K is 16 rows of 64 bytes.
          _tile_loadd(6, b + k * 16, 64);
          _tile_loadd(7, b + block_elems + k * 16, 64);
          _tile_loadd(4, a0 + k, K * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (m1) {
            _tile_loadd(5, a1 + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, kPanel * 4);
        _tile_stored(1, c + 16, kPanel * 4);
        if (m1) {
          _tile_stored(2, c + 16 * kPanel, kPanel * 4);
          _tile_stored(3, c + 16 * kPanel + 16, kPanel * 4);
        }
        const int64_t n0 = p * kPanel;
        store_rows(c, rows, std::min(kPanel, N - n0), bias ? bias + n0 : nullptr,
                   out + m_start * N + n0, N);
      }
    }
    _tile_release();
  });
}

#endif  // KVIK_HAVE_AMX

bool amx_supported() {
#ifdef KVIK_HAVE_AMX
  return request_amx();
#else
  return false;
#endif
}

// weight [N, K] bf16 -> packed [Np / 16, Kp / 2, 16, 2] bf16, zero padded.
at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack: expected a 2-D bfloat16 weight, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = round_up(N, kPanel), Kp = round_up(K, kKStep);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({Np / 16, Kp / 2, 16, 2}, weight.options());
  const auto* src = w.data_ptr<c10::BFloat16>();
  auto* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      c10::BFloat16* block = dst + (n / 16) * (Kp / 2) * 32 + (n % 16) * 2;
      for (int64_t k = 0; k < K; ++k) block[(k / 2) * 32 + (k % 2)] = src[n * K + k];
    }
  });
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_supported(), "amx_linear: this CPU or build has no AMX");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear: expected 2-D bfloat16 input and weight");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) * 16 == round_up(N, kPanel) &&
                  packed.size(1) * 2 == round_up(K, kKStep),
              "amx_linear: packed weight ", packed.sizes(), " does not fit input ", x.sizes(),
              " and ", N, " output features");
  at::Tensor input = x;
  if (K % kKStep != 0) {  // tiles read K in steps of 32: pad the rows with zeros
    input = at::zeros({M, round_up(K, kKStep)}, x.options());
    input.narrow(1, 0, K).copy_(x);
  } else {
    input = x.contiguous();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "amx_linear: the bias must be ", N, " contiguous float32 values");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef KVIK_HAVE_AMX
  amx_linear_kernel(input.data_ptr<c10::BFloat16>(), M, input.size(1),
                    packed.data_ptr<c10::BFloat16>(), N,
                    bias.has_value() ? bias->data_ptr<float>() : nullptr,
                    out.data_ptr<c10::BFloat16>());
#endif
  return out;
}

}  // namespace

namespace kvik_cpu::ops {
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias_fp32) {
  return ::amx_linear(x, packed, out_features, bias_fp32);
}
}  // namespace kvik_cpu::ops

TORCH_LIBRARY_FRAGMENT(kvik_cpu, m) {
  m.def("amx_pack(Tensor weight) -> Tensor", &amx_pack);
  // A kernel for the CPU key (not a catch-all), so that torch.compile can trace the op through
  // its fake implementation (kvik_cpu/extension.py).
  m.def("amx_linear(Tensor x, Tensor packed, int out_features, Tensor? bias_fp32=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvik_cpu, CPU, m) { m.impl("amx_linear", &amx_linear); }
