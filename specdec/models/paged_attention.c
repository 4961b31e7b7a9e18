/* Attention of the few query rows of a decode or verify step on CPU, float32,
 * straight from the paged KV cache.
 *
 * Why by hand: torch's path gathers every sequence's keys and values out of
 * the cache into [B, L, Hkv, D] copies each layer, pads the queries to
 * [B, Qmax] and runs the CPU flash kernel, which is tuned for long queries.
 * At batch 11 with one query row each that was 45 of a 68 ms step, and one
 * sequence verifying 2 rows (Qmax 2) made it 64 ms of 91. Here each row reads its
 * sequence's keys and values in place, through the block table, with no padding:
 * the cost follows the rows each sequence really has.
 *
 * Query token j of a sequence of len tokens with nq new ones sees keys 0 .. first + j,
 * first = len - nq being the position of its first query token; in a token tree's
 * block (tree_bits[t] != 0, bit i for the block's token i) it sees keys 0 .. first - 1
 * and then its ancestors and itself, in block order: the keys, in the order, that
 * decoding that path one token at a time would see. Query head hq reads
 * KV head hq / group (GQA). Every score is one 8-lane accumulator over the head
 * dimension in order, then a fixed pairwise sum; softmax and the weighted sum of
 * values run over the row's keys in position order. A row's rounding therefore
 * depends only on its own query, its position and the cache: not on the batch, on
 * how many rows its sequence verifies, or on the thread count (batch-invariant rows,
 * which keeps a speculative step's greedy tokens identical to plain decoding's).
 *
 * Built and loaded by paged_attention.py (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

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

/* How far ahead (in keys) a row's pass over its keys asks for them: the first row of
 * a KV head reads them from memory, and the hardware prefetcher does not follow the
 * block table. 16 took a plain step of 16 sequences' attention from 10.5 to 8.5 ms;
 * 32 and 64 gave the same. */
#define PREFETCH_KEYS 16

/* Asks for count rows of dim floats (one cache line per 16) into L1. */
static inline void prefetch_rows(const float *const *rows, int64_t count, int64_t dim)
{
    for (int64_t i = 0; i < count; i++)
        for (int64_t d = 0; d < dim; d += 16)
            _mm_prefetch((const char *)(rows[i] + d), _MM_HINT_T0);
}

/* One score: an 8-lane accumulator over the head dimension in order, the fixed
 * pairwise sum of its lanes, times scale. */
static inline float score1(const float *qr, const float *key, int64_t dim, float scale)
{
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += LANES)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(key + d), a);
    return lanes_sum(a) * scale;
}

/* score1 of eight keys at once, with the same arithmetic for each: eight independent
 * accumulators (the FMA chains overlap instead of waiting on each other), and their
 * lanes summed together by a transpose that adds the same pairs in the same order as
 * lanes_sum, ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)), so every score has
 * the bits score1 gives it. */
static inline void score8(const float *qr, const float *const *keys, int64_t dim, float scale,
                          float *s)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t d = 0; d < dim; d += LANES) {
        const __m256 x = _mm256_loadu_ps(qr + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[0] + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[1] + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[2] + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[3] + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[4] + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[5] + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[6] + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[7] + d), a7);
    }
    /* [lo ai + hi ai | lo aj + hi aj]: lane l of a half is (a_l + a_l+4). */
#define HALVES(x, y) _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), \
                                   _mm256_permute2f128_ps(x, y, 0x31))
    const __m256 h01 = HALVES(a0, a1), h23 = HALVES(a2, a3), h45 = HALVES(a4, a5),
                 h67 = HALVES(a6, a7);
#undef HALVES
    /* Adjacent pairs twice: scores 0, 2, 4, 6 | 1, 3, 5, 7, then in key order. */
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(h01, h23), _mm256_hadd_ps(h45, h67));
    const __m256 ordered = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_ps(s, _mm256_mul_ps(ordered, _mm256_set1_ps(scale)));
}

/* o[0 : 64] = inv * the sum over l = 0 .. n - 1, in order, of s[l] * values[l][col :
 * col + 64]: each column one FMA chain over the keys, in eight vector registers. */
static inline void values64(const float *s, const float *const *values, int64_t col, int64_t n,
                            float inv, float *o)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t l = 0; l < n; l++) {
        if (l + PREFETCH_KEYS < n)
            for (int64_t d = 0; d < 64; d += 16)
                _mm_prefetch((const char *)(values[l + PREFETCH_KEYS] + col + d), _MM_HINT_T0);
        const __m256 p = _mm256_set1_ps(s[l]);
        const float *v = values[l] + col;
        a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
        a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
        a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
        a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
        a4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), a4);
        a5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), a5);
        a6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), a6);
        a7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), a7);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    _mm256_storeu_ps(o, _mm256_mul_ps(a0, iv));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(a1, iv));
    _mm256_storeu_ps(o + 16, _mm256_mul_ps(a2, iv));
    _mm256_storeu_ps(o + 24, _mm256_mul_ps(a3, iv));
    _mm256_storeu_ps(o + 32, _mm256_mul_ps(a4, iv));
    _mm256_storeu_ps(o + 40, _mm256_mul_ps(a5, iv));
    _mm256_storeu_ps(o + 48, _mm256_mul_ps(a6, iv));
    _mm256_storeu_ps(o + 56, _mm256_mul_ps(a7, iv));
}

/* values64 for LANES columns (a head dimension's rest past its multiples of 64). */
static inline void values8(const float *s, const float *const *values, int64_t col, int64_t n,
                           float inv, float *o)
{
    __m256 a = _mm256_setzero_ps();
    for (int64_t l = 0; l < n; l++)
        a = _mm256_fmadd_ps(_mm256_set1_ps(s[l]), _mm256_loadu_ps(values[l] + col), a);
    _mm256_storeu_ps(o, _mm256_mul_ps(a, _mm256_set1_ps(inv)));
}

/* out[t, h, :] for every query token t of the sequences listed in seqs.
 * q, out: [T, heads, dim]; k_cache, v_cache: [slots, kv_heads, dim];
 * block_tables: [B, table_stride]; query_start: [B + 1]; seq_lens: [B] (with the
 * step's tokens); seqs: [num_seqs] indices into the batch; max_len: the longest;
 * tree_bits: [T] each token's ancestors in its tree block, 0 outside trees (or NULL).
 *
 * A work item is one (sequence, query head): its query tokens one row at a time, all
 * reading the same KV head's keys and values (from L1 or L2 after the first row).
 * Rows, not KV heads, are the unit because a row alone keeps its accumulators in
 * registers, and because a decode step of one sequence has only kv_heads KV heads
 * (3 for SmolLM2: two threads split them 2 : 1). The items go to the threads in
 * contiguous runs (guided), so each thread streams its own sequences' cache: with
 * items dealt one at a time, both threads read the same KV head at once and the
 * step waited on one stream from memory. The first version of this kernel walked
 * the keys once for all rows of a KV head, each score a chain of dependent FMAs
 * and a sum through memory, each value update a load and a store of the row's
 * accumulator, and found every key through a division by the block size: on the
 * AMD EPYC, a plain step of 16 sequences of 256 tokens spent 18-28 of its 43-52 ms
 * in attention, now 6-7 (SmolLM2-135M, 2 threads; reading the cache takes about 5). */
void paged_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                     const int64_t *block_tables, int64_t table_stride,
                     const int64_t *query_start, const int64_t *seq_lens,
                     const int64_t *seqs, int64_t num_seqs, const int64_t *tree_bits,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                     int64_t max_len, float scale, int threads)
{
    const int64_t group = heads / kv_heads;
    const int64_t stride = (max_len + LANES - 1) / LANES * LANES; /* a row of scores */
#pragma omp parallel num_threads(threads)
    {
        float *scores = aligned_alloc(32, sizeof(float) * stride);          /* [stride] */
        const float **keys = malloc(sizeof(float *) * stride);              /* [max_len] */
        const float **values = malloc(sizeof(float *) * stride);            /* [max_len] */
        /* A tree block's own key and value rows in block order (at most 64 tokens):
         * each of its rows lays its ancestors' over keys[first ..] before it reads. */
        const float *block_keys[64], *block_values[64];
        int64_t cached = -1; /* the (sequence, KV head) whose key and value rows are in keys */
#pragma omp for collapse(2) schedule(guided)
        for (int64_t i = 0; i < num_seqs; i++) {
            for (int64_t hq = 0; hq < heads; hq++) {
                const int64_t b = seqs[i], h = hq / group;
                const int64_t t0 = query_start[b], nq = query_start[b + 1] - t0;
                const int64_t len = seq_lens[b], first = len - nq;
                if (cached != i * kv_heads + h) {
                    /* Block by block: a division per key cost as much as its scores. */
                    const int64_t *table = block_tables + b * table_stride;
                    for (int64_t l0 = 0; l0 < len; l0 += block_size) {
                        const int64_t start = (table[l0 / block_size] * block_size * kv_heads + h) * dim;
                        const int64_t end = len - l0 < block_size ? len - l0 : block_size;
                        for (int64_t o = 0; o < end; o++) {
                            keys[l0 + o] = k_cache + start + o * kv_heads * dim;
                            values[l0 + o] = v_cache + start + o * kv_heads * dim;
                        }
                    }
                    cached = i * kv_heads + h;
                    if (tree_bits && tree_bits[t0])
                        for (int64_t o = 0; o < nq; o++) {
                            block_keys[o] = keys[first + o];
                            block_values[o] = values[first + o];
                        }
                }
                for (int64_t j = 0; j < nq; j++) {
                    const int64_t row = (t0 + j) * heads + hq;
                    int64_t n = first + j + 1;
                    if (tree_bits && tree_bits[t0 + j]) {
                        n = first;
                        for (int64_t o = 0; o <= j; o++)
                            if (tree_bits[t0 + j] >> o & 1) {
                                keys[n] = block_keys[o];
                                values[n] = block_values[o];
                                n++;
                            }
                    }
                    const float *qr = q + row * dim;
                    float *s = scores;
                    int64_t l = 0;
                    for (; l + 8 <= n; l += 8) {
                        if (l + 8 + PREFETCH_KEYS <= n)
                            prefetch_rows(keys + l + PREFETCH_KEYS, 8, dim);
                        score8(qr, keys + l, dim, scale, s + l);
                    }
                    for (; l < n; l++)
                        s[l] = score1(qr, keys[l], dim, scale);
                    /* Softmax over the row's n keys, in LANES-wide chunks; the chunk
                     * past n is padded (exp(0), then zeroed), so every lane's value
                     * and the sum's order depend on n alone. */
                    const int64_t padded = (n + LANES - 1) / LANES * LANES;
                    float m = s[0];
                    for (l = 1; l < n; l++)
                        m = s[l] > m ? s[l] : m;
                    for (l = n; l < padded; l++)
                        s[l] = m;
                    const __m256 mv = _mm256_set1_ps(m);
                    __m256 sum = _mm256_setzero_ps();
                    for (l = 0; l < padded; l += LANES)
                        _mm256_store_ps(s + l, exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(s + l), mv)));
                    for (l = n; l < padded; l++)
                        s[l] = 0.0f;
                    for (l = 0; l < padded; l += LANES)
                        sum = _mm256_add_ps(sum, _mm256_load_ps(s + l));
                    const float inv = 1.0f / lanes_sum(sum);
                    /* Values: every column's sum over the keys in order. */
                    float *o = out + row * dim;
                    int64_t d = 0;
                    for (; d + 64 <= dim; d += 64)
                        values64(s, values, d, n, inv, o + d);
                    for (; d < dim; d += LANES)
                        values8(s, values, d, n, inv, o + d);
                }
            }
        }
        free(scores);
        free(keys);
        free(values);
    }
}
