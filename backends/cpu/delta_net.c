/* Gated delta rule (scalar gate = GDN, per-key gate = KDA), with snapshots.
 *
 * Tokens are packed (sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s+1]-1);
 * a unit depends only on its own sequence, so a packed call computes every
 * sequence exactly as a call of its own would.  The options (q/k head map,
 * q/k L2 normalisation, the gate and beta from raw projections) are applied
 * while a unit packs its per-token vectors, once per (sequence, head).
 *
 * Storage per value head is [j][i] = M[i][j] (i = key index, fastest).  For a
 * fixed token every row j of that block evolves on its own: it is decayed,
 * dotted with k to form delta[j], updated by k * delta[j] and dotted with q.
 * So, as in the Mamba-2 scan, a work unit is (sequence, value head) and it
 * walks a tile of rows (up to 32 KiB) through every token with the tile in
 * L1, vectorised over the key index; the AVX2 path takes four rows per pass
 * (see gdn_rows_impl).  Read-before-write per slice as in ssm_scan.c. */
#include "sc_gemm.h"

/* Rows per tile: 32 KiB of f32 at head size 128, L1-resident for all tokens. */
#define SC_GDN_TILE_BYTES 32768

/* q or k[t0 .. t0 + n_t, h, :] as token rows at stride *t_stride: the view
 * itself when its last stride is 1, nothing is normalised and no copy is
 * forced, else a packed (L2-normalised when `eps` >= 0) copy in `scratch`. */
static const float *pack_tokens(const sc_view *v, int64_t t0, int64_t h, int64_t n_t, int64_t n, float eps,
                                int force, float *scratch, int64_t *t_stride) {
    const float *base = v->data + t0 * v->strides[0] + h * v->strides[1];
    if (v->strides[2] == 1 && eps < 0.0f && !force) {
        *t_stride = v->strides[0];
        return base;
    }
    for (int64_t t = 0; t < n_t; t++) {
        float *row = scratch + t * n;
        if (t + SC_PREFETCH_ROWS < n_t) sc_prefetch_run(base + (t + SC_PREFETCH_ROWS) * v->strides[0], n, v->strides[2]);
        if (v->strides[2] == 1)
            memcpy(row, base + t * v->strides[0], sizeof(float) * (size_t)n);
        else
            for (int64_t i = 0; i < n; i++) row[i] = base[t * v->strides[0] + i * v->strides[2]];
        if (eps >= 0.0f) {
            float ss = 0.0f;
            for (int64_t i = 0; i < n; i++) ss += row[i] * row[i];
            const float inv = 1.0f / sqrtf(ss + eps);
            for (int64_t i = 0; i < n; i++) row[i] *= inv;
        }
    }
    *t_stride = n;
    return scratch;
}

#ifdef SC_HAVE_AVX2
/* One token over rows of a head, AVX2 (S % 8 == 0), as two passes per group
 * of four rows.  The k-dot is taken on the state before the token, the
 * decay folded into the vector it dots with,
 *     kd = (g * M) . k = M . (g k),   delta = (v - kd) beta,
 * so the first pass (gdn_kdots4) only reads the rows; the second
 * (gdn_update4) reads them again from L1, writes M' = g * M + k delta once
 * and dots M' with q.  The former form wrote every element twice (the
 * decayed row, then the updated one): Zen 4 retires one 256-bit store per
 * cycle, so those two stores per 8 elements cost as much as the four
 * multiply-adds they came with.  The multiply-adds stay four (k-dot,
 * decay, update, q-dot), with half the stores.  The output still comes
 * from the updated row, so a NaN made in the state (inf - inf) reaches it
 * as the definition says (an output taken as M . (g q) + delta (k . q)
 * read inf where the reference has NaN).  The k-dots of the next group
 * are taken before this group's update, so the update never waits on
 * their horizontal sums.  16 heads of 128, decode, C calls on this host
 * (Zen 4), fastest of 300-2000, old and new alternated: one sequence, one
 * thread 25.4-25.8 -> 23.0-23.7 us, two threads 12.6-12.8 -> 11.9-12.5;
 * eight sequences (8 MiB, from L3), one thread 226-230 -> 201-205 us, two
 * threads 115-118 -> 102-104; KDA, eight sequences, one thread 276-280 ->
 * 248-259.  The rounding of kd differs from the former form's
 * (so the state's and the output's bits), within the conformance
 * tolerances; every path of a head size (decode, the token loop of a
 * prefill, streamed or not, any thread count) runs these functions, so
 * they agree bit for bit. */
static inline __attribute__((always_inline)) void gdn_kdots4(const float *in, int64_t S, const float *gk, float *kd,
                                                             const float *pf) {
    const float *i0 = in, *i1 = i0 + S, *i2 = i1 + S, *i3 = i2 + S;
    __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0, c0 = d0, c1 = d0, c2 = d0, c3 = d0;
    int64_t i = 0;
#pragma GCC unroll 8
    for (; i + 16 <= S; i += 16) {
        _mm_prefetch((const char *)(pf + 4 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 4 * i + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 4 * i + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 4 * i + 48), _MM_HINT_T0);
        const __m256 a = _mm256_loadu_ps(gk + i), b = _mm256_loadu_ps(gk + i + 8);
        d0 = _mm256_fmadd_ps(_mm256_loadu_ps(i0 + i), a, d0);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(i0 + i + 8), b, c0);
        d1 = _mm256_fmadd_ps(_mm256_loadu_ps(i1 + i), a, d1);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(i1 + i + 8), b, c1);
        d2 = _mm256_fmadd_ps(_mm256_loadu_ps(i2 + i), a, d2);
        c2 = _mm256_fmadd_ps(_mm256_loadu_ps(i2 + i + 8), b, c2);
        d3 = _mm256_fmadd_ps(_mm256_loadu_ps(i3 + i), a, d3);
        c3 = _mm256_fmadd_ps(_mm256_loadu_ps(i3 + i + 8), b, c3);
    }
    if (i < S) { /* S % 16 == 8 */
        _mm_prefetch((const char *)(pf + 4 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(pf + 4 * i + 16), _MM_HINT_T0);
        const __m256 a = _mm256_loadu_ps(gk + i);
        d0 = _mm256_fmadd_ps(_mm256_loadu_ps(i0 + i), a, d0);
        d1 = _mm256_fmadd_ps(_mm256_loadu_ps(i1 + i), a, d1);
        d2 = _mm256_fmadd_ps(_mm256_loadu_ps(i2 + i), a, d2);
        d3 = _mm256_fmadd_ps(_mm256_loadu_ps(i3 + i), a, d3);
    }
    _mm_storeu_ps(kd, sc_hsum4x8(_mm256_add_ps(d0, c0), _mm256_add_ps(d1, c1), _mm256_add_ps(d2, c2),
                                 _mm256_add_ps(d3, c3)));
}

/* out row = in row * g + k * delta[row] for four rows, and the dots of the
 * new rows with q into ot[0..4) (times scale).  `stream`: `out` is an
 * aligned pool row other than `in` (a large call or decode, see
 * sc_stream_rows) and S % 16 == 0: each 64-byte line leaves with two
 * back-to-back non-temporal stores, finished as soon as it is started (see
 * update_rows in ssm_scan.c).  The same values either way. */
static inline __attribute__((always_inline)) void gdn_update4(const float *in, float *out, int64_t S, const float *kt,
                                                              const float *qt, const float *et, float es,
                                                              const float *delta, float scale, float *ot,
                                                              const int stream) {
    const float *i0 = in, *i1 = i0 + S, *i2 = i1 + S, *i3 = i2 + S;
    float *w0 = out, *w1 = w0 + S, *w2 = w1 + S, *w3 = w2 + S;
    const __m256 e0 = _mm256_set1_ps(delta[0]), e1 = _mm256_set1_ps(delta[1]);
    const __m256 e2 = _mm256_set1_ps(delta[2]), e3 = _mm256_set1_ps(delta[3]);
    const __m256 gs = _mm256_set1_ps(es);
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
#define SC_GDN_ROW(ir, wr, er, acc)                                                                                    \
    {                                                                                                                  \
        const __m256 lo = _mm256_fmadd_ps(k, er, _mm256_mul_ps(_mm256_loadu_ps(ir + i), g));                           \
        const __m256 hi = _mm256_fmadd_ps(k8, er, _mm256_mul_ps(_mm256_loadu_ps(ir + i + 8), g8));                     \
        if (stream) {                                                                                                  \
            _mm256_stream_ps(wr + i, lo);                                                                              \
            _mm256_stream_ps(wr + i + 8, hi);                                                                          \
        } else {                                                                                                       \
            _mm256_storeu_ps(wr + i, lo);                                                                              \
            _mm256_storeu_ps(wr + i + 8, hi);                                                                          \
        }                                                                                                              \
        acc = _mm256_fmadd_ps(hi, _mm256_loadu_ps(qt + i + 8), _mm256_fmadd_ps(lo, _mm256_loadu_ps(qt + i), acc));    \
    }
    int64_t i = 0;
#pragma GCC unroll 8
    for (; i + 16 <= S; i += 16) {
        const __m256 g = et ? _mm256_loadu_ps(et + i) : gs, g8 = et ? _mm256_loadu_ps(et + i + 8) : gs;
        const __m256 k = _mm256_loadu_ps(kt + i), k8 = _mm256_loadu_ps(kt + i + 8);
        SC_GDN_ROW(i0, w0, e0, o0)
        SC_GDN_ROW(i1, w1, e1, o1)
        SC_GDN_ROW(i2, w2, e2, o2)
        SC_GDN_ROW(i3, w3, e3, o3)
    }
#undef SC_GDN_ROW
    if (i < S) { /* S % 16 == 8 (never streamed) */
        const __m256 g = et ? _mm256_loadu_ps(et + i) : gs, k = _mm256_loadu_ps(kt + i), q = _mm256_loadu_ps(qt + i);
        const __m256 m0 = _mm256_fmadd_ps(k, e0, _mm256_mul_ps(_mm256_loadu_ps(i0 + i), g));
        const __m256 m1 = _mm256_fmadd_ps(k, e1, _mm256_mul_ps(_mm256_loadu_ps(i1 + i), g));
        const __m256 m2 = _mm256_fmadd_ps(k, e2, _mm256_mul_ps(_mm256_loadu_ps(i2 + i), g));
        const __m256 m3 = _mm256_fmadd_ps(k, e3, _mm256_mul_ps(_mm256_loadu_ps(i3 + i), g));
        _mm256_storeu_ps(w0 + i, m0);
        _mm256_storeu_ps(w1 + i, m1);
        _mm256_storeu_ps(w2 + i, m2);
        _mm256_storeu_ps(w3 + i, m3);
        o0 = _mm256_fmadd_ps(m0, q, o0);
        o1 = _mm256_fmadd_ps(m1, q, o1);
        o2 = _mm256_fmadd_ps(m2, q, o2);
        o3 = _mm256_fmadd_ps(m3, q, o3);
    }
    _mm_storeu_ps(ot, _mm_mul_ps(_mm_set1_ps(scale), sc_hsum4x8(o0, o1, o2, o3)));
}

/* The largest head size the AVX2 rows take (their g k vector lives on the
 * stack); larger heads take the scalar loop of gdn_token_unit. */
#define SC_GDN_ROWS_MAX_S 2048

/* Rows ahead of the group whose k-dots run that those dots fetch (a group
 * of 128-key rows is 2 KiB).  A 16-head decode of 8 sequences (8 MiB, from
 * L3) on one thread, fastest of 300 calls, three runs alternated: rows
 * ahead 0 (the rows being read: no help) 221-297 us, 4: 208-212, 8:
 * 208-210, 16: 212-222. */
#ifndef SC_GDN_AHEAD
#define SC_GDN_AHEAD 8
#endif

/* One token over rows [0, n) (n % 4 == 0, S % 8 == 0, S <= SC_GDN_ROWS_MAX_S;
 * in and out the same memory or disjoint): the two passes above, group by
 * group, the k-dots of group r + 4 before the update of group r (streamed:
 * of group r, see below).  `stream` as for gdn_update4. */
static inline __attribute__((always_inline)) void gdn_rows_impl(const float *in, float *out, int64_t n, int64_t S,
                                                                const float *kt, const float *qt, const float *et,
                                                                float es, const float *vt, int64_t vstride,
                                                                float beta, float scale, float *ot, const int stream) {
    float gk[S] __attribute__((aligned(32)));
    const __m256 gs = _mm256_set1_ps(es);
    for (int64_t i = 0; i < S; i += 8)
        _mm256_store_ps(gk + i, _mm256_mul_ps(et ? _mm256_loadu_ps(et + i) : gs, _mm256_loadu_ps(kt + i)));
    /* The passes load g k from memory: without this barrier GCC forwarded
     * the stores above into vector values held across the unrolled
     * passes, which spilled. */
    __asm__ volatile("" ::: "memory");
    float kd[8]; /* group r's k-dots at (r & 4) */
    if (stream) {
        /* Streamed rows come from memory (a rotated plane of a large call):
         * each group's k-dots just before its update, its source fetched
         * SC_STREAM_PREFETCH_BYTES ahead in one burst as before.  With the
         * k-dots of the next group first (the in-place order below), the
         * source's misses shared the fill buffers with the open streamed
         * lines: a rotated decode over 16 pools of 8 x 1 MiB (from memory),
         * one thread, 770-870 us per call against 460-515 before this
         * change; in this order 490-560. */
        for (int64_t r = 0; r < n; r += 4) {
            float delta[4];
            sc_prefetch_ahead(in + r * S, 4 * S * (int64_t)sizeof(float));
            gdn_kdots4(in + r * S, S, gk, kd, in + r * S);
            for (int j = 0; j < 4; j++) delta[j] = (vt[(r + j) * vstride] - kd[j]) * beta;
            gdn_update4(in + r * S, out + r * S, S, kt, qt, et, es, delta, scale, ot + r, stream);
        }
        return;
    }
    if (n > 0) gdn_kdots4(in, S, gk, kd, in + SC_GDN_AHEAD * S);
    for (int64_t r = 0; r < n; r += 4) {
        const int64_t c = r & 4, nx = (r + 4) & 4;
        float delta[4];
        for (int j = 0; j < 4; j++) delta[j] = (vt[(r + j) * vstride] - kd[c + j]) * beta;
        if (r + 4 < n) gdn_kdots4(in + (r + 4) * S, S, gk, kd + nx, in + (r + 4 + SC_GDN_AHEAD) * S);
        gdn_update4(in + r * S, out + r * S, S, kt, qt, et, es, delta, scale, ot + r, stream);
    }
}

/* gdn_rows_impl with the model head sizes compiled apart (their loops
 * unroll; see wkv7_rows in linear_attn.c), streamed or not. */
static __attribute__((noinline)) void gdn_rows(const float *in, float *out, int64_t n, int64_t S, const float *kt,
                                                const float *qt, const float *et, float es, const float *vt,
                                                int64_t vstride, float beta, float scale, float *ot, int stream) {
    if (stream && S == 128)
        gdn_rows_impl(in, out, n, 128, kt, qt, et, es, vt, vstride, beta, scale, ot, 1);
    else if (stream)
        gdn_rows_impl(in, out, n, S, kt, qt, et, es, vt, vstride, beta, scale, ot, 1);
    else if (S == 128)
        gdn_rows_impl(in, out, n, 128, kt, qt, et, es, vt, vstride, beta, scale, ot, 0);
    else if (S == 64)
        gdn_rows_impl(in, out, n, 64, kt, qt, et, es, vt, vstride, beta, scale, ot, 0);
    else
        gdn_rows_impl(in, out, n, S, kt, qt, et, es, vt, vstride, beta, scale, ot, 0);
}
#endif

/* What a unit needs of its (sequence, value head): per-token vectors after
 * the options were applied (k and q normalised when asked, the log decay
 * after the raw-gate map, beta after its sigmoid). */
typedef struct {
    int64_t S, n_t, per; /* per: 1 (scalar gate) or S (KDA) */
    const float *k, *q;  /* token rows at strides kts, qts */
    int64_t kts, qts;
    const float *v; /* token rows at stride vts, elements at stride ves */
    int64_t vts, ves;
    float *g;          /* [n_t][per] log decays at row stride gts (exp'd in place by the token loop) */
    int64_t gts;       /* per, or (gates_in_view) the view's token stride */
    const float *beta; /* [n_t] */
    float *o;          /* token rows at stride ots */
    int64_t ots;
    float scale;
    int stream; /* a large call: outputs written with non-temporal stores */
    /* The chunked form packs its chunks itself: the views, the token the
     * sequence starts at, the q/k head and value head, the L2 epsilon (< 0:
     * none). */
    const sc_view *kv, *qv, *vv;
    int64_t t0, hk, h;
    float eps;
    /* KDA's chunked form reads the gates in place (no raw-gate map, unit
     * stride) from the view gv, fetching each chunk's rows with its k, q, v:
     * a copy of the whole head's gates up front waited on every row. */
    int gates_in_view;
    const sc_view *gv;
} gdn_unit;

/* The token loop over one unit (see the top of the file); g holds the
 * decays themselves (exp of the log decays). */
static void gdn_token_unit(const sc_state *st, int64_t s, int64_t head_off, const gdn_unit *u, int64_t tile_rows,
                           int stream, float *tile) {
    const int64_t S = u->S, n_t = u->n_t;
    const int kda = u->per > 1;
    const sc_dtype pool_dtype = (sc_dtype)st->pool_dtype;
    const int64_t r0 = sc_snap_row(st, s, 0);
    /* One token from an f32 pool reads and writes pool rows and never the
     * tile: the whole head is one span (one run of gdn_rows, not
     * one per tile). */
    const int64_t span = n_t == 1 && pool_dtype == SC_F32 && r0 >= 0 ? S : tile_rows;
    for (int64_t j0 = 0; j0 < S; j0 += span) {
        const int64_t jr = S - j0 < span ? S - j0 : span;
        const int64_t off = head_off + j0 * S;
        /* f32 pools: the first token reads the start row and the last
         * writes column 0 in place, as in ssm_scan.c. */
        const int direct = pool_dtype == SC_F32 && n_t > 0;
        char *start = sc_pool_at(st, st->start_rows[s], off);
        if (!direct) sc_load_f32(start, pool_dtype, tile, jr * S);
        /* The input state: undoing the whole call is exact. */
        sc_copy_input_state(st, s, n_t, off, direct ? NULL : tile, jr * S);
        for (int64_t t = 0; t < n_t; t++) {
            const float *SC_RESTRICT kt = u->k + t * u->kts;
            const float *SC_RESTRICT qt = u->q + t * u->qts;
            const float *SC_RESTRICT et = kda ? u->g + t * S : NULL;
            const float es_t = kda ? 1.0f : u->g[t];
            const float b = u->beta[t];
            float *ot = u->o + t * u->ots + j0;
            const float *vt = u->v + t * u->vts + j0 * u->ves;
            const int64_t j = n_t - 1 - t;
            const float *in = t == 0 && direct ? (const float *)start : tile;
            float *out = j == 0 && direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, off) : tile;
            int64_t r = 0;
#ifdef SC_HAVE_AVX2
            if (S % 8 == 0 && S <= SC_GDN_ROWS_MAX_S) {
                /* a disjoint, aligned pool row of a large call or decode (sc_stream_rows): streamed */
                const int via = stream && S % 16 == 0 && out != tile && out != in && ((uintptr_t)out & 31) == 0;
                r = jr - jr % 4;
                gdn_rows(in, out, r, S, kt, qt, et, es_t, vt, u->ves, b, u->scale, ot, via);
            }
#endif
            for (; r < jr; r++) {
                const float *rin = in + r * S; /* the same row as `row` or disjoint from it */
                float *row = out + r * S;
                float kd = 0.0f;
                if (kda) {
#pragma omp simd reduction(+ : kd)
                    for (int64_t i = 0; i < S; i++) {
                        float m = rin[i] * et[i];
                        row[i] = m;
                        kd += m * kt[i];
                    }
                } else {
#pragma omp simd reduction(+ : kd)
                    for (int64_t i = 0; i < S; i++) {
                        float m = rin[i] * es_t;
                        row[i] = m;
                        kd += m * kt[i];
                    }
                }
                const float delta = (vt[r * u->ves] - kd) * b;
                float oq = 0.0f;
#pragma omp simd reduction(+ : oq)
                for (int64_t i = 0; i < S; i++) {
                    float m = row[i] + kt[i] * delta;
                    row[i] = m;
                    oq += m * qt[i];
                }
                ot[r] = u->scale * oq;
            }
            const int64_t rj = sc_snap_row(st, s, j);
            if (out == tile && rj >= 0) sc_store_f32(tile, sc_pool_at(st, rj, off), pool_dtype, jr * S);
        }
    }
}

#ifdef SC_HAVE_AVX2
/* -- Prefill in chunked (WY / UT-transform) form --------------------------------
 *
 * flash-linear-attention's chunked form of the gated delta rule, on the CPU.
 * With the state as M [key i][value j], a chunk of L tokens starting from
 * state M0, the decays folded as G_t = sum_{v<=t} g_v (per key for KDA),
 * gam_t = exp(G_t) and Gam[t][u] = exp(G_t - G_u), the token loop is
 *
 *   delta = U - W M0                    (the L value corrections)
 *   U = T (beta v),  W = T (beta gam k),  T = (I + A)^-1,
 *   A[t][u] = beta_t (k_t . Gam[t][u] k_u) for u < t (unit lower triangular
 *             system, solved by forward substitution),
 *   o_t = scale (q_t gam_t) M0 + scale sum_{u<=t} (q_t . Gam[t][u] k_u) delta_u,
 *   M_L = gam_L M0 + sum_u (Gam[L][u] k_u) delta_u^T,
 *
 * all of them products of [L x S] and [S x S] matrices (sc_gemm).  The state
 * is kept key-major (the transpose of the pool's storage) so that every
 * product runs with lanes across values; it is transposed in at the start of
 * a unit and out at each snapshot.  Chunks end at every snapshot position
 * (sc_state_stops), so snapshots are states of the recurrence; the rounding
 * differs from the token loop by the order of the sums only.
 *
 * Each chunk's q, k and v rows are packed (and normalised) as the chunk
 * starts, while the previous chunk's products were fetching them, with
 * KDA's gate rows, which it reads in place (see gates_in_view): rows a head
 * count apart defeat the hardware prefetchers and share L1 sets.  A
 * chunk whose inputs are not all finite, and every token after it, runs the
 * token loop on the key-major state instead (see sc_all_finite).
 *
 * KDA's decays differ per key, so Gam[t][u] cannot leave the dot products
 * q_t . Gam[t][u] k_u as one scalar.  As in fla's KDA kernels the chunk is
 * cut into sub-blocks of 16 rows, each with a reference point R (the
 * cumulative decay just before the block): rows are scaled by
 * exp(G_t - R) <= 1, columns of earlier tokens by exp(R - G_u) <= 1, so one
 * product per sub-block gives every pair without overflow.  Pairs inside a
 * sub-block need exp(R - G_u) >= 1 for the block's own keys: used while the
 * block's decay span stays below SC_KDA_SPAN (the factors then stay far from
 * overflow), else those pairs are summed element by element with their exact
 * decay. */
#ifndef SC_GDN_CHUNK
#define SC_GDN_CHUNK 16
#endif
/* A unit takes the chunked form when some run between its stops is at least
 * this long; shorter runs of such a unit are chunks of their own. */
#ifndef SC_GDN_CHUNK_MIN
#define SC_GDN_CHUNK_MIN 16
#endif
#define SC_KDA_BLOCK 16
/* Value columns per strip of a chunk's products (see gdn_chunk); a multiple of 8. */
#ifndef SC_GDN_STRIP
#define SC_GDN_STRIP 16
#endif
#define SC_KDA_SPAN 60.0f

/* Scratch of one thread for the chunked form (C = SC_GDN_CHUNK). */
typedef struct {
    float *M;                  /* [S][S] state, key-major (in strips: see gdn_state_to_panels) */
    float *tmp;                /* [S][S] a state in storage layout */
    float *kc, *qc, *vc;       /* [C][S] the chunk's packed k, q, v */
    float *KT;                 /* [S][C] keys transposed (then the decayed keys of the state update) */
    float *Akk, *Aqk, *T, *T2; /* [C][C] */
    float *Vb, *U, *Kb;        /* [C][S]; Vb: token-major scratch */
    float *X, *Y;              /* [2C][S]: [W; gam q] and [W M; gam q M] */
    float *seg, *gam;          /* [C] (scalar gate) */
    float *Gam;                /* [C][C] (scalar gate) */
    float *Gc, *E;             /* [C][S] cumulative log decays, exp(G_t) (KDA) */
    float *XA, *AB;            /* [2 * SC_KDA_BLOCK][S], [2 * SC_KDA_BLOCK][C] (KDA) */
    float *R;                  /* [S] exp of a sub-block's reference (KDA) */
    int keys_factored;         /* KT holds k_u exp(-G_u) for the whole chunk (KDA) */
    int panels;                /* M is in strips (gdn_state_to_panels), else key-major rows */
    int64_t next, n_next;      /* the next chunk's tokens (prefetched meanwhile), rows fetched */
    int64_t *stops;            /* [n_cols + 1] */
} gdn_chunk_ws;

static inline int64_t round8(int64_t n) { return (n + 7) & ~(int64_t)7; }

/* Fetches the next `rows` of the 3 * n_next token rows (k, q, v; and the
 * gates when read in place) of the next chunk: called a few rows at a time from the current chunk's loops,
 * so the misses overlap its arithmetic instead of stalling in a burst. */
static void gdn_fetch_next(const gdn_unit *u, gdn_chunk_ws *w, int64_t len, int64_t rows) {
    const int64_t total = (u->gates_in_view ? 4 : 3) * len;
    for (int64_t r = 0; r < rows && w->n_next < total; r++, w->n_next++) {
        const int64_t which = w->n_next / len, t = u->t0 + w->next + w->n_next % len;
        const sc_view *v = which == 0 ? u->kv : which == 1 ? u->qv : which == 2 ? u->vv : u->gv;
        const int64_t head = which >= 2 ? u->h : u->hk;
        sc_prefetch_run(v->data + t * v->strides[0] + head * v->strides[1], u->S, v->strides[2]);
    }
}

/* Akk and Aqk of a chunk with a scalar gate. */
static void gdn_chunk_pairs_scalar(const gdn_unit *u, gdn_chunk_ws *w, int64_t c0, int64_t L) {
    const int64_t S = u->S, C = SC_GDN_CHUNK, Lp = round8(L);
    const float *g = u->g + c0, *beta = u->beta + c0;
    sc_chunk_decays(g, L, w->seg, w->Gam, C, w->gam); /* Gam[t][u] and gam_t */
    sc_transpose(w->kc, S, w->KT, C, L, S);
    for (int64_t i = 0; i < S; i++)
        for (int64_t v = L; v < Lp; v++) w->KT[i * C + v] = 0.0f;
    sc_gemm(L, Lp, S, w->kc, S, w->KT, C, w->Akk, C, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_C_LOWER, 0);
    sc_gemm(L, Lp, S, w->qc, S, w->KT, C, w->Aqk, C, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_C_LOWER, 1);
    for (int64_t t = 0; t < L; t++) {
        float *ak = w->Akk + t * C, *aq = w->Aqk + t * C;
        const float *Gt = w->Gam + t * C;
        const float b = beta[t];
        for (int64_t v = 0; v < t; v++) ak[v] *= b * Gt[v];
        for (int64_t v = t; v < Lp; v++) ak[v] = 0.0f;
        for (int64_t v = 0; v <= t; v++) aq[v] *= Gt[v];
        for (int64_t v = t + 1; v < Lp; v++) aq[v] = 0.0f;
    }
}

/* Rows v < n of the token-major scratch Vb: k_v exp(R - G_v) (R NULL: 0). */
static void kda_decayed_key_rows(const gdn_unit *u, gdn_chunk_ws *w, const float *R, int64_t n) {
    const int64_t S = u->S;
    for (int64_t v = 0; v < n; v++) {
        const float *Gv = w->Gc + v * S, *kv = w->kc + v * S;
        float *d = w->Vb + v * S;
        for (int64_t i = 0; i < S; i += 8) {
            const __m256 r = R ? _mm256_loadu_ps(R + i) : _mm256_setzero_ps();
            const __m256 e = sc_exp8(_mm256_sub_ps(r, _mm256_loadu_ps(Gv + i)));
            _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_loadu_ps(kv + i), e));
        }
    }
}

/* KT [S][C] = the first n rows of Vb transposed, zero in columns [n, n_pad). */
static void kda_keys_to_columns(gdn_chunk_ws *w, int64_t S, int64_t n, int64_t n_pad) {
    const int64_t C = SC_GDN_CHUNK;
    sc_transpose(w->Vb, S, w->KT, C, n, S);
    for (int64_t i = 0; i < S; i++)
        for (int64_t v = n; v < n_pad; v++) w->KT[i * C + v] = 0.0f;
}

/* Akk and Aqk of a KDA chunk, by sub-blocks (see above); also fills Gc
 * (cumulative log decays) and E (exp(G_t)).  When the chunk is one factored
 * sub-block, KT is left holding k_u exp(-G_u) (w->keys_factored), from which
 * the state update's keys follow by a row scale instead of exps. */
static void gdn_chunk_pairs_kda(const gdn_unit *u, gdn_chunk_ws *w, int64_t c0, int64_t L) {
    const int64_t S = u->S, C = SC_GDN_CHUNK, B = SC_KDA_BLOCK;
    const float *beta = u->beta + c0;
    for (int64_t t = 0; t < L; t++) {
        const float *gt = u->g + (c0 + t) * u->gts, *prev = w->Gc + (t - 1) * S;
        float *Gt = w->Gc + t * S;
        for (int64_t i = 0; i < S; i += 8) {
            const __m256 g = _mm256_loadu_ps(gt + i);
            _mm256_storeu_ps(Gt + i, t ? _mm256_add_ps(_mm256_loadu_ps(prev + i), g) : g);
        }
    }
    w->keys_factored = 0;
    for (int64_t i0 = 0; i0 < L; i0 += B) {
        const int64_t i1 = i0 + B < L ? i0 + B : L, nb = i1 - i0, n_cols = round8(i1);
        const float *R = i0 ? w->Gc + (i0 - 1) * S : NULL, *Glast = w->Gc + (i1 - 1) * S;
        float span = 0.0f;
        for (int64_t i = 0; i < S; i++) {
            const float d = (R ? R[i] : 0.0f) - Glast[i];
            span = d > span ? d : span;
        }
        const int factored = span <= SC_KDA_SPAN; /* NaN spans are not: they take the exact sums */
        if (R)
            for (int64_t i = 0; i < S; i += 8) _mm256_storeu_ps(w->R + i, sc_exp8(_mm256_loadu_ps(R + i)));
        /* Columns of earlier blocks: k_u exp(R - G_u) <= 1. */
        kda_decayed_key_rows(u, w, R, i0);
        /* Rows: beta_t k_t e_t and q_t e_t with e_t = exp(G_t - R) <= 1;
         * E = exp(G_t) = e_t exp(R); the block's own columns (factored)
         * k_t exp(R - G_t) = k_t / e_t, by a refined reciprocal. */
        for (int64_t t = i0; t < i1; t++) {
            const float *Gt = w->Gc + t * S, *kt = w->kc + t * S, *qt = w->qc + t * S;
            float *kr = w->XA + (t - i0) * S, *qr = w->XA + (nb + t - i0) * S, *Et = w->E + t * S;
            float *col = w->Vb + t * S;
            const __m256 b = _mm256_set1_ps(beta[t]), one = _mm256_set1_ps(1.0f);
            for (int64_t i = 0; i < S; i += 8) {
                const __m256 G = _mm256_loadu_ps(Gt + i), k = _mm256_loadu_ps(kt + i);
                const __m256 e = sc_exp8(R ? _mm256_sub_ps(G, _mm256_loadu_ps(R + i)) : G);
                _mm256_storeu_ps(kr + i, _mm256_mul_ps(_mm256_mul_ps(b, k), e));
                _mm256_storeu_ps(qr + i, _mm256_mul_ps(_mm256_loadu_ps(qt + i), e));
                _mm256_storeu_ps(Et + i, R ? _mm256_mul_ps(e, _mm256_loadu_ps(w->R + i)) : e);
                if (factored) {
                    const __m256 r0 = _mm256_rcp_ps(e);
                    const __m256 r = _mm256_fmadd_ps(r0, _mm256_fnmadd_ps(e, r0, one), r0);
                    _mm256_storeu_ps(col + i, _mm256_mul_ps(k, r));
                }
            }
        }
        kda_keys_to_columns(w, S, factored ? i1 : i0, n_cols);
        w->keys_factored = factored && i0 == 0 && i1 == L;
        sc_gemm(2 * nb, n_cols, S, w->XA, S, w->KT, C, w->AB, C, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_DENSE, 0);
        for (int64_t t = i0; t < i1; t++) {
            const float *ab = w->AB + (t - i0) * C, *qb = w->AB + (nb + t - i0) * C;
            float *ak = w->Akk + t * C, *aq = w->Aqk + t * C;
            for (int64_t v = 0; v < t; v++) ak[v] = ab[v];
            for (int64_t v = 0; v <= t; v++) aq[v] = qb[v];
            if (!factored) {
                /* The block's own pairs, each with its exact decays. */
                const float *Gt = w->Gc + t * S, *kt = w->kc + t * S, *qt = w->qc + t * S;
                for (int64_t v = i0; v <= t; v++) {
                    const float *Gv = w->Gc + v * S, *kv = w->kc + v * S;
                    __m256 sk = _mm256_setzero_ps(), sq = sk;
                    for (int64_t i = 0; i < S; i += 8) {
                        const __m256 d = sc_exp8(_mm256_sub_ps(_mm256_loadu_ps(Gt + i), _mm256_loadu_ps(Gv + i)));
                        const __m256 kd = _mm256_mul_ps(_mm256_loadu_ps(kv + i), d);
                        sk = _mm256_fmadd_ps(_mm256_loadu_ps(kt + i), kd, sk);
                        sq = _mm256_fmadd_ps(_mm256_loadu_ps(qt + i), kd, sq);
                    }
                    float hk[8], hq[8], tk = 0.0f, tq = 0.0f;
                    _mm256_storeu_ps(hk, sk);
                    _mm256_storeu_ps(hq, sq);
                    for (int l = 0; l < 8; l++) {
                        tk += hk[l];
                        tq += hq[l];
                    }
                    if (v < t) ak[v] = beta[t] * tk;
                    aq[v] = tq;
                }
            }
            for (int64_t v = t; v < C; v++) ak[v] = 0.0f;
            for (int64_t v = t + 1; v < C; v++) aq[v] = 0.0f;
        }
    }
}

/* C = (mode) + A B over M x N x K (dense) in row blocks of at most six rows,
 * as even as they come (32 rows: 6, 6, 5, 5, 5, 5), where sc_gemm's blocks
 * of six leave a tail of two rows whose four accumulator chains cannot keep
 * the FMA units busy.  Each element is still one chain of FMAs over k in
 * order, so the blocking does not change a bit.  `fetch` token rows of the
 * next chunk (`next_len` tokens) are fetched after each block (see gdn_chunk). */
static void gdn_gemm_blocks(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                            float *Cm, int64_t ldc, int mode, float c_scale, const float *c_rows, const gdn_unit *u,
                            gdn_chunk_ws *w, int64_t next_len, int64_t fetch) {
    const int64_t nb = (M + 5) / 6, base = M / nb, extra = M % nb; /* the first `extra` blocks take one more */
    for (int64_t b = 0, i0 = 0; b < nb; b++) {
        const int64_t rows = base + (b < extra);
        sc_gemm(rows, N, K, A + i0 * lda, lda, B, ldb, Cm + i0 * ldc, ldc, mode, c_scale, c_rows ? c_rows + i0 : NULL,
                SC_GEMM_DENSE, 0);
        i0 += rows;
        if (fetch) gdn_fetch_next(u, w, next_len, fetch);
    }
}

/* One chunk [c0, c0 + L) of a unit, its k, q, v packed in w->kc, qc, vc: M
 * advances over it and o is written; `next_len` rows of the next chunk are
 * fetched meanwhile. */
static void gdn_chunk(const gdn_unit *u, gdn_chunk_ws *w, int64_t c0, int64_t L, int64_t next_len) {
    const int64_t S = u->S, C = SC_GDN_CHUNK, Lp = round8(L);
    const int kda = u->per > 1;
    if (kda)
        gdn_chunk_pairs_kda(u, w, c0, L);
    else
        gdn_chunk_pairs_scalar(u, w, c0, L);
    /* T = (I + Akk)^-1 by forward substitution: T_t = e_t - sum_{v<t} Akk[t][v] T_v. */
    for (int64_t t = 0; t < L; t++) {
        float *Tt = w->T + t * C;
        for (int64_t v = 0; v < Lp; v++) Tt[v] = v == t ? 1.0f : 0.0f;
        const float *ak = w->Akk + t * C;
        if (Lp <= 16) {
            /* The row in two registers: through memory, every step would
             * wait on the store of the one before. */
            __m256 r0 = _mm256_loadu_ps(Tt), r1 = Lp > 8 ? _mm256_loadu_ps(Tt + 8) : _mm256_setzero_ps();
            for (int64_t v = 0; v < t; v++) {
                const __m256 a = _mm256_set1_ps(-ak[v]);
                const float *Tv = w->T + v * C;
                r0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(Tv), r0);
                if (v >= 8) r1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(Tv + 8), r1);
            }
            _mm256_storeu_ps(Tt, r0);
            if (Lp > 8) _mm256_storeu_ps(Tt + 8, r1);
            continue;
        }
        for (int64_t v = 0; v < t; v++) {
            const __m256 a = _mm256_set1_ps(-ak[v]);
            const float *Tv = w->T + v * C;
            for (int64_t x = 0; x <= v; x += 8)
                _mm256_storeu_ps(Tt + x, _mm256_fmadd_ps(a, _mm256_loadu_ps(Tv + x), _mm256_loadu_ps(Tt + x)));
        }
    }
    /* U = T (beta v) = T' v and W = T (beta gam k) with T' = T diag(beta): the
     * column scales go into the small T (scalar gate: into a second copy
     * T'' = T' diag(gam), so that both products read v and k in place; KDA's
     * per-key gam needs the rows k_t E_t). */
    const float *beta = u->beta + c0;
    for (int64_t t = 0; t < L; t++) {
        float *Tt = w->T + t * C, *T2 = w->T2 + t * C;
        for (int64_t v = 0; v <= t; v++) Tt[v] *= beta[v];
        if (!kda)
            for (int64_t v = 0; v < Lp; v++) T2[v] = v <= t ? Tt[v] * w->gam[v] : 0.0f;
    }
    float *gq = w->X + L * S;
    for (int64_t t = 0; t < L; t++) {
        const float *kt = w->kc + t * S, *qt = w->qc + t * S;
        float *kb = w->Kb + t * S, *qg = gq + t * S;
        if (kda) {
            const float *Et = w->E + t * S;
            for (int64_t i = 0; i < S; i += 8) {
                const __m256 e = _mm256_loadu_ps(Et + i);
                _mm256_storeu_ps(kb + i, _mm256_mul_ps(_mm256_loadu_ps(kt + i), e));
                _mm256_storeu_ps(qg + i, _mm256_mul_ps(_mm256_loadu_ps(qt + i), e));
            }
        } else {
            const __m256 gt = _mm256_set1_ps(w->gam[t]);
            for (int64_t i = 0; i < S; i += 8) _mm256_storeu_ps(qg + i, _mm256_mul_ps(gt, _mm256_loadu_ps(qt + i)));
        }
    }
    sc_gemm(L, S, L, w->T, C, w->vc, S, w->U, S, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_A_LOWER, 0);
    if (kda)
        sc_gemm(L, S, L, w->T, C, w->Kb, S, w->X, S, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_A_LOWER, 0);
    else
        sc_gemm(L, S, L, w->T2, C, w->kc, S, w->X, S, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_A_LOWER, 0);
    /* The keys of the state update, into KT: Gam[L][u] k_u (per key for KDA). */
    float *El = NULL;
    if (kda) {
        El = w->E + (L - 1) * S;
        if (w->keys_factored) {
            /* KT holds k_u exp(-G_u): times exp(G_last), row by row. */
            for (int64_t i = 0; i < S; i++) {
                float *row = w->KT + i * C;
                const __m256 e = _mm256_set1_ps(El[i]);
                for (int64_t v = 0; v < L; v += 8) _mm256_storeu_ps(row + v, _mm256_mul_ps(e, _mm256_loadu_ps(row + v)));
            }
        } else {
            kda_decayed_key_rows(u, w, w->Gc + (L - 1) * S, L);
            kda_keys_to_columns(w, S, L, L);
        }
    } else {
        const float *Gl = w->Gam + (L - 1) * C;
        for (int64_t v = 0; v < L; v++) {
            const float *kv = w->kc + v * S;
            float *d = w->Vb + v * S; /* scratch */
            const __m256 gv = _mm256_set1_ps(Gl[v]);
            for (int64_t i = 0; i < S; i += 8) _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_loadu_ps(kv + i), gv));
        }
        sc_transpose(w->Vb, S, w->KT, C, L, S);
    }
    /* The rest is separate per value column j of M, so it runs a strip of
     * SC_GDN_STRIP columns at a time ([W; gam q] M0, delta, o, then the
     * strip's update): the strip of M, a contiguous 8 KiB panel at S = 128
     * (see gdn_state_to_panels), stays in L1 from its first row block to
     * its update, where whole-matrix products read all 64 KiB of M from L2
     * for every row block.  The next chunk's token rows are fetched a row at
     * a time after the row blocks of both products, so that their misses
     * overlap the arithmetic instead of arriving as one burst of lines. */
    float *oq = w->Y + L * S;
    const int64_t n_points = (S + SC_GDN_STRIP - 1) / SC_GDN_STRIP * ((2 * L + 5) / 6 + (S + 5) / 6);
    const int64_t fetch = ((u->gates_in_view ? 4 : 3) * next_len + n_points - 1) / n_points;
    for (int64_t j = 0; j < S; j += SC_GDN_STRIP) {
        const int64_t n = S - j < SC_GDN_STRIP ? S - j : SC_GDN_STRIP;
        /* [W; gam q] M0. */
        gdn_gemm_blocks(2 * L, n, S, w->X, S, w->M + j * S, n, w->Y + j, S, SC_GEMM_SET, 0.0f, NULL, u, w, next_len, fetch);
        /* delta = U - W M0. */
        for (int64_t t = 0; t < L; t++) {
            float *d = w->U + t * S + j;
            const float *wm = w->Y + t * S + j;
            for (int64_t x = 0; x < n; x += 8)
                _mm256_storeu_ps(d + x, _mm256_sub_ps(_mm256_loadu_ps(d + x), _mm256_loadu_ps(wm + x)));
        }
        /* o = scale (gam q M0 + Aqk delta) (scaled as it is stored). */
        sc_gemm(L, n, L, w->Aqk, C, w->U + j, S, oq + j, S, SC_GEMM_SCALE, 1.0f, NULL, SC_GEMM_A_LOWER, 0);
        /* M = gam_L M0 + (Gam[L][u] k_u)^T delta. */
        if (kda)
            gdn_gemm_blocks(S, n, L, w->KT, C, w->U + j, S, w->M + j * S, n, SC_GEMM_ROWS, 0.0f, El, u, w, next_len,
                            fetch);
        else
            gdn_gemm_blocks(S, n, L, w->KT, C, w->U + j, S, w->M + j * S, n, SC_GEMM_SCALE, w->gam[L - 1], NULL, u, w,
                            next_len, fetch);
    }
    const __m256 sc = _mm256_set1_ps(u->scale);
    for (int64_t t = 0; t < L; t++) {
        float *ot = u->o + (c0 + t) * u->ots;
        const float *r = oq + t * S;
        /* Outputs of a large call go out with non-temporal stores: o rows are
         * out of cache, and a normal store would first read each line. */
        if (u->stream && ((uintptr_t)ot & 31) == 0)
            for (int64_t j = 0; j < S; j += 8) _mm256_stream_ps(ot + j, _mm256_mul_ps(sc, _mm256_loadu_ps(r + j)));
        else
            for (int64_t j = 0; j < S; j += 8) _mm256_storeu_ps(ot + j, _mm256_mul_ps(sc, _mm256_loadu_ps(r + j)));
    }
    gdn_fetch_next(u, w, next_len, 4 * next_len); /* whatever the strips left */
}

/* Rows t0 .. t0 + L of head `head` of v into dst [L][S] (normalised when
 * eps >= 0); 1 when they are all finite.  Unnormalised rows with unit stride
 * (S % 8 == 0) are copied and checked in one pass. */
static int gdn_pack_rows(const sc_view *v, int64_t t0, int64_t head, int64_t L, int64_t S, float eps, float *dst) {
    if (eps >= 0.0f || v->strides[2] != 1) {
        int64_t ts;
        pack_tokens(v, t0, head, L, S, eps, 1, dst, &ts);
        return sc_all_finite(dst, 1, 0, L * S, 1);
    }
    const float *base = v->data + t0 * v->strides[0] + head * v->strides[1];
    __m256 bad = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
        const float *src = base + t * v->strides[0];
        float *row = dst + t * S;
        for (int64_t i = 0; i < S; i += 8) {
            const __m256 x = _mm256_loadu_ps(src + i);
            _mm256_storeu_ps(row + i, x);
            /* x - x is 0 exactly when x is finite (as in sc_all_finite). */
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        }
    }
    return !_mm256_movemask_ps(bad);
}

/* Packs tokens [c0, c0 + L) of k, q (normalised when asked) and v into
 * w->kc, qc, vc; 1 when they and the tokens' log decays and betas are all
 * finite. */
static int gdn_pack_chunk(const gdn_unit *u, gdn_chunk_ws *w, int64_t c0, int64_t L) {
    const int64_t S = u->S;
    return gdn_pack_rows(u->kv, u->t0 + c0, u->hk, L, S, u->eps, w->kc) &&
           gdn_pack_rows(u->qv, u->t0 + c0, u->hk, L, S, u->eps, w->qc) &&
           gdn_pack_rows(u->vv, u->t0 + c0, u->h, L, S, -1.0f, w->vc) &&
           sc_all_finite(u->g + c0 * u->gts, L, u->gts, u->per, 1) && sc_all_finite(u->beta + c0, 1, 0, L, 1);
}

/* The chunked form keeps M key-major in strips of SC_GDN_STRIP value
 * columns, each strip a contiguous [S][n] panel at M + j S: the strip
 * products then read and update 8 KiB of consecutive lines (at S = 128)
 * instead of S lines a row apart, which fall into a few L1 sets.  These
 * convert from and to the storage layout [j][i]. */
static void gdn_state_to_panels(const float *src, float *M, int64_t S) {
    for (int64_t j = 0; j < S; j += SC_GDN_STRIP) {
        const int64_t n = S - j < SC_GDN_STRIP ? S - j : SC_GDN_STRIP;
        sc_transpose(src + j * S, S, M + j * S, n, n, S);
    }
}

static void gdn_panels_to_state(const float *M, float *dst, int64_t S) {
    for (int64_t j = 0; j < S; j += SC_GDN_STRIP) {
        const int64_t n = S - j < SC_GDN_STRIP ? S - j : SC_GDN_STRIP;
        sc_transpose(M + j * S, n, dst + j * S, S, S, n);
    }
}

/* State M (panels, or key-major after a fall back to the token loop) into
 * pool row r at head_off, in storage layout. */
static void gdn_store_state(const sc_state *st, int64_t r, int64_t head_off, const gdn_unit *u, gdn_chunk_ws *w) {
    const int64_t S = u->S;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    char *dst = sc_pool_at(st, r, head_off);
    float *out = pdt == SC_F32 && !u->stream ? (float *)dst : w->tmp;
    if (w->panels)
        gdn_panels_to_state(w->M, out, S);
    else
        sc_transpose(w->M, S, out, S, S, S);
    if (out == w->tmp) sc_store_state(w->tmp, dst, pdt, S * S, u->stream);
}

/* The token loop on the key-major state M over tokens [t, n_t), with the
 * snapshots at stops[i..]: where a chunk's inputs are not all finite, so
 * that NaN and Inf land where the definition puts them. */
static void gdn_tokens_keymajor(const sc_state *st, int64_t s, int64_t head_off, const gdn_unit *u, gdn_chunk_ws *w,
                                int64_t t, const int64_t *stops, int64_t i, int64_t n_stops) {
    const int64_t S = u->S, n_t = u->n_t;
    float *kd = w->Y, *o = w->Y + S;
    if (w->panels) { /* key-major rows for the token loop */
        gdn_panels_to_state(w->M, w->tmp, S);
        sc_transpose(w->tmp, S, w->M, S, S, S);
        w->panels = 0;
    }
    for (; t < n_t; t++) {
        int64_t ts;
        pack_tokens(u->kv, u->t0 + t, u->hk, 1, S, u->eps, 1, w->kc, &ts);
        pack_tokens(u->qv, u->t0 + t, u->hk, 1, S, u->eps, 1, w->qc, &ts);
        pack_tokens(u->vv, u->t0 + t, u->h, 1, S, -1.0f, 1, w->vc, &ts);
        const float *g = u->g + t * u->gts;
        /* M = decay M; kd = M^T k. */
        for (int64_t j = 0; j < S; j++) kd[j] = 0.0f;
        for (int64_t r = 0; r < S; r++) {
            float *row = w->M + r * S;
            const __m256 a = _mm256_set1_ps(sc_exp(g[u->per > 1 ? r : 0])), kr = _mm256_set1_ps(w->kc[r]);
            for (int64_t j = 0; j < S; j += 8) {
                const __m256 m = _mm256_mul_ps(a, _mm256_loadu_ps(row + j));
                _mm256_storeu_ps(row + j, m);
                _mm256_storeu_ps(kd + j, _mm256_fmadd_ps(kr, m, _mm256_loadu_ps(kd + j)));
            }
        }
        /* delta = beta (v - kd); M += k delta^T; o = scale M^T q. */
        const __m256 b = _mm256_set1_ps(u->beta[t]);
        for (int64_t j = 0; j < S; j += 8) {
            _mm256_storeu_ps(kd + j, _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(w->vc + j), _mm256_loadu_ps(kd + j))));
            _mm256_storeu_ps(o + j, _mm256_setzero_ps());
        }
        for (int64_t r = 0; r < S; r++) {
            float *row = w->M + r * S;
            const __m256 kr = _mm256_set1_ps(w->kc[r]), qr = _mm256_set1_ps(w->qc[r]);
            for (int64_t j = 0; j < S; j += 8) {
                const __m256 m = _mm256_fmadd_ps(kr, _mm256_loadu_ps(kd + j), _mm256_loadu_ps(row + j));
                _mm256_storeu_ps(row + j, m);
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(qr, m, _mm256_loadu_ps(o + j)));
            }
        }
        float *ot = u->o + t * u->ots;
        for (int64_t j = 0; j < S; j++) ot[j] = u->scale * o[j];
        for (; i < n_stops && stops[i] <= t + 1; i++) {
            const int64_t r = sc_snap_row(st, s, n_t - stops[i]);
            if (r >= 0) gdn_store_state(st, r, head_off, u, w);
        }
    }
}

/* The chunked form of a unit, or 0 (nothing written) when its start state
 * is not all finite; the caller then runs the token loop. */
static int gdn_chunked_unit(const sc_state *st, int64_t s, int64_t head_off, const gdn_unit *u, gdn_chunk_ws *w,
                            const int64_t *stops, int64_t n_stops) {
    const int64_t S = u->S, n_t = u->n_t, C = SC_GDN_CHUNK;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const char *start = sc_pool_at(st, st->start_rows[s], head_off);
    const float *src = (const float *)start;
    if (pdt != SC_F32) {
        sc_load_f32(start, pdt, w->tmp, S * S);
        src = w->tmp;
    }
    if (!sc_all_finite(src, 1, 0, S * S, 1)) return 0;
    gdn_state_to_panels(src, w->M, S);
    w->panels = 1;
    sc_copy_input_state(st, s, n_t, head_off, pdt == SC_F32 ? NULL : w->tmp, S * S);
    int64_t pos = 0;
    for (int64_t i = 0; i < n_stops; i++) {
        while (pos < stops[i]) {
            const int64_t L = stops[i] - pos < C ? stops[i] - pos : C;
            if (!gdn_pack_chunk(u, w, pos, L)) {
                gdn_tokens_keymajor(st, s, head_off, u, w, pos, stops, i, n_stops);
                return 1;
            }
            /* The next chunk ends at the next stop or C tokens on. */
            const int64_t nxt = pos + L, end = nxt < stops[i] ? stops[i] : (i + 1 < n_stops ? stops[i + 1] : nxt);
            const int64_t next_len = end - nxt < C ? end - nxt : C;
            w->next = nxt;
            w->n_next = 0;
            gdn_chunk(u, w, pos, L, next_len);
            pos = nxt;
        }
        const int64_t r = sc_snap_row(st, s, n_t - stops[i]);
        if (r >= 0) gdn_store_state(st, r, head_off, u, w);
    }
    return 1;
}

static void gdn_chunk_ws_alloc(gdn_chunk_ws *w, int64_t S, int kda, int64_t n_cols) {
    const size_t C = SC_GDN_CHUNK, f = sizeof(float), SS = (size_t)S;
    memset(w, 0, sizeof(*w));
    w->M = (float *)sc_alloc(f * SS * SS);
    w->tmp = (float *)sc_alloc(f * SS * SS);
    w->kc = (float *)sc_alloc(f * C * SS);
    w->qc = (float *)sc_alloc(f * C * SS);
    w->vc = (float *)sc_alloc(f * C * SS);
    w->KT = (float *)sc_alloc(f * SS * C);
    w->Akk = (float *)sc_alloc(f * C * C);
    w->Aqk = (float *)sc_alloc(f * C * C);
    w->T = (float *)sc_alloc(f * C * C);
    w->T2 = (float *)sc_alloc(f * C * C);
    w->Vb = (float *)sc_alloc(f * C * SS);
    w->U = (float *)sc_alloc(f * C * SS);
    w->Kb = (float *)sc_alloc(f * C * SS);
    w->X = (float *)sc_alloc(f * 2 * C * SS);
    w->Y = (float *)sc_alloc(f * 2 * C * SS);
    w->stops = (int64_t *)sc_alloc(sizeof(int64_t) * (size_t)(n_cols + 1));
    if (kda) {
        w->Gc = (float *)sc_alloc(f * C * SS);
        w->E = (float *)sc_alloc(f * C * SS);
        w->XA = (float *)sc_alloc(f * 2 * SC_KDA_BLOCK * SS);
        w->AB = (float *)sc_alloc(f * 2 * SC_KDA_BLOCK * C);
        w->R = (float *)sc_alloc(f * SS);
    } else {
        w->seg = (float *)sc_alloc(f * C);
        w->gam = (float *)sc_alloc(f * C);
        w->Gam = (float *)sc_alloc(f * C * C);
    }
}

static void gdn_chunk_ws_free(gdn_chunk_ws *w) {
    float *all[] = {w->M, w->tmp, w->kc,  w->qc,  w->vc,  w->KT, w->Akk, w->Aqk, w->T,  w->T2, w->Vb, w->U,
                    w->Kb, w->X,  w->Y,   w->seg, w->gam, w->Gam, w->Gc, w->E,   w->XA, w->AB, w->R};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]);
    free(w->stops);
}
#endif

/* A head's gates (rows at token stride ts, elements at stride gi) into
 * buf [n_t][per]. */
static void gdn_gather_gates(const float *gs, int64_t ts, int64_t gi, int64_t per, int64_t n_t, float *buf) {
    for (int64_t t = 0; t < n_t; t++) {
        if (per > 1 && t + SC_PREFETCH_ROWS < n_t) sc_prefetch_run(gs + (t + SC_PREFETCH_ROWS) * ts, per, gi);
        if (gi == 1)
            memcpy(buf + t * per, gs + t * ts, sizeof(float) * (size_t)per);
        else
            for (int64_t i = 0; i < per; i++) buf[t * per + i] = gs[t * ts + i * gi];
    }
}

/* What every thread of a delta_f32 call reads (delta_thread). */
typedef struct {
    const sc_state *st;
    const sc_view *q, *k, *v, *g, *beta;
    float *o;
    const sc_delta_options *opt;
    int64_t n_head_k, Hv, S, n_units, tile_rows, per;
    size_t tmax;
    float eps;
    int kda, stream, rows_stream, may_chunk;
    int need_tile; /* some unit runs its tokens through the tile (see delta_needs_tile) */
} delta_call;

/* Whether a unit of this call may use the tile: more than one token, none
 * (its input state goes through the tile), a pool of another dtype, or a
 * state written to no row.  A one-token f32 decode reads and writes the pool
 * in place and allocates no 32 KiB tile per thread and call (see la_thread
 * in linear_attn.c). */
static int delta_needs_tile(const sc_state *st) {
    if (st->max_tokens >= 2 || st->pool_dtype != SC_F32) return 1;
    for (int64_t s = 0; s < st->n_seqs; s++)
        if (st->cu_seqlens[s + 1] == st->cu_seqlens[s] || sc_snap_row(st, s, 0) < 0) return 1;
    return 0;
}

/* Floats of decode scratch a thread keeps on the stack (3 S + 1 at most). */
#define SC_GDN_DECODE_STACK 1600

/* The units [lo, hi) of thread tid of nt (sc_split). */
static void delta_thread(void *arg, int tid, int nt) {
    const delta_call *a = (const delta_call *)arg;
    const sc_state *st = a->st;
    const sc_view *q = a->q, *k = a->k, *v = a->v, *g = a->g, *beta = a->beta;
    float *o = a->o;
    const sc_delta_options *opt = a->opt;
    const int64_t n_head_k = a->n_head_k, Hv = a->Hv, S = a->S, n_units = a->n_units, tile_rows = a->tile_rows;
    const int64_t per = a->per;
    const size_t tmax = a->tmax;
    const float eps = a->eps;
    const int kda = a->kda, stream = a->stream, rows_stream = a->rows_stream, may_chunk = a->may_chunk;
    /* A decode (one token per sequence) keeps its scratch on the stack:
     * six allocations per thread and call were a few percent of a one-head
     * call (see la_thread in linear_attn.c). */
    float stack_buf[SC_GDN_DECODE_STACK] __attribute__((aligned(SC_ALIGN)));
    const size_t scratch = tmax * (size_t)(2 * S + per + 1);
    const int on_stack = tmax == 1 && scratch <= SC_GDN_DECODE_STACK;
    float *kpack, *qpack, *gbuf, *bt;
    if (on_stack) {
        kpack = stack_buf;
        qpack = kpack + S;
        gbuf = qpack + S;
        bt = gbuf + per;
    } else {
        kpack = (float *)sc_alloc(sizeof(float) * tmax * (size_t)S);
        qpack = (float *)sc_alloc(sizeof(float) * tmax * (size_t)S);
        gbuf = (float *)sc_alloc(sizeof(float) * tmax * (size_t)per);
        bt = (float *)sc_alloc(sizeof(float) * tmax);
    }
    float *tile = a->need_tile ? (float *)sc_alloc(sizeof(float) * (size_t)(tile_rows * S)) : NULL;
#ifdef SC_HAVE_AVX2
    gdn_chunk_ws w = {0};
    if (may_chunk) gdn_chunk_ws_alloc(&w, S, kda, st->n_cols);
#endif
    int64_t lo, hi;
    sc_split(n_units, tid, nt, &lo, &hi);
    for (int64_t un = lo; un < hi; un++) {
        const int64_t s = un / Hv, h = un % Hv;
        const int64_t hk = opt->grouped ? h / (Hv / n_head_k) : h % n_head_k;
        const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
        gdn_unit u = {S,      n_t,  per, NULL, NULL, 0, 0, v->data + t0 * v->strides[0] + h * v->strides[1],
                      v->strides[0], v->strides[2], gbuf, per, bt, o + (t0 * Hv + h) * S, Hv * S, opt->scale,
                      stream, k, q, v, t0, hk, h, eps, 0, g};
        int64_t longest = 0, n_stops = 0;
#ifdef SC_HAVE_AVX2
        if (may_chunk && n_t >= SC_GDN_CHUNK_MIN) n_stops = sc_state_stops(st, s, n_t, w.stops, &longest);
#endif
        const int chunked = longest >= SC_GDN_CHUNK_MIN; /* which packs its own chunks */
        const float *gs = g->data + t0 * g->strides[0] + h * g->strides[1];
        const int64_t gi = kda ? g->strides[2] : 0;
        u.gates_in_view = chunked && kda && gi == 1 && !opt->A_log;
        if (u.gates_in_view) {
            u.g = (float *)gs; /* read only: the chunked form does not write its gates */
            u.gts = g->strides[0];
        } else {
            gdn_gather_gates(gs, g->strides[0], gi, per, n_t, gbuf);
        }
        if (opt->A_log) {
            /* The raw gate: log-decay = -exp(A_log) * softplus(a + dt_bias). */
            const float rate = -expf(opt->A_log[h]);
            const float *bias = opt->dt_bias ? opt->dt_bias + h * per : NULL;
            for (int64_t t = 0; t < n_t; t++) {
                float *gt = gbuf + t * per;
                if (bias)
                    for (int64_t i = 0; i < per; i++) gt[i] += bias[i];
#pragma omp simd
                for (int64_t i = 0; i < per; i++) gt[i] = rate * sc_softplus(gt[i]);
            }
        }
        for (int64_t t = 0; t < n_t; t++) bt[t] = beta->data[(t0 + t) * beta->strides[0] + h * beta->strides[1]];
        if (opt->beta_sigmoid)
            for (int64_t t = 0; t < n_t; t++) bt[t] = 1.0f / (1.0f + sc_exp(-bt[t]));
        const int64_t head_off = h * S * S;
#ifdef SC_HAVE_AVX2
        if (chunked && gdn_chunked_unit(st, s, head_off, &u, &w, w.stops, n_stops)) continue;
        if (u.gates_in_view) { /* the chunked form gave up before its first chunk: the token loop's copy */
            gdn_gather_gates(gs, g->strides[0], gi, per, n_t, gbuf);
            u.g = gbuf;
            u.gts = per;
            u.gates_in_view = 0;
        }
#else
        (void)n_stops;
        (void)chunked;
#endif
        u.k = pack_tokens(k, t0, hk, n_t, S, eps, 0, kpack, &u.kts);
        u.q = pack_tokens(q, t0, hk, n_t, S, eps, 0, qpack, &u.qts);
#pragma omp simd
        for (int64_t i = 0; i < n_t * per; i++) gbuf[i] = sc_exp(gbuf[i]);
        gdn_token_unit(st, s, head_off, &u, tile_rows, rows_stream, tile);
    }
    if (!on_stack) {
        free(kpack);
        free(qpack);
        free(gbuf);
        free(bt);
    }
    free(tile);
#ifdef SC_HAVE_AVX2
    if (may_chunk) gdn_chunk_ws_free(&w);
#endif
    sc_stream_fence(); /* this thread's streamed rows are visible before it joins */
}

static void delta_f32(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                      int kda, const sc_view *beta, float *o, const sc_delta_options *opt, int64_t n_head_k,
                      int64_t n_head_v, int64_t head_size, int n_threads) {
    const int64_t S = head_size, Hv = n_head_v, n_s = st->n_seqs, n_units = n_s * Hv;
    int64_t tile_rows = SC_GDN_TILE_BYTES / 4 / (S > 0 ? S : 1);
    tile_rows = tile_rows < 4 ? 4 : tile_rows - tile_rows % 4;
    const float eps = opt->qk_l2norm ? opt->l2norm_eps : -1.0f;
    /* State streamed: every token passes over the state, plus the rows written
     * (a token does more arithmetic per element than the scan: this undercounts,
     * so the single-thread rule errs towards threads). */
    const int64_t work_bytes = Hv * S * S * (int64_t)sizeof(float) * (st->n_tokens + n_s * sc_max_written(st));
    const int team = sc_state_team(n_units, work_bytes, n_threads);
    const int stream = work_bytes >= sc_stream_min_bytes;
    const int rows_stream = sc_stream_rows(st, work_bytes, Hv * S * S * (int64_t)sizeof(float));
    const size_t tmax = (size_t)(st->max_tokens > 0 ? st->max_tokens : 1);
    const int64_t per = kda ? S : 1;
#ifdef SC_HAVE_AVX2
    const int may_chunk = S % 8 == 0 && st->max_tokens >= SC_GDN_CHUNK_MIN;
#else
    const int may_chunk = 0;
#endif
    const delta_call call = {.st = st, .q = q, .k = k, .v = v, .g = g, .beta = beta, .o = o, .opt = opt,
                             .n_head_k = n_head_k, .Hv = Hv, .S = S, .n_units = n_units, .tile_rows = tile_rows,
                             .per = per, .tmax = tmax, .eps = eps, .kda = kda, .stream = stream,
                             .rows_stream = rows_stream, .may_chunk = may_chunk, .need_tile = delta_needs_tile(st)};
    sc_team_run(team, delta_thread, (void *)&call);
}

void sc_gated_delta_net(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                        int kda, const sc_view *beta, void *o, sc_dtype o_dtype, const sc_delta_options *opt,
                        int64_t n_head_k, int64_t n_head_v, int64_t head_size, int n_threads) {
    const int64_t T = st->n_tokens, Hk = n_head_k, Hv = n_head_v, S = head_size;
    float *own[5];
    const sc_view qf = sc_widen3(q, T, Hk, S, &own[0]), kf = sc_widen3(k, T, Hk, S, &own[1]);
    const sc_view vf = sc_widen3(v, T, Hv, S, &own[2]), bf = sc_widen2(beta, T, Hv, &own[4]);
    const sc_view gf = kda ? sc_widen3(g, T, Hv, S, &own[3]) : sc_widen2(g, T, Hv, &own[3]);
    float *of = sc_output_f32(o, o_dtype, T * Hv * S);
    delta_f32(st, &qf, &kf, &vf, &gf, kda, &bf, of, opt, Hk, Hv, S, n_threads);
    sc_narrow_output(of, o, o_dtype, T * Hv * S);
    for (int i = 0; i < 5; i++) free(own[i]);
}
