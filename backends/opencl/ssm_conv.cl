// Depthwise causal conv over concat(window, x) with window snapshots
// (protocol 2: packed tokens, sequence s owning tokens cu[s] .. cu[s + 1] - 1,
// snapshot table).  Work-items over (channels, sequence): a work-item owns
// its channels of every row its sequence writes, so it reads a channel's
// whole start window into private memory before writing anything, and no
// other work-item touches those elements.  That is what makes in-place
// decode (start row == destination row) and rollback starts (start row ==
// one of its own snapshot rows) safe.

#ifndef MAX_WINDOW
#define MAX_WINDOW 32
#endif

__kernel void ssm_conv(__global pool_t *pool, long pool_off, long row_size,
                       __global const int *start_rows, long start_off,
                       __global const int *snap_rows, long snap_off, long n_cols,
                       __global const int *cu, long cu_off,
                       __global const float *x, long x_off, long xs0, long xs1,
                       __global const float *weight, long w_off, long ws0, long ws1,
                       __global const float *bias, long b_off, long bs0,
                       __global float *y, long y_off,
                       long ch, long d_conv, int apply_silu, long rows_per_item) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);  // the input window's row, or -1
    // A work-item walks rows_per_item consecutive channels: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long c_end = min((long)(get_global_id(0) + 1) * rows_per_item, ch);
    const long W = d_conv - 1;
    const long src_row = pool_off + (long)start_rows[start_off + s] * row_size;
    long c = get_global_id(0) * rows_per_item;

    // Blocks of 8 channels as float8 lanes (x contiguous along channels).  The
    // window gathers and snapshot scatters are per lane (a row is [ch, W],
    // time fastest); the per-token work is all vector.
    for (; c + 8 <= c_end && xs1 == 1; c += 8) {
        float8 win8[MAX_WINDOW];
        float8 w8[MAX_WINDOW + 1];
        const long src = src_row + c * W;
        for (long w = 0; w < W; ++w) {
            win8[w] = (float8)(POOL_LOAD(pool, src + w), POOL_LOAD(pool, src + W + w),
                               POOL_LOAD(pool, src + 2 * W + w), POOL_LOAD(pool, src + 3 * W + w),
                               POOL_LOAD(pool, src + 4 * W + w), POOL_LOAD(pool, src + 5 * W + w),
                               POOL_LOAD(pool, src + 6 * W + w), POOL_LOAD(pool, src + 7 * W + w));
        }
        for (long k = 0; k <= W; ++k) w8[k] = load8_strided(weight + w_off + c * ws0 + k * ws1, ws0);
        const float8 b8 = bias ? load8_strided(bias + b_off + c * bs0, bs0) : (float8)(0.0f);
        float lanes[8];
        if (in_row >= 0) {  // the input window
            const long p = pool_off + in_row * row_size + c * W;
            for (long w = 0; w < W; ++w) {
                vstore8(win8[w], 0, lanes);
                for (int l = 0; l < 8; ++l) POOL_STORE(pool, p + l * W + w, lanes[l]);
            }
        }
        for (long t = 0; t < n_t; ++t) {
            const float8 xt = vload8(0, x + x_off + (t0 + t) * xs0 + c);
            float8 acc = (float8)(0.0f);
            for (long k = 0; k < W; ++k) acc += win8[k] * w8[k];
            acc += xt * w8[W];
            acc += b8;
            if (apply_silu) acc = acc / (1.0f + exp(-acc));
            vstore8(acc, 0, y + y_off + (t0 + t) * ch + c);
            for (long k = 0; k + 1 < W; ++k) win8[k] = win8[k + 1];
            win8[W - 1] = xt;
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
            if (row >= 0) {
                const long p = pool_off + row * row_size + c * W;
                for (long w = 0; w < W; ++w) {
                    vstore8(win8[w], 0, lanes);
                    for (int l = 0; l < 8; ++l) POOL_STORE(pool, p + l * W + w, lanes[l]);
                }
            }
        }
    }

    // Remaining channels (or strided x), one at a time.
    const long c_scalar = c;
    for (; c < c_end; ++c) {

        // win holds ext[t : t + W] before token t is consumed (ext = window ++ x).
        float win[MAX_WINDOW];
        const long src = src_row + c * W;
        for (long w = 0; w < W; ++w) win[w] = POOL_LOAD(pool, src + w);

        if (in_row >= 0) {  // the input window, so undoing the whole call is exact
            const long p = pool_off + in_row * row_size + c * W;
            for (long w = 0; w < W; ++w) POOL_STORE(pool, p + w, win[w]);
        }

        const float b = bias ? bias[b_off + c * bs0] : 0.0f;
        const long wbase = w_off + c * ws0;
        const float w_last = weight[wbase + W * ws1];
        for (long t = 0; t < n_t; ++t) {
            const float xt = x[x_off + (t0 + t) * xs0 + c * xs1];
            float acc = 0.0f;
            for (long k = 0; k < W; ++k) acc += win[k] * weight[wbase + k * ws1];
            acc += xt * w_last;
            acc += b;
            y[y_off + (t0 + t) * ch + c] = acc;  // SiLU, if asked, is applied below

            for (long k = 0; k + 1 < W; ++k) win[k] = win[k + 1];
            if (W > 0) win[W - 1] = xt;
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);  // win: n_t - 1 - t before the end
            if (row >= 0) {
                const long p = pool_off + row * row_size + c * W;
                for (long w = 0; w < W; ++w) POOL_STORE(pool, p + w, win[w]);
            }
        }
    }

    // SiLU over the outputs of the one-at-a-time channels, 8 channels per
    // vector: a scalar exp costs ~20 ns on PoCL, three times the rest of a
    // channel's decode work.
    if (apply_silu) {
        for (long t = 0; t < n_t; ++t) {
            __global float *yt = y + y_off + (t0 + t) * ch;
            long c = c_scalar;
            for (; c + 8 <= c_end; c += 8) {
                const float8 a = vload8(0, yt + c);
                vstore8(a / (1.0f + exp(-a)), 0, yt + c);
            }
            for (; c < c_end; ++c) yt[c] = yt[c] / (1.0f + exp(-yt[c]));
        }
    }
}
