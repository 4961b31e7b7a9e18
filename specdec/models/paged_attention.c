/* Attention of the few query rows of a decode or verify step on CPU, float32,
 * straight from the paged KV cache.
 *
 * Why by hand: torch's path gathers every sequence's keys and values out of
 * the cache into [B, L, Hkv, D] copies each layer, pads the queries to
 * [B, Qmax] and runs the CPU flash kernel, which is tuned for long queries.
 * At batch 11 with one query row each that was 45 of a 68 ms step, and one
 * sequence verifying 2 rows (Qmax 2) made it 64 ms of 91. Here each (sequence,
 * KV head) reads its keys and values once, through its block table, for all of
 * its query rows and all query heads sharing the KV head (GQA), with no
 * padding: the cost follows the rows each sequence really has.
 *
 * Row r = j * group + g is query token j of the sequence with query head
 * h * group + g; it sees keys 0 .. first + j, first = len - nq being the
 * position of the sequence's first query token. Every score is one 8-lane
 * accumulator over the head dimension in order, then a fixed pairwise sum;
 * softmax and the weighted sum of values run over the row's keys in position
 * order. A row's rounding therefore depends only on its own query, its
 * position and the cache: not on the batch, on how many rows its sequence
 * verifies, or on the thread count (batch-invariant rows, which keeps a
 * speculative step's greedy tokens identical to plain decoding's).
 *
 * Built and loaded by paged_attention.py (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

/* The fixed pairwise sum of a vector's lanes. */
static inline float lanes_sum(__m256 v)
{
    float a[LANES];
    _mm256_storeu_ps(a, v);
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* exp(x) for x <= 0 (a score minus its row's maximum), lane by lane: 2^n e^r with
 * |r| <= ln 2 / 2 and Cephes' polynomial for e^r (relative error about 1e-7). */
static inline __m256 exp_nonpositive(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* out[t, h, :] for every query token t of the sequences listed in seqs.
 * q, out: [T, heads, dim]; k_cache, v_cache: [slots, kv_heads, dim];
 * block_tables: [B, table_stride]; query_start: [B + 1]; seq_lens: [B] (with the
 * step's tokens); seqs: [num_seqs] indices into the batch; max_rows: the most
 * query rows (tokens x group) of a listed sequence; max_len: the longest. */
void paged_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                     const int64_t *block_tables, int64_t table_stride,
                     const int64_t *query_start, const int64_t *seq_lens,
                     const int64_t *seqs, int64_t num_seqs,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                     int64_t max_rows, int64_t max_len, float scale, int threads)
{
    const int64_t group = heads / kv_heads;
    const int64_t stride = (max_len + LANES - 1) / LANES * LANES; /* a row of scores */
#pragma omp parallel num_threads(threads)
    {
        float *scores = aligned_alloc(32, sizeof(float) * max_rows * stride); /* [rows, stride] */
        float *acc = aligned_alloc(32, sizeof(float) * max_rows * dim);       /* [rows, dim] */
        float *inv = malloc(sizeof(float) * max_rows);
        const float **qrows = malloc(sizeof(float *) * max_rows);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t i = 0; i < num_seqs; i++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t b = seqs[i];
                const int64_t t0 = query_start[b], nq = query_start[b + 1] - t0;
                const int64_t len = seq_lens[b], first = len - nq, rows = nq * group;
                const int64_t *table = block_tables + b * table_stride;
                for (int64_t r = 0; r < rows; r++)
                    qrows[r] = q + ((t0 + r / group) * heads + h * group + r % group) * dim;
                /* Scores: for each key, the rows that see it, four at a time (four
                 * independent FMA chains; the key's chunk loaded once for them). */
                for (int64_t l = 0; l < len; l++) {
                    const int64_t slot = table[l / block_size] * block_size + l % block_size;
                    const float *key = k_cache + (slot * kv_heads + h) * dim;
                    int64_t r = (l > first ? l - first : 0) * group;
                    for (; r + 4 <= rows; r += 4) {
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                        for (int64_t d = 0; d < dim; d += LANES) {
                            const __m256 k = _mm256_loadu_ps(key + d);
                            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r] + d), k, a0);
                            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r + 1] + d), k, a1);
                            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r + 2] + d), k, a2);
                            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r + 3] + d), k, a3);
                        }
                        scores[r * stride + l] = lanes_sum(a0) * scale;
                        scores[(r + 1) * stride + l] = lanes_sum(a1) * scale;
                        scores[(r + 2) * stride + l] = lanes_sum(a2) * scale;
                        scores[(r + 3) * stride + l] = lanes_sum(a3) * scale;
                    }
                    for (; r < rows; r++) {
                        __m256 a0 = _mm256_setzero_ps();
                        for (int64_t d = 0; d < dim; d += LANES)
                            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qrows[r] + d),
                                                 _mm256_loadu_ps(key + d), a0);
                        scores[r * stride + l] = lanes_sum(a0) * scale;
                    }
                }
                /* Softmax of each row over its n keys, in LANES-wide chunks; the
                 * chunk past n is padded (exp(0), then zeroed), so every lane's
                 * value and the sum's order depend on n alone. */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t n = first + r / group + 1, padded = (n + LANES - 1) / LANES * LANES;
                    float *s = scores + r * stride;
                    float m = s[0];
                    for (int64_t l = 1; l < n; l++)
                        m = s[l] > m ? s[l] : m;
                    for (int64_t l = n; l < padded; l++)
                        s[l] = m;
                    const __m256 mv = _mm256_set1_ps(m);
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t l = 0; l < padded; l += LANES) {
                        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(s + l), mv));
                        _mm256_store_ps(s + l, e);
                    }
                    for (int64_t l = n; l < padded; l++)
                        s[l] = 0.0f;
                    for (int64_t l = 0; l < padded; l += LANES)
                        sum = _mm256_add_ps(sum, _mm256_load_ps(s + l));
                    inv[r] = 1.0f / lanes_sum(sum);
                }
                /* Values: for each key, every row that sees it, in key order. */
                memset(acc, 0, sizeof(float) * rows * dim);
                for (int64_t l = 0; l < len; l++) {
                    const int64_t slot = table[l / block_size] * block_size + l % block_size;
                    const float *value = v_cache + (slot * kv_heads + h) * dim;
                    for (int64_t r = (l > first ? l - first : 0) * group; r < rows; r++) {
                        const __m256 p = _mm256_set1_ps(scores[r * stride + l]);
                        float *a = acc + r * dim;
                        for (int64_t d = 0; d < dim; d += LANES)
                            _mm256_store_ps(a + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(value + d),
                                                                   _mm256_load_ps(a + d)));
                    }
                }
                for (int64_t r = 0; r < rows; r++) {
                    float *o = out + ((t0 + r / group) * heads + h * group + r % group) * dim;
                    const __m256 iv = _mm256_set1_ps(inv[r]);
                    for (int64_t d = 0; d < dim; d += LANES)
                        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_load_ps(acc + r * dim + d), iv));
                }
            }
        }
        free(scores);
        free(acc);
        free(inv);
        free(qrows);
    }
}
