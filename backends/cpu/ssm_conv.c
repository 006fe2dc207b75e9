/* Depthwise causal conv over concat(window, x), with window snapshots.
 *
 * A work unit is (sequence, block of SC_CONV_BLOCK channels).  Each unit
 * transposes its windows and inputs into a time-major scratch `ext[t][c]`
 * so that the convolution vectorises over channels, then writes outputs and
 * snapshot windows straight back into the pool.  Every read of the start
 * row's slice happens before any write to it, and no other unit touches that
 * slice, so in-place decode and rollback are safe under any thread split. */
#include "sc_internal.h"

#define SC_CONV_BLOCK 64

void sc_ssm_conv(void *pool, sc_dtype pool_dtype, int64_t row_elems, const int32_t *start_rows,
                 const int32_t *dst_rows, int n_snap, int64_t plane_stride, const sc_view *x, const float *weight,
                 const float *bias, float *y, int64_t n_s, int64_t n_t, int64_t channels, int64_t d_conv,
                 int apply_silu, int n_threads) {
    const int64_t W = d_conv - 1;
    const int64_t n_blocks = (channels + SC_CONV_BLOCK - 1) / SC_CONV_BLOCK;
    const int64_t n_units = n_s * n_blocks;
    const int64_t n_written = n_t + 1 < n_snap ? n_t + 1 : n_snap;
    const size_t es = sc_dtype_size(pool_dtype);
    const int64_t xs0 = x->strides[0], xs1 = x->strides[1], xs2 = x->strides[2];
    const int team = n_units < n_threads ? (int)n_units : (n_threads < 1 ? 1 : n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *ext = (float *)sc_alloc(sizeof(float) * (size_t)((W + n_t) * SC_CONV_BLOCK));
        float *win = (float *)sc_alloc(sizeof(float) * (size_t)(W * SC_CONV_BLOCK));
        float *wT = (float *)sc_alloc(sizeof(float) * (size_t)(d_conv * SC_CONV_BLOCK));
        int64_t lo, hi;
        sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t u = lo; u < hi; u++) {
            const int64_t s = u / n_blocks, c0 = (u % n_blocks) * SC_CONV_BLOCK;
            const int64_t cb = channels - c0 < SC_CONV_BLOCK ? channels - c0 : SC_CONV_BLOCK;
            /* Window [cb, W] (time fastest in the pool) -> ext[0..W)[c]. */
            const char *src = (const char *)pool + ((size_t)start_rows[s] * (size_t)row_elems + (size_t)(c0 * W)) * es;
            sc_load_f32(src, pool_dtype, win, cb * W);
            for (int64_t c = 0; c < cb; c++)
                for (int64_t m = 0; m < W; m++) ext[m * SC_CONV_BLOCK + c] = win[c * W + m];
            for (int64_t t = 0; t < n_t; t++) {
                const float *xr = x->data + s * xs0 + t * xs1 + c0 * xs2;
                float *e = ext + (W + t) * SC_CONV_BLOCK;
                if (xs2 == 1) {
                    memcpy(e, xr, sizeof(float) * (size_t)cb);
                } else {
                    for (int64_t c = 0; c < cb; c++) e[c] = xr[c * xs2];
                }
            }
            for (int64_t k = 0; k < d_conv; k++)
                for (int64_t c = 0; c < cb; c++) wT[k * SC_CONV_BLOCK + c] = weight[(c0 + c) * d_conv + k];
            for (int64_t t = 0; t < n_t; t++) {
                float *yr = y + (s * n_t + t) * channels + c0;
                /* k outer, channels inner: every loop below vectorises. */
#pragma omp simd
                for (int64_t c = 0; c < cb; c++) yr[c] = ext[t * SC_CONV_BLOCK + c] * wT[c];
                for (int64_t k = 1; k < d_conv; k++) {
                    const float *SC_RESTRICT e = ext + (t + k) * SC_CONV_BLOCK;
                    const float *SC_RESTRICT wk = wT + k * SC_CONV_BLOCK;
#pragma omp simd
                    for (int64_t c = 0; c < cb; c++) yr[c] += e[c] * wk[c];
                }
                if (bias) {
#pragma omp simd
                    for (int64_t c = 0; c < cb; c++) yr[c] += bias[c0 + c];
                }
                if (apply_silu) {
#pragma omp simd
                    for (int64_t c = 0; c < cb; c++) yr[c] = yr[c] / (1.0f + sc_exp(-yr[c]));
                }
            }
            /* Snapshot j is the window ending j tokens before the end. */
            for (int64_t j = 0; j < n_written; j++) {
                const float *e = ext + (n_t - j) * SC_CONV_BLOCK;
                for (int64_t c = 0; c < cb; c++)
                    for (int64_t m = 0; m < W; m++) win[c * W + m] = e[m * SC_CONV_BLOCK + c];
                char *dst = (char *)pool +
                            ((size_t)(dst_rows[s] + j * plane_stride) * (size_t)row_elems + (size_t)(c0 * W)) * es;
                sc_store_f32(win, dst, pool_dtype, cb * W);
            }
        }
        free(ext);
        free(win);
        free(wT);
    }
}
