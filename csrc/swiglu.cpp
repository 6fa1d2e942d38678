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

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// fn over [0, n) in `threads` ranges of a multiple of 64 elements (the last one shorter): in an
// OpenMP parallel region when built with -fopenmp (the threads of the runtime torch runs, see
// ftlib/_cbuild.py), else on std::threads.
void parallel(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  threads = std::max(1, threads);
  const int64_t per = std::max<int64_t>(64, ((n + threads - 1) / threads + 63) / 64 * 64);
  const int64_t chunks = (n + per - 1) / per;
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) fn(c * per, std::min(n, (c + 1) * per));
#else
  std::vector<std::thread> pool;
  for (int64_t s = per; s < n; s += per) pool.emplace_back(fn, s, std::min(n, s + per));
  fn(0, std::min(n, per));
  for (auto& th : pool) th.join();
#endif
}

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

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
  parallel(n, threads, [&](int64_t a, int64_t b) { fwd_range(g, u, h, a, b); });
}

void ft_swiglu_bwd(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n, int threads) {
  parallel(n, threads, [&](int64_t a, int64_t b) { bwd_range(dh, g, u, dg, du, a, b); });
}

}  // extern "C"
