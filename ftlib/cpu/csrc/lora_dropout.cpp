// The three products of a LoRA adapter's input dropout on CPU, with the 1-byte keep mask read in
// place (ftlib/lora/dropout.py: ``masked_linear``):
//
//   xa:  u[t, j]  = scale * sum_k x[t, k] m[t, k] A[j, k]     forward,      (N, K) -> (N, r)
//   dx:  dx[t, k] = m[t, k] * sum_j du[t, j] A[j, k]           input grad,   (N, r) -> (N, K)
//        (or added to what dx holds: the base layer's input gradient, no separate sum pass)
//   da:  dA[j, k] = sum_t du[t, j] x[t, k] m[t, k]             weight grad,  -> (r, K)
//
// and the keep mask itself (ft_lora_dropout_mask): m[i, k] = (u16(i, k) >= t), u16 the 16-bit uniforms
// of the counter-based Philox4x32-10 stream of ftlib/kernels/lora_ref.py (``uniform16_ref``, the
// fused kernels' mask), eight Philox calls (64 columns of a row) at a time in AVX2 lanes.
//
// fp32, row-major, contiguous; m is 0/1 bytes (torch.bool storage). ``x * m`` is a multiplication
// (a NaN in x stays NaN), as in the PyTorch path. The PyTorch path spends ~5 passes over an
// (N, K) tensor per product (the mask widened to fp32, x * m written, read by a skinny GEMM); here
// each product reads x/m once and keeps the r-wide accumulators in registers. AVX2 + FMA
// (checked at run time by ft_lora_supported); r a multiple of 8 up to 64. Work is split into
// `threads` ranges of rows (xa, dx) or of columns k (da: no shared accumulators), run by the
// threads of torch's OpenMP runtime when built with -fopenmp (ftlib/_cbuild.py), else std::threads.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

namespace {

using ftlib_cpu::parallel;

__attribute__((target("avx2,fma"))) inline __m256 mask8(const uint8_t* m) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

// out[k] = x[k] * m[k] for k < K (one row), 8 at a time.
__attribute__((target("avx2,fma"))) inline void masked_row(const float* x, const uint8_t* m, float* out, int64_t K) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(x + k), mask8(m + k)));
  for (; k < K; ++k) out[k] = x[k] * static_cast<float>(m[k]);
}

// u rows [t0, t1): ROWS rows at a time, R vectors of 8 outputs each (r = 8 R); at = A^T (K, r). The
// rows' x * m is written to a buffer first (vector ops), so the inner loop is one broadcast load
// and R fused multiply-adds per row and k.
template <int R, int ROWS>
__attribute__((target("avx2,fma"))) void xa_rows(const float* x, const uint8_t* m, const float* at, float* u,
                                                 int64_t t0, int64_t t1, int64_t K, float scale) {
  constexpr int r = 8 * R;
  std::vector<float> xm(static_cast<size_t>(ROWS * K));
  int64_t t = t0;
  for (; t + ROWS <= t1; t += ROWS) {
    for (int q = 0; q < ROWS; ++q) masked_row(x + (t + q) * K, m + (t + q) * K, xm.data() + q * K, K);
    __m256 acc[ROWS][R];
    for (int q = 0; q < ROWS; ++q)
      for (int i = 0; i < R; ++i) acc[q][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      __m256 a[R];
      for (int i = 0; i < R; ++i) a[i] = _mm256_loadu_ps(at + k * r + 8 * i);
      for (int q = 0; q < ROWS; ++q) {
        const __m256 xv = _mm256_broadcast_ss(xm.data() + q * K + k);
        for (int i = 0; i < R; ++i) acc[q][i] = _mm256_fmadd_ps(xv, a[i], acc[q][i]);
      }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int q = 0; q < ROWS; ++q)
      for (int i = 0; i < R; ++i) _mm256_storeu_ps(u + (t + q) * r + 8 * i, _mm256_mul_ps(acc[q][i], s));
  }
  if (t < t1) xa_rows<R, 1>(x, m, at, u, t, t1, K, scale);
}

// dx rows [t0, t1); a = A (r, K). 32 columns (4 vectors) x 2 rows at a time, scalar tail.
template <int ROWS, bool ADD>
__attribute__((target("avx2,fma"))) void dx_rows(const float* du, const float* a, const uint8_t* m, float* dx,
                                                 int64_t t0, int64_t t1, int64_t K, int r) {
  int64_t t = t0;
  for (; t + ROWS <= t1; t += ROWS) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m256 acc[ROWS][4];
      for (int q = 0; q < ROWS; ++q)
        for (int i = 0; i < 4; ++i) acc[q][i] = _mm256_setzero_ps();
      for (int j = 0; j < r; ++j) {
        __m256 av[4];
        for (int i = 0; i < 4; ++i) av[i] = _mm256_loadu_ps(a + j * K + k + 8 * i);
        for (int q = 0; q < ROWS; ++q) {
          __m256 d = _mm256_set1_ps(du[(t + q) * r + j]);
          for (int i = 0; i < 4; ++i) acc[q][i] = _mm256_fmadd_ps(d, av[i], acc[q][i]);
        }
      }
      for (int q = 0; q < ROWS; ++q)
        for (int i = 0; i < 4; ++i) {
          const int64_t o = (t + q) * K + k + 8 * i;
          const __m256 v = _mm256_mul_ps(acc[q][i], mask8(m + o));
          _mm256_storeu_ps(dx + o, ADD ? _mm256_add_ps(_mm256_loadu_ps(dx + o), v) : v);
        }
    }
    for (; k < K; ++k)
      for (int q = 0; q < ROWS; ++q) {
        float s = 0.f;
        for (int j = 0; j < r; ++j) s += du[(t + q) * r + j] * a[j * K + k];
        const int64_t o = (t + q) * K + k;
        dx[o] = (ADD ? dx[o] : 0.f) + s * static_cast<float>(m[o]);
      }
  }
  if (t < t1) dx_rows<1, ADD>(du, a, m, dx, t, t1, K, r);
}

// dA columns [k0, k1) (k0 a multiple of 16). Rows t in chunks of 64 (their x and m slices stay in
// L1 across the passes over j, and a chunk's rows span few pages); within a chunk, 4 rows j x 16
// columns of dA at a time in registers, added to what the earlier chunks left in dA.
__attribute__((target("avx2,fma"))) void da_cols(const float* du, const float* x, const uint8_t* m, float* da,
                                                 int64_t k0, int64_t k1, int64_t N, int64_t K, int r) {
  for (int j = 0; j < r; ++j) std::fill(da + j * K + k0, da + j * K + k1, 0.f);
  const int64_t kv = k0 + (k1 - k0) / 16 * 16;  // vector columns [k0, kv), scalar tail [kv, k1)
  for (int64_t c0 = 0; c0 < N; c0 += 64) {
    const int64_t c1 = std::min(N, c0 + 64);
    for (int64_t k = k0; k < kv; k += 16) {
      alignas(32) float xb[64 * 16];  // this block's x * m, computed once for the r / 4 passes over j
      for (int64_t t = c0; t < c1; ++t) {
        const int64_t o = t * K + k;
        _mm256_store_ps(xb + (t - c0) * 16, _mm256_mul_ps(_mm256_loadu_ps(x + o), mask8(m + o)));
        _mm256_store_ps(xb + (t - c0) * 16 + 8, _mm256_mul_ps(_mm256_loadu_ps(x + o + 8), mask8(m + o + 8)));
      }
      for (int j = 0; j < r; j += 4) {
        __m256 acc[4][2];
        for (int p = 0; p < 4; ++p) {
          acc[p][0] = _mm256_loadu_ps(da + (j + p) * K + k);
          acc[p][1] = _mm256_loadu_ps(da + (j + p) * K + k + 8);
        }
        for (int64_t t = c0; t < c1; ++t) {
          const __m256 x0 = _mm256_load_ps(xb + (t - c0) * 16), x1 = _mm256_load_ps(xb + (t - c0) * 16 + 8);
          for (int p = 0; p < 4; ++p) {
            __m256 d = _mm256_set1_ps(du[t * r + j + p]);
            acc[p][0] = _mm256_fmadd_ps(d, x0, acc[p][0]);
            acc[p][1] = _mm256_fmadd_ps(d, x1, acc[p][1]);
          }
        }
        for (int p = 0; p < 4; ++p) {
          _mm256_storeu_ps(da + (j + p) * K + k, acc[p][0]);
          _mm256_storeu_ps(da + (j + p) * K + k + 8, acc[p][1]);
        }
      }
    }
    for (int64_t k = kv; k < k1; ++k)
      for (int j = 0; j < r; ++j) {
        float s = da[j * K + k];
        for (int64_t t = c0; t < c1; ++t) s += du[t * r + j] * x[t * K + k] * static_cast<float>(m[t * K + k]);
        da[j * K + k] = s;
      }
  }
}

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // Philox4x32 multipliers
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments

// One Philox4x32-10 call: c (counter) -> c (output words), key (k0, k1).
inline void philox1(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0], p1 = static_cast<uint64_t>(kM1) * c[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = static_cast<uint32_t>(p1);
    c[2] = n2;
    c[3] = static_cast<uint32_t>(p0);
    k0 += kW0;
    k1 += kW1;
  }
}

// (hi, lo) 32-bit halves of m * b in each of 8 lanes.
__attribute__((target("avx2,fma"))) inline void mulhilo8(__m256i m, __m256i b, __m256i& hi, __m256i& lo) {
  const __m256i pe = _mm256_mul_epu32(b, m);                         // 64-bit products of lanes 0, 2, 4, 6
  const __m256i po = _mm256_mul_epu32(_mm256_srli_epi64(b, 32), m);  // of lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(pe, _mm256_slli_epi64(po, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
}

// Philox4x32-10 of 8 x NB counters (k / 8 + lane, i, c2, c3): NB independent blocks of 8 lanes
// interleaved, so the multiplies of one block overlap the others' latency. Then the keep bytes of
// the 64 NB columns from k: word q of lane j holds columns k + 8 j + 2 q (low 16 bits) and + 1 (high).
template <int NB>
__attribute__((target("avx2,fma"))) inline void mask_block(uint8_t* row, int64_t k, int64_t i, uint32_t key0,
                                                           uint32_t key1, uint32_t c2, uint32_t c3, __m256i below) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0)), m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF), one = _mm256_set1_epi32(1);
  __m256i x[NB][4];
  for (int b = 0; b < NB; ++b) {
    x[b][0] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(k / 8 + 8 * b)), lane);
    x[b][1] = _mm256_set1_epi32(static_cast<int>(i));
    x[b][2] = _mm256_set1_epi32(static_cast<int>(c2));
    x[b][3] = _mm256_set1_epi32(static_cast<int>(c3));
  }
  uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    const __m256i kv0 = _mm256_set1_epi32(static_cast<int>(k0)), kv1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int b = 0; b < NB; ++b) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(m0, x[b][0], hi0, lo0);
      mulhilo8(m1, x[b][2], hi1, lo1);
      x[b][0] = _mm256_xor_si256(_mm256_xor_si256(hi1, x[b][1]), kv0);
      x[b][1] = lo1;
      x[b][2] = _mm256_xor_si256(_mm256_xor_si256(hi0, x[b][3]), kv1);
      x[b][3] = lo0;
    }
    k0 += kW0;
    k1 += kW1;
  }
  for (int b = 0; b < NB; ++b) {
    __m256i pair[4];
    for (int q = 0; q < 4; ++q) {
      const __m256i lo = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_and_si256(x[b][q], low16), below), one);
      const __m256i hi = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_srli_epi32(x[b][q], 16), below), one);
      pair[q] = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8));  // bytes (col 2q, col 2q + 1, 0, 0)
    }
    const __m256i l = _mm256_or_si256(pair[0], _mm256_slli_epi32(pair[1], 16));  // lane j: bytes 0..3
    const __m256i h = _mm256_or_si256(pair[2], _mm256_slli_epi32(pair[3], 16));  // lane j: bytes 4..7
    const __m256i lo = _mm256_unpacklo_epi32(l, h), hi = _mm256_unpackhi_epi32(l, h);
    uint8_t* dst = row + k + 64 * b;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

// Mask bytes of rows [i0, i1): 256 columns (4 blocks of 8 Philox calls) at a time, then 64, then
// scalar calls for the tail.
__attribute__((target("avx2,fma"))) void mask_rows(uint8_t* out, int64_t i0, int64_t i1, int64_t cols, uint32_t key0,
                                                   uint32_t key1, uint32_t c2, uint32_t c3, uint32_t t) {
  const __m256i below = _mm256_set1_epi32(static_cast<int>(t) - 1);  // keep: u16 > t - 1
  for (int64_t i = i0; i < i1; ++i) {
    uint8_t* row = out + i * cols;
    int64_t k = 0;
    for (; k + 256 <= cols; k += 256) mask_block<4>(row, k, i, key0, key1, c2, c3, below);
    for (; k + 64 <= cols; k += 64) mask_block<1>(row, k, i, key0, key1, c2, c3, below);
    for (; k < cols; k += 8) {
      uint32_t c[4] = {static_cast<uint32_t>(k / 8), static_cast<uint32_t>(i), c2, c3};
      philox1(c, key0, key1);
      for (int64_t e = 0; e < 8 && k + e < cols; ++e) {
        const uint32_t u16 = (c[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
        row[k + e] = u16 >= t ? 1 : 0;
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 when built with OpenMP (kernels split over the runtime's threads), else 0.
int ft_lora_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int ft_lora_supported(int r) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && r > 0 && r % 8 == 0 && r <= 64;
}

// Keep mask (1 byte per element) of a [rows, cols] input: m[i, k] = (u16(i, k) >= t), the Philox
// stream with key (key0, key1) and counter words (k / 8, i, c2, c3) (lora_ref.rng_words gives them).
void ft_lora_dropout_mask(uint8_t* out, int64_t rows, int64_t cols, uint32_t key0, uint32_t key1, uint32_t c2,
                          uint32_t c3, uint32_t t, int threads) {
  parallel(rows, threads, 1, [&](int64_t i0, int64_t i1) { mask_rows(out, i0, i1, cols, key0, key1, c2, c3, t); });
}

void ft_lora_masked_xa(const float* x, const uint8_t* m, const float* at, float* u, int64_t N, int64_t K, int r,
                       float scale, int threads) {
  parallel(N, threads, 4, [&](int64_t t0, int64_t t1) {
    switch (r / 8) {
      case 1: xa_rows<1, 4>(x, m, at, u, t0, t1, K, scale); break;
      case 2: xa_rows<2, 4>(x, m, at, u, t0, t1, K, scale); break;
      case 3: xa_rows<3, 2>(x, m, at, u, t0, t1, K, scale); break;
      case 4: xa_rows<4, 2>(x, m, at, u, t0, t1, K, scale); break;
      case 5: xa_rows<5, 1>(x, m, at, u, t0, t1, K, scale); break;
      case 6: xa_rows<6, 1>(x, m, at, u, t0, t1, K, scale); break;
      case 7: xa_rows<7, 1>(x, m, at, u, t0, t1, K, scale); break;
      default: xa_rows<8, 1>(x, m, at, u, t0, t1, K, scale); break;
    }
  });
}

// accumulate: 1 adds the product to dx's contents, 0 overwrites them.
void ft_lora_masked_dx(const float* du, const float* a, const uint8_t* m, float* dx, int64_t N, int64_t K, int r,
                       int accumulate, int threads) {
  parallel(N, threads, 2, [&](int64_t t0, int64_t t1) {
    if (accumulate)
      dx_rows<2, true>(du, a, m, dx, t0, t1, K, r);
    else
      dx_rows<2, false>(du, a, m, dx, t0, t1, K, r);
  });
}

void ft_lora_masked_da(const float* du, const float* x, const uint8_t* m, float* da, int64_t N, int64_t K, int r,
                       int threads) {
  parallel(K, threads, 16, [&](int64_t k0, int64_t k1) { da_cols(du, x, m, da, k0, k1, N, K, r); });
}

}  // extern "C"
