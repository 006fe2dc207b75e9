// Mamba-1 / Mamba-2 selective scan from start rows, writing the snapshot
// rows straight into the pool in one pass (protocol 2: packed tokens,
// sequence s owning tokens cu[s] .. cu[s + 1] - 1, snapshot table).
//
// Work-items over the state rows r = h * head_dim + i of a sequence
// (dimension 0; rows_per_item consecutive rows each), one sequence per
// dimension 1.  A row holds d_state elements, walked in chunks of KCHUNK kept
// in private memory (decode streams instead); the work-item reads a chunk of
// the start state before writing any element of it, and only it touches
// those elements, so a start row that is one of the sequence's own output
// rows (in-place decode, rollback) is safe.  y[t, h, i] belongs to the
// same work-item, which accumulates the per-chunk partial sums into it and
// applies the D skip and z gate after the last chunk.  A sequence's path
// (decode or not) depends only on its own length, so a packed call computes
// each sequence exactly as a call of its own.

#ifndef KCHUNK
#define KCHUNK 256
#endif

// Per (token, head): softplus(dt + dt_bias), clamped when asked, and, for
// Mamba-2, the decay exp(d * A[h]), computed once here instead of once per
// state row, 8 heads per vector (a scalar transcendental costs ~20-60 ns on
// PoCL).  One work-item per token.  Layout: prep[tok * n_head + h] holds d,
// prep[decay_off + the same index] the decay.
__kernel void ssm_scan_prep(__global const float *dt, long dt_off, long dts0, long dts1,
                            __global const float *A, long a_off, long as0, int a_per_state,
                            __global const float *dt_bias, long dtb_off, long dtbs0,
                            int dt_clamp, float dt_lo, float dt_hi,
                            __global float *prep, long decay_off, long n_tokens, long n_head) {
    const long tok = get_global_id(0);
    if (tok >= n_tokens) return;
    __global const float *dp = dt + dt_off + tok * dts0;
    __global const float *ap = A + a_off;
    __global float *d_out = prep + tok * n_head;
    __global float *decay_out = prep + decay_off + tok * n_head;
    long h = 0;
    for (; h + 8 <= n_head; h += 8) {
        float8 z = load8_strided(dp + h * dts1, dts1);
        if (dt_bias) z += load8_strided(dt_bias + dtb_off + h * dtbs0, dtbs0);
        float8 d = select(log1p(exp(z)), z, isgreater(z, (float8)(20.0f)));
        if (dt_clamp) {
            d = select(d, (float8)(dt_lo), isless(d, (float8)(dt_lo)));
            d = select(d, (float8)(dt_hi), isgreater(d, (float8)(dt_hi)));
        }
        vstore8(d, 0, d_out + h);
        if (!a_per_state) vstore8(exp(d * load8_strided(ap + h * as0, as0)), 0, decay_out + h);
    }
    for (; h < n_head; ++h) {
        float z = dp[h * dts1];
        if (dt_bias) z += dt_bias[dtb_off + h * dtbs0];
        float d = softplus_f(z);
        if (dt_clamp) d = clamp_keep_nan(d, dt_lo, dt_hi);
        d_out[h] = d;
        if (!a_per_state) decay_out[h] = exp(d * ap[h * as0]);
    }
}

// y = (acc + D * x) * silu(z), each part when given.
inline float scan_out(float acc, float xv, __global const float *D, long dpos, __global const float *z, long zpos) {
    if (D) acc += D[dpos] * xv;
    if (z) acc *= silu_f(z[zpos]);
    return acc;
}

#define SCAN_ARGS                                                                                              \
    __global pool_t *pool, long pool_off, long row_size, __global const int *start_rows, long start_off,      \
        __global const int *snap_rows, long snap_off, long n_cols, __global const int *cu, long cu_off,       \
        __global const float *x, long x_off, long xs0, long xs1, long xs2, __global const float *prep,        \
        long decay_off, __global const float *A, long a_off, long as0, long as1, __global const float *B,     \
        long b_off, long bs0, long bs1, long bs2, __global const float *C, long c_off, long cs0, long cs1,    \
        long cs2, __global float *y, long y_off, __global const float *D, long d_off, long ds0, long ds1,     \
        __global const float *z, long z_off, long zs0, long zs1, long zs2, long n_head, long head_dim,        \
        long d_state, long heads_per_group, int a_per_state, long rows_per_item

__kernel void ssm_scan(SCAN_ARGS) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);  // the input state's row, or -1
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head * head_dim);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        // 32-bit divisions: a 64-bit one costs as much as a row's arithmetic on CPUs.
        const int h = (int)r / (int)head_dim;
        const int i = (int)r - h * (int)head_dim;
        const int g = h / (int)heads_per_group;

        const long src = pool_off + (long)start_rows[start_off + s] * row_size + r * d_state;
        const long y_base = y_off + (t0 * n_head + h) * head_dim + i;
        const long y_tstride = n_head * head_dim;

        float st[KCHUNK];
        for (long k0 = 0; k0 < d_state; k0 += KCHUNK) {
            const long kn = min((long)KCHUNK, d_state - k0);
            const int last_chunk = k0 + KCHUNK >= d_state;
            for (long kk = 0; kk < kn; ++kk) st[kk] = POOL_LOAD(pool, src + k0 + kk);
            if (in_row >= 0) {  // the input state (undo of the whole call)
                const long p = pool_off + in_row * row_size + r * d_state + k0;
                for (long kk = 0; kk < kn; ++kk) POOL_STORE(pool, p + kk, st[kk]);
            }
            for (long t = 0; t < n_t; ++t) {
                const long tok = t0 + t;
                const long pi = tok * n_head + h;
                const float2 dd = (float2)(prep[pi], prep[decay_off + pi]);  // softplus(dt), decay
                const float d = dd.x;
                const float xv = x[x_off + tok * xs0 + h * xs1 + i * xs2];
                const float xd = xv * d;
                const long bb = b_off + tok * bs0 + g * bs1 + k0 * bs2;
                const long cb = c_off + tok * cs0 + g * cs1 + k0 * cs2;
                float acc = 0.0f;
                if (a_per_state) {
                    const long ab = a_off + h * as0 + k0 * as1;
                    for (long kk = 0; kk < kn; ++kk) {
                        const float v = st[kk] * exp(d * A[ab + kk * as1]) + B[bb + kk * bs2] * xd;
                        st[kk] = v;
                        acc += v * C[cb + kk * cs2];
                    }
                } else {
                    const float decay = dd.y;
                    for (long kk = 0; kk < kn; ++kk) {
                        const float v = st[kk] * decay + B[bb + kk * bs2] * xd;
                        st[kk] = v;
                        acc += v * C[cb + kk * cs2];
                    }
                }
                const long yi = y_base + t * y_tstride;
                float yv = k0 == 0 ? acc : y[yi] + acc;
                if (last_chunk) yv = scan_out(yv, xv, D, d_off + h * ds0 + i * ds1, z, z_off + tok * zs0 + h * zs1 + i * zs2);
                y[yi] = yv;
                const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);  // st: n_t - 1 - t before the end
                if (row >= 0) {
                    const long p = pool_off + row * row_size + r * d_state + k0;
                    for (long kk = 0; kk < kn; ++kk) POOL_STORE(pool, p + kk, st[kk]);
                }
            }
        }
    }
}

// The same scan, 8 state elements per vector operation.  Used when d_state is
// a multiple of 8 and B, C (and A for Mamba-1) are contiguous along d_state,
// which is every real model: the scalar kernel above leaves a CPU's SIMD
// units idle and is several times slower on PoCL.
__kernel void ssm_scan_vec8(SCAN_ARGS) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head * head_dim);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        // 32-bit divisions: a 64-bit one costs as much as a row's arithmetic on CPUs.
        const int h = (int)r / (int)head_dim;
        const int i = (int)r - h * (int)head_dim;
        const int g = h / (int)heads_per_group;

        const long src = pool_off + (long)start_rows[start_off + s] * row_size + r * d_state;
        const long y_base = y_off + (t0 * n_head + h) * head_dim + i;
        const long y_tstride = n_head * head_dim;

        if (n_t == 1) {
            // Decode: one streaming pass, no private copy of the state.  Each
            // 8-element block is read before the same block of any output
            // row is written, which is all in-place and rollback starts need.
            const long r0 = snap_row(snap_rows, snap_off, n_cols, s, 0);
            const long p0 = pool_off + r0 * row_size + r * d_state, p1 = pool_off + in_row * row_size + r * d_state;
            const float2 dd = (float2)(prep[t0 * n_head + h], prep[decay_off + t0 * n_head + h]);
            const float xv = x[x_off + t0 * xs0 + h * xs1 + i * xs2];
            const float xd = xv * dd.x;
            __global const float *Bp = B + b_off + t0 * bs0 + g * bs1;
            __global const float *Cp = C + c_off + t0 * cs0 + g * cs1;
            __global const float *Ap = A + a_off + h * as0;
            float8 acc = (float8)(0.0f);
            for (long v = 0; v < d_state / 8; ++v) {
                const float8 old = POOL_LOAD8(pool, src + 8 * v);
                if (in_row >= 0) POOL_STORE8(pool, p1 + 8 * v, old);
                const float8 decay = a_per_state ? exp(dd.x * vload8(v, Ap)) : (float8)(dd.y);
                const float8 st = old * decay + vload8(v, Bp) * xd;
                acc += st * vload8(v, Cp);
                if (r0 >= 0) POOL_STORE8(pool, p0 + 8 * v, st);
            }
            y[y_base] = scan_out(sum8(acc), xv, D, d_off + h * ds0 + i * ds1, z, z_off + t0 * zs0 + h * zs1 + i * zs2);
            continue;
        }

        float8 st[KCHUNK / 8];
        for (long k0 = 0; k0 < d_state; k0 += KCHUNK) {
            const long nv = min((long)KCHUNK, d_state - k0) / 8;
            const int last_chunk = k0 + KCHUNK >= d_state;
            for (long v = 0; v < nv; ++v) st[v] = POOL_LOAD8(pool, src + k0 + 8 * v);
            if (in_row >= 0) {
                const long p = pool_off + in_row * row_size + r * d_state + k0;
                for (long v = 0; v < nv; ++v) POOL_STORE8(pool, p + 8 * v, st[v]);
            }
            for (long t = 0; t < n_t; ++t) {
                const long tok = t0 + t;
                const long pi = tok * n_head + h;
                const float2 dd = (float2)(prep[pi], prep[decay_off + pi]);  // softplus(dt), decay
                const float d = dd.x;
                const float xv = x[x_off + tok * xs0 + h * xs1 + i * xs2];
                const float xd = xv * d;
                __global const float *Bp = B + b_off + tok * bs0 + g * bs1 + k0;
                __global const float *Cp = C + c_off + tok * cs0 + g * cs1 + k0;
                float8 acc = (float8)(0.0f);
                if (a_per_state) {
                    __global const float *Ap = A + a_off + h * as0 + k0;
                    for (long v = 0; v < nv; ++v) {
                        st[v] = st[v] * exp(d * vload8(v, Ap)) + vload8(v, Bp) * xd;
                        acc += st[v] * vload8(v, Cp);
                    }
                } else {
                    const float decay = dd.y;
                    for (long v = 0; v < nv; ++v) {
                        st[v] = st[v] * decay + vload8(v, Bp) * xd;
                        acc += st[v] * vload8(v, Cp);
                    }
                }
                const long yi = y_base + t * y_tstride;
                float yv = k0 == 0 ? sum8(acc) : y[yi] + sum8(acc);
                if (last_chunk) yv = scan_out(yv, xv, D, d_off + h * ds0 + i * ds1, z, z_off + tok * zs0 + h * zs1 + i * zs2);
                y[yi] = yv;
                const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
                if (row >= 0) {
                    const long p = pool_off + row * row_size + r * d_state + k0;
                    for (long v = 0; v < nv; ++v) POOL_STORE8(pool, p + 8 * v, st[v]);
                }
            }
        }
    }
}
