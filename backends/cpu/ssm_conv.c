/* Depthwise causal conv over concat(window, x), with window snapshots.
 *
 * A work unit is (sequence, block of SC_CONV_BLOCK channels).  Each unit
 * transposes its windows into a time-major scratch `ext[t][c]` and reads x
 * rows in place (strided x is packed into ext), so that the taps, bias and
 * SiLU vectorise over channels (8-lane AVX2 loop, portable loops for the
 * channel tail and other builds); then it writes outputs and snapshot
 * windows straight back into the pool.  Decode (one token) on AVX2 skips the
 * transposes and gathers windows and weights instead.  Every read of the start
 * row's slice happens before any write to it, and no other unit touches that
 * slice, so in-place decode and rollback are safe under any thread split. */
#include "sc_internal.h"

/* 1 KiB of each x and y row per token: long contiguous runs for the
 * prefetchers (rows are a whole channel count apart), and still enough units
 * to split a 3k-channel prefill evenly over two threads. */
#define SC_CONV_BLOCK 256
#define SC_CONV_MAX_TAPS 16

#ifdef SC_HAVE_AVX2
/* One token (decode) for channels [c0, c0 + cb) of sequence s.  The pool's
 * [ch][W] windows and the [ch][d_conv] weights are read with gathers, 8
 * channels per vector, instead of being transposed through scratch (at one
 * token the transposes cost more than the convolution).  `win` and `nwin`
 * are [cb][W] scratch: the start window and the window after the token. */
static void conv_decode_block(const float *win, float *nwin, const float *xr, int64_t xs2, const float *weight,
                              const float *bias, float *yr, int64_t c0, int64_t cb, int64_t d_conv, int apply_silu) {
    const int64_t W = d_conv - 1;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx_w = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)W));
    const __m256i idx_k = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)d_conv));
    const __m256i idx_x = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)xs2));
    const int64_t c_vec = cb - cb % 8;
    for (int64_t c = 0; c < c_vec; c += 8) {
        const float *wc = win + c * W, *kc = weight + (c0 + c) * d_conv;
        const __m256 xv = xs2 == 1 ? _mm256_loadu_ps(xr + c) : _mm256_i32gather_ps(xr + c * xs2, idx_x, 4);
        /* Same order as the multi-token path: taps 0 .. d_conv-1, then bias. */
        __m256 acc = W > 0 ? _mm256_mul_ps(_mm256_i32gather_ps(wc, idx_w, 4), _mm256_i32gather_ps(kc, idx_k, 4))
                           : _mm256_mul_ps(xv, _mm256_i32gather_ps(kc, idx_k, 4));
        for (int64_t k = 1; k < W; k++)
            acc = _mm256_fmadd_ps(_mm256_i32gather_ps(wc + k, idx_w, 4), _mm256_i32gather_ps(kc + k, idx_k, 4), acc);
        if (W > 0) acc = _mm256_fmadd_ps(xv, _mm256_i32gather_ps(kc + W, idx_k, 4), acc);
        if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + c0 + c));
        if (apply_silu) acc = sc_silu8(acc);
        _mm256_storeu_ps(yr + c, acc);
    }
    for (int64_t c = c_vec; c < cb; c++) {
        const float *wc = win + c * W, *kc = weight + (c0 + c) * d_conv;
        const float xc = xr[c * xs2];
        float acc = W > 0 ? wc[0] * kc[0] : xc * kc[0];
        for (int64_t k = 1; k < W; k++) acc += wc[k] * kc[k];
        if (W > 0) acc += xc * kc[W];
        if (bias) acc += bias[c0 + c];
        if (apply_silu) acc = acc / (1.0f + sc_exp(-acc));
        yr[c] = acc;
    }
    /* The new window is the old one shifted by a token, x in the last slot. */
    if (W > 0) {
        memcpy(nwin, win + 1, sizeof(float) * (size_t)(cb * W - 1));
        for (int64_t c = 0; c < cb; c++) nwin[c * W + W - 1] = xr[c * xs2];
    }
}
#endif

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
    /* Bytes moved: the window read and the planes written, plus x in and y out. */
    const int64_t work_bytes = n_s * channels * (int64_t)sizeof(float) * (W * (1 + n_written) + 2 * n_t);
    const int team = sc_state_team(n_units, work_bytes, n_threads);
#pragma omp parallel num_threads(team) if (team > 1)
    {
        float *ext = (float *)sc_alloc(sizeof(float) * (size_t)((W + (xs2 == 1 ? 0 : n_t)) * SC_CONV_BLOCK));
        float *win = (float *)sc_alloc(sizeof(float) * (size_t)(W * SC_CONV_BLOCK));
        float *wT = (float *)sc_alloc(sizeof(float) * (size_t)(d_conv * SC_CONV_BLOCK));
        float *nwin = (float *)sc_alloc(sizeof(float) * (size_t)(W * SC_CONV_BLOCK));
        int64_t lo, hi;
        sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t u = lo; u < hi; u++) {
            const int64_t s = u / n_blocks, c0 = (u % n_blocks) * SC_CONV_BLOCK;
            const int64_t cb = channels - c0 < SC_CONV_BLOCK ? channels - c0 : SC_CONV_BLOCK;
            /* Window [cb, W] (time fastest in the pool) -> ext[0..W)[c]. */
            const char *src = (const char *)pool + ((size_t)start_rows[s] * (size_t)row_elems + (size_t)(c0 * W)) * es;
            sc_load_f32(src, pool_dtype, win, cb * W);
#ifdef SC_HAVE_AVX2
            if (n_t == 1) {
                conv_decode_block(win, nwin, x->data + s * xs0 + c0 * xs2, xs2, weight, bias, y + s * channels + c0, c0,
                                  cb, d_conv, apply_silu);
                /* Plane 0 is the new window, plane 1 (when kept) the input one. */
                for (int64_t j = 0; j < n_written; j++) {
                    char *dst = (char *)pool +
                                ((size_t)(dst_rows[s] + j * plane_stride) * (size_t)row_elems + (size_t)(c0 * W)) * es;
                    sc_store_f32(j == 0 ? nwin : win, dst, pool_dtype, cb * W);
                }
                continue;
            }
#endif
            for (int64_t c = 0; c < cb; c++)
                for (int64_t m = 0; m < W; m++) ext[m * SC_CONV_BLOCK + c] = win[c * W + m];
            /* Time row q of concat(window, x) for this block: contiguous x is
             * read in place, strided x is packed into ext once. */
            const float *xblock = x->data + s * xs0 + c0 * xs2;
#define EROW(q) ((q) < W || xs2 != 1 ? ext + (q) * SC_CONV_BLOCK : xblock + ((q) - W) * xs1)
            if (xs2 != 1)
                for (int64_t t = 0; t < n_t; t++)
                    for (int64_t c = 0; c < cb; c++) ext[(W + t) * SC_CONV_BLOCK + c] = xblock[t * xs1 + c * xs2];
            for (int64_t k = 0; k < d_conv; k++)
                for (int64_t c = 0; c < cb; c++) wT[k * SC_CONV_BLOCK + c] = weight[(c0 + c) * d_conv + k];
            int64_t c_vec = 0; /* channels [0, c_vec) done by the AVX2 loop */
#ifdef SC_HAVE_AVX2
            c_vec = cb - cb % 8;
            for (int64_t t = 0; t < n_t; t++) {
                float *yr = y + (s * n_t + t) * channels + c0;
                const float *taps[SC_CONV_MAX_TAPS];
                const int64_t n_taps = d_conv < SC_CONV_MAX_TAPS ? d_conv : SC_CONV_MAX_TAPS;
                for (int64_t k = 0; k < n_taps; k++) taps[k] = EROW(t + k);
                for (int64_t c = 0; c < c_vec; c += 8) {
                    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(taps[0] + c), _mm256_load_ps(wT + c));
                    for (int64_t k = 1; k < n_taps; k++)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps[k] + c), _mm256_load_ps(wT + k * SC_CONV_BLOCK + c),
                                              acc);
                    for (int64_t k = n_taps; k < d_conv; k++)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(EROW(t + k) + c),
                                              _mm256_load_ps(wT + k * SC_CONV_BLOCK + c), acc);
                    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + c0 + c));
                    if (apply_silu) acc = sc_silu8(acc);
                    _mm256_storeu_ps(yr + c, acc);
                }
            }
#endif
            for (int64_t t = 0; t < n_t && c_vec < cb; t++) {
                float *yr = y + (s * n_t + t) * channels + c0;
                /* k outer, channels inner: every loop below vectorises. */
#pragma omp simd
                for (int64_t c = c_vec; c < cb; c++) yr[c] = EROW(t)[c] * wT[c];
                for (int64_t k = 1; k < d_conv; k++) {
                    const float *SC_RESTRICT e = EROW(t + k);
                    const float *SC_RESTRICT wk = wT + k * SC_CONV_BLOCK;
#pragma omp simd
                    for (int64_t c = c_vec; c < cb; c++) yr[c] += e[c] * wk[c];
                }
                if (bias) {
#pragma omp simd
                    for (int64_t c = c_vec; c < cb; c++) yr[c] += bias[c0 + c];
                }
                if (apply_silu) {
#pragma omp simd
                    for (int64_t c = c_vec; c < cb; c++) yr[c] = yr[c] / (1.0f + sc_exp(-yr[c]));
                }
            }
            /* Snapshot j is the window ending j tokens before the end. */
            for (int64_t j = 0; j < n_written; j++) {
                for (int64_t m = 0; m < W; m++) {
                    const float *e = EROW(n_t - j + m);
                    for (int64_t c = 0; c < cb; c++) win[c * W + m] = e[c];
                }
                char *dst = (char *)pool +
                            ((size_t)(dst_rows[s] + j * plane_stride) * (size_t)row_elems + (size_t)(c0 * W)) * es;
                sc_store_f32(win, dst, pool_dtype, cb * W);
            }
        }
#undef EROW
        free(ext);
        free(win);
        free(wT);
        free(nwin);
    }
}
