// SwiGLU's elementwise product and its gradients in one pass each, fp32 on CPU (AVX2 + FMA):
//
//   forward:   h  = silu(g) * u = g * s * u,                 s = sigmoid(g) = 1 / (1 + exp(-g))
//   backward:  dg = dh * u * s * (1 + g * (1 - s)),   du = dh * g * s
//
// (ftlib/kernels/swiglu.py). PyTorch's ops take five passes over the [N, I] tensors in backward and
// two in forward, and keep silu(g) for backward; here each direction reads its inputs once and
// backward recomputes s from g. exp is Cephes' single-precision expf (range reduction by ln 2, a
// degree-5 polynomial, within ~2 ulp), the scalar tail uses std::exp. Work is split into `threads`
// element ranges, run by the threads of torch's OpenMP runtime when built with -fopenmp
// (ftlib/_cbuild.py), else std::threads.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

namespace {

using ftlib_cpu::exp8;
using ftlib_cpu::parallel;

__attribute__((target("avx2,fma"))) inline __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

inline float sigmoid1(float g) { return 1.0f / (1.0f + std::exp(-g)); }

__attribute__((target("avx2,fma"))) void fwd_range(const float* g, const float* u, float* h, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), _mm256_loadu_ps(u + i)));
  }
  for (; i < i1; ++i) h[i] = g[i] * sigmoid1(g[i]) * u[i];
}

__attribute__((target("avx2,fma"))) void bwd_range(const float* dh, const float* g, const float* u, float* dg,
                                                   float* du, int64_t i0, int64_t i1) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i), d = _mm256_loadu_ps(dh + i);
    __m256 s = sigmoid8(gv);
    __m256 gs = _mm256_mul_ps(gv, s);
    _mm256_storeu_ps(du + i, _mm256_mul_ps(d, gs));
    // dg = dh * u * s * (1 + g (1 - s)) = dh * u * (s + g s - g s s)
    __m256 t = _mm256_fnmadd_ps(gs, s, _mm256_add_ps(s, gs));
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + i)), t));
  }
  for (; i < i1; ++i) {
    float s = sigmoid1(g[i]);
    du[i] = dh[i] * g[i] * s;
    dg[i] = dh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
  (void)one;
}

}  // namespace

extern "C" {

// 1 when built with OpenMP (kernels split over the runtime's threads), else 0.
int ft_swiglu_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int ft_swiglu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void ft_swiglu_fwd(const float* g, const float* u, float* h, int64_t n, int threads) {
  parallel(n, threads, 64, [&](int64_t a, int64_t b) { fwd_range(g, u, h, a, b); });
}

void ft_swiglu_bwd(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n, int threads) {
  parallel(n, threads, 64, [&](int64_t a, int64_t b) { bwd_range(dh, g, u, dg, du, a, b); });
}

}  // extern "C"
