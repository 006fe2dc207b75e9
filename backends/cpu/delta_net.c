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
 * (see gdn_rows4).  Read-before-write per slice as in ssm_scan.c. */
#include "sc_internal.h"

/* Rows per tile: 32 KiB of f32 at head size 128, L1-resident for all tokens. */
#define SC_GDN_TILE_BYTES 32768

/* q or k[t0 .. t0 + n_t, h, :] as token rows at stride *t_stride: the view
 * itself when its last stride is 1 and nothing is normalised, else a packed
 * (L2-normalised when `eps` >= 0) copy in `scratch`. */
static const float *pack_tokens(const sc_view *v, int64_t t0, int64_t h, int64_t n_t, int64_t n, float eps,
                                float *scratch, int64_t *t_stride) {
    const float *base = v->data + t0 * v->strides[0] + h * v->strides[1];
    if (v->strides[2] == 1 && eps < 0.0f) {
        *t_stride = v->strides[0];
        return base;
    }
    for (int64_t t = 0; t < n_t; t++) {
        float *row = scratch + t * n;
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
/* One token over four rows of the tile (S % 8 == 0): both passes (decay and
 * k-dot, then update and q-dot) handle the four rows together, so k, q and
 * the gate are loaded once for four rows and the four dot products are
 * independent FMA chains.  `et` is the per-key gate (KDA) or NULL for the
 * scalar gate `es`.  With `mid` (4 * S floats of scratch) the decayed rows go
 * there and the updated ones to `out` with non-temporal stores: `out` is then
 * a pool row other than `in` in a large call (see update_rows in ssm_scan.c). */
static inline __attribute__((always_inline)) void gdn_rows4_impl(const float *in, float *out, float *mid, int64_t S,
                                                                 const float *kt, const float *qt, const float *et,
                                                                 float es, const float *vt, int64_t vstride,
                                                                 float beta, float scale, float *ot,
                                                                 const int stream) {
    const float *i0 = in, *i1 = i0 + S, *i2 = i1 + S, *i3 = i2 + S;
    float *r0 = stream ? mid : out, *r1 = r0 + S, *r2 = r1 + S, *r3 = r2 + S;
    float *w0 = out, *w1 = w0 + S, *w2 = w1 + S, *w3 = w2 + S;
    __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
    const __m256 gs = _mm256_set1_ps(es);
    for (int64_t i = 0; i < S; i += 8) {
        const __m256 g = et ? _mm256_loadu_ps(et + i) : gs, k = _mm256_loadu_ps(kt + i);
        const __m256 m0 = _mm256_mul_ps(_mm256_loadu_ps(i0 + i), g), m1 = _mm256_mul_ps(_mm256_loadu_ps(i1 + i), g);
        const __m256 m2 = _mm256_mul_ps(_mm256_loadu_ps(i2 + i), g), m3 = _mm256_mul_ps(_mm256_loadu_ps(i3 + i), g);
        _mm256_storeu_ps(r0 + i, m0);
        _mm256_storeu_ps(r1 + i, m1);
        _mm256_storeu_ps(r2 + i, m2);
        _mm256_storeu_ps(r3 + i, m3);
        d0 = _mm256_fmadd_ps(m0, k, d0);
        d1 = _mm256_fmadd_ps(m1, k, d1);
        d2 = _mm256_fmadd_ps(m2, k, d2);
        d3 = _mm256_fmadd_ps(m3, k, d3);
    }
    float kd[4];
    _mm_storeu_ps(kd, sc_hsum4x8(d0, d1, d2, d3));
    const __m256 e0 = _mm256_set1_ps((vt[0] - kd[0]) * beta), e1 = _mm256_set1_ps((vt[vstride] - kd[1]) * beta);
    const __m256 e2 = _mm256_set1_ps((vt[2 * vstride] - kd[2]) * beta);
    const __m256 e3 = _mm256_set1_ps((vt[3 * vstride] - kd[3]) * beta);
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
    for (int64_t i = 0; i < S; i += 8) {
        const __m256 k = _mm256_loadu_ps(kt + i), q = _mm256_loadu_ps(qt + i);
        const __m256 m0 = _mm256_fmadd_ps(k, e0, _mm256_loadu_ps(r0 + i));
        const __m256 m1 = _mm256_fmadd_ps(k, e1, _mm256_loadu_ps(r1 + i));
        const __m256 m2 = _mm256_fmadd_ps(k, e2, _mm256_loadu_ps(r2 + i));
        const __m256 m3 = _mm256_fmadd_ps(k, e3, _mm256_loadu_ps(r3 + i));
        if (stream) {
            _mm256_stream_ps(w0 + i, m0);
            _mm256_stream_ps(w1 + i, m1);
            _mm256_stream_ps(w2 + i, m2);
            _mm256_stream_ps(w3 + i, m3);
        } else {
            _mm256_storeu_ps(w0 + i, m0);
            _mm256_storeu_ps(w1 + i, m1);
            _mm256_storeu_ps(w2 + i, m2);
            _mm256_storeu_ps(w3 + i, m3);
        }
        o0 = _mm256_fmadd_ps(m0, q, o0);
        o1 = _mm256_fmadd_ps(m1, q, o1);
        o2 = _mm256_fmadd_ps(m2, q, o2);
        o3 = _mm256_fmadd_ps(m3, q, o3);
    }
    _mm_storeu_ps(ot, _mm_mul_ps(_mm_set1_ps(scale), sc_hsum4x8(o0, o1, o2, o3)));
}

static void gdn_rows4(const float *in, float *out, float *mid, int64_t S, const float *kt, const float *qt,
                      const float *et, float es, const float *vt, int64_t vstride, float beta, float scale,
                      float *ot) {
    if (mid)
        gdn_rows4_impl(in, out, mid, S, kt, qt, et, es, vt, vstride, beta, scale, ot, 1);
    else
        gdn_rows4_impl(in, out, NULL, S, kt, qt, et, es, vt, vstride, beta, scale, ot, 0);
}
#endif

static void delta_f32(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                      int kda, const sc_view *beta, float *o, const sc_delta_options *opt, int64_t n_head_k,
                      int64_t n_head_v, int64_t head_size, int n_threads) {
    const int64_t S = head_size, Hv = n_head_v, n_s = st->n_seqs, n_units = n_s * Hv;
    const sc_dtype pool_dtype = (sc_dtype)st->pool_dtype;
    int64_t tile_rows = SC_GDN_TILE_BYTES / 4 / (S > 0 ? S : 1);
    tile_rows = tile_rows < 4 ? 4 : tile_rows - tile_rows % 4;
    const float scale = opt->scale, eps = opt->qk_l2norm ? opt->l2norm_eps : -1.0f;
    /* State streamed: every token passes over the state, plus the rows written
     * (a token does more arithmetic per element than the scan: this undercounts,
     * so the single-thread rule errs towards threads). */
    const int64_t work_bytes = Hv * S * S * (int64_t)sizeof(float) * (st->n_tokens + n_s * sc_max_written(st));
    const int team = sc_state_team(n_units, work_bytes, n_threads);
    const int stream = work_bytes >= sc_stream_min_bytes;
    const size_t tmax = (size_t)(st->max_tokens > 0 ? st->max_tokens : 1);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *kpack = (float *)sc_alloc(sizeof(float) * tmax * (size_t)S);
        float *qpack = (float *)sc_alloc(sizeof(float) * tmax * (size_t)S);
        float *gexp = (float *)sc_alloc(sizeof(float) * tmax * (size_t)(kda ? S : 1));
        float *bt = (float *)sc_alloc(sizeof(float) * tmax);
        float *tile = (float *)sc_alloc(sizeof(float) * (size_t)(tile_rows * S));
        float *mid = (float *)sc_alloc(sizeof(float) * (size_t)(4 * S));
        int64_t lo, hi;
        sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t u = lo; u < hi; u++) {
            const int64_t s = u / Hv, h = u % Hv;
            const int64_t hk = opt->grouped ? h / (Hv / n_head_k) : h % n_head_k;
            const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
            int64_t kts, qts;
            const float *ks = pack_tokens(k, t0, hk, n_t, S, eps, kpack, &kts);
            const float *qs = pack_tokens(q, t0, hk, n_t, S, eps, qpack, &qts);
            const float *gs = g->data + t0 * g->strides[0] + h * g->strides[1];
            const int64_t per = kda ? S : 1, gi = kda ? g->strides[2] : 0;
            for (int64_t t = 0; t < n_t; t++)
                for (int64_t i = 0; i < per; i++) gexp[t * per + i] = gs[t * g->strides[0] + i * gi];
            if (opt->A_log) {
                /* The raw gate: log-decay = -exp(A_log) * softplus(a + dt_bias). */
                const float rate = -expf(opt->A_log[h]);
                const float *bias = opt->dt_bias ? opt->dt_bias + h * per : NULL;
                for (int64_t t = 0; t < n_t; t++) {
                    float *gt = gexp + t * per;
                    if (bias)
                        for (int64_t i = 0; i < per; i++) gt[i] += bias[i];
#pragma omp simd
                    for (int64_t i = 0; i < per; i++) gt[i] = rate * sc_softplus(gt[i]);
                }
            }
#pragma omp simd
            for (int64_t i = 0; i < n_t * per; i++) gexp[i] = sc_exp(gexp[i]);
            for (int64_t t = 0; t < n_t; t++)
                bt[t] = beta->data[(t0 + t) * beta->strides[0] + h * beta->strides[1]];
            if (opt->beta_sigmoid)
                for (int64_t t = 0; t < n_t; t++) bt[t] = 1.0f / (1.0f + sc_exp(-bt[t]));
            const float *vs = v->data + t0 * v->strides[0] + h * v->strides[1];
            const int64_t head_off = h * S * S, r0 = sc_snap_row(st, s, 0);
            for (int64_t j0 = 0; j0 < S; j0 += tile_rows) {
                const int64_t jr = S - j0 < tile_rows ? S - j0 : tile_rows;
                const int64_t off = head_off + j0 * S;
                /* f32 pools: the first token reads the start row and the last
                 * writes column 0 in place, as in ssm_scan.c. */
                const int direct = pool_dtype == SC_F32 && n_t > 0;
                char *start = sc_pool_at(st, st->start_rows[s], off);
                if (!direct) sc_load_f32(start, pool_dtype, tile, jr * S);
                /* The input state: undoing the whole call is exact. */
                sc_copy_input_state(st, s, n_t, off, direct ? NULL : tile, jr * S);
                for (int64_t t = 0; t < n_t; t++) {
                    const float *SC_RESTRICT kt = ks + t * kts;
                    const float *SC_RESTRICT qt = qs + t * qts;
                    const float *SC_RESTRICT et = kda ? gexp + t * S : NULL;
                    const float es_t = kda ? 1.0f : gexp[t];
                    const float b = bt[t];
                    float *ot = o + ((t0 + t) * Hv + h) * S + j0;
                    const float *vt = vs + t * v->strides[0] + j0 * v->strides[2];
                    const int64_t j = n_t - 1 - t;
                    const float *in = t == 0 && direct ? (const float *)start : tile;
                    float *out = j == 0 && direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, off) : tile;
                    int64_t r = 0;
#ifdef SC_HAVE_AVX2
                    if (S % 8 == 0) {
                        /* a disjoint, aligned pool row of a large call: streamed */
                        float *via = stream && out != tile && out != in && ((uintptr_t)out & 31) == 0 ? mid : NULL;
                        for (; r + 4 <= jr; r += 4)
                            gdn_rows4(in + r * S, out + r * S, via, S, kt, qt, et, es_t, vt + r * v->strides[2],
                                      v->strides[2], b, scale, ot + r);
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
                        const float delta = (vt[r * v->strides[2]] - kd) * b;
                        float oq = 0.0f;
#pragma omp simd reduction(+ : oq)
                        for (int64_t i = 0; i < S; i++) {
                            float m = row[i] + kt[i] * delta;
                            row[i] = m;
                            oq += m * qt[i];
                        }
                        ot[r] = scale * oq;
                    }
                    const int64_t rj = sc_snap_row(st, s, j);
                    if (out == tile && rj >= 0) sc_store_f32(tile, sc_pool_at(st, rj, off), pool_dtype, jr * S);
                }
            }
        }
        free(kpack);
        free(qpack);
        free(gexp);
        free(bt);
        free(tile);
        free(mid);
        sc_stream_fence(); /* this thread's streamed rows are visible before it joins */
    }
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
