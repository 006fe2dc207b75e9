/* Gated delta rule (scalar gate = GDN, per-key gate = KDA), with snapshots.
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

/* v[s, :, h, :] rows of one token as a contiguous pointer (packing when the
 * last stride is not 1). */
static const float *pack_tokens(const sc_view *v, int64_t s, int64_t h, int64_t n_t, int64_t n, float *scratch,
                                int64_t *t_stride) {
    const float *base = v->data + s * v->strides[0] + h * v->strides[2];
    if (v->strides[3] == 1) {
        *t_stride = v->strides[1];
        return base;
    }
    for (int64_t t = 0; t < n_t; t++)
        for (int64_t i = 0; i < n; i++) scratch[t * n + i] = base[t * v->strides[1] + i * v->strides[3]];
    *t_stride = n;
    return scratch;
}

#ifdef SC_HAVE_AVX2
/* One token over four rows of the tile (S % 8 == 0): both passes (decay and
 * k-dot, then update and q-dot) handle the four rows together, so k, q and
 * the gate are loaded once for four rows and the four dot products are
 * independent FMA chains.  `et` is the per-key gate (KDA) or NULL for the
 * scalar gate `es`. */
static inline void gdn_rows4(const float *in, float *out, int64_t S, const float *kt, const float *qt, const float *et,
                             float es, const float *vt, int64_t vstride, float beta, float scale, float *ot) {
    const float *i0 = in, *i1 = i0 + S, *i2 = i1 + S, *i3 = i2 + S;
    float *r0 = out, *r1 = r0 + S, *r2 = r1 + S, *r3 = r2 + S;
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
        _mm256_storeu_ps(r0 + i, m0);
        _mm256_storeu_ps(r1 + i, m1);
        _mm256_storeu_ps(r2 + i, m2);
        _mm256_storeu_ps(r3 + i, m3);
        o0 = _mm256_fmadd_ps(m0, q, o0);
        o1 = _mm256_fmadd_ps(m1, q, o1);
        o2 = _mm256_fmadd_ps(m2, q, o2);
        o3 = _mm256_fmadd_ps(m3, q, o3);
    }
    _mm_storeu_ps(ot, _mm_mul_ps(_mm_set1_ps(scale), sc_hsum4x8(o0, o1, o2, o3)));
}
#endif

void sc_gated_delta_net(void *pool, sc_dtype pool_dtype, int64_t row_elems, const int32_t *start_rows,
                        const int32_t *dst_rows, int n_snap, int64_t plane_stride, const sc_view *q,
                        const sc_view *k, const sc_view *v, const sc_view *g, int kda, const sc_view *beta, float *o,
                        int64_t n_s, int64_t n_t, int64_t n_head_k, int64_t n_head_v, int64_t head_size, float scale,
                        int n_threads) {
    const int64_t S = head_size, Hv = n_head_v, n_units = n_s * Hv;
    int64_t tile_rows = SC_GDN_TILE_BYTES / 4 / (S > 0 ? S : 1);
    tile_rows = tile_rows < 4 ? 4 : tile_rows - tile_rows % 4;
    const size_t es = sc_dtype_size(pool_dtype);
    /* State streamed: every token passes over the state, plus the planes written
     * (a token does more arithmetic per element than the scan: this undercounts,
     * so the single-thread rule errs towards threads). */
    const int64_t n_written = n_t + 1 < n_snap ? n_t + 1 : n_snap;
    const int64_t work_bytes = n_s * Hv * S * S * (int64_t)sizeof(float) * (n_t + n_written);
    const int team = sc_state_team(n_units, work_bytes, n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *kpack = (float *)sc_alloc(sizeof(float) * (size_t)(n_t * S));
        float *qpack = (float *)sc_alloc(sizeof(float) * (size_t)(n_t * S));
        float *gexp = (float *)sc_alloc(sizeof(float) * (size_t)(n_t * (kda ? S : 1)));
        float *bt = (float *)sc_alloc(sizeof(float) * (size_t)n_t);
        float *tile = (float *)sc_alloc(sizeof(float) * (size_t)(tile_rows * S));
        int64_t lo, hi;
        sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t u = lo; u < hi; u++) {
            const int64_t s = u / Hv, h = u % Hv, hk = h % n_head_k;
            int64_t kts, qts;
            const float *ks = pack_tokens(k, s, hk, n_t, S, kpack, &kts);
            const float *qs = pack_tokens(q, s, hk, n_t, S, qpack, &qts);
            const float *gs = g->data + s * g->strides[0] + h * g->strides[2];
            if (kda) {
                for (int64_t t = 0; t < n_t; t++) {
                    const float *gt = gs + t * g->strides[1];
                    const int64_t gi = g->strides[3];
#pragma omp simd
                    for (int64_t i = 0; i < S; i++) gexp[t * S + i] = sc_exp(gt[i * gi]);
                }
            } else {
                for (int64_t t = 0; t < n_t; t++) gexp[t] = sc_exp(gs[t * g->strides[1]]);
            }
            for (int64_t t = 0; t < n_t; t++)
                bt[t] = beta->data[s * beta->strides[0] + t * beta->strides[1] + h * beta->strides[2]];
            const float *vs = v->data + s * v->strides[0] + h * v->strides[2];
            const int64_t head_off = h * S * S;
            for (int64_t j0 = 0; j0 < S; j0 += tile_rows) {
                const int64_t jr = S - j0 < tile_rows ? S - j0 : tile_rows;
                const size_t off = (size_t)(head_off + j0 * S);
                /* f32 pools: the first token reads the start row and the last
                 * writes plane 0 in place, as in ssm_scan.c. */
                const int direct = pool_dtype == SC_F32 && n_t > 0;
                char *start = (char *)pool + ((size_t)start_rows[s] * (size_t)row_elems + off) * es;
                float *plane0 = (float *)((char *)pool + ((size_t)dst_rows[s] * (size_t)row_elems + off) * es);
                if (!direct) sc_load_f32(start, pool_dtype, tile, jr * S);
                if (n_t < n_snap) { /* the input state: undoing the whole call is exact */
                    char *dst = (char *)pool + ((size_t)(dst_rows[s] + n_t * plane_stride) * (size_t)row_elems + off) * es;
                    const void *src = direct ? (const void *)start : (const void *)tile;
                    if (dst != src) sc_store_f32(src, dst, pool_dtype, jr * S);
                }
                for (int64_t t = 0; t < n_t; t++) {
                    const float *SC_RESTRICT kt = ks + t * kts;
                    const float *SC_RESTRICT qt = qs + t * qts;
                    const float *SC_RESTRICT et = kda ? gexp + t * S : NULL;
                    const float es_t = kda ? 1.0f : gexp[t];
                    const float b = bt[t];
                    float *ot = o + ((s * n_t + t) * Hv + h) * S + j0;
                    const float *vt = vs + t * v->strides[1] + j0 * v->strides[3];
                    const int64_t j = n_t - 1 - t;
                    const float *in = t == 0 && direct ? (const float *)start : tile;
                    float *out = j == 0 && direct ? plane0 : tile;
                    int64_t r = 0;
#ifdef SC_HAVE_AVX2
                    if (S % 8 == 0) {
                        for (; r + 4 <= jr; r += 4)
                            gdn_rows4(in + r * S, out + r * S, S, kt, qt, et, es_t, vt + r * v->strides[3],
                                      v->strides[3], b, scale, ot + r);
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
                        const float delta = (vt[r * v->strides[3]] - kd) * b;
                        float oq = 0.0f;
#pragma omp simd reduction(+ : oq)
                        for (int64_t i = 0; i < S; i++) {
                            float m = row[i] + kt[i] * delta;
                            row[i] = m;
                            oq += m * qt[i];
                        }
                        ot[r] = scale * oq;
                    }
                    if (j < n_snap && !(j == 0 && direct))
                        sc_store_f32(tile,
                                     (char *)pool + ((size_t)(dst_rows[s] + j * plane_stride) * (size_t)row_elems + off) * es,
                                     pool_dtype, jr * S);
                }
            }
        }
        free(kpack);
        free(qpack);
        free(gexp);
        free(bt);
        free(tile);
    }
}
