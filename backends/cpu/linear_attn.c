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

enum { LA_RWKV6 = 0, LA_GLA = 1 };

/* [n_t][S] floats of view v (a float32 [T, H, S] view) for head h from
 * token t0, multiplied by `mul`, or exp of the values when take_exp. */
static void pack(const sc_view *v, int64_t t0, int64_t h, int64_t n_t, int64_t S, float mul, int take_exp,
                 float *out) {
    const int64_t es = v->strides[2];
    for (int64_t t = 0; t < n_t; t++) {
        const float *src = v->data + (t0 + t) * v->strides[0] + h * v->strides[1];
        float *dst = out + t * S;
        if (es == 1) {
#pragma omp simd
            for (int64_t i = 0; i < S; i++) dst[i] = src[i] * mul;
        } else {
            for (int64_t i = 0; i < S; i++) dst[i] = src[i * es] * mul;
        }
        if (take_exp) {
#pragma omp simd
            for (int64_t i = 0; i < S; i++) dst[i] = sc_exp(dst[i]);
        }
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
 * row from element `elem`, into / out of a dense float32 tile [n][cols]. */
static void load_block(const sc_state *st, int64_t row, int64_t elem, int64_t stride, int64_t n, int64_t cols,
                       float *tile) {
    const sc_dtype dt = (sc_dtype)st->pool_dtype;
    if (cols == stride) {
        sc_load_f32(sc_pool_at(st, row, elem), dt, tile, n * cols);
        return;
    }
    for (int64_t i = 0; i < n; i++) sc_load_f32(sc_pool_at(st, row, elem + i * stride), dt, tile + i * cols, cols);
}

static void store_block(const sc_state *st, const float *tile, int64_t row, int64_t elem, int64_t stride, int64_t n,
                        int64_t cols) {
    const sc_dtype dt = (sc_dtype)st->pool_dtype;
    if (cols == stride) {
        sc_store_f32(tile, sc_pool_at(st, row, elem), dt, n * cols);
        return;
    }
    for (int64_t i = 0; i < n; i++) sc_store_f32(tile + i * cols, sc_pool_at(st, row, elem + i * stride), dt, cols);
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
/* kv_step for cw = 8 * NV columns, NV <= 4: v and the accumulators stay in
 * registers for the whole pass down the rows. */
static inline __attribute__((always_inline)) void kv_step8_impl(const float *in, int64_t ins, float *out,
                                                                int64_t outs, int64_t S, const int NV,
                                                                const float *k, const float *v, const float *q,
                                                                const float *e, float bonus, const int gla, float *o) {
    __m256 acc[4], vv[4];
    for (int c = 0; c < NV; c++) {
        acc[c] = _mm256_setzero_ps();
        vv[c] = _mm256_loadu_ps(v + 8 * c);
    }
    for (int64_t i = 0; i < S; i++) {
        const __m256 kb = _mm256_set1_ps(k[i]), qb = _mm256_set1_ps(q[i]), eb = _mm256_set1_ps(e[i]);
        const float *src = in + i * ins;
        float *dst = out + i * outs;
        for (int c = 0; c < NV; c++) {
            const __m256 x = _mm256_loadu_ps(src + 8 * c);
            const __m256 n = _mm256_fmadd_ps(x, eb, _mm256_mul_ps(kb, vv[c]));
            _mm256_storeu_ps(dst + 8 * c, n);
            acc[c] = _mm256_fmadd_ps(qb, gla ? n : x, acc[c]);
        }
    }
    const __m256 bb = _mm256_set1_ps(bonus);
    for (int c = 0; c < NV; c++) _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(bb, vv[c], acc[c]));
}

#define SC_KV8(NV, GLA)                                                                                      \
    static void kv_step8_##NV##_##GLA(const float *in, int64_t ins, float *out, int64_t outs, int64_t S,     \
                                      const float *k, const float *v, const float *q, const float *e,        \
                                      float bonus, float *o) {                                               \
        kv_step8_impl(in, ins, out, outs, S, NV, k, v, q, e, bonus, GLA, o);                                 \
    }
SC_KV8(1, 0)
SC_KV8(2, 0)
SC_KV8(3, 0)
SC_KV8(4, 0)
SC_KV8(1, 1)
SC_KV8(2, 1)
SC_KV8(3, 1)
SC_KV8(4, 1)
#undef SC_KV8

typedef void (*kv_step8_fn)(const float *, int64_t, float *, int64_t, int64_t, const float *, const float *,
                            const float *, const float *, float, float *);
static const kv_step8_fn kv_step8[2][5] = {
    {NULL, kv_step8_1_0, kv_step8_2_0, kv_step8_3_0, kv_step8_4_0},
    {NULL, kv_step8_1_1, kv_step8_2_1, kv_step8_3_1, kv_step8_4_1},
};
#endif

/* Per-thread scratch of the linear-attention units. */
typedef struct {
    float *in[6]; /* packed per-token vectors, [max_tokens][S] each */
    float *bonus; /* RWKV-6: per token, sum_i r[i] u[i] k[i] (r already scaled) */
    float *tile;
} la_scratch;

static la_scratch la_scratch_new(int64_t max_tokens, int64_t S, int n_in, size_t tile_floats) {
    la_scratch sc;
    const size_t per = (size_t)(max_tokens > 0 ? max_tokens : 1) * (size_t)S;
    for (int m = 0; m < 6; m++) sc.in[m] = m < n_in ? (float *)sc_alloc(sizeof(float) * per) : NULL;
    sc.bonus = (float *)sc_alloc(sizeof(float) * (size_t)(max_tokens > 0 ? max_tokens : 1));
    sc.tile = (float *)sc_alloc(sizeof(float) * tile_floats);
    return sc;
}

static void la_scratch_free(la_scratch *sc) {
    for (int m = 0; m < 6; m++) free(sc->in[m]);
    free(sc->bonus);
    free(sc->tile);
}

/* One (sequence, head) of RWKV-6 (kind LA_RWKV6: q = r, e = exp(w), bonus)
 * or GLA: the packed vectors are in sc (q, k, v, e in sc->in[0..3]). */
static void kv_unit(const sc_state *st, int64_t s, int64_t h, int64_t H, int64_t S, int kind, la_scratch *sc,
                    float *o) {
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t head_off = h * S * S, r0 = sc_snap_row(st, s, 0);
    const int gla = kind == LA_GLA;
    const int direct = st->pool_dtype == SC_F32 && n_t > 0;
    float *start = (float *)sc_pool_at(st, st->start_rows[s], head_off);
    float *final = direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, head_off) : NULL;
    const float *qs = sc->in[0], *ks = sc->in[1], *vs = sc->in[2], *es = sc->in[3];
    copy_input_state(st, s, n_t, head_off, S * S);
    for (int64_t j0 = 0; j0 < S; j0 += SC_LA_COLS) {
        const int64_t cw = S - j0 < SC_LA_COLS ? S - j0 : SC_LA_COLS;
        if (!direct && n_t > 0) load_block(st, st->start_rows[s], head_off + j0, S, S, cw, sc->tile);
        for (int64_t t = 0; t < n_t; t++) {
            const float *in = t == 0 && direct ? start + j0 : sc->tile;
            const int64_t ins = t == 0 && direct ? S : cw;
            float *out = t == n_t - 1 && final ? final + j0 : sc->tile;
            const int64_t outs = t == n_t - 1 && final ? S : cw;
            const float *kt = ks + t * S, *vt = vs + t * S + j0, *qt = qs + t * S, *et = es + t * S;
            const float bonus = gla ? 0.0f : sc->bonus[t];
            float *ot = o + ((t0 + t) * H + h) * S + j0;
#ifdef SC_HAVE_AVX2
            if (cw % 8 == 0)
                kv_step8[gla][cw / 8](in, ins, out, outs, S, kt, vt, qt, et, bonus, ot);
            else
#endif
                kv_step(in, ins, out, outs, S, cw, kt, vt, qt, et, bonus, gla, ot);
            const int64_t rj = sc_snap_row(st, s, n_t - 1 - t);
            if (out == sc->tile && rj >= 0) store_block(st, sc->tile, rj, head_off + j0, S, S, cw);
        }
    }
}

/* The threads of a call: units (sequence, head) split evenly. */
static int la_team(const sc_state *st, int64_t H, int64_t S, int n_threads) {
    /* state streamed: every token passes over it, plus the rows written */
    const int64_t work = H * S * S * (int64_t)sizeof(float) * (st->n_tokens + st->n_seqs * sc_max_written(st));
    return sc_state_team(st->n_seqs * H, work, n_threads);
}

static void kv_call(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *e,
                    const float *u, int kind, float *o, float scale, int64_t H, int64_t S, int n_threads) {
    const int team = la_team(st, H, S, n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        la_scratch sc = la_scratch_new(st->max_tokens, S, 4, (size_t)(S * SC_LA_COLS));
        int64_t lo, hi;
        sc_split(st->n_seqs * H, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t unit = lo; unit < hi; unit++) {
            const int64_t s = unit / H, h = unit % H;
            const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
            pack(q, t0, h, n_t, S, scale, 0, sc.in[0]);
            pack(k, t0, h, n_t, S, 1.0f, 0, sc.in[1]);
            pack(v, t0, h, n_t, S, 1.0f, 0, sc.in[2]);
            pack(e, t0, h, n_t, S, 1.0f, 1, sc.in[3]);
            if (kind == LA_RWKV6) {
                const float *uh = u + h * S;
                for (int64_t t = 0; t < n_t; t++) {
                    const float *rt = sc.in[0] + t * S, *kt = sc.in[1] + t * S;
                    float b = 0.0f;
#pragma omp simd reduction(+ : b)
                    for (int64_t i = 0; i < S; i++) b += rt[i] * uh[i] * kt[i];
                    sc.bonus[t] = b;
                }
            }
            kv_unit(st, s, h, H, S, kind, &sc, o);
        }
        la_scratch_free(&sc);
    }
}

/* ---- RWKV-7: value-major blocks, row tiles ----------------------------------- */

#ifdef SC_HAVE_AVX2
/* wkv7_rows on NR <= 4 rows, S % 8 == 0.  The a-dot takes two accumulators
 * per row (even and odd chunks) so that it is not bound by FMA latency; the
 * update and the r-dot load the shared vectors once for all NR rows. */
static inline __attribute__((always_inline)) void wkv7_rows8_impl(const float *in, float *out, const int NR,
                                                                  int64_t S, const float *r, const float *e,
                                                                  const float *k, const float *v, const float *a,
                                                                  const float *b, float *o) {
    __m256 p[4], q[4], sa[4], vi[4], acc[4];
    for (int m = 0; m < NR; m++) p[m] = q[m] = acc[m] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= S; j += 16) {
        const __m256 a0 = _mm256_loadu_ps(a + j), a1 = _mm256_loadu_ps(a + j + 8);
        for (int m = 0; m < NR; m++) {
            p[m] = _mm256_fmadd_ps(_mm256_loadu_ps(in + m * S + j), a0, p[m]);
            q[m] = _mm256_fmadd_ps(_mm256_loadu_ps(in + m * S + j + 8), a1, q[m]);
        }
    }
    if (j < S) {
        const __m256 a0 = _mm256_loadu_ps(a + j);
        for (int m = 0; m < NR; m++) p[m] = _mm256_fmadd_ps(_mm256_loadu_ps(in + m * S + j), a0, p[m]);
    }
    float dots[4];
    for (int m = 0; m < NR; m++) p[m] = _mm256_add_ps(p[m], q[m]);
    for (int m = NR; m < 4; m++) p[m] = p[0];
    _mm_storeu_ps(dots, sc_hsum4x8(p[0], p[1], p[2], p[3]));
    for (int m = 0; m < NR; m++) {
        sa[m] = _mm256_set1_ps(dots[m]);
        vi[m] = _mm256_set1_ps(v[m]);
    }
    for (j = 0; j < S; j += 8) {
        const __m256 ej = _mm256_loadu_ps(e + j), bj = _mm256_loadu_ps(b + j);
        const __m256 kj = _mm256_loadu_ps(k + j), rj = _mm256_loadu_ps(r + j);
        for (int m = 0; m < NR; m++) {
            const __m256 add = _mm256_fmadd_ps(sa[m], bj, _mm256_mul_ps(vi[m], kj));
            const __m256 n = _mm256_fmadd_ps(_mm256_loadu_ps(in + m * S + j), ej, add);
            _mm256_storeu_ps(out + m * S + j, n);
            acc[m] = _mm256_fmadd_ps(n, rj, acc[m]);
        }
    }
    for (int m = NR; m < 4; m++) acc[m] = acc[0];
    float outs[4];
    _mm_storeu_ps(outs, sc_hsum4x8(acc[0], acc[1], acc[2], acc[3]));
    for (int m = 0; m < NR; m++) o[m] = outs[m];
}

static void wkv7_rows8_4(const float *in, float *out, int64_t S, const float *r, const float *e, const float *k,
                         const float *v, const float *a, const float *b, float *o) {
    wkv7_rows8_impl(in, out, 4, S, r, e, k, v, a, b, o);
}

static void wkv7_rows8_1(const float *in, float *out, int64_t S, const float *r, const float *e, const float *k,
                         const float *v, const float *a, const float *b, float *o) {
    wkv7_rows8_impl(in, out, 1, S, r, e, k, v, a, b, o);
}
#endif

/* One token over rows [0, n) (row stride S, in and out the same memory or
 * disjoint): sa = a . S[i]; S[i][j] = S[i][j] * e[j] + (sa * b[j] + v[i] * k[j]);
 * o[i] = S[i] . r (r already scaled). */
static void wkv7_rows(const float *in, float *out, int64_t n, int64_t S, const float *r, const float *e,
                      const float *k, const float *v, const float *a, const float *b, float *o) {
    int64_t i = 0;
#ifdef SC_HAVE_AVX2
    if (S % 8 == 0) {
        for (; i + 4 <= n; i += 4) wkv7_rows8_4(in + i * S, out + i * S, S, r, e, k, v + i, a, b, o + i);
        for (; i < n; i++) wkv7_rows8_1(in + i * S, out + i * S, S, r, e, k, v + i, a, b, o + i);
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

static void wkv7_unit(const sc_state *st, int64_t s, int64_t h, int64_t H, int64_t S, int64_t tile_rows,
                      la_scratch *sc, float *o) {
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t head_off = h * S * S, r0 = sc_snap_row(st, s, 0);
    const int direct = st->pool_dtype == SC_F32 && n_t > 0;
    float *start = (float *)sc_pool_at(st, st->start_rows[s], head_off);
    float *final = direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, head_off) : NULL;
    const float *rs = sc->in[0], *es = sc->in[1], *ks = sc->in[2], *vs = sc->in[3], *as = sc->in[4], *bs = sc->in[5];
    copy_input_state(st, s, n_t, head_off, S * S);
    for (int64_t i0 = 0; i0 < S; i0 += tile_rows) {
        const int64_t nr = S - i0 < tile_rows ? S - i0 : tile_rows;
        const int64_t off = i0 * S;
        if (!direct && n_t > 0) load_block(st, st->start_rows[s], head_off + off, S, nr, S, sc->tile);
        for (int64_t t = 0; t < n_t; t++) {
            const float *in = t == 0 && direct ? start + off : sc->tile;
            float *out = t == n_t - 1 && final ? final + off : sc->tile;
            wkv7_rows(in, out, nr, S, rs + t * S, es + t * S, ks + t * S, vs + t * S + i0, as + t * S, bs + t * S,
                      o + ((t0 + t) * H + h) * S + i0);
            const int64_t rj = sc_snap_row(st, s, n_t - 1 - t);
            if (out == sc->tile && rj >= 0) store_block(st, sc->tile, rj, head_off + off, S, nr, S);
        }
    }
}

/* ---- entry points ---------------------------------------------------------------- */

/* Widened float32 views of the inputs and a float32 output (see sc_internal.h). */
typedef struct {
    sc_view f[6];
    float *own[6];
    float *o;
} la_io;

static la_io la_widen(const sc_view *const *in, int n_in, void *o, sc_dtype o_dtype, int64_t T, int64_t H,
                      int64_t S) {
    la_io io;
    for (int m = 0; m < 6; m++) io.own[m] = NULL;
    for (int m = 0; m < n_in; m++) io.f[m] = sc_widen3(in[m], T, H, S, &io.own[m]);
    io.o = sc_output_f32(o, o_dtype, T * H * S);
    return io;
}

static void la_finish(la_io *io, void *o, sc_dtype o_dtype, int64_t n) {
    sc_narrow_output(io->o, o, o_dtype, n);
    for (int m = 0; m < 6; m++) free(io->own[m]);
}

void sc_rwkv_wkv6(const sc_state *st, const sc_view *r, const sc_view *k, const sc_view *v, const sc_view *w,
                  const float *u, void *o, sc_dtype o_dtype, float scale, int64_t n_head, int64_t head_size,
                  int n_threads) {
    const sc_view *in[4] = {r, k, v, w};
    la_io io = la_widen(in, 4, o, o_dtype, st->n_tokens, n_head, head_size);
    kv_call(st, &io.f[0], &io.f[1], &io.f[2], &io.f[3], u, LA_RWKV6, io.o, scale, n_head, head_size, n_threads);
    la_finish(&io, o, o_dtype, st->n_tokens * n_head * head_size);
}

void sc_gated_linear_attn(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                          void *o, sc_dtype o_dtype, float scale, int64_t n_head, int64_t head_size, int n_threads) {
    const sc_view *in[4] = {q, k, v, g};
    la_io io = la_widen(in, 4, o, o_dtype, st->n_tokens, n_head, head_size);
    kv_call(st, &io.f[0], &io.f[1], &io.f[2], &io.f[3], NULL, LA_GLA, io.o, scale, n_head, head_size, n_threads);
    la_finish(&io, o, o_dtype, st->n_tokens * n_head * head_size);
}

void sc_rwkv_wkv7(const sc_state *st, const sc_view *r, const sc_view *w, const sc_view *k, const sc_view *v,
                  const sc_view *a, const sc_view *b, void *o, sc_dtype o_dtype, float scale, int64_t n_head,
                  int64_t head_size, int n_threads) {
    const int64_t H = n_head, S = head_size;
    const sc_view *in[6] = {r, w, k, v, a, b};
    la_io io = la_widen(in, 6, o, o_dtype, st->n_tokens, H, S);
    int64_t tile_rows = SC_LA_ROW_TILE_BYTES / 4 / (S > 0 ? S : 1);
    tile_rows = tile_rows < 4 ? 4 : tile_rows - tile_rows % 4;
    const int team = la_team(st, H, S, n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        la_scratch sc = la_scratch_new(st->max_tokens, S, 6, (size_t)(tile_rows * S));
        int64_t lo, hi;
        sc_split(st->n_seqs * H, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t unit = lo; unit < hi; unit++) {
            const int64_t s = unit / H, h = unit % H;
            const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
            for (int m = 0; m < 6; m++) pack(&io.f[m], t0, h, n_t, S, m == 0 ? scale : 1.0f, m == 1, sc.in[m]);
            wkv7_unit(st, s, h, H, S, tile_rows, &sc, io.o);
        }
        la_scratch_free(&sc);
    }
    la_finish(&io, o, o_dtype, st->n_tokens * H * S);
}
