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
 * made before anything is written. */
#include "sc_internal.h"

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
/* The update and r-dot of two rows whose a-dots are sa0, sa1 (S % 8 == 0):
 * the shared vectors load once for both rows.  Written out in variables, as
 * kv_step32_impl: four rows at once would not fit the 16 vector registers. */
static inline __attribute__((always_inline)) void wkv7_update2(const float *s0, const float *s1, float *d0, float *d1,
                                                               int64_t S, float sa0, float sa1, float v0, float v1,
                                                               const float *r, const float *e, const float *k,
                                                               const float *b, float *o0, float *o1) {
    const __m256 A0 = _mm256_set1_ps(sa0), A1 = _mm256_set1_ps(sa1);
    const __m256 V0 = _mm256_set1_ps(v0), V1 = _mm256_set1_ps(v1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t j = 0; j < S; j += 8) {
        const __m256 ej = _mm256_loadu_ps(e + j), bj = _mm256_loadu_ps(b + j);
        const __m256 kj = _mm256_loadu_ps(k + j), rj = _mm256_loadu_ps(r + j);
        const __m256 n0 = _mm256_fmadd_ps(_mm256_loadu_ps(s0 + j), ej, _mm256_fmadd_ps(A0, bj, _mm256_mul_ps(V0, kj)));
        const __m256 n1 = _mm256_fmadd_ps(_mm256_loadu_ps(s1 + j), ej, _mm256_fmadd_ps(A1, bj, _mm256_mul_ps(V1, kj)));
        _mm256_storeu_ps(d0 + j, n0);
        _mm256_storeu_ps(d1 + j, n1);
        acc0 = _mm256_fmadd_ps(n0, rj, acc0);
        acc1 = _mm256_fmadd_ps(n1, rj, acc1);
    }
    float dots[4];
    _mm_storeu_ps(dots, sc_hsum4x8(acc0, acc1, acc0, acc1));
    *o0 = dots[0];
    *o1 = dots[1];
}

/* Four rows, S % 8 == 0: the a-dots of all four first (two accumulators per
 * row, even and odd chunks, so the dots are not bound by FMA latency), then
 * the updates two rows at a time. */
static void wkv7_rows4(const float *in, float *out, int64_t S, const float *r, const float *e, const float *k,
                       const float *v, const float *a, const float *b, float *o) {
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
    float sa[4];
    _mm_storeu_ps(sa, sc_hsum4x8(_mm256_add_ps(p0, q0), _mm256_add_ps(p1, q1), _mm256_add_ps(p2, q2),
                                 _mm256_add_ps(p3, q3)));
    wkv7_update2(s0, s1, out, out + S, S, sa[0], sa[1], v[0], v[1], r, e, k, b, o, o + 1);
    wkv7_update2(s2, s3, out + 2 * S, out + 3 * S, S, sa[2], sa[3], v[2], v[3], r, e, k, b, o + 2, o + 3);
}
#endif

/* One token over rows [0, n) (row stride S, in and out the same memory or
 * disjoint): sa = a . S[i]; S[i][j] = S[i][j] * e[j] + (sa * b[j] + v[i] * k[j]);
 * o[i] = S[i] . r (r already scaled). */
static void wkv7_rows(const float *in, float *out, int64_t n, int64_t S, const float *r, const float *e,
                      const float *k, const float *v, const float *a, const float *b, float *o) {
    int64_t i = 0;
#ifdef SC_HAVE_AVX2
    if (S % 8 == 0)
        for (; i + 4 <= n; i += 4) wkv7_rows4(in + i * S, out + i * S, S, r, e, k, v + i, a, b, o + i);
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
            float b = 0.0f;
#pragma omp simd reduction(+ : b)
            for (int64_t i = 0; i < S; i++) b += rt[i] * uh[i] * kt[i];
            bonus[hh * SC_LA_CHUNK + t] = b;
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
    float bonus = 0.0f;
    pack_chunk(c, s, 0, 1, h, 1, buf, &bonus);
    const float *p[6];
    for (int m = 0; m < c->n_in; m++) p[m] = buf + m * SC_LA_CHUNK * S;
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

static void la_run(const la_call *c, int n_threads) {
    const sc_state *st = c->st;
    const int64_t H = c->H, S = c->S;
    int64_t tile_rows = SC_LA_ROW_TILE_BYTES / 4 / (S > 0 ? S : 1);
    tile_rows = tile_rows < 4 ? 4 : tile_rows - tile_rows % 4;
    int64_t group = SC_LA_GROUP_BYTES / (S * S * (int64_t)sizeof(float));
    group = group < 1 ? 1 : (group > H ? H : group);
    const int64_t longest = st->max_tokens;
    /* state streamed: every token passes over it, plus the rows written */
    const int64_t work = H * S * S * (int64_t)sizeof(float) * (st->n_tokens + st->n_seqs * sc_max_written(st));
    const int team = sc_state_team(st->n_seqs * H, work, n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        const int64_t G = longest >= 2 ? group : 1;
        float *buf = (float *)sc_alloc(sizeof(float) * (size_t)(c->n_in * G * SC_LA_CHUNK * S));
        float *bonus = (float *)sc_alloc(sizeof(float) * (size_t)(G * SC_LA_CHUNK));
        const int64_t tile_floats = G * S * S; /* a decode unit uses at most one head's worth */
        float *tiles = (float *)sc_alloc(sizeof(float) * (size_t)tile_floats);
        int64_t lo, hi;
        sc_split(st->n_seqs * H, sc_thread_id(), sc_team_size(), &lo, &hi);
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
            prefill_group(c, s, h, g, buf, bonus, tiles, tile_rows);
            unit += g;
        }
        free(buf);
        free(bonus);
        free(tiles);
    }
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
