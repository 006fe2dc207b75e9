/* Mamba-1 / Mamba-2 selective scan from start rows, with snapshot planes.
 *
 * Mamba-2: a work unit is (sequence, head).  Rows i of a head's state
 * [head_dim, d_state] evolve independently (the per-token decay and B/C are
 * shared), so each unit walks a tile of SC_SCAN_TILE rows through every token
 * with the tile in L1, vectorised over d_state, and writes the tile's slice
 * of each snapshot plane when its token passes.
 *
 * Mamba-1 (head_dim 1, d_inner heads, decay per state element): a unit is
 * (sequence, block of SC_M1_HEADS heads); softplus is vectorised over the
 * block's heads and the decay exp over d_state.
 *
 * A unit reads its slice of the start row before writing that slice of any
 * plane, and no other unit touches the slice, so in-place decode and
 * rollback are safe and the result does not depend on the thread split. */
#include "sc_internal.h"

#define SC_SCAN_TILE 4
#define SC_M1_HEADS 64

static inline char *row_ptr(void *pool, sc_dtype dt, int64_t row, int64_t row_elems, int64_t elem) {
    return (char *)pool + ((size_t)row * (size_t)row_elems + (size_t)elem) * sc_dtype_size(dt);
}

/* B[s, t, g, :] as a contiguous pointer: the view itself when its last
 * stride is 1, else a packed copy of all tokens in `scratch`. */
static const float *tokens_of(const sc_view *v, int64_t s, int64_t g, int64_t n_t, int64_t n, float *scratch,
                              int64_t *t_stride) {
    const float *base = v->data + s * v->strides[0] + g * v->strides[2];
    if (v->strides[3] == 1) {
        *t_stride = v->strides[1];
        return base;
    }
    for (int64_t t = 0; t < n_t; t++)
        for (int64_t k = 0; k < n; k++) scratch[t * n + k] = base[t * v->strides[1] + k * v->strides[3]];
    *t_stride = n;
    return scratch;
}

static void scan_mamba2_unit(void *pool, sc_dtype pdt, int64_t row_elems, int64_t start_row, int64_t dst_row,
                             int n_snap, int64_t plane_stride, const sc_view *x, const sc_view *dt, const float *A,
                             const sc_view *B, const sc_view *C, float *y, int64_t s, int64_t h, int64_t n_t,
                             int64_t H, int64_t P, int64_t N, int64_t G, float *dbuf, float *abuf, float *bpack,
                             float *cpack, float *tile) {
    const int64_t g = h / (H / G);
    const float Ah = A[h];
    for (int64_t t = 0; t < n_t; t++) dbuf[t] = dt->data[s * dt->strides[0] + t * dt->strides[1] + h * dt->strides[2]];
#pragma omp simd
    for (int64_t t = 0; t < n_t; t++) {
        float d = sc_softplus(dbuf[t]);
        dbuf[t] = d;
        abuf[t] = sc_exp(d * Ah);
    }
    int64_t bts, cts;
    const float *Bs = tokens_of(B, s, g, n_t, N, bpack, &bts);
    const float *Cs = tokens_of(C, s, g, n_t, N, cpack, &cts);
    const float *xs = x->data + s * x->strides[0] + h * x->strides[2];
    const int64_t head_off = h * P * N;
    for (int64_t i0 = 0; i0 < P; i0 += SC_SCAN_TILE) {
        const int64_t ir = P - i0 < SC_SCAN_TILE ? P - i0 : SC_SCAN_TILE;
        const int64_t off = head_off + i0 * N;
        sc_load_f32(row_ptr(pool, pdt, start_row, row_elems, off), pdt, tile, ir * N);
        if (n_t < n_snap) /* the input state, so that undoing the whole call is exact */
            sc_store_f32(tile, row_ptr(pool, pdt, dst_row + n_t * plane_stride, row_elems, off), pdt, ir * N);
        for (int64_t t = 0; t < n_t; t++) {
            const float *SC_RESTRICT Bt = Bs + t * bts;
            const float *SC_RESTRICT Ct = Cs + t * cts;
            const float a = abuf[t], d = dbuf[t];
            float *yt = y + ((s * n_t + t) * H + h) * P + i0;
            for (int64_t r = 0; r < ir; r++) {
                float *SC_RESTRICT S = tile + r * N;
                const float xd = xs[t * x->strides[1] + (i0 + r) * x->strides[3]] * d;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < N; k++) {
                    float v = S[k] * a + Bt[k] * xd;
                    S[k] = v;
                    acc += v * Ct[k];
                }
                yt[r] = acc;
            }
            const int64_t j = n_t - 1 - t;
            if (j < n_snap)
                sc_store_f32(tile, row_ptr(pool, pdt, dst_row + j * plane_stride, row_elems, off), pdt, ir * N);
        }
    }
}

static void scan_mamba1_unit(void *pool, sc_dtype pdt, int64_t row_elems, int64_t start_row, int64_t dst_row,
                             const sc_view *x, const sc_view *dt, const float *A, const sc_view *B, const sc_view *C,
                             float *y, int64_t s, int64_t h0, int64_t hb, int64_t n_t, int64_t H, int64_t N,
                             float *dvec, float *bvec, float *cvec, float *decay, float *state) {
    const int64_t off = h0 * N;
    sc_load_f32(row_ptr(pool, pdt, start_row, row_elems, off), pdt, state, hb * N);
    for (int64_t t = 0; t < n_t; t++) {
        const float *dtr = dt->data + s * dt->strides[0] + t * dt->strides[1] + h0 * dt->strides[2];
        const int64_t dts = dt->strides[2];
#pragma omp simd
        for (int64_t hh = 0; hh < hb; hh++) dvec[hh] = sc_softplus(dtr[hh * dts]);
        const float *Br = B->data + s * B->strides[0] + t * B->strides[1];
        const float *Cr = C->data + s * C->strides[0] + t * C->strides[1];
        for (int64_t k = 0; k < N; k++) {
            bvec[k] = Br[k * B->strides[3]];
            cvec[k] = Cr[k * C->strides[3]];
        }
        const float *xr = x->data + s * x->strides[0] + t * x->strides[1] + h0 * x->strides[2];
        float *yt = y + (s * n_t + t) * H + h0;
        for (int64_t hh = 0; hh < hb; hh++) {
            const float d = dvec[hh], xd = xr[hh * x->strides[2]] * d;
            const float *SC_RESTRICT Ah = A + (h0 + hh) * N;
            float *SC_RESTRICT S = state + hh * N;
            float acc = 0.0f;
            /* The decay exps in their own loop: it vectorises cleanly. */
#pragma omp simd
            for (int64_t k = 0; k < N; k++) decay[k] = sc_exp(d * Ah[k]);
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < N; k++) {
                float v = S[k] * decay[k] + bvec[k] * xd;
                S[k] = v;
                acc += v * cvec[k];
            }
            yt[hh] = acc;
        }
    }
    /* Mamba-1 emits only the final state (n_snap == 1, checked by the caller). */
    sc_store_f32(state, row_ptr(pool, pdt, dst_row, row_elems, off), pdt, hb * N);
}

void sc_ssm_scan(void *pool, sc_dtype pool_dtype, int64_t row_elems, const int32_t *start_rows,
                 const int32_t *dst_rows, int n_snap, int64_t plane_stride, const sc_view *x, const sc_view *dt,
                 const float *A, int a_per_state, const sc_view *B, const sc_view *C, float *y, int64_t n_s,
                 int64_t n_t, int64_t n_head, int64_t head_dim, int64_t d_state, int64_t n_group, int n_threads) {
    const int64_t H = n_head, P = head_dim, N = d_state;
    if (a_per_state) {
        const int64_t n_blocks = (H + SC_M1_HEADS - 1) / SC_M1_HEADS, n_units = n_s * n_blocks;
        const int team = n_units < n_threads ? (int)n_units : (n_threads < 1 ? 1 : n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
        {
            float *dvec = (float *)sc_alloc(sizeof(float) * SC_M1_HEADS);
            float *bvec = (float *)sc_alloc(sizeof(float) * (size_t)N);
            float *cvec = (float *)sc_alloc(sizeof(float) * (size_t)N);
            float *decay = (float *)sc_alloc(sizeof(float) * (size_t)N);
            float *state = (float *)sc_alloc(sizeof(float) * (size_t)(SC_M1_HEADS * N));
            int64_t lo, hi;
            sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
            for (int64_t u = lo; u < hi; u++) {
                const int64_t s = u / n_blocks, h0 = (u % n_blocks) * SC_M1_HEADS;
                const int64_t hb = H - h0 < SC_M1_HEADS ? H - h0 : SC_M1_HEADS;
                scan_mamba1_unit(pool, pool_dtype, row_elems, start_rows[s], dst_rows[s], x, dt, A, B, C, y, s, h0, hb,
                                 n_t, H, N, dvec, bvec, cvec, decay, state);
            }
            free(dvec);
            free(bvec);
            free(cvec);
            free(decay);
            free(state);
        }
        return;
    }
    const int64_t n_units = n_s * H;
    const int need_pack = B->strides[3] != 1 || C->strides[3] != 1;
    const int team = n_units < n_threads ? (int)n_units : (n_threads < 1 ? 1 : n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *dbuf = (float *)sc_alloc(sizeof(float) * (size_t)n_t);
        float *abuf = (float *)sc_alloc(sizeof(float) * (size_t)n_t);
        float *bpack = need_pack ? (float *)sc_alloc(sizeof(float) * (size_t)(n_t * N)) : NULL;
        float *cpack = need_pack ? (float *)sc_alloc(sizeof(float) * (size_t)(n_t * N)) : NULL;
        float *tile = (float *)sc_alloc(sizeof(float) * (size_t)(SC_SCAN_TILE * N));
        int64_t lo, hi;
        sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t u = lo; u < hi; u++) {
            const int64_t s = u / H, h = u % H;
            scan_mamba2_unit(pool, pool_dtype, row_elems, start_rows[s], dst_rows[s], n_snap, plane_stride, x, dt, A,
                             B, C, y, s, h, n_t, H, P, N, n_group, dbuf, abuf, bpack, cpack, tile);
        }
        free(dbuf);
        free(abuf);
        free(bpack);
        free(cpack);
        free(tile);
    }
}
