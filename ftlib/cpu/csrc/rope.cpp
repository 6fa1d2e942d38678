// RoPE's rotation of q or k and its adjoint, fp32 on CPU (AVX2 + FMA), one pass each
// (ftlib/kernels/rope.py). With h = D / 2, c = cos[t], s = sin[t] ([T, D] rows of the token) and
// x, y rows [T, H, D] (every head of a token rotated by that token's angles):
//
//   rotate:   y[i] = x[i] c[i] - x[i+h] s[i],        y[i+h] = x[i+h] c[i+h] + x[i] s[i+h]
//   adjoint:  y[i] = x[i] c[i] + x[i+h] s[i+h],      y[i+h] = x[i+h] c[i+h] - x[i] s[i]     (i < h)
//
// i.e. y = x * cos + rotate_half(x) * sin and its transpose (the backward; with the halves of
// cos/sin equal, as rope_cos_sin builds them, the inverse rotation). PyTorch's ops take four
// passes and three temporaries forward and about six passes backward; here each direction reads
// x once and writes y once. Work is
// split into `threads` token ranges, run by the threads of torch's OpenMP runtime when built with
// -fopenmp (ftlib/_cbuild.py), else std::threads.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

namespace {

using ftlib_cpu::parallel;

template <bool ADJOINT>
__attribute__((target("avx2,fma"))) void rope_rows(const float* x, const float* cs, const float* sn, float* y,
                                                   int64_t t0, int64_t t1, int64_t H, int64_t D) {
  const int64_t h = D / 2;
  const int64_t hv = h / 8 * 8;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = cs + t * D;
    const float* s = sn + t * D;
    for (int64_t head = 0; head < H; ++head) {
      const float* xr = x + (t * H + head) * D;
      float* yr = y + (t * H + head) * D;
      for (int64_t i = 0; i < hv; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(xr + i), x2 = _mm256_loadu_ps(xr + h + i);
        const __m256 c1 = _mm256_loadu_ps(c + i), c2 = _mm256_loadu_ps(c + h + i);
        const __m256 s1 = _mm256_loadu_ps(s + i), s2 = _mm256_loadu_ps(s + h + i);
        if (ADJOINT) {
          _mm256_storeu_ps(yr + i, _mm256_fmadd_ps(x2, s2, _mm256_mul_ps(x1, c1)));
          _mm256_storeu_ps(yr + h + i, _mm256_fnmadd_ps(x1, s1, _mm256_mul_ps(x2, c2)));
        } else {
          _mm256_storeu_ps(yr + i, _mm256_fnmadd_ps(x2, s1, _mm256_mul_ps(x1, c1)));
          _mm256_storeu_ps(yr + h + i, _mm256_fmadd_ps(x1, s2, _mm256_mul_ps(x2, c2)));
        }
      }
      for (int64_t i = hv; i < h; ++i) {
        const float x1 = xr[i], x2 = xr[h + i];
        if (ADJOINT) {
          yr[i] = x1 * c[i] + x2 * s[h + i];
          yr[h + i] = x2 * c[h + i] - x1 * s[i];
        } else {
          yr[i] = x1 * c[i] - x2 * s[i];
          yr[h + i] = x2 * c[h + i] + x1 * s[h + i];
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 when built with OpenMP (work split over the runtime's threads), else 0.
int ft_rope_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int ft_rope_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// y = rope(x) (adjoint 0) or its transpose (adjoint 1); x, y [T, H, D], cos/sin [T, D], D even.
void ft_rope(const float* x, const float* cs, const float* sn, float* y, int64_t T, int64_t H, int64_t D, int adjoint,
             int threads) {
  parallel(T, threads, 1, [&](int64_t a, int64_t b) {
    if (adjoint)
      rope_rows<true>(x, cs, sn, y, a, b, H, D);
    else
      rope_rows<false>(x, cs, sn, y, a, b, H, D);
  });
}

}  // extern "C"
