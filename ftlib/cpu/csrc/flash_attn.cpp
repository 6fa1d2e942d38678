// Flash attention over packed documents, forward and backward, fp32 on CPU (AVX2 + FMA)
// (ftlib/kernels/attention_cpu.py). Layout: q [N, Hq, D], k and v [N, Hkv, D], the rows of
// document d are cu[d] .. cu[d+1]-1, query head h reads key/value head h / G (G = Hq / Hkv).
// Within a document, with s the softmax scale and causal masking j <= i:
//
//   forward:   S = s Q K^T,  m = rowmax S,  l = rowsum exp(S - m),  O = exp(S - m) V / l,
//              lse = m + log l                                        (kept for backward)
//   backward:  P = exp(S - lse),  Delta = rowsum(dO * O),  dV = P^T dO,  dP = dO V^T,
//              dS = P * (dP - Delta),  dQ = s dS K,  dK = s dS^T Q
//
// (Dao 2023, FlashAttention-2: the forward streams key blocks with a running max and sum, the
// backward recomputes P from lse, so no [L, L] matrix exists.) What differs from ATen's CPU
// flash-attention kernel, which this replaces on the varlen path:
//
// - the G query heads sharing a key/value head form one tile of G * 64 rows against a 64-key
//   block: each key block is packed once for G heads, and the products have G times the rows;
// - every product of a tile (S, PV forward; S, dP, dV, dK, dQ backward) is one register-blocked
//   6 x 16 AVX2 micro-kernel over packed operands, so short documents (a packed row of 16- to
//   1000-token documents) keep the GEMM rate, where per-call and per-block overheads dominate
//   ATen's kernel;
// - causal tiles above the diagonal are skipped, the diagonal tile masked;
// - one call covers every document: tasks (forward: document x kv head x query block;
//   backward: document x kv head, which owns dK, dV of its head and dQ of its G query heads, so
//   no two tasks write the same row; one holding more than a thread's share of the work is cut
//   into key-block ranges whose dQ parts are summed in order afterwards) are taken largest first
//   from a shared counter by `threads` threads of torch's OpenMP runtime when built with -fopenmp
//   (ftlib/_cbuild.py). Results are fixed for given inputs and thread count.
//
// Masked entries of P are exactly zero; padded rows and keys of a partial block never reach the
// outputs. NaN in the inputs propagates to the outputs.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

extern "C" {

int ft_flash_attn_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int ft_flash_attn_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // extern "C"

#define FT_AVX2 __attribute__((target("avx2,fma")))

namespace {

using ftlib_cpu::hsum;

constexpr int64_t BQ = 32;  // query positions of a tile (times G heads = its rows)
constexpr int64_t BK = 32;  // keys of a tile (BQ == BK: the diagonal tile of a query block is one key block)
constexpr int MR = 6;       // micro-kernel rows

// c[R x 8NV] (+)= a[R x K] b[K x 8NV]: a(m, k) = a[m * sam + k * sak] (broadcast), b rows ldb apart
// (8NV contiguous floats each), c rows ldc apart. R x NV accumulators stay in registers.
template <int R, int NV>
FT_AVX2 inline void micro(int64_t K, const float* a, int64_t sam, int64_t sak, const float* b, int64_t ldb, float* c,
                          int64_t ldc, bool acc) {
  __m256 z[R][NV];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) z[m][v] = acc ? _mm256_loadu_ps(c + m * ldc + 8 * v) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    const float* ak = a + k * sak;
    __m256 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(bk + 8 * v);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const __m256 am = _mm256_broadcast_ss(ak + m * sam);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) z[m][v] = _mm256_fmadd_ps(am, bv[v], z[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + m * ldc + 8 * v, z[m][v]);
}

template <int NV>
FT_AVX2 void gemm_panel(int64_t M, int64_t K, const float* a, int64_t sam, int64_t sak, const float* b, int64_t ldb,
                        float* c, int64_t ldc, bool acc) {
  int64_t m = 0;
  for (; M - m >= MR && M - m != 7 && M - m != 8; m += MR)
    micro<MR, NV>(K, a + m * sam, sam, sak, b, ldb, c + m * ldc, ldc, acc);
  if (M - m >= 7) {  // 4 + 3 or 4 + 4 rows rather than 6 + 1 or 6 + 2 (a 1- or 2-row pass is mostly loads)
    micro<4, NV>(K, a + m * sam, sam, sak, b, ldb, c + m * ldc, ldc, acc);
    m += 4;
  }
  const float* am = a + m * sam;
  float* cm = c + m * ldc;
  switch (M - m) {
    case 1: micro<1, NV>(K, am, sam, sak, b, ldb, cm, ldc, acc); break;
    case 2: micro<2, NV>(K, am, sam, sak, b, ldb, cm, ldc, acc); break;
    case 3: micro<3, NV>(K, am, sam, sak, b, ldb, cm, ldc, acc); break;
    case 4: micro<4, NV>(K, am, sam, sak, b, ldb, cm, ldc, acc); break;
    case 5: micro<5, NV>(K, am, sam, sak, b, ldb, cm, ldc, acc); break;
    default: break;
  }
}

// c[M x N] (+)= a[M x K] b[K x N], N a multiple of 8; a as in micro.
FT_AVX2 void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t sam, int64_t sak, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool acc) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) gemm_panel<2>(M, K, a, sam, sak, b + n, ldb, c + n, ldc, acc);
  if (n < N) gemm_panel<1>(M, K, a, sam, sak, b + n, ldb, c + n, ldc, acc);
}

inline int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

struct Shape {
  const int64_t* cu;
  int64_t N, Hq, Hkv, D, G;
  bool causal;
  float scale;
};

// Keys [j0, j0 + nk) of head h of the document starting at row s, transposed for a tile:
// kt [D x ld] (for S = Q K^T, and dP = dO V^T with v); columns nk .. ld-1 zero.
FT_AVX2 void pack_keys_t(const float* src, const Shape& sh, int64_t s, int64_t h, int64_t j0, int64_t nk, int64_t ld,
                         float* kt) {
  const int64_t D = sh.D, stride = sh.Hkv * D;
  for (int64_t j = 0; j < nk; ++j) {
    const float* x = src + (s + j0 + j) * stride + h * D;
    for (int64_t d = 0; d < D; ++d) kt[d * ld + j] = x[d];
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = nk; j < ld; ++j) kt[d * ld + j] = 0.0f;
}

// Rows of query block [i0, i0 + nq) for the G heads of kv head h, times mul: dst [G*BQ x D], row
// g * BQ + t = position i0 + t of head h * G + g; rows t >= nq zero.
FT_AVX2 void pack_rows(const float* src, const Shape& sh, int64_t s, int64_t h, int64_t i0, int64_t nq, float mul,
                       float* dst) {
  const int64_t D = sh.D, ld = sh.Hq * D;
  const __m256 mv = _mm256_set1_ps(mul);
  for (int64_t g = 0; g < sh.G; ++g) {
    for (int64_t t = 0; t < BQ; ++t) {
      float* o = dst + (g * BQ + t) * D;
      if (t >= nq) {
        std::memset(o, 0, D * sizeof(float));
        continue;
      }
      const float* x = src + (s + i0 + t) * ld + (h * sh.G + g) * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(x + d), mv));
    }
  }
}

// Number of keys of tile (i0 + t, j0 ..) row t may see, of nk.
inline int64_t visible(const Shape& sh, int64_t i0, int64_t t, int64_t j0, int64_t nk) {
  return sh.causal ? std::max<int64_t>(0, std::min(nk, i0 + t - j0 + 1)) : nk;
}

// ---- forward -------------------------------------------------------------------------------

struct FwdScratch {
  std::vector<float> q, s, o, m, l;
  explicit FwdScratch(const Shape& sh)
      : q(sh.G * BQ * sh.D), s(sh.G * BQ * BK), o(sh.G * BQ * sh.D), m(sh.G * BQ), l(sh.G * BQ) {}
};

// Query block [i0, i0 + 64) of the document at rows [s, s + L), kv head h; kt: the document's key
// blocks of head h transposed ([D x BK] each, packed once per call by ft_flash_attn_fwd).
FT_AVX2 void fwd_tile(const float* q, const float* kt, const float* v, float* out, float* lse, const Shape& sh,
                      int64_t s, int64_t L, int64_t h, int64_t i0, FwdScratch& w) {
  const int64_t D = sh.D, R = sh.G * BQ, nq = std::min(BQ, L - i0);
  const float ninf = -std::numeric_limits<float>::infinity();
  pack_rows(q, sh, s, h, i0, nq, sh.scale, w.q.data());
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  std::fill(w.m.begin(), w.m.end(), ninf);
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  const int64_t kv_end = sh.causal ? i0 + nq : L;
  for (int64_t j0 = 0; j0 < kv_end; j0 += BK) {
    const int64_t nk = std::min(BK, kv_end - j0), nkp = round8(nk);
    float* S = w.s.data();
    gemm(R, nkp, D, w.q.data(), D, 1, kt + (j0 / BK) * D * BK, BK, S, nkp, false);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = r % BQ;
      float* p = S + r * nkp;
      const int64_t lim = t < nq ? visible(sh, i0, t, j0, nk) : 0;
      if (lim == 0) {  // a padded row, or (never for a query's own block) a row seeing none of these keys
        std::memset(p, 0, nkp * sizeof(float));
        continue;
      }
      __m256 mv8 = _mm256_set1_ps(ninf);
      int64_t j = 0;
      for (; j + 8 <= lim; j += 8) mv8 = _mm256_max_ps(_mm256_loadu_ps(p + j), mv8);  // a NaN score stays in p
      float mx = ninf;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv8);
      for (int e = 0; e < 8; ++e) mx = std::max(mx, lanes[e]);
      for (; j < lim; ++j) mx = std::max(mx, p[j]);
      const float m_old = w.m[r], m_new = std::max(m_old, mx);
      const float alpha = m_old == ninf ? 0.0f : std::exp(m_old - m_new);
      w.m[r] = m_new;
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 acc = _mm256_setzero_ps();
      for (j = 0; j + 8 <= lim; j += 8) {
        const __m256 e = ftlib_cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
        _mm256_storeu_ps(p + j, e);
        acc = _mm256_add_ps(acc, e);
      }
      float sum = hsum(acc);
      for (; j < lim; ++j) {
        p[j] = std::exp(p[j] - m_new);
        sum += p[j];
      }
      for (; j < nkp; ++j) p[j] = 0.0f;
      w.l[r] = w.l[r] * alpha + sum;
      if (alpha != 1.0f) {
        float* o = w.o.data() + r * D;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), av));
      }
    }
    gemm(R, D, nk, S, nkp, 1, v + (s + j0) * sh.Hkv * D + h * D, sh.Hkv * D, w.o.data(), D, true);  // O += P V
  }
  for (int64_t g = 0; g < sh.G; ++g) {
    for (int64_t t = 0; t < nq; ++t) {
      const int64_t r = g * BQ + t, hq = h * sh.G + g, row = s + i0 + t;
      const float l = w.l[r];
      const __m256 inv = _mm256_set1_ps(1.0f / l);
      const float* o = w.o.data() + r * D;
      float* dst = out + row * sh.Hq * D + hq * D;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
      lse[hq * sh.N + row] = w.m[r] + std::log(l);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------

struct BwdScratch {
  std::vector<float> q, dO, dq, lse, delta, kt, vt, p, dp, dk, dv;
  BwdScratch(const Shape& sh, int64_t Lp)
      : q(sh.G * Lp * sh.D), dO(sh.G * Lp * sh.D), dq(sh.G * Lp * sh.D), lse(sh.G * Lp), delta(sh.G * Lp),
        kt(sh.D * BK), vt(sh.D * BK), p(sh.G * BQ * BK), dp(sh.G * BQ * BK), dk(BK * sh.D),
        dv(BK * sh.D) {}
};

// One document's gradients for kv head h (and its G query heads) from key blocks [kb0, kb1): dK, dV
// of those keys, and dQ of every query, written to dq (scaled) when part is null, else left
// unscaled in part ([blocks][G * BQ][D], the block-major layout of the scratch) for a later sum.
FT_AVX2 void bwd_task(const float* dout, const float* q, const float* k, const float* v, const float* out,
                      const float* lse, float* dq, float* dk, float* dv, const Shape& sh, int64_t s, int64_t L,
                      int64_t h, int64_t kb0, int64_t kb1, float* part, BwdScratch& w) {
  const int64_t D = sh.D, R = sh.G * BQ, nb = (L + BQ - 1) / BQ;
  const int64_t tile = R * D;  // floats of one query block in q/dO/dq scratch
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * BQ, nq = std::min(BQ, L - i0);
    pack_rows(q, sh, s, h, i0, nq, sh.scale, w.q.data() + b * tile);
    pack_rows(dout, sh, s, h, i0, nq, 1.0f, w.dO.data() + b * tile);
    for (int64_t g = 0; g < sh.G; ++g) {
      const int64_t hq = h * sh.G + g;
      for (int64_t t = 0; t < BQ; ++t) {
        const int64_t r = b * R + g * BQ + t;
        if (t >= nq) {
          w.lse[r] = 0.0f;
          w.delta[r] = 0.0f;
          continue;
        }
        const int64_t row = s + i0 + t;
        const float* x = dout + row * sh.Hq * D + hq * D;
        const float* o = out + row * sh.Hq * D + hq * D;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(o + d), a);
        w.delta[r] = hsum(a);
        w.lse[r] = lse[hq * sh.N + row];
      }
    }
  }
  std::fill(w.dq.begin(), w.dq.begin() + nb * tile, 0.0f);
  float* P = w.p.data();
  float* dP = w.dp.data();
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int64_t j0 = kb * BK, nk = std::min(BK, L - j0), nkp = round8(nk);
    pack_keys_t(k, sh, s, h, j0, nk, nkp, w.kt.data());
    pack_keys_t(v, sh, s, h, j0, nk, nkp, w.vt.data());
    const float* krows = k + (s + j0) * sh.Hkv * D + h * D;  // K's rows in place for dQ
    std::fill(w.dk.begin(), w.dk.end(), 0.0f);
    std::fill(w.dv.begin(), w.dv.end(), 0.0f);
    for (int64_t b = sh.causal ? kb : 0; b < nb; ++b) {
      const int64_t i0 = b * BQ, nq = std::min(BQ, L - i0);
      const float* qb = w.q.data() + b * tile;
      const float* dob = w.dO.data() + b * tile;
      gemm(R, nkp, D, qb, D, 1, w.kt.data(), nkp, P, nkp, false);   // S
      gemm(R, nkp, D, dob, D, 1, w.vt.data(), nkp, dP, nkp, false);  // dP = dO V^T
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = r % BQ;
        float* p = P + r * nkp;
        float* dp = dP + r * nkp;
        const int64_t lim = t < nq ? visible(sh, i0, t, j0, nk) : 0;
        const __m256 lv = _mm256_set1_ps(w.lse[b * R + r]), dl = _mm256_set1_ps(w.delta[b * R + r]);
        int64_t j = 0;
        for (; j + 8 <= lim; j += 8) {
          const __m256 e = ftlib_cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), lv));
          _mm256_storeu_ps(p + j, e);
          _mm256_storeu_ps(dp + j, _mm256_mul_ps(e, _mm256_sub_ps(_mm256_loadu_ps(dp + j), dl)));  // dS
        }
        for (; j < lim; ++j) {
          p[j] = std::exp(p[j] - w.lse[b * R + r]);
          dp[j] = p[j] * (dp[j] - w.delta[b * R + r]);
        }
        for (; j < nkp; ++j) p[j] = dp[j] = 0.0f;
      }
      gemm(nkp, D, R, P, 1, nkp, dob, D, w.dv.data(), D, true);                 // dV += P^T dO
      gemm(nkp, D, R, dP, 1, nkp, qb, D, w.dk.data(), D, true);                 // dK += dS^T (s Q)
      gemm(R, D, nk, dP, nkp, 1, krows, sh.Hkv * D, w.dq.data() + b * tile, D, true);  // dQ/s += dS K
    }
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t off = (s + j0 + j) * sh.Hkv * D + h * D;
      std::memcpy(dk + off, w.dk.data() + j * D, D * sizeof(float));
      std::memcpy(dv + off, w.dv.data() + j * D, D * sizeof(float));
    }
  }
  if (part != nullptr) {
    std::memcpy(part, w.dq.data(), nb * tile * sizeof(float));
    return;
  }
  const __m256 sv = _mm256_set1_ps(sh.scale);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * BQ, nq = std::min(BQ, L - i0);
    for (int64_t g = 0; g < sh.G; ++g)
      for (int64_t t = 0; t < nq; ++t) {
        const float* src = w.dq.data() + b * tile + (g * BQ + t) * D;
        float* dst = dq + (s + i0 + t) * sh.Hq * D + (h * sh.G + g) * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), sv));
      }
  }
}

// Run tasks [0, n) (cost(i), largest first) on `threads` threads pulling from one counter.
void run_tasks(int64_t n, int threads, const std::function<int64_t(int64_t)>& cost,
               const std::function<void(int64_t, int64_t)>& run /* (task, worker) */,
               const std::function<void(int64_t)>& begin /* (worker): scratch */) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  ftlib_cpu::parallel_for(workers, [&](int64_t wkr) {
    begin(wkr);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) run(order[i], wkr);
  });
}

// dq rows of one split (document, kv head): scale * the sum of its parts' buffers, in part order.
template <typename SplitT, typename TaskT>
FT_AVX2 void sum_parts(const SplitT& sp, const std::vector<TaskT>& tasks, const float* parts, float* dq,
                       const Shape& sh, int64_t tile) {
  const int64_t s = sh.cu[sp.doc], L = sh.cu[sp.doc + 1] - s, nb = (L + BQ - 1) / BQ, D = sh.D;
  const __m256 sv = _mm256_set1_ps(sh.scale);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * BQ, nq = std::min(BQ, L - i0);
    for (int64_t g = 0; g < sh.G; ++g)
      for (int64_t t = 0; t < nq; ++t) {
        const int64_t off = b * tile + (g * BQ + t) * D;
        float* dst = dq + (s + i0 + t) * sh.Hq * D + (sp.h * sh.G + g) * D;
        for (int64_t d = 0; d < D; d += 8) {
          __m256 acc = _mm256_loadu_ps(parts + tasks[sp.first].part + off + d);
          for (int64_t p = 1; p < sp.count; ++p)
            acc = _mm256_add_ps(acc, _mm256_loadu_ps(parts + tasks[sp.first + p].part + off + d));
          _mm256_storeu_ps(dst + d, _mm256_mul_ps(acc, sv));
        }
      }
  }
}

Shape make_shape(const int64_t* cu, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int causal,
                 float scale) {
  return Shape{cu, N, Hq, Hkv, D, Hq / Hkv, causal != 0, scale};
}

}  // namespace

extern "C" {

// out [N, Hq, D], lse [Hq, N] from q [N, Hq, D], k, v [N, Hkv, D]; cu [docs + 1] rising from 0 to N;
// D a multiple of 8, Hq a multiple of Hkv.
void ft_flash_attn_fwd(const float* q, const float* k, const float* v, float* out, float* lse, const int64_t* cu,
                       int64_t docs, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int causal, float scale,
                       int threads) {
  const Shape sh = make_shape(cu, N, Hq, Hkv, D, causal, scale);
  struct Task {
    int64_t doc, h, i0, cost;
  };
  std::vector<Task> tasks;
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t L = cu[d + 1] - cu[d];
    for (int64_t i0 = 0; i0 < L; i0 += BQ)
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({d, h, i0, sh.causal ? i0 + BQ : L});
  }
  // Every key block of every document and kv head transposed once: kt [Hkv][blocks][D x BK].
  std::vector<int64_t> first(docs + 1, 0);  // first block of each document
  for (int64_t d = 0; d < docs; ++d) first[d + 1] = first[d] + (cu[d + 1] - cu[d] + BK - 1) / BK;
  const int64_t blocks = first[docs];
  std::vector<float> kt(static_cast<size_t>(Hkv * blocks * D * BK));
  std::vector<int64_t> block_doc(blocks);
  for (int64_t d = 0; d < docs; ++d)
    for (int64_t b = first[d]; b < first[d + 1]; ++b) block_doc[b] = d;
  ftlib_cpu::parallel(Hkv * blocks, threads, 1, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      const int64_t h = i / blocks, b = i % blocks, d = block_doc[b], s = cu[d];
      const int64_t j0 = (b - first[d]) * BK, nk = std::min(BK, cu[d + 1] - s - j0);
      pack_keys_t(k, sh, s, h, j0, nk, BK, kt.data() + i * D * BK);
    }
  });
  std::vector<FwdScratch*> scratch(std::max(1, threads), nullptr);
  run_tasks(
      static_cast<int64_t>(tasks.size()), threads, [&](int64_t i) { return tasks[i].cost; },
      [&](int64_t i, int64_t wkr) {
        const Task& tk = tasks[i];
        const int64_t s = cu[tk.doc];
        const float* ktd = kt.data() + (tk.h * blocks + first[tk.doc]) * D * BK;
        fwd_tile(q, ktd, v, out, lse, sh, s, cu[tk.doc + 1] - s, tk.h, tk.i0, *scratch[wkr]);
      },
      [&](int64_t wkr) { scratch[wkr] = new FwdScratch(sh); });
  for (auto* p : scratch) delete p;
}

// dq [N, Hq, D], dk, dv [N, Hkv, D] from dout, q, out [N, Hq, D], k, v, and the forward's lse.
// A (document, kv head) holding more than a thread's share of the tiles (one long document, fewer
// kv heads than threads) is cut into ranges of key blocks with about a share's tiles each (at most
// MAX_PARTS): each part owns dK, dV of its keys and sums dQ into its own buffer; the parts' dQ are
// added in part order after all tasks. For given inputs and thread count the result is fixed.
void ft_flash_attn_bwd(const float* dout, const float* q, const float* k, const float* v, const float* out,
                       const float* lse, float* dq, float* dk, float* dv, const int64_t* cu, int64_t docs, int64_t N,
                       int64_t Hq, int64_t Hkv, int64_t D, int causal, float scale, int threads) {
  constexpr int64_t MAX_PARTS = 8;
  const Shape sh = make_shape(cu, N, Hq, Hkv, D, causal, scale);
  const int64_t tile = sh.G * BQ * D;
  int64_t lmax = 0;
  struct Task {
    int64_t doc, h, kb0, kb1, cost, part;  // part: index into parts, or -1 (dq written directly)
  };
  struct Split {
    int64_t doc, h, first, count;  // tasks [first, first + count) are its parts, in order
  };
  std::vector<Task> tasks;
  std::vector<Split> splits;
  int64_t part_floats = 0, all_tiles = 0;
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t nb = (cu[d + 1] - cu[d] + BQ - 1) / BQ;
    all_tiles += Hkv * (sh.causal ? nb * (nb + 1) / 2 : nb * nb);
  }
  const int64_t share = std::max<int64_t>(1, all_tiles / std::max(1, threads));
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t L = cu[d + 1] - cu[d], nb = (L + BQ - 1) / BQ;
    lmax = std::max(lmax, L);
    if (L == 0) continue;
    auto tiles_of = [&](int64_t kb) { return sh.causal ? nb - kb : nb; };  // query tiles key block kb meets
    const int64_t total = sh.causal ? nb * (nb + 1) / 2 : nb * nb;
    const int64_t parts = total > share ? std::min({MAX_PARTS, nb, (total + share - 1) / share}) : 1;
    for (int64_t h = 0; h < Hkv; ++h) {
      if (parts == 1) {
        tasks.push_back({d, h, 0, nb, total, -1});
        continue;
      }
      splits.push_back({d, h, static_cast<int64_t>(tasks.size()), 0});
      int64_t kb = 0, acc = 0;
      for (int64_t p = 0; p < parts && kb < nb; ++p) {
        const int64_t target = total * (p + 1) / parts;
        const int64_t start = kb;
        int64_t cost = 0;
        while (kb < nb && (acc + tiles_of(kb) <= target || kb == start || p == parts - 1)) {
          acc += tiles_of(kb);
          cost += tiles_of(kb);
          ++kb;
        }
        tasks.push_back({d, h, start, kb, cost, part_floats});
        part_floats += nb * tile;
        ++splits.back().count;
      }
    }
  }
  std::vector<float> parts(static_cast<size_t>(part_floats));
  const int64_t lp = (lmax + BQ - 1) / BQ * BQ;
  std::vector<BwdScratch*> scratch(std::max(1, threads), nullptr);
  run_tasks(
      static_cast<int64_t>(tasks.size()), threads, [&](int64_t i) { return tasks[i].cost; },
      [&](int64_t i, int64_t wkr) {
        const Task& tk = tasks[i];
        const int64_t s = cu[tk.doc];
        bwd_task(dout, q, k, v, out, lse, dq, dk, dv, sh, s, cu[tk.doc + 1] - s, tk.h, tk.kb0, tk.kb1,
                 tk.part < 0 ? nullptr : parts.data() + tk.part, *scratch[wkr]);
      },
      [&](int64_t wkr) { scratch[wkr] = new BwdScratch(sh, lp); });
  for (auto* p : scratch) delete p;
  // dq of the split (document, kv head) pairs: scale * (part 0 + part 1 + ...), rows in parallel
  ftlib_cpu::parallel(static_cast<int64_t>(splits.size()), threads, 1, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) sum_parts(splits[i], tasks, parts.data(), dq, sh, tile);
  });
}

}  // extern "C"
