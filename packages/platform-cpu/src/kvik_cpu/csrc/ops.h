// kvik_cpu's kernels as plain C++ functions, for kernels that call others without the dispatcher
// (decode_layers.cpp). Each is the function its file registers as a torch op.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace kvik_cpu::ops {

// The kernel paths (kvik_cpu.isa.CpuIsa), each allowing the ones below it. A kernel whose result
// depends on the path takes the highest one it may use as an argument, so that a path forced from
// Python (KVIK_CPU_ISA) reaches the code that would otherwise choose by what it was built for.
enum Isa : int64_t { kPlain = 0, kAvx512Bf16 = 1, kAmx = 2 };

// isa.cpp: the highest path this build can run in this process (AMX also needs the kernel's
// permission to use the tiles).
int64_t built_isa();

// small_ops.cpp (torch.ops.kvik.*'s CPU kernels)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& query,
                                                    const at::Tensor& key, int64_t head_size,
                                                    const at::Tensor& cos_sin_cache, bool is_neox);
at::Tensor silu_and_mul(const at::Tensor& x);

// amx_linear.cpp
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias_fp32);

// paged_attention.cpp
void paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& token_request,
                     const at::Tensor& token_position, double scale, int64_t sliding_window,
                     int64_t max_isa, at::Tensor& output, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale);

}  // namespace kvik_cpu::ops
