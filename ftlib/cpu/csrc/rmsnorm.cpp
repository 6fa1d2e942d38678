// RMSNorm forward and input gradient, fp32 on CPU (AVX2 + FMA), one pass over a row each
// (ftlib/kernels/rmsnorm.py). Per row x of length H, weight w:
//
//   forward:   r = 1 / sqrt(sum(x^2) / H + eps),   y = w * (x * r)          (r kept for backward)
//   backward:  n = x r,  g = dy * w,  dx = r * (g - n * sum(g n) / H)
//
// PyTorch's ops take three passes forward and five backward, each writing a temporary; here a row
// (a few KB, in L1 after its first read) is read twice and written once each way. Rows are split
// into `threads` ranges, run by the threads of torch's OpenMP runtime when built with -fopenmp
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

using ftlib_cpu::hsum;
using ftlib_cpu::parallel;

__attribute__((target("avx2,fma"))) void fwd_rows(const float* x, const float* w, float* y, float* r, int64_t i0,
                                                  int64_t i1, int64_t H, float eps) {
  const int64_t hv = H / 8 * 8;
  for (int64_t i = i0; i < i1; ++i) {
    const float* xr = x + i * H;
    float* yr = y + i * H;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= hv; k += 16) {
      const __m256 v0 = _mm256_loadu_ps(xr + k), v1 = _mm256_loadu_ps(xr + k + 8);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
      a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; k < hv; k += 8) {
      const __m256 v0 = _mm256_loadu_ps(xr + k);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
    }
    float ss = hsum(_mm256_add_ps(a0, a1));
    for (; k < H; ++k) ss += xr[k] * xr[k];
    const float rr = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    r[i] = rr;
    const __m256 rv = _mm256_set1_ps(rr);
    for (k = 0; k < hv; k += 8)
      _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), rv)));
    for (; k < H; ++k) yr[k] = w[k] * (xr[k] * rr);
  }
}

__attribute__((target("avx2,fma"))) void bwd_rows(const float* dy, const float* x, const float* w, const float* r,
                                                  float* dx, int64_t i0, int64_t i1, int64_t H) {
  const int64_t hv = H / 8 * 8;
  for (int64_t i = i0; i < i1; ++i) {
    const float* d = dy + i * H;
    const float* xr = x + i * H;
    float* o = dx + i * H;
    const float rr = r[i];
    // sum(g n) = r * sum(dy w x)
    __m256 a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < hv; k += 8)
      a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d + k), _mm256_loadu_ps(w + k)), _mm256_loadu_ps(xr + k), a);
    float dot = hsum(a);
    for (; k < H; ++k) dot += d[k] * w[k] * xr[k];
    const float m = dot * rr / static_cast<float>(H);  // mean(g n)
    // dx = r (g - n m) = r g - (r^2 m) x
    const __m256 rv = _mm256_set1_ps(rr), cv = _mm256_set1_ps(rr * rr * m);
    for (k = 0; k < hv; k += 8) {
      const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(d + k), _mm256_loadu_ps(w + k));
      _mm256_storeu_ps(o + k, _mm256_fnmadd_ps(cv, _mm256_loadu_ps(xr + k), _mm256_mul_ps(rv, g)));
    }
    for (; k < H; ++k) o[k] = rr * (d[k] * w[k]) - rr * rr * m * xr[k];
  }
}

}  // namespace

extern "C" {

// 1 when built with OpenMP (rows split over the runtime's threads), else 0.
int ft_rmsnorm_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int ft_rmsnorm_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// y [rows, H] and r [rows] from x [rows, H], w [H].
void ft_rmsnorm_fwd(const float* x, const float* w, float* y, float* r, int64_t rows, int64_t H, float eps,
                    int threads) {
  parallel(rows, threads, 1, [&](int64_t a, int64_t b) { fwd_rows(x, w, y, r, a, b, H, eps); });
}

// dx [rows, H] from dy, x [rows, H], w [H], r [rows].
void ft_rmsnorm_bwd(const float* dy, const float* x, const float* w, const float* r, float* dx, int64_t rows, int64_t H,
                    int threads) {
  parallel(rows, threads, 1, [&](int64_t a, int64_t b) { bwd_rows(dy, x, w, r, dx, a, b, H); });
}

}  // extern "C"
