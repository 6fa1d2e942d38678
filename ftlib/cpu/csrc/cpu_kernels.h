// What the CPU compute kernels (lora_dropout, swiglu, rope, rmsnorm, xent_block, flash_attn) share: splitting
// work over threads, an AVX2 lane sum and exp. Included by their .cpp files; ftlib/_cbuild.py hashes it
// with each of them, so a change here rebuilds them all.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace ftlib_cpu {

// fn(c) for c in [0, chunks), each on its own thread: in an OpenMP parallel region when built with
// -fopenmp (the threads of the runtime torch runs, see ftlib/_cbuild.py), else on std::threads
// (the calling thread takes chunk 0).
inline void parallel_for(int64_t chunks, const std::function<void(int64_t)>& fn) {
  if (chunks <= 1) {
    if (chunks == 1) fn(0);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) fn(c);
#else
  std::vector<std::thread> pool;
  for (int64_t c = 1; c < chunks; ++c) pool.emplace_back(fn, c);
  fn(0);
  for (auto& th : pool) th.join();
#endif
}

// The range length `parallel` cuts [0, n) into for `threads`: a multiple of `align`, at least align.
inline int64_t range_length(int64_t n, int threads, int64_t align) {
  const int64_t per = (n + std::max(1, threads) - 1) / std::max(1, threads);
  return std::max<int64_t>(align, (per + align - 1) / align * align);
}

// fn(a, b) over [0, n) in at most `threads` ranges of range_length(n, threads, align) (the last one
// shorter); one range runs on the calling thread.
inline void parallel(int64_t n, int threads, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t per = range_length(n, threads, align);
  const int64_t chunks = (n + per - 1) / per;
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  parallel_for(chunks, [&](int64_t c) { fn(c * per, std::min(n, (c + 1) * per)); });
}

// Sum of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp of 8 floats: Cephes' single-precision expf (range reduction by ln 2, a degree-5 polynomial,
// within ~2 ulp), inputs clamped to [-87.3, 88.3] (x as the second operand of max/min, which
// return it when it is NaN: a NaN stays NaN).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
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

}  // namespace ftlib_cpu
