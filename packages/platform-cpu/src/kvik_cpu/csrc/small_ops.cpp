// The CPU kernels of kvik's small ops (kvik.ops): rms_norm, fused_add_rms_norm, rotary_embedding
// and silu_and_mul, registered as the CPU implementations of torch.ops.kvik.*.
//
// Each is one pass over its rows instead of the 5 to 25 PyTorch calls of its reference, and rounds
// where the reference does (to the tensor's dtype after the fp32 normalisation, after the
// activation, ...), so that it computes the reference's values. Built with the paged attention
// kernel by kvik_cpu.extension, without -ffast-math (vector_math.h says why).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "vector_math.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

constexpr int64_t kRowsPerTask = 16;

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), normalised in fp32 (as Hugging Face).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* weight, T* out, int64_t out_stride,
                   int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += f32(xr[i]) * f32(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + r * out_stride;
      for (int64_t i = 0; i < hidden; ++i) {
        o[i] = round_to<T>(f32(weight[i]) * f32(round_to<T>(f32(xr[i]) * inv)));
      }
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected rows [tokens, hidden] with dense rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input differ in dtype");
}

#define KVIK_DISPATCH(dtype, NAME, ...)                                                   \
  [&] {                                                                                   \
    switch (dtype) {                                                                      \
      case at::kFloat: {                                                                  \
        using scalar_t = float;                                                           \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kBFloat16: {                                                               \
        using scalar_t = c10::BFloat16;                                                   \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kHalf: {                                                                   \
        using scalar_t = c10::Half;                                                       \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      default:                                                                            \
        TORCH_CHECK(false, NAME " supports float32, bfloat16 and float16, not ", dtype); \
    }                                                                                     \
  }()

// Any leading dims ([T, H, D] for Qwen3's per-head norms) are flattened into rows.
inline at::Tensor as_rows(const at::Tensor& x) {
  return x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const at::Tensor x = as_rows(input);
  check_rows(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  KVIK_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out.view(input.sizes());
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& input,
                                                      const at::Tensor& residual_input,
                                                      const at::Tensor& weight, double eps) {
  const at::Tensor x = as_rows(input), residual = as_rows(residual_input);
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match the input");
  at::Tensor summed = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  KVIK_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    const int64_t rows = x.size(0), hidden = x.size(1);
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* b = residual.data_ptr<scalar_t>();
    scalar_t* s = summed.data_ptr<scalar_t>();
    const int64_t as = x.stride(0), bs = residual.stride(0);
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < hidden; ++i) {
          s[r * hidden + i] = round_to<scalar_t>(f32(a[r * as + i]) + f32(b[r * bs + i]));
        }
      }
    });
    rms_norm_rows<scalar_t>(s, hidden, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            hidden, rows, hidden, static_cast<float>(eps));
  });
  return {out.view(input.sizes()), summed.view(input.sizes())};
}

// Rotates the first rot_dim dims of each head of x [T, heads * head_size] into out (dense rows).
template <typename T>
void rotate(const int64_t* positions, const T* x, int64_t x_stride, T* out, int64_t tokens,
            int64_t heads, int64_t head_size, const float* cos_sin, int64_t rot_dim,
            bool is_neox) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * rot_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * x_stride + h * head_size;
        T* oh = out + (t * heads + h) * head_size;
        for (int64_t i = 0; i < half; ++i) {
          // neox pairs dim i with i + half; GPT-J pairs 2i with 2i + 1.
          const int64_t i1 = is_neox ? i : 2 * i, i2 = is_neox ? i + half : 2 * i + 1;
          const float x1 = f32(xh[i1]), x2 = f32(xh[i2]);
          oh[i1] = round_to<T>(x1 * cos[i] - x2 * sin[i]);
          oh[i2] = round_to<T>(x2 * cos[i] + x1 * sin[i]);
        }
        for (int64_t i = rot_dim; i < head_size; ++i) oh[i] = xh[i];  // partial rotary
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& query,
                                                    const at::Tensor& key, int64_t head_size,
                                                    const at::Tensor& cos_sin_cache,
                                                    bool is_neox) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous float32 [max_position, rot_dim]");
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= head_size, "rot_dim must be even, <= head_size");
  for (const at::Tensor* x : {&query, &key}) {
    TORCH_CHECK(x->dim() == 2 && x->stride(1) == 1 && x->size(1) % head_size == 0 &&
                    x->size(0) == positions.size(0),
                "query and key must be [tokens, heads * head_size] with dense rows");
  }
  at::Tensor q_out = at::empty(query.sizes(), query.options());
  at::Tensor k_out = at::empty(key.sizes(), key.options());
  KVIK_DISPATCH(query.scalar_type(), "rotary_embedding", [&] {
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* cs = cos_sin_cache.data_ptr<float>();
    rotate<scalar_t>(pos, query.data_ptr<scalar_t>(), query.stride(0), q_out.data_ptr<scalar_t>(),
                     query.size(0), query.size(1) / head_size, head_size, cs, rot_dim, is_neox);
    rotate<scalar_t>(pos, key.data_ptr<scalar_t>(), key.stride(0), k_out.data_ptr<scalar_t>(),
                     key.size(0), key.size(1) / head_size, head_size, cs, rot_dim, is_neox);
  });
  return {q_out, k_out};
}

// [T, 2I] (gate, up) -> silu(gate) * up [T, I], rounding after the activation as the reference.
// A true division and an expf within 1 ulp (libmvec's vector expf): in bf16 and fp16 the
// activation then has the reference's bits for every input (-0 below a gate of -88.7, not NaN).
template <typename T>
void silu_mul_rows(const T* in, int64_t stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * stride;
      const T* up = gate + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float g = f32(gate[i]);
        const float act = f32(round_to<T>(g / (1.f + std::exp(-g))));
        o[i] = round_to<T>(act * f32(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "expected [tokens, 2 * intermediate] with dense rows");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  KVIK_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), rows,
                            inter);
  });
  return out;
}

}  // namespace

namespace kvik_cpu::ops {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ::rms_norm(x, weight, eps);
}
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  return ::fused_add_rms_norm(x, residual, weight, eps);
}
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& query,
                                                    const at::Tensor& key, int64_t head_size,
                                                    const at::Tensor& cos_sin_cache, bool is_neox) {
  return ::rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox);
}
at::Tensor silu_and_mul(const at::Tensor& x) { return ::silu_and_mul(x); }
}  // namespace kvik_cpu::ops

TORCH_LIBRARY_IMPL(kvik, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
