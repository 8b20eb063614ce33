// A Llama-family model's decoder layers for one decode step, in one call.
//
// Eagerly, each layer is about 35 Python-level calls (modules, views, the kernels), whose cost is a
// large share of a small model's decode step at batch 1 (docs/benchmarks.md). Here the same kernels
// run in the same order on the same tensors, called as C++ functions, so the result is the same
// bits as the layer-by-layer path (tests/test_cpu_fast_path.py checks it). kvik_cpu.decode_layers decides when it applies:
// decode-only steps of Llama, Mistral, Qwen2 and SmolLM layers whose matmuls run on AMX.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace {

// Per layer, in `weights`: input norm, qkv, qkv bias, o, o bias, post-attention norm, gate_up,
// gate_up bias, down, down bias. Matmul weights are packed by amx_pack; an empty bias is none.
constexpr int64_t kPerLayer = 10;

std::optional<at::Tensor> bias_of(const at::Tensor& bias) {
  return bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt;
}

at::Tensor llama_decode_layers(const at::Tensor& embedded, const at::Tensor& positions,
                               at::TensorList weights, const at::Tensor& final_norm, double eps,
                               const at::Tensor& cos_sin_cache, bool is_neox, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_size, int64_t intermediate_size,
                               at::TensorList kv_caches, at::IntArrayRef sliding_windows,
                               at::TensorList k_scales, at::TensorList v_scales,
                               double scale, const at::Tensor& slot_mapping,
                               const at::Tensor& block_table, const at::Tensor& token_request,
                               const at::Tensor& token_position, int64_t max_isa) {
  namespace ops = kvik_cpu::ops;
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(sliding_windows.size()) == layers &&
                  static_cast<int64_t>(k_scales.size()) == layers &&
                  static_cast<int64_t>(v_scales.size()) == layers,
              "llama_decode_layers: ", weights.size(), " weights, ", sliding_windows.size(),
              " sliding windows, ", k_scales.size(), " k scales and ", v_scales.size(),
              " v scales for ", layers, " layers (want ", kPerLayer, " weights a layer)");
  TORCH_CHECK(embedded.dim() == 2, "llama_decode_layers: hidden must be [tokens, hidden]");
  const int64_t hidden_size = embedded.size(1);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  at::Tensor hidden = embedded, residual, x;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    if (l == 0) {
      x = ops::rms_norm(hidden, w[0], eps);
      residual = hidden;
    } else {
      std::tie(x, residual) = ops::fused_add_rms_norm(hidden, residual, w[0], eps);
    }
    const at::Tensor qkv = ops::amx_linear(x, w[1], q_size + 2 * kv_size, bias_of(w[2]));
    const std::vector<at::Tensor> parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
    auto [q, k] = ops::rotary_embedding(positions, parts[0], parts[1], head_size, cos_sin_cache,
                                        is_neox);
    at::Tensor attention = at::empty_like(q);
    at::Tensor cache = kv_caches[l];
    ops::paged_attention(q, k, parts[2], cache, slot_mapping, block_table, token_request,
                         token_position, scale, sliding_windows[l], max_isa, attention,
                         k_scales[l], v_scales[l]);
    hidden = ops::amx_linear(attention, w[3], hidden_size, bias_of(w[4]));
    std::tie(x, residual) = ops::fused_add_rms_norm(hidden, residual, w[5], eps);
    const at::Tensor gate_up = ops::amx_linear(x, w[6], 2 * intermediate_size, bias_of(w[7]));
    hidden = ops::amx_linear(ops::silu_and_mul(gate_up), w[8], hidden_size, bias_of(w[9]));
  }
  return std::get<0>(ops::fused_add_rms_norm(hidden, residual, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvik_cpu, m) {
  m.def(
      "llama_decode_layers(Tensor embedded, Tensor positions, Tensor[] weights, Tensor final_norm, "
      "float eps, Tensor cos_sin_cache, bool is_neox, int num_heads, int num_kv_heads, "
      "int head_size, int intermediate_size, Tensor[] kv_caches, int[] sliding_windows, "
      "Tensor[] k_scales, Tensor[] v_scales, "
      "float scale, Tensor slot_mapping, Tensor block_table, Tensor token_request, "
      "Tensor token_position, int max_isa) -> Tensor",
      &llama_decode_layers);
}
