/* y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]) for the few rows of a decode or
 * verify step on CPU, float32, AVX-512 (or AVX2 + FMA where there is none).
 *
 * Why by hand: at 1-16 rows a projection only has to stream its weight once,
 * but MKL's sgemm and oneDNN (packed or not, specialised for the batch size
 * or not) lose 1.4-1.9x between 1 and 5 rows on the default model's shapes,
 * which is what made a K = 4 verify step cost 1.4x a decode step. Here every
 * weight row is read once for all M rows. A tile reads NB weight rows side by
 * side; while it runs, it prefetches the next tile's NB rows (one contiguous
 * block) in address order, NB cache lines per step, so the next tile finds its
 * rows there. The hardware prefetcher alone leaves the loads latency-bound once
 * there is compute between them. All of SmolLM2's projections, 2 threads,
 * 1 / 5 / 8 rows: 17.3 / 18.8 / 23.3 ms this way (into L2, an Intel Xeon);
 * 20.3 / 23.6 / 27.6 prefetching 16 KiB ahead in each row stream instead;
 * 5 rows 27.4 with no software prefetch; oneDNN packed 25.3 / 30.2 / 33.6.
 * 12 / 16 rows in one pass: 27.7 / 35.9 ms, packed 38.5 / 41.3.
 * The hint is non-temporal: a weight is read once a step, and the whole model
 * (540 MB) passes through the caches every step, so its lines should not push
 * out what stays (activations, the KV cache's recent blocks). On the AMD EPYC
 * (Zen 5) that took a whole decode step of SmolLM2-135M at batch 1 from
 * 16.6-17.2 to 13.1-13.5 ms, 5 rows from 19.0-19.5 to 15.3-15.9, batch 4 with
 * 2 rows each from 24.1-24.7 to 20.6-21.3, against prefetching into L2 (T0,
 * into L1, was in between); asking for the next tile in the first half or
 * quarter of this one's steps was slower (16-22 against 10-14 ms for all
 * projections at 3-6 rows). Prefetches past the weight's end are harmless: a
 * prefetch never faults.
 * On Intel the same hint is the wrong one: a non-temporal prefetch there fills
 * L1 alone, and a tile's next rows (up to 24 KiB) are pushed out of it before
 * they are read. On an Intel Xeon with AVX-512 (2 threads, 25 GB/s from memory,
 * all projections and the lm_head, 1 / 5 / 12 rows) NTA took 56 / 54 / 69 ms,
 * into L2 (T1) 22 / 21 / 27, at the weight's streaming floor (22 ms); a decode
 * step of SmolLM2-135M at batch 1 (bench/decode.py) took 71 against 33 ms.
 * small_rows.py builds it with PREFETCH_HINT set by the CPU's vendor: NTA on
 * AMD, T1 elsewhere.
 *
 * Every y[m, n] is one vector accumulator (16 lanes, or 8 with AVX2) over k in
 * order, the tail masked, then one horizontal sum and the bias: its rounding
 * does not depend on M, on which rows share the call, or on the thread count
 * (batch-invariant rows).
 *
 * AVX2 has 16 vector registers instead of 32, so its tiles are narrower (at
 * most 12 accumulators) and a pass takes at most 12 rows. On an AMD EPYC
 * without AVX-512, all projections, 1 / 3 / 5 / 8 / 12 rows: 28.7 / 29.8 /
 * 30.7 / 34.2 / 49.2 ms; oneDNN packed 33.8 / 51.7 / 45.3 / 48.4 / 56.1;
 * MKL's F.linear 41.9 / 116.9 / 101.9 / 106.3 / 121.3.
 *
 * Built and loaded by small_rows.py (gcc -O3 -march=native -fopenmp); the
 * OpenMP runtime is the one torch already loaded (same soname).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
typedef __mmask16 tail_mask;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VLOAD_TAIL(mask, p) _mm512_maskz_loadu_ps(mask, p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
#define TAIL_MASK(r) ((__mmask16)((1u << (r)) - 1))
#define MAX_TILE_ROWS 16
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
typedef __m256i tail_mask;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VLOAD_TAIL(mask, p) _mm256_maskload_ps(p, mask)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSUM(v) hsum8(v)
#define TAIL_MASK(r) _mm256_cmpgt_epi32(_mm256_set1_epi32(r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define MAX_TILE_ROWS 12
/* Lanes summed in one fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the two. */
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#error "small_rows_gemm needs AVX-512F, or AVX2 and FMA"
#endif

#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_NTA
#endif

/* Weight rows per block of a blocked call: a multiple of every tile width (4, 3,
 * 2); 48 rows of K = 1536 (288 KiB) and the next block stay in L2 while every
 * pass reads them. */
#define CHUNK 48

/* One tile: rows m0..m0+MB-1 of x against weight rows n..n+NB-1, prefetching weight
 * rows n+AHEAD.. (NB of them; none where AHEAD is 0) with hint HINT. */
#define TILE_FN(NAME, MB, NB, AHEAD, HINT)                                              \
  static void NAME(const float *x, const float *w, const float *b, float *y,             \
                   int64_t N, int64_t K, int64_t n) {                                    \
    vec acc[MB][NB];                                                                     \
    for (int m = 0; m < MB; m++)                                                         \
      for (int j = 0; j < NB; j++) acc[m][j] = VZERO();                                  \
    /* The rows to prefetch, as an integer address: they may lie past the end. */        \
    const uintptr_t ahead = (uintptr_t)w + sizeof(float) * (uintptr_t)((n + AHEAD) * K); \
    int64_t k = 0;                                                                       \
    for (; k + LANES <= K; k += LANES) {                                                 \
      vec wv[NB];                                                                        \
      for (int j = 0; j < NB; j++) wv[j] = VLOAD(w + (n + j) * K + k);                   \
      /* NB cache lines of the next tile every 16 columns: all of it by the end. */      \
      if (AHEAD && k % 16 == 0)                                                          \
        for (int j = 0; j < NB; j++)                                                     \
          _mm_prefetch((const char *)(ahead + sizeof(float) * (NB * k + 16 * j)), HINT); \
      for (int m = 0; m < MB; m++) {                                                     \
        vec xv = VLOAD(x + m * K + k);                                                   \
        for (int j = 0; j < NB; j++) acc[m][j] = VFMA(xv, wv[j], acc[m][j]);             \
      }                                                                                  \
    }                                                                                    \
    if (k < K) {                                                                         \
      const tail_mask tail = TAIL_MASK((int)(K - k));                                    \
      vec wv[NB];                                                                        \
      for (int j = 0; j < NB; j++) wv[j] = VLOAD_TAIL(tail, w + (n + j) * K + k);        \
      for (int m = 0; m < MB; m++) {                                                     \
        vec xv = VLOAD_TAIL(tail, x + m * K + k);                                        \
        for (int j = 0; j < NB; j++) acc[m][j] = VFMA(xv, wv[j], acc[m][j]);             \
      }                                                                                  \
    }                                                                                    \
    for (int m = 0; m < MB; m++)                                                         \
      for (int j = 0; j < NB; j++)                                                       \
        y[m * N + n + j] = VSUM(acc[m][j]) + (b ? b[n + j] : 0.0f);                      \
  }
/* A single pass asks for the next tile's rows (with PREFETCH_HINT). */
#define TILE(MB, NB) TILE_FN(tile_##MB##_##NB, MB, NB, NB, PREFETCH_HINT)
/* Blocked passes: the first over a block asks for the next block into L2 (CHUNK
 * rows on), where every pass over it finds it; the others ask for nothing. */
#define BLOCK_TILE(MB, NB)                                                              \
  TILE_FN(first_##MB##_##NB, MB, NB, CHUNK, _MM_HINT_T1)                                \
  TILE_FN(block_##MB##_##NB, MB, NB, 0, _MM_HINT_T1)

typedef void (*tile_fn)(const float *, const float *, const float *, float *, int64_t, int64_t,
                        int64_t);

#if LANES == 16
/* Up to 5 rows: 4 weight rows a tile (20 accumulators of 32 registers);
 * 6-12 rows: 2 weight rows; 13-16 rows: 1. Single weight rows finish an N
 * not divisible by the tile's width. */
TILE(1, 4) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(5, 4)
TILE(6, 2) TILE(7, 2) TILE(8, 2) TILE(9, 2) TILE(10, 2) TILE(11, 2) TILE(12, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1) TILE(7, 1) TILE(8, 1)
TILE(9, 1) TILE(10, 1) TILE(11, 1) TILE(12, 1) TILE(13, 1) TILE(14, 1) TILE(15, 1) TILE(16, 1)

static const tile_fn WIDE[MAX_TILE_ROWS + 1] = {
    0,         tile_1_4,  tile_2_4,  tile_3_4,  tile_4_4,  tile_5_4,  tile_6_2,  tile_7_2, tile_8_2,
    tile_9_2,  tile_10_2, tile_11_2, tile_12_2, tile_13_1, tile_14_1, tile_15_1, tile_16_1};
static const int WIDTH[MAX_TILE_ROWS + 1] = {0, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1};
static const tile_fn SINGLE[MAX_TILE_ROWS + 1] = {
    0,         tile_1_1,  tile_2_1,  tile_3_1,  tile_4_1,  tile_5_1,  tile_6_1,  tile_7_1, tile_8_1,
    tile_9_1,  tile_10_1, tile_11_1, tile_12_1, tile_13_1, tile_14_1, tile_15_1, tile_16_1};
/* Blocked passes: 8 rows against 3 weight rows (24 accumulators). */
BLOCK_TILE(8, 3)
#define BLOCK_ROWS 8
#define BLOCK_WIDTH 3
#define BLOCK block_8_3
#define FIRST first_8_3
#else
/* 16 registers: at most 12 accumulators beside the tile's weight vectors. 1-2 rows:
 * 4 weight rows a tile; 3 rows: 3; 4-5 rows: 2; 6-12 rows: 1. */
TILE(1, 4) TILE(2, 4) TILE(3, 3) TILE(4, 2) TILE(5, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1) TILE(7, 1) TILE(8, 1)
TILE(9, 1) TILE(10, 1) TILE(11, 1) TILE(12, 1)

static const tile_fn WIDE[MAX_TILE_ROWS + 1] = {
    0,        tile_1_4, tile_2_4, tile_3_3, tile_4_2,  tile_5_2,  tile_6_1,
    tile_7_1, tile_8_1, tile_9_1, tile_10_1, tile_11_1, tile_12_1};
static const int WIDTH[MAX_TILE_ROWS + 1] = {0, 4, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1};
static const tile_fn SINGLE[MAX_TILE_ROWS + 1] = {
    0,        tile_1_1, tile_2_1, tile_3_1, tile_4_1,  tile_5_1,  tile_6_1,
    tile_7_1, tile_8_1, tile_9_1, tile_10_1, tile_11_1, tile_12_1};
/* Blocked passes: 5 rows against 2 weight rows (10 accumulators). */
BLOCK_TILE(5, 2)
#define BLOCK_ROWS 5
#define BLOCK_WIDTH 2
#define BLOCK block_5_2
#define FIRST first_5_2
#endif

/* y = x w^T (+ b). Up to one_pass_max rows: passes of at most MAX_TILE_ROWS, each
 * streaming the weight once, its rows split evenly between threads in whole tiles.
 * More rows (prefill chunks, verify steps of big batches): each thread's weight
 * rows in blocks of CHUNK, every pass of BLOCK_ROWS rows run over a block while
 * it is in L2. Either way every y[m, n] is the same accumulation over k, so a
 * row's bits do not depend on M or on the path. b may be NULL. */
void small_rows_gemm(const float *x, const float *w, const float *b, float *y, int64_t M,
                     int64_t N, int64_t K, int num_threads, int64_t one_pass_max) {
  if (M > one_pass_max) {
#pragma omp parallel num_threads(num_threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t blocks = N / CHUNK; /* whole blocks; the last thread also takes the rest */
      const int64_t lo = blocks * t / nt * CHUNK;
      const int64_t hi = t == nt - 1 ? N : blocks * (t + 1) / nt * CHUNK;
      for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < hi ? c0 + CHUNK : hi;
        for (int64_t m0 = 0; m0 < M; m0 += BLOCK_ROWS) {
          const int64_t mb = M - m0 < BLOCK_ROWS ? M - m0 : BLOCK_ROWS;
          const tile_fn wide = mb < BLOCK_ROWS ? WIDE[mb] : m0 == 0 ? FIRST : BLOCK;
          const int64_t width = mb == BLOCK_ROWS ? BLOCK_WIDTH : WIDTH[mb];
          const float *xm = x + m0 * K;
          float *ym = y + m0 * N;
          int64_t n = c0;
          for (; n + width <= c1; n += width) wide(xm, w, b, ym, N, K, n);
          for (; n < c1; n++) SINGLE[mb](xm, w, b, ym, N, K, n);
        }
      }
    }
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t m0 = 0; m0 < M; m0 += MAX_TILE_ROWS) {
      const int64_t mb = M - m0 < MAX_TILE_ROWS ? M - m0 : MAX_TILE_ROWS;
      const int64_t width = WIDTH[mb], tiles = N / width;
      const float *xm = x + m0 * K;
      float *ym = y + m0 * N;
      for (int64_t i = tiles * t / nt; i < tiles * (t + 1) / nt; i++)
        WIDE[mb](xm, w, b, ym, N, K, i * width);
      if (t == nt - 1)
        for (int64_t n = tiles * width; n < N; n++) SINGLE[mb](xm, w, b, ym, N, K, n);
    }
  }
}
