// Vectorised expf without -ffast-math: glibc's vector expf (libmvec) for `#pragma omp simd` loops.
//
// glibc's <math.h> declares libmvec's vector variants of expf (_ZGVeN16v_expf with AVX-512, ...)
// only under -ffast-math (__FAST_MATH__). kvik_cpu's kernels are not built with it: it let the
// compiler replace divisions with approximate reciprocals, which gave silu(x) = NaN for x <= -89
// (the reciprocal of 1 + exp(89) = inf) and rounded some bf16 activations to the wrong side. This
// header declares the vector variants as glibc does (an OpenMP `declare simd` on expf), so that
// the softmax's and silu's `#pragma omp simd` loops still call them; with -fno-math-errno a call
// has no side effect to keep in order. Elsewhere the loops call the scalar expf.
#pragma once

#include <cmath>

#if defined(__GLIBC__) && defined(__x86_64__) && defined(_OPENMP) && !defined(__FAST_MATH__)
extern "C" {
#pragma omp declare simd notinbranch
float expf(float) noexcept;
}
#define KVIK_CPU_VECTOR_EXPF 1
#else
#define KVIK_CPU_VECTOR_EXPF 0
#endif
