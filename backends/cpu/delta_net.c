/* Gated delta rule (scalar gate = GDN, per-key gate = KDA), with snapshots.
 *
 * Storage per value head is [j][i] = M[i][j] (i = key index, fastest).  For a
 * fixed token every row j of that block evolves on its own: it is decayed,
 * dotted with k to form delta[j], updated by k * delta[j] and dotted with q.
 * So, as in the Mamba-2 scan, a work unit is (sequence, value head) and it
 * walks a tile of SC_GDN_TILE rows through every token with the tile in L1,
 * vectorised over the key index.  Read-before-write per slice as in
 * ssm_scan.c. */
#include "sc_internal.h"

#define SC_GDN_TILE 4

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

void sc_gated_delta_net(void *pool, sc_dtype pool_dtype, int64_t row_elems, const int32_t *start_rows,
                        const int32_t *dst_rows, int n_snap, int64_t plane_stride, const sc_view *q,
                        const sc_view *k, const sc_view *v, const sc_view *g, int kda, const sc_view *beta, float *o,
                        int64_t n_s, int64_t n_t, int64_t n_head_k, int64_t n_head_v, int64_t head_size, float scale,
                        int n_threads) {
    const int64_t S = head_size, Hv = n_head_v, n_units = n_s * Hv;
    const size_t es = sc_dtype_size(pool_dtype);
    const int team = n_units < n_threads ? (int)n_units : (n_threads < 1 ? 1 : n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *kpack = (float *)sc_alloc(sizeof(float) * (size_t)(n_t * S));
        float *qpack = (float *)sc_alloc(sizeof(float) * (size_t)(n_t * S));
        float *gexp = (float *)sc_alloc(sizeof(float) * (size_t)(n_t * (kda ? S : 1)));
        float *bt = (float *)sc_alloc(sizeof(float) * (size_t)n_t);
        float *tile = (float *)sc_alloc(sizeof(float) * (size_t)(SC_GDN_TILE * S));
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
            for (int64_t j0 = 0; j0 < S; j0 += SC_GDN_TILE) {
                const int64_t jr = S - j0 < SC_GDN_TILE ? S - j0 : SC_GDN_TILE;
                const size_t off = (size_t)(head_off + j0 * S);
                sc_load_f32((const char *)pool + ((size_t)start_rows[s] * (size_t)row_elems + off) * es, pool_dtype,
                            tile, jr * S);
                if (n_t < n_snap) /* the input state: undoing the whole call is exact */
                    sc_store_f32(tile,
                                 (char *)pool + ((size_t)(dst_rows[s] + n_t * plane_stride) * (size_t)row_elems + off) * es,
                                 pool_dtype, jr * S);
                for (int64_t t = 0; t < n_t; t++) {
                    const float *SC_RESTRICT kt = ks + t * kts;
                    const float *SC_RESTRICT qt = qs + t * qts;
                    const float *SC_RESTRICT et = kda ? gexp + t * S : NULL;
                    const float es_t = kda ? 1.0f : gexp[t];
                    const float b = bt[t];
                    float *ot = o + ((s * n_t + t) * Hv + h) * S + j0;
                    for (int64_t r = 0; r < jr; r++) {
                        float *SC_RESTRICT row = tile + r * S;
                        float kd = 0.0f;
                        if (kda) {
#pragma omp simd reduction(+ : kd)
                            for (int64_t i = 0; i < S; i++) {
                                float m = row[i] * et[i];
                                row[i] = m;
                                kd += m * kt[i];
                            }
                        } else {
#pragma omp simd reduction(+ : kd)
                            for (int64_t i = 0; i < S; i++) {
                                float m = row[i] * es_t;
                                row[i] = m;
                                kd += m * kt[i];
                            }
                        }
                        const float delta = (vs[t * v->strides[1] + (j0 + r) * v->strides[3]] - kd) * b;
                        float oq = 0.0f;
#pragma omp simd reduction(+ : oq)
                        for (int64_t i = 0; i < S; i++) {
                            float m = row[i] + kt[i] * delta;
                            row[i] = m;
                            oq += m * qt[i];
                        }
                        ot[r] = scale * oq;
                    }
                    const int64_t j = n_t - 1 - t;
                    if (j < n_snap)
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
