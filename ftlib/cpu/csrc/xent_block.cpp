// The chunked cross-entropy's softmax over a (V, C) block of logits, fp32 on CPU (AVX2 + FMA):
// for every column c (one target token; the block's rows are the vocabulary),
//
//   lse[c] = log sum_v exp(z[v, c]),         and with grad:   z[v, c] <- exp(z[v, c] - lse[c]) - [v == y[c]]
//
// (ftlib/kernels/xent_block.py; the (V, C) layout is the one ftlib/losses.py uses on CPU). PyTorch's
// ops take five passes over the block (amax, sub_, exp_, sum, div_), each a full read or
// read-write of hundreds of MB at V = 128k; here pass 1 sweeps the rows in blocks of 32 (contiguous
// reads) keeping a running max and sum per column (the block's second read comes from L2; one exp
// per element, one rescale per column per block), and pass 2 writes the gradient in one
// read-write sweep. Rows are split into `threads` ranges (per-range maxima and sums merged), run by
// the threads of torch's OpenMP runtime when built with -fopenmp (ftlib/_cbuild.py), else
// std::threads. exp is the same Cephes-style polynomial as csrc/swiglu.cpp (~2 ulp).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

namespace {

using ftlib_cpu::exp8;

inline float exp1(float x) { return std::exp(std::max(x, -87.3f)); }

constexpr int64_t kRowBlock = 32;

// Running column maxima m and sums s (of exp(z - m), in double) over rows [v0, v1). Per block of
// 32 rows: the block's maxima, the old sums rescaled to the new maxima, the block's float sum of
// exp(z - m) added in double (a float running sum over 128k rows would drift ~1e-4 relative).
__attribute__((target("avx2,fma"))) void stats_rows(const float* z, int64_t ld, int64_t C, int64_t v0, int64_t v1,
                                                    float* m, double* s, float* scratch) {
  const int64_t cv = C / 8 * 8;
  const float inf = std::numeric_limits<float>::infinity();
  float* bm = scratch;      // block maxima, then the rescale factors
  float* bs = scratch + C;  // block sums
  for (int64_t b0 = v0; b0 < v1; b0 += kRowBlock) {
    const int64_t b1 = std::min(v1, b0 + kRowBlock);
    std::fill(bm, bm + C, -inf);
    std::fill(bs, bs + C, 0.f);
    for (int64_t v = b0; v < b1; ++v) {
      const float* row = z + v * ld;
      int64_t c = 0;
      for (; c < cv; c += 8) _mm256_storeu_ps(bm + c, _mm256_max_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(bm + c)));
      for (; c < C; ++c) bm[c] = std::max(bm[c], row[c]);
    }
    int64_t c = 0;
    for (; c < cv; c += 8) {  // new maxima into m, rescale factors exp(m_old - m_new) into bm
      const __m256 mo = _mm256_loadu_ps(m + c), mn = _mm256_max_ps(mo, _mm256_loadu_ps(bm + c));
      _mm256_storeu_ps(bm + c, exp8(_mm256_sub_ps(mo, mn)));  // 0 for the first block (m_old = -inf)
      _mm256_storeu_ps(m + c, mn);
    }
    for (; c < C; ++c) {
      const float mn = std::max(m[c], bm[c]);
      bm[c] = exp1(m[c] - mn);
      m[c] = mn;
    }
    for (int64_t v = b0; v < b1; ++v) {
      const float* row = z + v * ld;
      c = 0;
      for (; c < cv; c += 8)
        _mm256_storeu_ps(bs + c, _mm256_add_ps(_mm256_loadu_ps(bs + c),
                                               exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(m + c)))));
      for (; c < C; ++c) bs[c] += exp1(row[c] - m[c]);
    }
    c = 0;
    for (; c + 4 <= C; c += 4) {
      const __m256d f = _mm256_cvtps_pd(_mm_loadu_ps(bm + c)), b = _mm256_cvtps_pd(_mm_loadu_ps(bs + c));
      _mm256_storeu_pd(s + c, _mm256_fmadd_pd(_mm256_loadu_pd(s + c), f, b));
    }
    for (; c < C; ++c) s[c] = s[c] * static_cast<double>(bm[c]) + static_cast<double>(bs[c]);
  }
}

// z[v, c] <- exp(z[v, c] - lse[c]) over rows [v0, v1).
__attribute__((target("avx2,fma"))) void grad_rows(float* z, int64_t ld, int64_t C, int64_t v0, int64_t v1,
                                                   const float* lse) {
  const int64_t cv = C / 8 * 8;
  for (int64_t v = v0; v < v1; ++v) {
    float* row = z + v * ld;
    int64_t c = 0;
    for (; c < cv; c += 8)
      _mm256_storeu_ps(row + c, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), _mm256_loadu_ps(lse + c))));
    for (; c < C; ++c) row[c] = exp1(row[c] - lse[c]);
  }
}

}  // namespace

extern "C" {

// 1 when built with OpenMP (rows split over the runtime's threads), else 0.
int ft_xent_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int ft_xent_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// z (V, C) with row stride ld >= C, y[C] the label rows (0 <= y < V); lse[C] out. grad: z becomes
// softmax(z) - onehot(y) along its rows, in place.
void ft_xent_block(float* z, int64_t V, int64_t C, int64_t ld, const int64_t* y, float* lse, int grad, int threads) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, V / kRowBlock));
  const int64_t per = (V + parts - 1) / parts;
  std::vector<float> ms(parts * C, -inf), scratch(parts * 2 * C);
  std::vector<double> ss(parts * C, 0.0);
  ftlib_cpu::parallel_for(parts, [&](int64_t p) {
    const int64_t v0 = p * per, v1 = std::min(V, v0 + per);
    if (v0 < v1) stats_rows(z, ld, C, v0, v1, ms.data() + p * C, ss.data() + p * C, scratch.data() + p * 2 * C);
  });
  for (int64_t c = 0; c < C; ++c) {
    float m = -inf;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, ms[p * C + c]);
    double s = 0.0;
    for (int64_t p = 0; p < parts; ++p)
      if (ss[p * C + c] != 0.0) s += ss[p * C + c] * std::exp(static_cast<double>(ms[p * C + c]) - m);
    lse[c] = m + static_cast<float>(std::log(s));
  }
  if (!grad) return;
  ftlib_cpu::parallel_for(parts, [&](int64_t p) {
    const int64_t v0 = p * per, v1 = std::min(V, v0 + per);
    if (v0 < v1) grad_rows(z, ld, C, v0, v1, lse);
  });
  for (int64_t c = 0; c < C; ++c) z[y[c] * ld + c] -= 1.0f;
}

}  // extern "C"
