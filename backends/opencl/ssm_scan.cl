// Mamba-1 / Mamba-2 selective scan from start rows, writing the destination
// row and snapshot planes straight into the pool in one pass.
//
// Work-items over the state rows r = h * head_dim + i of a sequence
// (dimension 0; rows_per_item consecutive rows each), one sequence per
// dimension 1.  A row holds d_state elements, walked in chunks of KCHUNK kept
// in private memory (decode streams instead); the work-item reads a chunk of
// the start state before writing any element of it, and only it touches
// those elements, so a start row that is one of the sequence's own output
// rows (in-place decode, rollback) is safe.  y[s, t, h, i] belongs to the
// same work-item, which accumulates the per-chunk partial sums into it.

#ifndef KCHUNK
#define KCHUNK 256
#endif

// Per (sequence, token, head): softplus(dt) and, for Mamba-2, the decay
// exp(softplus(dt) * A[h]), computed once here instead of once per state row,
// 8 heads per vector (a scalar transcendental costs ~20-60 ns on PoCL).  One
// work-item per (sequence, token).  Layout: prep[(s * n_t + t) * n_head + h]
// holds softplus(dt), prep[decay_off + the same index] the decay.
__kernel void ssm_scan_prep(__global const float *dt, long dt_off, long dts0, long dts1, long dts2,
                            __global const float *A, long a_off, long as0, int a_per_state,
                            __global float *prep, long decay_off, long n_s, long n_t, long n_head) {
    const long st = get_global_id(0);
    if (st >= n_s * n_t) return;
    const long s = st / n_t;
    const long t = st - s * n_t;
    __global const float *dp = dt + dt_off + s * dts0 + t * dts1;
    __global const float *ap = A + a_off;
    __global float *d_out = prep + st * n_head;
    __global float *decay_out = prep + decay_off + st * n_head;
    long h = 0;
    for (; h + 8 <= n_head; h += 8) {
        const float8 z = load8_strided(dp + h * dts2, dts2);
        const float8 d = select(log1p(exp(z)), z, isgreater(z, (float8)(20.0f)));
        vstore8(d, 0, d_out + h);
        if (!a_per_state) vstore8(exp(d * load8_strided(ap + h * as0, as0)), 0, decay_out + h);
    }
    for (; h < n_head; ++h) {
        const float d = softplus_f(dp[h * dts2]);
        d_out[h] = d;
        if (!a_per_state) decay_out[h] = exp(d * ap[h * as0]);
    }
}

__kernel void ssm_scan(__global pool_t *pool, long pool_off, long row_size,
                       __global const int *start_rows, __global const int *dst_rows,
                       __global const float *x, long x_off, long xs0, long xs1, long xs2, long xs3,
                       __global const float *prep, long decay_off,
                       __global const float *A, long a_off, long as0, long as1,
                       __global const float *B, long b_off, long bs0, long bs1, long bs2, long bs3,
                       __global const float *C, long c_off, long cs0, long cs1, long cs2, long cs3,
                       __global float *y, long y_off,
                       long n_t, long n_head, long head_dim, long d_state, long heads_per_group,
                       int a_per_state, long n_written, long plane_step, long rows_per_item) {
    const long s = get_global_id(1);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head * head_dim);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        // 32-bit divisions: a 64-bit one costs as much as a row's arithmetic on CPUs.
        const int h = (int)r / (int)head_dim;
        const int i = (int)r - h * (int)head_dim;
        const int g = h / (int)heads_per_group;

        const long src = pool_off + (long)start_rows[s] * row_size + r * d_state;
        const long dst0 = pool_off + (long)dst_rows[s] * row_size + r * d_state;
        const long y_base = y_off + ((s * n_t) * n_head + h) * head_dim + i;
        const long y_tstride = n_head * head_dim;

        float st[KCHUNK];
        for (long k0 = 0; k0 < d_state; k0 += KCHUNK) {
            const long kn = min((long)KCHUNK, d_state - k0);
            for (long kk = 0; kk < kn; ++kk) st[kk] = POOL_LOAD(pool, src + k0 + kk);
            if (n_written > n_t) {  // plane n_t: the input state (undo of the whole call)
                const long p = dst0 + n_t * plane_step + k0;
                for (long kk = 0; kk < kn; ++kk) POOL_STORE(pool, p + kk, st[kk]);
            }
            for (long t = 0; t < n_t; ++t) {
                const long pi = (s * n_t + t) * n_head + h;
                const float2 dd = (float2)(prep[pi], prep[decay_off + pi]);  // softplus(dt), decay
                const float d = dd.x;
                const float xd = x[x_off + s * xs0 + t * xs1 + h * xs2 + i * xs3] * d;
                const long bb = b_off + s * bs0 + t * bs1 + g * bs2 + k0 * bs3;
                const long cb = c_off + s * cs0 + t * cs1 + g * cs2 + k0 * cs3;
                float acc = 0.0f;
                if (a_per_state) {
                    const long ab = a_off + h * as0 + k0 * as1;
                    for (long kk = 0; kk < kn; ++kk) {
                        const float v = st[kk] * exp(d * A[ab + kk * as1]) + B[bb + kk * bs3] * xd;
                        st[kk] = v;
                        acc += v * C[cb + kk * cs3];
                    }
                } else {
                    const float decay = dd.y;
                    for (long kk = 0; kk < kn; ++kk) {
                        const float v = st[kk] * decay + B[bb + kk * bs3] * xd;
                        st[kk] = v;
                        acc += v * C[cb + kk * cs3];
                    }
                }
                const long yi = y_base + t * y_tstride;
                y[yi] = k0 == 0 ? acc : y[yi] + acc;
                const long j = n_t - 1 - t;  // st is now the state j tokens before the end
                if (j < n_written) {
                    const long p = dst0 + j * plane_step + k0;
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
__kernel void ssm_scan_vec8(__global pool_t *pool, long pool_off, long row_size,
                            __global const int *start_rows, __global const int *dst_rows,
                            __global const float *x, long x_off, long xs0, long xs1, long xs2, long xs3,
                            __global const float *prep, long decay_off,
                            __global const float *A, long a_off, long as0, long as1,
                            __global const float *B, long b_off, long bs0, long bs1, long bs2, long bs3,
                            __global const float *C, long c_off, long cs0, long cs1, long cs2, long cs3,
                            __global float *y, long y_off,
                            long n_t, long n_head, long head_dim, long d_state, long heads_per_group,
                            int a_per_state, long n_written, long plane_step, long rows_per_item) {
    const long s = get_global_id(1);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head * head_dim);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        // 32-bit divisions: a 64-bit one costs as much as a row's arithmetic on CPUs.
        const int h = (int)r / (int)head_dim;
        const int i = (int)r - h * (int)head_dim;
        const int g = h / (int)heads_per_group;

        const long src = pool_off + (long)start_rows[s] * row_size + r * d_state;
        const long dst0 = pool_off + (long)dst_rows[s] * row_size + r * d_state;
        const long y_base = y_off + ((s * n_t) * n_head + h) * head_dim + i;
        const long y_tstride = n_head * head_dim;

        if (n_t == 1) {
            // Decode: one streaming pass, no private copy of the state.  Each
            // 8-element block is read before the same block of any output
            // plane is written, which is all in-place and rollback starts need.
            const float2 dd = (float2)(prep[s * n_head + h], prep[decay_off + s * n_head + h]);
            const float xd = x[x_off + s * xs0 + h * xs2 + i * xs3] * dd.x;
            __global const float *Bp = B + b_off + s * bs0 + g * bs2;
            __global const float *Cp = C + c_off + s * cs0 + g * cs2;
            __global const float *Ap = A + a_off + h * as0;
            float8 acc = (float8)(0.0f);
            for (long v = 0; v < d_state / 8; ++v) {
                const float8 old = POOL_LOAD8(pool, src + 8 * v);
                if (n_written > 1) POOL_STORE8(pool, dst0 + plane_step + 8 * v, old);
                const float8 decay = a_per_state ? exp(dd.x * vload8(v, Ap)) : (float8)(dd.y);
                const float8 st = old * decay + vload8(v, Bp) * xd;
                acc += st * vload8(v, Cp);
                POOL_STORE8(pool, dst0 + 8 * v, st);
            }
            y[y_base] = sum8(acc);
            continue;
        }

        float8 st[KCHUNK / 8];
        for (long k0 = 0; k0 < d_state; k0 += KCHUNK) {
            const long nv = min((long)KCHUNK, d_state - k0) / 8;
            for (long v = 0; v < nv; ++v) st[v] = POOL_LOAD8(pool, src + k0 + 8 * v);
            if (n_written > n_t) {
                const long p = dst0 + n_t * plane_step + k0;
                for (long v = 0; v < nv; ++v) POOL_STORE8(pool, p + 8 * v, st[v]);
            }
            for (long t = 0; t < n_t; ++t) {
                const long pi = (s * n_t + t) * n_head + h;
                const float2 dd = (float2)(prep[pi], prep[decay_off + pi]);  // softplus(dt), decay
                const float d = dd.x;
                const float xd = x[x_off + s * xs0 + t * xs1 + h * xs2 + i * xs3] * d;
                __global const float *Bp = B + b_off + s * bs0 + t * bs1 + g * bs2 + k0;
                __global const float *Cp = C + c_off + s * cs0 + t * cs1 + g * cs2 + k0;
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
                y[yi] = k0 == 0 ? sum8(acc) : y[yi] + sum8(acc);
                const long j = n_t - 1 - t;
                if (j < n_written) {
                    const long p = dst0 + j * plane_step + k0;
                    for (long v = 0; v < nv; ++v) POOL_STORE8(pool, p + 8 * v, st[v]);
                }
            }
        }
    }
}
