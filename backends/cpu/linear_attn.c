/* RWKV-6, RWKV-7 and gated linear attention (GLA), with snapshots.
 *
 * Tokens are packed (sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s+1]-1)
 * and a work unit is one (sequence, head): it depends only on its own
 * sequence, and its path only on the head size, so a packed call computes
 * every sequence exactly as a call of its own would, and any thread count
 * gives the same bits.  A unit first packs its per-token vectors (the
 * decays and gates through exp, the scale folded into r / q), then walks
 * tiles of its [S, S] state block through every token with the tile in L1.
 *
 * RWKV-6 and GLA store a head as [key i][value j] (j fastest).  For a fixed
 * token, column j of the block evolves on its own,
 *     S[i][j] = exp(w[i]) * S[i][j] + k[i] * v[j],
 * and the output o[j] = sum_i q[i] * S[i][j] is a sum down that column.  So a
 * tile is a block of columns (SC_LA_COLS wide, all S rows), vectorised over
 * j: per row of the tile the AVX2 path keeps v and the o accumulators in
 * registers and spends one multiply and two FMAs per element (RWKV-6 reads
 * o from the state before the token and adds its bonus
 * (sum_i r[i] u[i] k[i]) * v[j] once per token; GLA reads the state after).
 *
 * RWKV-7 stores a head as [value i][key j] (j fastest) and row i evolves on
 * its own: sa = a . S[i], S[i][j] = S[i][j] * exp(w[j]) + sa * b[j] + v[i] * k[j],
 * o[i] = S[i] . r.  A tile is a block of rows, as in delta_net.c; the AVX2
 * path takes four rows per pass so the shared vectors load once for all four.
 *
 * f32 pools are read in place by a unit's first token and written in place
 * by its last (no tile copy); other dtypes go through the tile.  Every slice
 * of the start row is read before the unit writes that slice of any row, and
 * no other unit touches it, so in-place and rollback starts are safe.  The
 * input state (column n_t) is a raw copy of the start row's head block,
 * made before anything is written.
 *
 * Prefill (head size a multiple of 8, AVX2) runs the chunked forms
 * (prefill_group_chunked, below): RWKV-6 and GLA the chunked gated form,
 * RWKV-7 the chunked WY form of its generalized delta rule; small matrix
 * products per chunk of tokens instead of a pass over the state per token. */
#include "sc_gemm.h"

/* Key-major kernels: state columns per tile (S rows each: 16 KiB at S = 128). */
#define SC_LA_COLS 32
/* RWKV-7: rows per tile, 32 KiB of f32. */
#define SC_LA_ROW_TILE_BYTES 32768

enum { LA_RWKV6 = 0, LA_GLA = 1, LA_RWKV7 = 2 };

/* One head's S values of one token (element stride es), multiplied by `mul`,
 * or exp of them when take_exp. */
static inline __attribute__((always_inline)) void pack_row(const float *src, int64_t es, int64_t S, float mul,
                                                           int take_exp, float *dst) {
    int64_t i = 0;
    if (es == 1 && take_exp) {
#ifdef SC_HAVE_AVX2
        for (; i + 8 <= S; i += 8) _mm256_storeu_ps(dst + i, sc_exp8(_mm256_loadu_ps(src + i)));
#endif
        for (; i < S; i++) dst[i] = sc_exp(src[i]);
    } else if (es == 1) {
#pragma omp simd
        for (int64_t j = 0; j < S; j++) dst[j] = src[j] * mul;
    } else {
        for (; i < S; i++) dst[i] = take_exp ? sc_exp(src[i * es]) : src[i * es] * mul;
    }
}

/* A raw copy (same dtype, so exact) of n elements at `elem` from the start
 * row to the input-state column, when that column is written and is another row. */
static void copy_input_state(const sc_state *st, int64_t s, int64_t n_t, int64_t elem, int64_t n) {
    const int64_t r = sc_snap_row(st, s, n_t);
    if (r < 0) return;
    char *dst = sc_pool_at(st, r, elem);
    const char *src = sc_pool_at(st, st->start_rows[s], elem);
    if (dst != src) memcpy(dst, src, (size_t)n * sc_dtype_size((sc_dtype)st->pool_dtype));
}

/* Rows [0, n) of `cols` elements at row stride `stride` (elements) of a pool
 * row from element `elem`, into / out of a float32 tile with rows `ts` apart. */
static void load_block(const sc_state *st, int64_t row, int64_t elem, int64_t stride, int64_t n, int64_t cols,
                       float *tile, int64_t ts) {
    const sc_dtype dt = (sc_dtype)st->pool_dtype;
    if (cols == stride && ts == cols) {
        sc_load_f32(sc_pool_at(st, row, elem), dt, tile, n * cols);
        return;
    }
    for (int64_t i = 0; i < n; i++) sc_load_f32(sc_pool_at(st, row, elem + i * stride), dt, tile + i * ts, cols);
}

static void store_block(const sc_state *st, const float *tile, int64_t ts, int64_t row, int64_t elem, int64_t stride,
                        int64_t n, int64_t cols) {
    const sc_dtype dt = (sc_dtype)st->pool_dtype;
    if (cols == stride && ts == cols) {
        sc_store_f32(tile, sc_pool_at(st, row, elem), dt, n * cols);
        return;
    }
    for (int64_t i = 0; i < n; i++) sc_store_f32(tile + i * ts, sc_pool_at(st, row, elem + i * stride), dt, cols);
}

/* ---- RWKV-6 and GLA: key-major blocks, column tiles ---------------------- */

/* One token over `cw` columns of every row i < S: in/out rows at strides
 * ins/outs (the same memory or disjoint).  q holds r or q times the scale, e
 * the decays exp(w) or exp(g).  o[j] = sum_i q[i] * S[i][j] (the old state
 * for RWKV-6, the new one for GLA) + bonus * v[j]. */
static void kv_step(const float *in, int64_t ins, float *out, int64_t outs, int64_t S, int64_t cw, const float *k,
                    const float *v, const float *q, const float *e, float bonus, int gla, float *o) {
    float acc[SC_LA_COLS];
    for (int64_t j = 0; j < cw; j++) acc[j] = 0.0f;
    for (int64_t i = 0; i < S; i++) {
        const float ki = k[i], qi = q[i], ei = e[i];
        const float *src = in + i * ins;
        float *dst = out + i * outs;
        if (gla) {
#pragma omp simd
            for (int64_t j = 0; j < cw; j++) {
                const float n = src[j] * ei + ki * v[j];
                dst[j] = n;
                acc[j] += qi * n;
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < cw; j++) {
                const float x = src[j];
                acc[j] += qi * x;
                dst[j] = x * ei + ki * v[j];
            }
        }
    }
    for (int64_t j = 0; j < cw; j++) o[j] = acc[j] + bonus * v[j];
}

#ifndef SC_LA_AHEAD
#define SC_LA_AHEAD 8
#endif

#ifdef SC_HAVE_AVX2
/* kv_step for 32 columns: v and the four accumulators stay in registers for
 * the whole pass down the rows (written out, not as arrays: GCC kept arrays
 * of vectors on the stack, zeroing and reloading them on every call). */
static inline __attribute__((always_inline)) void kv_step32_impl(const float *in, int64_t ins, float *out,
                                                                 int64_t outs, int64_t S, const float *k,
                                                                 const float *v, const float *q, const float *e,
                                                                 float bonus, const int gla, float *o) {
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
    const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < S; i++) {
        const __m256 kb = _mm256_set1_ps(k[i]), qb = _mm256_set1_ps(q[i]), eb = _mm256_set1_ps(e[i]);
        const float *src = in + i * ins;
        float *dst = out + i * outs;
        /* the tile's row SC_LA_AHEAD on (two lines): rows a head row apart
         * take half of each line pair, which the prefetchers do not run ahead of */
        __builtin_prefetch(src + SC_LA_AHEAD * ins);
        __builtin_prefetch(src + SC_LA_AHEAD * ins + 16);
        const __m256 x0 = _mm256_loadu_ps(src), x1 = _mm256_loadu_ps(src + 8);
        const __m256 x2 = _mm256_loadu_ps(src + 16), x3 = _mm256_loadu_ps(src + 24);
        const __m256 n0 = _mm256_fmadd_ps(x0, eb, _mm256_mul_ps(kb, v0));
        const __m256 n1 = _mm256_fmadd_ps(x1, eb, _mm256_mul_ps(kb, v1));
        const __m256 n2 = _mm256_fmadd_ps(x2, eb, _mm256_mul_ps(kb, v2));
        const __m256 n3 = _mm256_fmadd_ps(x3, eb, _mm256_mul_ps(kb, v3));
        _mm256_storeu_ps(dst, n0);
        _mm256_storeu_ps(dst + 8, n1);
        _mm256_storeu_ps(dst + 16, n2);
        _mm256_storeu_ps(dst + 24, n3);
        a0 = _mm256_fmadd_ps(qb, gla ? n0 : x0, a0);
        a1 = _mm256_fmadd_ps(qb, gla ? n1 : x1, a1);
        a2 = _mm256_fmadd_ps(qb, gla ? n2 : x2, a2);
        a3 = _mm256_fmadd_ps(qb, gla ? n3 : x3, a3);
    }
    const __m256 bb = _mm256_set1_ps(bonus);
    _mm256_storeu_ps(o, _mm256_fmadd_ps(bb, v0, a0));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(bb, v1, a1));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(bb, v2, a2));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(bb, v3, a3));
}

/* The same for 8 columns (the tail of a head whose size is not a multiple of 32). */
static inline __attribute__((always_inline)) void kv_step8_impl(const float *in, int64_t ins, float *out,
                                                                int64_t outs, int64_t S, const float *k,
                                                                const float *v, const float *q, const float *e,
                                                                float bonus, const int gla, float *o) {
    const __m256 v0 = _mm256_loadu_ps(v);
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t i = 0; i < S; i++) {
        const __m256 x0 = _mm256_loadu_ps(in + i * ins);
        const __m256 n0 = _mm256_fmadd_ps(x0, _mm256_set1_ps(e[i]), _mm256_mul_ps(_mm256_set1_ps(k[i]), v0));
        _mm256_storeu_ps(out + i * outs, n0);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(q[i]), gla ? n0 : x0, a0);
    }
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(bonus), v0, a0));
}

/* One token over cw columns, cw % 8 == 0: blocks of 32, then of 8. */
static void kv_step_avx2(const float *in, int64_t ins, float *out, int64_t outs, int64_t S, int64_t cw, const float *k,
                         const float *v, const float *q, const float *e, float bonus, int gla, float *o) {
    int64_t c = 0;
    for (; c + 32 <= cw; c += 32) {
        if (gla)
            kv_step32_impl(in + c, ins, out + c, outs, S, k, v + c, q, e, bonus, 1, o + c);
        else
            kv_step32_impl(in + c, ins, out + c, outs, S, k, v + c, q, e, bonus, 0, o + c);
    }
    for (; c < cw; c += 8) {
        if (gla)
            kv_step8_impl(in + c, ins, out + c, outs, S, k, v + c, q, e, bonus, 1, o + c);
        else
            kv_step8_impl(in + c, ins, out + c, outs, S, k, v + c, q, e, bonus, 0, o + c);
    }
}
#endif

/* ---- RWKV-7: value-major blocks, row tiles ----------------------------------- */

#ifdef SC_HAVE_AVX2
/* A broadcast of *p that the compiler keeps in the loop: a load (port 2, 3
 * or 11) at each use instead of a register held across the loop, which
 * wkv7_update4's four rows have none left for. */
static inline __attribute__((always_inline)) __m256 wkv7_bcast(const float *p) {
    __m256 r;
    __asm__ volatile("vbroadcastss %1, %0" : "=x"(r) : "m"(*p));
    return r;
}

/* One row's step over columns [j, j + 8): d[j..] = s[j..] * e + (sa * b + v * k),
 * acc += d[j..] * r, the row's a-dot at *sa and value at *v (read at each
 * use, wkv7_bcast). */
static inline __attribute__((always_inline)) __m256 wkv7_row_step(const float *s, float *d, const float *sa,
                                                                  const float *v, __m256 ej, __m256 bj, __m256 kj,
                                                                  __m256 rj, __m256 acc) {
    const __m256 n = _mm256_fmadd_ps(_mm256_loadu_ps(s), ej,
                                     _mm256_fmadd_ps(wkv7_bcast(sa), bj, _mm256_mul_ps(wkv7_bcast(v), kj)));
    _mm256_storeu_ps(d, n);
    return _mm256_fmadd_ps(n, rj, acc);
}

/* The update and r-dot of four rows (rows S apart from s and d, S % 8 ==
 * 0) whose a-dots are sv[0..4) and values sv[4..8):
 * d[j] = s[j] * e[j] + (sa * b[j] + v * k[j]), o = d . r; pf: 4 S floats
 * fetched meanwhile (see wkv7_rows).  The shared vectors load once for the
 * four rows and one horizontal sum gives the four outputs; the per-row
 * scalars come from memory at each use (wkv7_bcast): four rows' broadcasts,
 * shared vectors and sums held in registers need 20 of the 16.  Against two
 * rows per pass (the shared vectors loaded twice as often, a horizontal sum
 * per pair): RWKV-7, 32 heads of 64, one thread, state in L2, 18.1 -> 17.0-
 * 17.5 us per call, the same bits (every row's operations, in the same order).
 * wkv7_rows takes eight rows at a time (wkv7_update8) and this for a last
 * group of four. */
static inline __attribute__((always_inline)) void wkv7_update4(const float *s, float *d, int64_t S, const float *sv,
                                                               const float *r, const float *e, const float *k,
                                                               const float *b, float *o, const float *pf) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
#pragma GCC unroll 16
    for (int64_t j = 0; j < S; j += 8) {
        _mm_prefetch((const char *)(pf + 4 * j), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 4 * j + 16), _MM_HINT_T0);
        const __m256 ej = _mm256_loadu_ps(e + j), bj = _mm256_loadu_ps(b + j);
        const __m256 kj = _mm256_loadu_ps(k + j), rj = _mm256_loadu_ps(r + j);
        acc0 = wkv7_row_step(s + j, d + j, sv, sv + 4, ej, bj, kj, rj, acc0);
        acc1 = wkv7_row_step(s + S + j, d + S + j, sv + 1, sv + 5, ej, bj, kj, rj, acc1);
        acc2 = wkv7_row_step(s + 2 * S + j, d + 2 * S + j, sv + 2, sv + 6, ej, bj, kj, rj, acc2);
        acc3 = wkv7_row_step(s + 3 * S + j, d + 3 * S + j, sv + 3, sv + 7, ej, bj, kj, rj, acc3);
    }
    _mm_storeu_ps(o, sc_hsum4x8(acc0, acc1, acc2, acc3));
}

/* The same for eight rows, a-dots sv[0..8) and values sv[8..16); pf: 8 S
 * floats.  The shared vectors e, b, k, r load once per eight rows instead of
 * four (eight sums and four shared vectors take 12 registers, the scalars
 * still come from memory).  Each row's operations are wkv7_update4's, in the
 * same order (two four-row horizontal sums), so the same bits. */
static inline __attribute__((always_inline)) void wkv7_update8(const float *s, float *d, int64_t S, const float *sv,
                                                               const float *r, const float *e, const float *k,
                                                               const float *b, float *o, const float *pf) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    __m256 acc4 = acc0, acc5 = acc0, acc6 = acc0, acc7 = acc0;
#pragma GCC unroll 16
    for (int64_t j = 0; j < S; j += 8) {
        _mm_prefetch((const char *)(pf + 8 * j), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 8 * j + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 8 * j + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 8 * j + 48), _MM_HINT_T0);
        const __m256 ej = _mm256_loadu_ps(e + j), bj = _mm256_loadu_ps(b + j);
        const __m256 kj = _mm256_loadu_ps(k + j), rj = _mm256_loadu_ps(r + j);
        acc0 = wkv7_row_step(s + j, d + j, sv, sv + 8, ej, bj, kj, rj, acc0);
        acc1 = wkv7_row_step(s + S + j, d + S + j, sv + 1, sv + 9, ej, bj, kj, rj, acc1);
        acc2 = wkv7_row_step(s + 2 * S + j, d + 2 * S + j, sv + 2, sv + 10, ej, bj, kj, rj, acc2);
        acc3 = wkv7_row_step(s + 3 * S + j, d + 3 * S + j, sv + 3, sv + 11, ej, bj, kj, rj, acc3);
        acc4 = wkv7_row_step(s + 4 * S + j, d + 4 * S + j, sv + 4, sv + 12, ej, bj, kj, rj, acc4);
        acc5 = wkv7_row_step(s + 5 * S + j, d + 5 * S + j, sv + 5, sv + 13, ej, bj, kj, rj, acc5);
        acc6 = wkv7_row_step(s + 6 * S + j, d + 6 * S + j, sv + 6, sv + 14, ej, bj, kj, rj, acc6);
        acc7 = wkv7_row_step(s + 7 * S + j, d + 7 * S + j, sv + 7, sv + 15, ej, bj, kj, rj, acc7);
    }
    _mm_storeu_ps(o, sc_hsum4x8(acc0, acc1, acc2, acc3));
    _mm_storeu_ps(o + 4, sc_hsum4x8(acc4, acc5, acc6, acc7));
}

/* The a-dots sa[0..4) = a . S[i] of four rows (S % 8 == 0): two accumulators
 * per row, even and odd chunks, so the dots are not bound by FMA latency. */
static inline __attribute__((always_inline)) void wkv7_adot4(const float *in, int64_t S, const float *a, float *sa) {
    const float *s0 = in, *s1 = in + S, *s2 = in + 2 * S, *s3 = in + 3 * S;
    __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, q0 = p0, q1 = p0, q2 = p0, q3 = p0;
    int64_t j = 0;
    for (; j + 16 <= S; j += 16) {
        const __m256 a0 = _mm256_loadu_ps(a + j), a1 = _mm256_loadu_ps(a + j + 8);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(s0 + j), a0, p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(s1 + j), a0, p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(s2 + j), a0, p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(s3 + j), a0, p3);
        q0 = _mm256_fmadd_ps(_mm256_loadu_ps(s0 + j + 8), a1, q0);
        q1 = _mm256_fmadd_ps(_mm256_loadu_ps(s1 + j + 8), a1, q1);
        q2 = _mm256_fmadd_ps(_mm256_loadu_ps(s2 + j + 8), a1, q2);
        q3 = _mm256_fmadd_ps(_mm256_loadu_ps(s3 + j + 8), a1, q3);
    }
    if (j < S) {
        const __m256 a0 = _mm256_loadu_ps(a + j);
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(s0 + j), a0, p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(s1 + j), a0, p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(s2 + j), a0, p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(s3 + j), a0, p3);
    }
    _mm_storeu_ps(sa, sc_hsum4x8(_mm256_add_ps(p0, q0), _mm256_add_ps(p1, q1), _mm256_add_ps(p2, q2),
                                 _mm256_add_ps(p3, q3)));
}

#endif

#ifndef SC_WKV7_AHEAD
#define SC_WKV7_AHEAD 16
#endif

/* One token over rows [0, n) (row stride S, in and out the same memory or
 * disjoint): sa = a . S[i]; S[i][j] = S[i][j] * e[j] + (sa * b[j] + v[i] * k[j]);
 * o[i] = S[i] . r (r already scaled).
 *
 * The AVX2 path takes rows in groups (of four when the figures here were
 * measured, of eight now: below), the next group's a-dots computed before
 * this group's updates: each update waits for its row's
 * a-dot (a horizontal sum, then a broadcast), and with the a-dots just
 * before their own updates every group stalled on that chain.  The rows
 * SC_WKV7_AHEAD on (past n too: in decode they are the next head's, which
 * this thread runs next) are fetched one line per step of the updates, so
 * the fetches overlap the arithmetic instead of stalling in a burst at the
 * a-dots (16 prefetches at once wait for free fill buffers).  Every value is computed by the same operations in the
 * same order as when each group's a-dots came just before its updates: the
 * schedule changed, not the bits (RWKV-7, 32 heads of 64, one thread, state
 * in L2: 0.34 -> 0.27 us per head, fastest of 8 runs alternated).
 *
 * The groups are now of eight rows (wkv7_update8; a last group of four when
 * n % 8 >= 4, as in row tiles of 84 at S = 96), the a-dots of the next eight
 * computed as two four-row a-dots, so each row's bits are what four-row
 * groups gave; the fetches run 16 rows (two groups) on.  Rows alone, state
 * in L2, one thread, fastest of 3000 calls, builds alternated: 32 heads of
 * 64 17.0 -> 14.4 us, 8 heads of 128 15.5 -> 13.5 us; the whole call (one
 * sequence, one thread) 17.1 -> 16.3 us (noisy shared host). */
static inline __attribute__((always_inline)) void wkv7_rows_impl(const float *in, float *out, int64_t n, int64_t S,
                                                                 const float *r, const float *e, const float *k,
                                                                 const float *v, const float *a, const float *b,
                                                                 float *o) {
    int64_t i = 0;
#ifdef SC_HAVE_AVX2
    if (S % 8 == 0 && n >= 4) {
        float sa[16]; /* the a-dots of this group and the next: halves by (i & 8) */
        wkv7_adot4(in, S, a, sa);
        if (n >= 8) wkv7_adot4(in + 4 * S, S, a, sa + 4);
        for (; i + 8 <= n; i += 8) {
            const float *cur = sa + (i & 8);
            float *next = sa + ((i + 8) & 8);
            if (i + 12 <= n) wkv7_adot4(in + (i + 8) * S, S, a, next);
            if (i + 16 <= n) wkv7_adot4(in + (i + 12) * S, S, a, next + 4);
            float sv[16];
            for (int q = 0; q < 8; q++) {
                sv[q] = cur[q];
                sv[8 + q] = v[i + q];
            }
            wkv7_update8(in + i * S, out + i * S, S, sv, r, e, k, b, o + i, in + (i + SC_WKV7_AHEAD) * S);
        }
        if (i + 4 <= n) { /* a last group of four, its a-dots computed above */
            const float *cur = sa + (i & 8);
            const float sv[8] = {cur[0], cur[1], cur[2], cur[3], v[i], v[i + 1], v[i + 2], v[i + 3]};
            wkv7_update4(in + i * S, out + i * S, S, sv, r, e, k, b, o + i, in + (i + SC_WKV7_AHEAD) * S);
            i += 4;
        }
    }
#endif
    for (; i < n; i++) {
        const float *src = in + i * S;
        float *dst = out + i * S;
        float sa = 0.0f;
#pragma omp simd reduction(+ : sa)
        for (int64_t j = 0; j < S; j++) sa += a[j] * src[j];
        const float vi = v[i];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < S; j++) {
            const float x = src[j] * e[j] + (sa * b[j] + vi * k[j]);
            dst[j] = x;
            acc += x * r[j];
        }
        o[i] = acc;
    }
}

/* wkv7_rows with the model head sizes compiled apart, their loop bounds
 * known: the loops over a row unroll completely and the row addresses fold
 * into the instructions (RWKV-7 at S = 64, one thread, 32 heads in L2:
 * 0.66 -> 0.38 us per head).  The same operations in the same order, so
 * the same bits. */
static void wkv7_rows(const float *in, float *out, int64_t n, int64_t S, const float *r, const float *e,
                      const float *k, const float *v, const float *a, const float *b, float *o) {
    if (S == 64)
        wkv7_rows_impl(in, out, n, 64, r, e, k, v, a, b, o);
    else if (S == 128)
        wkv7_rows_impl(in, out, n, 128, r, e, k, v, a, b, o);
    else
        wkv7_rows_impl(in, out, n, S, r, e, k, v, a, b, o);
}

/* ---- the driver ------------------------------------------------------------------ */

/* Prefill works on groups of heads of one sequence, a chunk of tokens at a
 * time: the chunk's inputs of every head of the group are packed in one pass
 * over each token's row (the heads of a token are neighbours in memory, a head
 * alone is a short run every H * S elements, which the prefetchers do not
 * follow), then each head runs the chunk on its tile.  The tiles of a group
 * stay below SC_LA_GROUP_BYTES (L2); the chunk boundaries are fixed from the
 * sequence's first token, so a head computes the same whatever group it is in. */
#define SC_LA_GROUP_BYTES ((int64_t)256 << 10)
#define SC_LA_CHUNK 32

typedef struct {
    const sc_state *st;
    int kind;          /* LA_RWKV6, LA_GLA, LA_RWKV7 */
    int n_in;          /* 4 (RWKV-6, GLA: q or r, k, v, w) or 6 (RWKV-7: r, w, k, v, a, b) */
    int exp_in;        /* the input given in log space */
    sc_view in[6];     /* float32 views */
    const float *u;    /* RWKV-6's bonus [H, S] */
    float *o;          /* float32 output [T, H, S] */
    float scale;       /* folded into input 0 (r or q) */
    int64_t H, S;
} la_call;

/* RWKV-6's bonus of one token, sum_i (r[i] * mul) u[i] k[i]: one compiled
 * copy (never inlined), so packed rows (mul 1, the scale applied) and rows
 * read in place (mul = the scale) give the same bits. */
static __attribute__((noinline)) float la_bonus(const float *r, const float *u, const float *k, float mul, int64_t S) {
    float b = 0.0f;
#pragma omp simd reduction(+ : b)
    for (int64_t i = 0; i < S; i++) b += r[i] * mul * u[i] * k[i];
    return b;
}

/* Pack tokens [c0, c0 + nc) of sequence s for heads [ha, ha + G): input m of
 * head hh, token t at buf + ((m * G + hh) * SC_LA_CHUNK + t) * S; with u (RWKV-6)
 * the bonus sum_i r[i] u[i] k[i] of (hh, t) at bonus[hh * SC_LA_CHUNK + t]. */
static void pack_chunk(const la_call *c, int64_t s, int64_t c0, int64_t nc, int64_t ha, int64_t G, float *buf,
                       float *bonus) {
    const int64_t S = c->S, t0 = c->st->cu_seqlens[s];
    for (int64_t t = 0; t < nc; t++)
        for (int m = 0; m < c->n_in; m++) {
            const sc_view *v = &c->in[m];
            const float *row = v->data + (t0 + c0 + t) * v->strides[0] + ha * v->strides[1];
            const float mul = m == 0 ? c->scale : 1.0f;
            const int take_exp = m == c->exp_in;
            for (int64_t hh = 0; hh < G; hh++)
                pack_row(row + hh * v->strides[1], v->strides[2], S, mul, take_exp,
                         buf + ((m * G + hh) * SC_LA_CHUNK + t) * S);
        }
    if (c->kind != LA_RWKV6) return;
    for (int64_t hh = 0; hh < G; hh++) {
        const float *uh = c->u + (ha + hh) * S;
        for (int64_t t = 0; t < nc; t++) {
            const float *rt = buf + ((0 * G + hh) * SC_LA_CHUNK + t) * S, *kt = buf + ((1 * G + hh) * SC_LA_CHUNK + t) * S;
            bonus[hh * SC_LA_CHUNK + t] = la_bonus(rt, uh, kt, 1.0f, S);
        }
    }
}

/* Decode (and zero-token) units: one (sequence, head), the f32 pool read and
 * written in place, no tile copy when one token passes. */
static void decode_unit(const la_call *c, int64_t s, int64_t h, float *buf, float *tile, int64_t tile_rows) {
    const sc_state *st = c->st;
    const int64_t S = c->S, H = c->H, t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t head_off = h * S * S, r0 = sc_snap_row(st, s, 0);
    copy_input_state(st, s, n_t, head_off, S * S);
    if (n_t == 0) return;
    /* the token's inputs packed as pack_chunk packs them (the same calls, so
     * the same bits), but next to each other: n_in * S floats */
    const float *p[6];
    for (int m = 0; m < c->n_in; m++) {
        const sc_view *v = &c->in[m];
        const float *row = v->data + t0 * v->strides[0] + h * v->strides[1];
        if (m != 0 && m != c->exp_in && v->strides[2] == 1) {
            p[m] = row; /* read in place: a packed copy would hold the same values */
            continue;
        }
        pack_row(row, v->strides[2], S, m == 0 ? c->scale : 1.0f, m == c->exp_in, buf + m * S);
        p[m] = buf + m * S;
    }
    const float bonus = c->kind == LA_RWKV6 ? la_bonus(p[0], c->u + h * S, p[1], 1.0f, S) : 0.0f;
    const int direct = st->pool_dtype == SC_F32;
    float *start = (float *)sc_pool_at(st, st->start_rows[s], head_off);
    float *final = direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, head_off) : NULL;
    float *o = c->o + (t0 * H + h) * S;
    if (c->kind == LA_RWKV7) {
        for (int64_t i0 = 0; i0 < S; i0 += tile_rows) {
            const int64_t nr = S - i0 < tile_rows ? S - i0 : tile_rows, off = i0 * S;
            if (!direct) load_block(st, st->start_rows[s], head_off + off, S, nr, S, tile, S);
            float *out = final ? final + off : tile;
            wkv7_rows(direct ? start + off : tile, out, nr, S, p[0], p[1], p[2], p[3] + i0, p[4], p[5], o + i0);
            if (out == tile && r0 >= 0) store_block(st, tile, S, r0, head_off + off, S, nr, S);
        }
        return;
    }
    const int gla = c->kind == LA_GLA;
    for (int64_t j0 = 0; j0 < S; j0 += SC_LA_COLS) {
        const int64_t cw = S - j0 < SC_LA_COLS ? S - j0 : SC_LA_COLS;
        if (!direct) load_block(st, st->start_rows[s], head_off + j0, S, S, cw, tile, cw);
        const float *in = direct ? start + j0 : tile;
        float *out = final ? final + j0 : tile;
        const int64_t ins = direct ? S : cw, outs = final ? S : cw;
#ifdef SC_HAVE_AVX2
        if (cw % 8 == 0)
            kv_step_avx2(in, ins, out, outs, S, cw, p[1], p[2] + j0, p[0], p[3], bonus, gla, o + j0);
        else
#endif
            kv_step(in, ins, out, outs, S, cw, p[1], p[2] + j0, p[0], p[3], bonus, gla, o + j0);
        if (out == tile && r0 >= 0) store_block(st, tile, cw, r0, head_off + j0, S, S, cw);
    }
}

/* Prefill of heads [ha, ha + G) of sequence s (n_t >= 2 tokens): the group's
 * start states are read into dense tiles [G][S][S] before anything is written
 * (after each head's input state is copied), then chunk by chunk every head
 * walks its tile through the chunk, column tiles (RWKV-6, GLA) or row tiles
 * (RWKV-7) in L1, and the snapshot rows are stored as their tokens pass. */
static void prefill_group(const la_call *c, int64_t s, int64_t ha, int64_t G, float *buf, float *bonus, float *tiles,
                          int64_t tile_rows) {
    const sc_state *st = c->st;
    const int64_t S = c->S, H = c->H, t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    for (int64_t hh = 0; hh < G; hh++) {
        const int64_t head_off = (ha + hh) * S * S;
        copy_input_state(st, s, n_t, head_off, S * S);
        load_block(st, st->start_rows[s], head_off, S, S, S, tiles + hh * S * S, S);
    }
    const int gla = c->kind == LA_GLA;
    for (int64_t c0 = 0; c0 < n_t; c0 += SC_LA_CHUNK) {
        const int64_t nc = n_t - c0 < SC_LA_CHUNK ? n_t - c0 : SC_LA_CHUNK;
        pack_chunk(c, s, c0, nc, ha, G, buf, bonus);
        for (int64_t hh = 0; hh < G; hh++) {
            const int64_t h = ha + hh, head_off = h * S * S;
            float *tile = tiles + hh * S * S;
            const float *p[6];
            for (int m = 0; m < c->n_in; m++) p[m] = buf + (m * G + hh) * SC_LA_CHUNK * S;
            if (c->kind == LA_RWKV7) {
                for (int64_t i0 = 0; i0 < S; i0 += tile_rows) {
                    const int64_t nr = S - i0 < tile_rows ? S - i0 : tile_rows, off = i0 * S;
                    for (int64_t t = 0; t < nc; t++) {
                        const int64_t at = t * S;
                        wkv7_rows(tile + off, tile + off, nr, S, p[0] + at, p[1] + at, p[2] + at, p[3] + at + i0,
                                  p[4] + at, p[5] + at, c->o + ((t0 + c0 + t) * H + h) * S + i0);
                        const int64_t rj = sc_snap_row(st, s, n_t - 1 - (c0 + t));
                        if (rj >= 0) store_block(st, tile + off, S, rj, head_off + off, S, nr, S);
                    }
                }
                continue;
            }
            for (int64_t j0 = 0; j0 < S; j0 += SC_LA_COLS) {
                const int64_t cw = S - j0 < SC_LA_COLS ? S - j0 : SC_LA_COLS;
                for (int64_t t = 0; t < nc; t++) {
                    const int64_t at = t * S;
                    const float b = gla ? 0.0f : bonus[hh * SC_LA_CHUNK + t];
                    float *o = c->o + ((t0 + c0 + t) * H + h) * S + j0;
#ifdef SC_HAVE_AVX2
                    if (cw % 8 == 0)
                        kv_step_avx2(tile + j0, S, tile + j0, S, S, cw, p[1] + at, p[2] + at + j0, p[0] + at,
                                     p[3] + at, b, gla, o);
                    else
#endif
                        kv_step(tile + j0, S, tile + j0, S, S, cw, p[1] + at, p[2] + at + j0, p[0] + at, p[3] + at,
                                b, gla, o);
                    const int64_t rj = sc_snap_row(st, s, n_t - 1 - (c0 + t));
                    if (rj >= 0) store_block(st, tile + j0, S, rj, head_off + j0, S, S, cw);
                }
            }
        }
    }
}

#ifdef SC_HAVE_AVX2
/* ---- RWKV-6 and GLA prefill: the chunked form ------------------------------------
 *
 * flash-linear-attention's chunked form of a per-key gated recurrence.  Over a
 * chunk of L tokens from state M0, with G_t = g_0 + ... + g_t the cumulative
 * log decays of each key (running sums within the chunk),
 *     S_t = diag(exp G_t) M0 + sum_{u<=t} diag(exp(G_t - G_u)) k_u v_u^T,
 * so the outputs are O = Qd M0 + A V with Qd[t] = q_t exp(Gq_t) and
 * A[t][u] = sum_i q_t[i] k_u[i] exp(Gq_t[i] - G_u[i]) = Qd Kf^T, Kf[u] =
 * k_u exp(-G_u); and the end state is M = diag(exp G_end) M0 + Kd^T V, Kd[u] =
 * Kf[u] exp(G_end).  GLA reads the state after its token: Gq_t = G_t and A
 * keeps u <= t.  RWKV-6 reads it before: Gq_t = G_{t-1} (0 for t = 0), A keeps
 * u < t, and its diagonal is the bonus (sum_i r[i] u[i] k[i]).  Four small
 * products per chunk on sc_gemm (about 2 L S^2 + L^2 S FMAs against the
 * token loop's 3 L S^2 element operations at a load and a store each).
 *
 * Factoring exp(Gq_t - G_u) into exp(Gq_t) exp(-G_u) is exact in real
 * arithmetic; in float32 it is safe while every |G_t[i]| of the chunk stays
 * below SC_LA_SPAN (the factors then lie within e^+-60, far from overflow and
 * from subnormals).  A steeper chunk runs the token loop, which multiplies
 * decays one token at a time, as does a chunk shorter than SC_LA_CHUNK_MIN,
 * and a head whose start state or some chunk's inputs are not all finite
 * runs the token loop from there on (a masked zero times an infinity in a
 * product would be NaN where the recurrence keeps the infinity).  Chunks end
 * at every snapshot position (sc_state_stops), so the planes are states the
 * recurrence passes through; each product sums its elements in a fixed order,
 * so the bits do not depend on the thread count or on the other sequences. */
#define SC_LA_SPAN 60.0f
#define SC_LA_CHUNK_MIN 8
#define SC_LA_BLOCK 16 /* tokens per chunk of the chunked form, <= SC_LA_CHUNK (24 and 32 measured slower) */
#define SC_LA_CHUNK_PAD ((SC_LA_CHUNK + 7) & ~7)

/* The next head's token rows (the inputs read in place): fetched a few rows
 * at a time while this head computes, so the misses overlap its products
 * instead of stalling in a burst (rows a token apart are in other pages,
 * where no hardware prefetcher goes). */
typedef struct {
    const float *next[7]; /* the inputs' rows, then the output's (written soon) */
    int64_t next_ls[7], n_in, next_rows, fetched;
} la_fetch;

/* Fetches the next `rows` of the next head's n_in * next_rows token rows of S floats. */
static void la_fetch_next(la_fetch *f, int64_t S, int64_t rows) {
    for (int64_t r = 0; r < rows && f->fetched < f->n_in * f->next_rows; r++, f->fetched++) {
        const int64_t m = f->fetched / f->next_rows, t = f->fetched % f->next_rows;
        /* into L2: L1 holds this head's state and products */
        const char *row = (const char *)(f->next[m] + t * f->next_ls[m]);
        for (int64_t b = 0; b < S * (int64_t)sizeof(float); b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
}

typedef struct {
    float *EG, *Qd, *Kf; /* [SC_LA_CHUNK][S]: exp G_t, decayed queries, keys times exp(-G_u) */
    float *KT;           /* [S][SC_LA_CHUNK_PAD]: Kf transposed, then scaled into Kd^T */
    float *A;            /* [SC_LA_CHUNK][SC_LA_CHUNK_PAD] intra-chunk scores */
    float *Eend;         /* [S] exp G_end */
    int64_t *stops;      /* [n_cols + 1] */
    int *token_loop;     /* [group]: the head went to the token loop for good */
    la_fetch fetch;
} la_chunk_ws;

/* G[t] = g[0] + ... + g[t] per key for the L token rows of log decays g
 * (rows lg apart) and Eend = exp G[L-1], or 0 when some |G| passes
 * SC_LA_SPAN (or is NaN): the chunk's factors exp(+-G) would then leave
 * float32's comfortable range, and it runs the token loop instead. */
static int la_log_decay_sums(const float *g, int64_t lg, int64_t L, int64_t S, float *G, float *Eend) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 most = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; t++)
        for (int64_t i = 0; i < S; i += 8) {
            __m256 x = _mm256_loadu_ps(g + t * lg + i);
            if (t) x = _mm256_add_ps(x, _mm256_loadu_ps(G + (t - 1) * S + i));
            _mm256_storeu_ps(G + t * S + i, x);
            most = _mm256_max_ps(most, _mm256_andnot_ps(sign, x));
        }
    float m8[8];
    _mm256_storeu_ps(m8, most);
    for (int l = 0; l < 8; l++)
        if (!(m8[l] <= SC_LA_SPAN)) return 0;
    for (int64_t i = 0; i < S; i += 8) _mm256_storeu_ps(Eend + i, sc_exp8(_mm256_loadu_ps(G + (L - 1) * S + i)));
    return 1;
}

/* One chunk of L tokens (SC_LA_CHUNK_MIN <= L <= SC_LA_CHUNK) of one head in
 * the chunked form, or 0 (nothing written) when its decays span too much.
 * in[0..3]: the token rows of q or r, k, v and the log decays g, rows ls[m]
 * apart (packed, or read in place); q / r is multiplied by `qscale` here;
 * bonus: RWKV-6's diagonal or NULL (GLA); M: the key-major state [S][S];
 * outputs at o, rows ldo apart. */
static int la_chunk(const float *const *in, const int64_t *ls, float qscale, const float *bonus, int64_t L, int64_t S,
                    float *M, float *o, int64_t ldo, la_chunk_ws *w) {
    const int64_t Lp = (L + 7) & ~(int64_t)7, ldv = ls[2];
    const float *V = in[2];
    const int gla = bonus == NULL;
    const __m256 qs = _mm256_set1_ps(qscale);
    if (!la_log_decay_sums(in[3], ls[3], L, S, w->EG, w->Eend)) return 0;
    for (int64_t t = 0; t < L; t++) {
        const float *Q = in[0] + t * ls[0], *K = in[1] + t * ls[1];
        la_fetch_next(&w->fetch, S, 2);
        for (int64_t i = 0; i < S; i += 8) {
            const __m256 e = sc_exp8(_mm256_loadu_ps(w->EG + t * S + i));
            _mm256_storeu_ps(w->EG + t * S + i, e);
            _mm256_storeu_ps(w->Kf + t * S + i, _mm256_div_ps(_mm256_loadu_ps(K + i), e));
            /* RWKV-6's query decays lag a token: exp G_{t-1}, 1 for the first */
            const __m256 eq = gla ? e : t ? _mm256_loadu_ps(w->EG + (t - 1) * S + i) : _mm256_set1_ps(1.0f);
            _mm256_storeu_ps(w->Qd + t * S + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(Q + i), qs), eq));
        }
    }
    /* inter-chunk: O = Qd M0 */
    sc_gemm(L, S, S, w->Qd, S, M, S, o, ldo, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_DENSE, 0);
    /* intra-chunk: A = Qd Kf^T, masked causally (RWKV-6: the bonus on the diagonal), O += A V */
    sc_transpose(w->Kf, S, w->KT, Lp, L, S);
    for (int64_t i = 0; i < S; i++)
        for (int64_t u = L; u < Lp; u++) w->KT[i * Lp + u] = 0.0f;
    sc_gemm(L, Lp, S, w->Qd, S, w->KT, Lp, w->A, Lp, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_C_LOWER, gla ? 1 : 0);
    for (int64_t t = 0; t < L; t++) {
        for (int64_t u = gla ? t + 1 : t; u < Lp; u++) w->A[t * Lp + u] = 0.0f;
        if (!gla) w->A[t * Lp + t] = bonus[t];
    }
    sc_gemm(L, S, L, w->A, Lp, V, ldv, o, ldo, SC_GEMM_SCALE, 1.0f, NULL, SC_GEMM_A_LOWER, 1);
    la_fetch_next(&w->fetch, S, L);
    /* state: M = diag(exp G_end) M0 + Kd^T V */
    for (int64_t i = 0; i < S; i++) {
        const float e = w->Eend[i];
        for (int64_t u = 0; u < L; u++) w->KT[i * Lp + u] *= e;
    }
    sc_gemm(S, S, L, w->KT, Lp, V, ldv, M, S, SC_GEMM_ROWS, 0.0f, w->Eend, SC_GEMM_DENSE, 0);
    la_fetch_next(&w->fetch, S, 4 * L); /* whatever is left */
    return 1;
}

/* Tokens [0, L) of one head the token loop's way on the key-major state M
 * (the decays exp'd into `e`, [L][S] scratch). */
static void la_chunk_tokens(const float *Q, const float *K, const float *V, const float *g, const float *bonus,
                            int64_t L, int64_t S, float *M, float *o, int64_t ldo, float *e) {
    const int gla = bonus == NULL;
    for (int64_t i = 0; i < L * S; i += 8) _mm256_storeu_ps(e + i, sc_exp8(_mm256_loadu_ps(g + i)));
    for (int64_t j0 = 0; j0 < S; j0 += SC_LA_COLS) {
        const int64_t cw = S - j0 < SC_LA_COLS ? S - j0 : SC_LA_COLS;
        for (int64_t t = 0; t < L; t++)
            kv_step_avx2(M + j0, S, M + j0, S, S, cw, K + t * S, V + t * S + j0, Q + t * S, e + t * S,
                         gla ? 0.0f : bonus[t], gla, o + t * ldo + j0);
    }
}

/* ---- RWKV-7 prefill: the chunked WY form of the generalized delta rule ----------
 *
 * flash-linear-attention's chunked form of a diagonal-plus-low-rank transition
 * (chunk_dplr_delta_rule, which its RWKV-7 kernels call).  In key-major form
 * (M = the transpose of the stored [value][key] block) a token is
 *     M_t = (diag(w_t) + b_t a_t^T) M_{t-1} + k_t v_t^T,   o_t = M_t^T r_t.
 * Over a chunk of L tokens from M0, with G_t the running sums of the log
 * decays of each key (G_{-1} = 0) and sa_t = a_t^T M_{t-1} (the a-dot of every
 * value), unrolling the recurrence gives
 *     sa_t = at_t M0 + sum_{u<t} (at_t . kh_u) v_u + (at_t . bh_u) sa_u,
 *     o_t  = rt_t M0 + sum_{u<=t} (rt_t . kh_u) v_u + (rt_t . bh_u) sa_u,
 *     M_L  = diag(exp G_end) M0 + sum_u exp(G_end) (kh_u v_u^T + bh_u sa_u^T),
 * with at_t = a_t exp(G_{t-1}), rt_t = r_t exp(G_t), kh_u = k_u exp(-G_u),
 * bh_u = b_u exp(-G_u).  So the chunk is one product of its [at; rt] rows with
 * [bh; kh]^T (the four L x L score blocks), the two rows M0 products, the
 * a-dots SA as a unit lower triangular system (I - Aab) SA = at M0 + Aak V
 * solved by forward substitution (fla's UT transform, applied to the rows
 * instead of forming the inverse), one product [Arb Ark] [SA; V] for the
 * outputs and one [bh kh]^T [SA; V] for the state: about 4 L S^2 + 7 L^2 S
 * FMAs against the token loop's 5 L S^2.
 *
 * As for RWKV-6 / GLA: the factors exp(+-G) are safe in float32 while every
 * |G| of the chunk stays below SC_LA_SPAN (RWKV-7's log decays are at least
 * -e^-0.5 per token, so a chunk of 16 spans at most ~10); a steeper chunk runs
 * the token loop, and a head whose start state or some chunk's inputs are not
 * all finite runs the token loop from there on.  A chunk of any length takes
 * this form (a one-token chunk costs about the token loop's work), so the
 * short runs between snapshot positions stay cheap. */
#ifndef SC_WKV7_BLOCK
#define SC_WKV7_BLOCK 8 /* tokens per chunk, <= SC_LA_CHUNK: 8 measured faster than 16 (fewer L^2 S score FMAs) */
#endif
#define SC_WKV7_BLOCK_PAD ((SC_WKV7_BLOCK + 7) & ~7)

typedef struct {
    float *G;    /* [SC_WKV7_BLOCK][S] running sums of the log decays, then exp of them */
    float *P;    /* [2 SC_WKV7_BLOCK][S]: at rows, then rt rows */
    float *Q;    /* [2 SC_WKV7_BLOCK_PAD][S]: bh rows from 0, kh rows from Lp, zero padding */
    float *QT;   /* [S][2 SC_WKV7_BLOCK_PAD]: Q transposed, then scaled into the state update's keys */
    float *A;    /* [2 SC_WKV7_BLOCK][2 SC_WKV7_BLOCK_PAD] scores: rows at, rt; columns bh, kh */
    float *VS;   /* [2 SC_WKV7_BLOCK_PAD][S]: SA rows from 0, V rows from Lp, zero padding */
    float *Y;    /* [2 SC_WKV7_BLOCK][S]: [at; rt] M0 */
    float *Eend; /* [S] exp G_end */
    float *tmp;  /* [S][S] a state in storage (value-major) layout */
    la_fetch fetch;
} wkv7_chunk_ws;

/* One chunk of L <= SC_WKV7_BLOCK tokens of one head in the chunked form, or 0
 * (nothing written) when its decays span too much, -1 (nothing written) when
 * some input is not finite (the head then runs the token loop for good).  in[0..5]: the token rows
 * of r, w (log decays), k, v, a, b, rows ls[m] apart; r is multiplied by
 * `scale` here; M: the key-major state [S][S]; outputs at o, rows ldo apart. */
static int wkv7_chunk(const float *const *in, const int64_t *ls, float scale, int64_t L, int64_t S, float *M,
                      float *o, int64_t ldo, wkv7_chunk_ws *w) {
    const int64_t Lp = (L + 7) & ~(int64_t)7, ld = 2 * SC_WKV7_BLOCK_PAD;
    const __m256 one = _mm256_set1_ps(1.0f), sc = _mm256_set1_ps(scale);
    if (!la_log_decay_sums(in[1], ls[1], L, S, w->G, w->Eend)) {
        for (int m = 0; m < 6; m++)
            if (!sc_all_finite(in[m], L, ls[m], S, 1)) return -1;
        return 0;
    }
    /* x - x is 0 exactly when x is finite: every input row is checked on its
     * way into the chunk (one pass over the rows, not a pass of its own) */
    __m256 bad = _mm256_setzero_ps();
    const __m256 zero = _mm256_setzero_ps();
#define WKV7_CHECK(x) bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps((x), (x)), zero, _CMP_NEQ_UQ))
    for (int64_t t = 0; t < L; t++) {
        const float *R = in[0] + t * ls[0], *K = in[2] + t * ls[2], *Av = in[4] + t * ls[4], *B = in[5] + t * ls[5];
        const float *W = in[1] + t * ls[1], *V = in[3] + t * ls[3];
        float *Vd = w->VS + (Lp + t) * S;
        la_fetch_next(&w->fetch, S, 2);
        for (int64_t i = 0; i < S; i += 8) {
            const __m256 wv = _mm256_loadu_ps(W + i), vv = _mm256_loadu_ps(V + i);
            const __m256 rv = _mm256_loadu_ps(R + i), kv = _mm256_loadu_ps(K + i);
            const __m256 av = _mm256_loadu_ps(Av + i), bv = _mm256_loadu_ps(B + i);
            WKV7_CHECK(wv);
            WKV7_CHECK(vv);
            WKV7_CHECK(rv);
            WKV7_CHECK(kv);
            WKV7_CHECK(av);
            WKV7_CHECK(bv);
            _mm256_storeu_ps(Vd + i, vv);
            /* 1 / e by a refined reciprocal (e lies in [e^-60, e^60]): a
             * divide would hold its port for several cycles per vector */
            const __m256 e = sc_exp8(_mm256_loadu_ps(w->G + t * S + i)), r0 = _mm256_rcp_ps(e);
            const __m256 inv = _mm256_fmadd_ps(r0, _mm256_fnmadd_ps(e, r0, one), r0);
            const __m256 before = t ? _mm256_loadu_ps(w->G + (t - 1) * S + i) : one; /* exp G_{t-1}, exp'd already */
            _mm256_storeu_ps(w->G + t * S + i, e);
            _mm256_storeu_ps(w->P + t * S + i, _mm256_mul_ps(av, before));
            _mm256_storeu_ps(w->P + (L + t) * S + i, _mm256_mul_ps(_mm256_mul_ps(rv, sc), e));
            _mm256_storeu_ps(w->Q + t * S + i, _mm256_mul_ps(bv, inv));
            _mm256_storeu_ps(w->Q + (Lp + t) * S + i, _mm256_mul_ps(kv, inv));
        }
    }
#undef WKV7_CHECK
    if (_mm256_movemask_ps(bad)) return -1;
    for (int64_t t = L; t < Lp; t++) {
        memset(w->Q + t * S, 0, sizeof(float) * (size_t)S);
        memset(w->Q + (Lp + t) * S, 0, sizeof(float) * (size_t)S);
        memset(w->VS + t * S, 0, sizeof(float) * (size_t)S);
        memset(w->VS + (Lp + t) * S, 0, sizeof(float) * (size_t)S);
    }
    sc_transpose(w->Q, S, w->QT, ld, 2 * Lp, S);
    /* The four score blocks in one product, then masked: the a-dots see the
     * tokens before their own (u < t), the outputs their own too (u <= t). */
    sc_gemm(2 * L, 2 * Lp, S, w->P, S, w->QT, ld, w->A, ld, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_DENSE, 0);
    for (int64_t t = 0; t < L; t++) {
        float *ra = w->A + t * ld, *rr = w->A + (L + t) * ld;
        for (int64_t u = t; u < Lp; u++) ra[u] = ra[Lp + u] = 0.0f;
        for (int64_t u = t + 1; u < Lp; u++) rr[u] = rr[Lp + u] = 0.0f;
    }
    la_fetch_next(&w->fetch, S, 6);
    /* [at; rt] M0 in one product (2L rows fill the kernel's row blocks of 6
     * better than two of L), then at M0 into the SA rows, rt M0 into the outputs. */
    sc_gemm(2 * L, S, S, w->P, S, M, S, w->Y, S, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_DENSE, 0);
    memcpy(w->VS, w->Y, sizeof(float) * (size_t)(L * S));
    for (int64_t t = 0; t < L; t++) memcpy(o + t * ldo, w->Y + (L + t) * S, sizeof(float) * (size_t)S);
    la_fetch_next(&w->fetch, S, 6);
    /* SA = at M0 + Aak V, then (I - Aab) SA = that, row by row. */
    sc_gemm(L, S, L, w->A + Lp, ld, w->VS + Lp * S, S, w->VS, S, SC_GEMM_SCALE, 1.0f, NULL, SC_GEMM_A_LOWER, 0);
    for (int64_t t = 1; t < L; t++) {
        float *sat = w->VS + t * S;
        const float *ab = w->A + t * ld;
        int64_t j = 0;
        /* 64 columns at once: eight independent chains cover the FMA latency
         * (each element is still one chain over u in order: same bits) */
        for (; j + 64 <= S; j += 64) {
            __m256 x[8];
            for (int q = 0; q < 8; q++) x[q] = _mm256_loadu_ps(sat + j + 8 * q);
            for (int64_t u = 0; u < t; u++) {
                const __m256 f = _mm256_set1_ps(ab[u]);
                const float *su = w->VS + u * S + j;
                for (int q = 0; q < 8; q++) x[q] = _mm256_fmadd_ps(f, _mm256_loadu_ps(su + 8 * q), x[q]);
            }
            for (int q = 0; q < 8; q++) _mm256_storeu_ps(sat + j + 8 * q, x[q]);
        }
        for (; j + 16 <= S; j += 16) {
            __m256 x0 = _mm256_loadu_ps(sat + j), x1 = _mm256_loadu_ps(sat + j + 8);
            for (int64_t u = 0; u < t; u++) {
                const __m256 f = _mm256_set1_ps(ab[u]);
                x0 = _mm256_fmadd_ps(f, _mm256_loadu_ps(w->VS + u * S + j), x0);
                x1 = _mm256_fmadd_ps(f, _mm256_loadu_ps(w->VS + u * S + j + 8), x1);
            }
            _mm256_storeu_ps(sat + j, x0);
            _mm256_storeu_ps(sat + j + 8, x1);
        }
        if (j < S) {
            __m256 x0 = _mm256_loadu_ps(sat + j);
            for (int64_t u = 0; u < t; u++) x0 = _mm256_fmadd_ps(_mm256_set1_ps(ab[u]), _mm256_loadu_ps(w->VS + u * S + j), x0);
            _mm256_storeu_ps(sat + j, x0);
        }
    }
    la_fetch_next(&w->fetch, S, 6);
    /* o += [Arb Ark] [SA; V]. */
    sc_gemm(L, S, 2 * Lp, w->A + L * ld, ld, w->VS, S, o, ldo, SC_GEMM_SCALE, 1.0f, NULL, SC_GEMM_DENSE, 0);
    la_fetch_next(&w->fetch, S, 6);
    /* M = diag(exp G_end) M0 + ([bh kh] exp G_end) [SA; V]. */
    for (int64_t i = 0; i < S; i++) {
        float *row = w->QT + i * ld;
        const __m256 e = _mm256_set1_ps(w->Eend[i]);
        for (int64_t u = 0; u < 2 * Lp; u += 8) _mm256_storeu_ps(row + u, _mm256_mul_ps(e, _mm256_loadu_ps(row + u)));
    }
    /* in slices of whole row blocks, the fetches between them (a burst of
     * them fills the line fill buffers and stalls the loads; each element's
     * chain is the same whatever rows the product covers) */
    for (int64_t i0 = 0; i0 < S; i0 += 18) {
        const int64_t n = S - i0 < 18 ? S - i0 : 18;
        sc_gemm(n, S, 2 * Lp, w->QT + i0 * ld, ld, w->VS, S, M + i0 * S, S, SC_GEMM_ROWS, 0.0f, w->Eend + i0,
                SC_GEMM_DENSE, 0);
        la_fetch_next(&w->fetch, S, 6);
    }
    la_fetch_next(&w->fetch, S, 7 * L); /* whatever is left */
    return 1;
}

/* Tokens [0, L) of one head the token loop's way (wkv7_rows, as decode runs
 * them) on the key-major state M, through the value-major scratch w->tmp
 * (arguments as wkv7_chunk's). */
static void wkv7_chunk_tokens(const float *const *in, const int64_t *ls, float scale, int64_t L, int64_t S, float *M,
                              float *o, int64_t ldo, wkv7_chunk_ws *w) {
    float *e = w->G, *r = w->P;
    sc_transpose(M, S, w->tmp, S, S, S);
    for (int64_t t = 0; t < L; t++) {
        const float *wt = in[1] + t * ls[1], *rt = in[0] + t * ls[0];
        for (int64_t i = 0; i < S; i += 8) {
            _mm256_storeu_ps(e + i, sc_exp8(_mm256_loadu_ps(wt + i)));
            _mm256_storeu_ps(r + i, _mm256_mul_ps(_mm256_loadu_ps(rt + i), _mm256_set1_ps(scale)));
        }
        wkv7_rows(w->tmp, w->tmp, S, S, r, e, in[2] + t * ls[2], in[3] + t * ls[3], in[4] + t * ls[4],
                  in[5] + t * ls[5], o + t * ldo);
    }
    sc_transpose(w->tmp, S, M, S, S, S);
}

static void wkv7_chunk_ws_alloc(wkv7_chunk_ws *w, int64_t S) {
    const size_t f = sizeof(float), SS = (size_t)S, C = SC_WKV7_BLOCK, Cp = SC_WKV7_BLOCK_PAD;
    w->G = (float *)sc_alloc(f * C * SS);
    w->P = (float *)sc_alloc(f * 2 * C * SS);
    w->Q = (float *)sc_alloc(f * 2 * Cp * SS);
    w->QT = (float *)sc_alloc(f * SS * 2 * Cp);
    w->A = (float *)sc_alloc(f * 2 * C * 2 * Cp);
    w->VS = (float *)sc_alloc(f * 2 * Cp * SS);
    w->Y = (float *)sc_alloc(f * 2 * C * SS);
    w->Eend = (float *)sc_alloc(f * SS);
    w->tmp = (float *)sc_alloc(f * SS * SS);
}

static void wkv7_chunk_ws_free(wkv7_chunk_ws *w) {
    float *all[] = {w->G, w->P, w->Q, w->QT, w->A, w->VS, w->Y, w->Eend, w->tmp};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]);
}

/* A head's state into / out of its key-major tile: RWKV-6 and GLA store
 * key-major blocks, RWKV-7 value-major ones (transposed through `tmp`). */
static void chunked_load(const la_call *c, int64_t row, int64_t head_off, float *tile, float *tmp) {
    const int64_t S = c->S;
    if (c->kind != LA_RWKV7) {
        load_block(c->st, row, head_off, S, S, S, tile, S);
        return;
    }
    load_block(c->st, row, head_off, S, S, S, tmp, S);
    sc_transpose(tmp, S, tile, S, S, S);
}

static void chunked_store(const la_call *c, const float *tile, int64_t row, int64_t head_off, float *tmp) {
    const int64_t S = c->S;
    if (c->kind != LA_RWKV7) {
        store_block(c->st, tile, S, row, head_off, S, S, S);
        return;
    }
    sc_transpose(tile, S, tmp, S, S, S);
    store_block(c->st, tmp, S, row, head_off, S, S, S);
}

/* Prefill with S % 8 == 0: chunks that end at the snapshot positions (and
 * every SC_LA_BLOCK tokens between them), packed for the whole group, then
 * each head's chunk in its chunked form or the token loop (see above); the
 * snapshots of every head stored at each stop. */
static void prefill_group_chunked(const la_call *c, int64_t s, int64_t ha, int64_t G, float *buf, float *bonus,
                                  float *tiles, la_chunk_ws *w, wkv7_chunk_ws *w7) {
    const sc_state *st = c->st;
    const int64_t S = c->S, H = c->H, t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    la_call logc = *c;
    logc.exp_in = -1; /* the chunked forms sum the log decays */
    for (int64_t hh = 0; hh < G; hh++) {
        const int64_t head_off = (ha + hh) * S * S;
        copy_input_state(st, s, n_t, head_off, S * S);
        chunked_load(c, st->start_rows[s], head_off, tiles + hh * S * S, w7->tmp);
        w->token_loop[hh] = !sc_all_finite(tiles + hh * S * S, 1, 0, S * S, 1);
    }
    const int gla = c->kind == LA_GLA, wkv7 = c->kind == LA_RWKV7;
    la_fetch *fetch = wkv7 ? &w7->fetch : &w->fetch;
    /* The token rows are read in place when their elements are adjacent (the
     * chunks scale r / q on the way into their products anyway): packing
     * them was a quarter of RWKV-6's prefill.  Only a chunk that runs the
     * token loop packs its head's rows. */
    int direct = 1;
    for (int m = 0; m < c->n_in; m++) direct &= c->in[m].strides[2] == 1;
    int64_t longest;
    const int64_t n_stops = sc_state_stops(st, s, n_t, w->stops, &longest);
    int64_t pos = 0;
    for (int64_t i = 0; i < n_stops; i++) {
        while (pos < w->stops[i]) {
            const int64_t block = wkv7 ? SC_WKV7_BLOCK : SC_LA_BLOCK;
            const int64_t L = w->stops[i] - pos < block ? w->stops[i] - pos : block;
            if (!direct) pack_chunk(&logc, s, pos, L, ha, G, buf, bonus);
            for (int64_t hh = 0; hh < G; hh++) {
                const int64_t h = ha + hh;
                const float *p[6];
                int64_t ls[6];
                for (int m = 0; m < c->n_in; m++) {
                    const sc_view *v = &c->in[m];
                    p[m] = direct ? v->data + (t0 + pos) * v->strides[0] + h * v->strides[1]
                                  : buf + (m * G + hh) * SC_LA_CHUNK * S;
                    ls[m] = direct ? v->strides[0] : S;
                    /* the next head's rows, fetched while this one computes */
                    fetch->next[m] = p[m] + v->strides[1];
                    fetch->next_ls[m] = ls[m];
                }
                /* and the next head's output rows, which its chunk writes */
                fetch->next[c->n_in] = c->o + ((t0 + pos) * H + h + 1) * S;
                fetch->next_ls[c->n_in] = H * S;
                fetch->n_in = c->n_in + 1;
                fetch->next_rows = direct && hh + 1 < G ? L : 0;
                if (direct && hh + 1 == G && pos + L < n_t) {
                    /* the last head of the group fetches the next chunk's rows
                     * of the first one (else every chunk begins on misses) */
                    const int64_t left = n_t - (pos + L);
                    for (int m = 0; m < c->n_in; m++) {
                        const sc_view *v = &c->in[m];
                        fetch->next[m] = v->data + (t0 + pos + L) * v->strides[0] + ha * v->strides[1];
                    }
                    fetch->next[c->n_in] = c->o + ((t0 + pos + L) * H + ha) * S;
                    fetch->next_rows = left < block ? left : block;
                }
                fetch->fetched = 0;
                float *b = gla || wkv7 ? NULL : bonus + hh * SC_LA_CHUNK;
                if (b && direct)
                    for (int64_t t = 0; t < L; t++)
                        b[t] = la_bonus(p[0] + t * ls[0], c->u + h * S, p[1] + t * ls[1], c->scale, S);
                float *tile = tiles + hh * S * S, *o = c->o + ((t0 + pos) * H + h) * S;
                if (!w->token_loop[hh] && !wkv7) { /* wkv7_chunk checks its rows itself */
                    int ok = 1;
                    for (int m = 0; m < c->n_in && ok; m++) ok = sc_all_finite(p[m], L, ls[m], S, 1);
                    if (ok && b) ok = sc_all_finite(b, 1, 0, L, 1);
                    w->token_loop[hh] = !ok;
                }
                if (wkv7) {
                    const float sc = direct ? c->scale : 1.0f;
                    const int done = w->token_loop[hh] ? -1 : wkv7_chunk(p, ls, sc, L, S, tile, o, H * S, w7);
                    if (done < 0) w->token_loop[hh] = 1;
                    if (done <= 0) wkv7_chunk_tokens(p, ls, sc, L, S, tile, o, H * S, w7);
                } else if (w->token_loop[hh] || L < SC_LA_CHUNK_MIN ||
                           !la_chunk(p, ls, direct ? c->scale : 1.0f, b, L, S, tile, o, H * S, w)) {
                    const float *q = p[0], *k = p[1], *v = p[2], *g = p[3];
                    if (direct) { /* the token loop takes packed rows, r / q scaled */
                        pack_chunk(&logc, s, pos, L, h, 1, buf, b ? b : bonus);
                        q = buf, k = buf + SC_LA_CHUNK * S, v = buf + 2 * SC_LA_CHUNK * S, g = buf + 3 * SC_LA_CHUNK * S;
                    }
                    la_chunk_tokens(q, k, v, g, b, L, S, tile, o, H * S, w->Qd);
                }
            }
            pos += L;
        }
        const int64_t r = sc_snap_row(st, s, n_t - w->stops[i]);
        if (r >= 0)
            for (int64_t hh = 0; hh < G; hh++) chunked_store(c, tiles + hh * S * S, r, (ha + hh) * S * S, w7->tmp);
    }
}
#endif

/* Whether a decode unit (one token, or none) of this call may need a tile:
 * a pool of another dtype, or a sequence whose state after the token is
 * written to no row (it is computed in the tile and dropped). */
static int la_decode_needs_tile(const sc_state *st) {
    if (st->pool_dtype != SC_F32) return 1;
    for (int64_t s = 0; s < st->n_seqs; s++)
        if (sc_snap_row(st, s, 0) < 0) return 1;
    return 0;
}

/* Decode packs at most this many floats of one token's inputs (n_in * S) on the stack. */
#define SC_LA_DECODE_STACK 1536

/* The units [lo, hi) of thread tid of nt (sc_split).  A call of decode units
 * alone needs no chunk buffers, bonus row or tiles (f32 pools, every state
 * written somewhere): it allocates nothing, and its token's inputs go on the
 * stack.  Allocations of tens of KiB per thread and call (48 KiB of chunk
 * buffer for RWKV-7 at S = 64, of which a decode used 1.5) each made glibc
 * consolidate the freed small chunks first: a quarter of a one-head call. */
static void la_thread(void *arg, int tid, int nt) {
    const la_call *c = (const la_call *)arg;
    const sc_state *st = c->st;
    const int64_t H = c->H, S = c->S;
    int64_t tile_rows = SC_LA_ROW_TILE_BYTES / 4 / (S > 0 ? S : 1);
    tile_rows = tile_rows < 4 ? 4 : tile_rows - tile_rows % 4;
    int64_t group = SC_LA_GROUP_BYTES / (S * S * (int64_t)sizeof(float));
    group = group < 1 ? 1 : (group > H ? H : group);
    const int64_t longest = st->max_tokens;
    const int64_t G = longest >= 2 ? group : 1;
    float stack_buf[SC_LA_DECODE_STACK];
    const int decode_only = longest < 2;
    float *buf = decode_only && c->n_in * S <= SC_LA_DECODE_STACK
                     ? stack_buf
                     : (float *)sc_alloc(sizeof(float) * (size_t)(c->n_in * (decode_only ? 1 : G * SC_LA_CHUNK) * S));
    float *bonus = decode_only ? NULL : (float *)sc_alloc(sizeof(float) * (size_t)(G * SC_LA_CHUNK));
    /* a decode unit uses at most one head's worth */
    float *tiles = !decode_only || la_decode_needs_tile(st) ? (float *)sc_alloc(sizeof(float) * (size_t)(G * S * S))
                                                              : NULL;
#ifdef SC_HAVE_AVX2
    const int chunked = S % 8 == 0 && longest >= 2;
    la_chunk_ws w = {0};
    wkv7_chunk_ws w7 = {0};
    if (chunked && c->kind == LA_RWKV7) wkv7_chunk_ws_alloc(&w7, S);
    if (chunked) {
        const size_t cs = sizeof(float) * (size_t)(SC_LA_CHUNK * S);
        w.EG = (float *)sc_alloc(cs);
        w.Qd = (float *)sc_alloc(cs);
        w.Kf = (float *)sc_alloc(cs);
        w.KT = (float *)sc_alloc(sizeof(float) * (size_t)(S * SC_LA_CHUNK_PAD));
        w.A = (float *)sc_alloc(sizeof(float) * (size_t)(SC_LA_CHUNK * SC_LA_CHUNK_PAD));
        w.Eend = (float *)sc_alloc(sizeof(float) * (size_t)S);
        w.stops = (int64_t *)sc_alloc(sizeof(int64_t) * (size_t)(st->n_cols + 1));
        w.token_loop = (int *)sc_alloc(sizeof(int) * (size_t)G);
    }
#endif
    int64_t lo, hi;
    sc_split(st->n_seqs * H, tid, nt, &lo, &hi);
    for (int64_t unit = lo; unit < hi;) {
        const int64_t s = unit / H, h = unit % H;
        const int64_t n_t = st->cu_seqlens[s + 1] - st->cu_seqlens[s];
        if (n_t < 2) {
            decode_unit(c, s, h, buf, tiles, tile_rows);
            unit++;
            continue;
        }
        /* the heads of this sequence in this thread's range, G at a time */
        const int64_t end = (s + 1) * H < hi ? (s + 1) * H : hi;
        const int64_t g = end - unit < G ? end - unit : G;
#ifdef SC_HAVE_AVX2
        if (chunked)
            prefill_group_chunked(c, s, h, g, buf, bonus, tiles, &w, &w7);
        else
#endif
            prefill_group(c, s, h, g, buf, bonus, tiles, tile_rows);
        unit += g;
    }
#ifdef SC_HAVE_AVX2
    free(w.EG);
    free(w.Qd);
    free(w.Kf);
    free(w.KT);
    free(w.A);
    free(w.Eend);
    free(w.stops);
    free(w.token_loop);
    wkv7_chunk_ws_free(&w7);
#endif
    if (buf != stack_buf) free(buf);
    free(bonus);
    free(tiles);
}

static void la_run(const la_call *c, int n_threads) {
    const sc_state *st = c->st;
    const int64_t H = c->H, S = c->S;
    /* state streamed: every token passes over it, plus the rows written */
    const int64_t work = H * S * S * (int64_t)sizeof(float) * (st->n_tokens + st->n_seqs * sc_max_written(st));
    const int team = sc_state_team(st->n_seqs * H, work, n_threads);
    sc_team_run(team, la_thread, (void *)c);
}

/* ---- entry points ---------------------------------------------------------------- */

/* The inputs widened to float32 (see sc_internal.h), the output in float32 scratch
 * when it is not float32, run, and narrowed back. */
static void la_entry(int kind, const sc_state *st, const sc_view *const *in, int n_in, const float *u, void *o,
                     sc_dtype o_dtype, float scale, int64_t H, int64_t S, int n_threads) {
    la_call c;
    float *own[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    c.st = st;
    c.kind = kind;
    c.n_in = n_in;
    c.exp_in = kind == LA_RWKV7 ? 1 : 3;
    for (int m = 0; m < n_in; m++) c.in[m] = sc_widen3(in[m], st->n_tokens, H, S, &own[m]);
    c.u = u;
    c.o = sc_output_f32(o, o_dtype, st->n_tokens * H * S);
    c.scale = scale;
    c.H = H;
    c.S = S;
    la_run(&c, n_threads);
    sc_narrow_output(c.o, o, o_dtype, st->n_tokens * H * S);
    for (int m = 0; m < 6; m++) free(own[m]);
}

void sc_rwkv_wkv6(const sc_state *st, const sc_view *r, const sc_view *k, const sc_view *v, const sc_view *w,
                  const float *u, void *o, sc_dtype o_dtype, float scale, int64_t n_head, int64_t head_size,
                  int n_threads) {
    const sc_view *in[4] = {r, k, v, w};
    la_entry(LA_RWKV6, st, in, 4, u, o, o_dtype, scale, n_head, head_size, n_threads);
}

void sc_gated_linear_attn(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                          void *o, sc_dtype o_dtype, float scale, int64_t n_head, int64_t head_size, int n_threads) {
    const sc_view *in[4] = {q, k, v, g};
    la_entry(LA_GLA, st, in, 4, NULL, o, o_dtype, scale, n_head, head_size, n_threads);
}

void sc_rwkv_wkv7(const sc_state *st, const sc_view *r, const sc_view *w, const sc_view *k, const sc_view *v,
                  const sc_view *a, const sc_view *b, void *o, sc_dtype o_dtype, float scale, int64_t n_head,
                  int64_t head_size, int n_threads) {
    const sc_view *in[6] = {r, w, k, v, a, b};
    la_entry(LA_RWKV7, st, in, 6, NULL, o, o_dtype, scale, n_head, head_size, n_threads);
}
