// Gated delta rule (scalar gate = GDN, per-key gate = KDA) from start rows,
// writing the destination row and snapshot planes into the pool in one pass.
//
// Work-items over the (value head h, value index j) rows of a sequence,
// flattened as r = h * S + j (dimension 0; rows_per_item consecutive rows
// each), one sequence per dimension 1.  In storage, element [j, i] of a head
// block is M[i][j], so row r is one contiguous storage row: column j of M.
// Everything computed for it (the decay, the dot with k, delta[j], the
// update, o[j]) needs only that column plus the read-only k, q and gate
// vectors, so work-items never synchronise.  A
// work-item reads a whole start column before writing any of it (into
// private memory; decode re-reads it in a second streaming pass instead),
// and no other work-item touches it, so in-place and rollback starts are
// safe.  (A version staging k/q in local memory behind barriers was 8x
// slower on PoCL, whose barriers split the kernel into separate loops.)

#ifndef MAX_S
#define MAX_S 256
#endif

#define DELTA_ARGS                                                                                      \
    __global pool_t *pool, long pool_off, long row_size, __global const int *start_rows,               \
        __global const int *dst_rows, __global const float *q, long q_off, long qs0, long qs1, long qs2, \
        long qs3, __global const float *k, long k_off, long ks0, long ks1, long ks2, long ks3,          \
        __global const float *v, long v_off, long vs0, long vs1, long vs2, long vs3,                    \
        __global const float *gate,                                                                     \
        __global const float *beta, long be_off, long bes0, long bes1, long bes2, __global float *o,    \
        long o_off, long n_t, long n_head_k, long n_head_v, long S, int per_key_gate, long n_written,   \
        long plane_step, float scale, long rows_per_item

// exp(g) for every gate element, into a contiguous [n_s, n_t, H_v(, S)]
// array: once per element instead of once per work-item that needs it (for
// KDA every work-item of a head needs all S of them).
__kernel void gated_delta_net_gate(__global const float *g, long g_off, long gs0, long gs1, long gs2, long gs3,
                                   __global float *gate, long n_s, long n_t, long n_head_v, long per_head) {
    // One work-item per (sequence, token, head), 8 gate elements per vector.
    const long idx = get_global_id(0);
    if (idx >= n_s * n_t * n_head_v) return;
    const long h = idx % n_head_v;
    const long t = (idx / n_head_v) % n_t;
    const long s = idx / (n_head_v * n_t);
    __global const float *gp = g + g_off + s * gs0 + t * gs1 + h * gs2;
    __global float *out = gate + idx * per_head;
    long i = 0;
    for (; i + 8 <= per_head; i += 8) vstore8(exp(load8_strided(gp + i * gs3, gs3)), 0, out + i);
    for (; i < per_head; ++i) out[i] = exp(gp[i * gs3]);
}

// Any strides, any head size up to MAX_S.
__kernel void gated_delta_net(DELTA_ARGS) {
    const long s = get_global_id(1);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head_v * S);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        const int h = (int)r / (int)S;  // 32-bit division: a 64-bit one is slow on CPUs
        const int j = (int)r - h * (int)S;
        const int hk = h % (int)n_head_k;  // value head h uses q/k head h % H_k (tiling)

        float m[MAX_S];  // m[i] = M[i][j]
        const long src = pool_off + (long)start_rows[s] * row_size + r * S;
        const long dst0 = pool_off + (long)dst_rows[s] * row_size + r * S;
        for (long i = 0; i < S; ++i) m[i] = POOL_LOAD(pool, src + i);
        if (n_written > n_t) {  // plane n_t: the input state (undo of the whole call)
            const long p = dst0 + n_t * plane_step;
            for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i, m[i]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long kb = k_off + s * ks0 + t * ks1 + hk * ks2;
            const long qb = q_off + s * qs0 + t * qs1 + hk * qs2;
            const long gb = ((s * n_t + t) * n_head_v + h) * (per_key_gate ? S : 1);
            float kd = 0.0f;
            if (per_key_gate) {
                for (long i = 0; i < S; ++i) {
                    m[i] *= gate[gb + i];
                    kd += m[i] * k[kb + i * ks3];
                }
            } else {
                const float decay = gate[gb];
                for (long i = 0; i < S; ++i) {
                    m[i] *= decay;
                    kd += m[i] * k[kb + i * ks3];
                }
            }
            const float delta = (v[v_off + s * vs0 + t * vs1 + h * vs2 + j * vs3] - kd) *
                                beta[be_off + s * bes0 + t * bes1 + h * bes2];
            float acc = 0.0f;
            for (long i = 0; i < S; ++i) {
                m[i] += k[kb + i * ks3] * delta;
                acc += m[i] * q[qb + i * qs3];
            }
            o[o_off + ((s * n_t + t) * n_head_v + h) * S + j] = scale * acc;
            const long jj = n_t - 1 - t;  // m is now the state jj tokens before the end
            if (jj < n_written) {
                const long p = dst0 + jj * plane_step;
                for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i, m[i]);
            }
        }
    }
}

// The same, 8 key elements per vector operation: S % 8 == 0 and q, k
// contiguous along the head dimension, which is every real model.
__kernel void gated_delta_net_vec8(DELTA_ARGS) {
    const long s = get_global_id(1);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head_v * S);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        const int h = (int)r / (int)S;
        const int j = (int)r - h * (int)S;
        const int hk = h % (int)n_head_k;
        const long nv = S / 8;
        const long src = pool_off + (long)start_rows[s] * row_size + r * S;
        const long dst0 = pool_off + (long)dst_rows[s] * row_size + r * S;

        if (n_t == 1) {
            // Decode: two streaming passes over the column instead of a private
            // copy (the second re-reads it from cache).  Each 8-element block
            // is read before the same block of any output plane is written.
            __global const float *kp = k + k_off + s * ks0 + hk * ks2;
            __global const float *qp = q + q_off + s * qs0 + hk * qs2;
            __global const float *gp = gate + (s * n_head_v + h) * (per_key_gate ? S : 1);
            float8 kd = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                const float8 gu = per_key_gate ? vload8(u, gp) : (float8)(gp[0]);
                kd += (POOL_LOAD8(pool, src + 8 * u) * gu) * vload8(u, kp);
            }
            const float delta = (v[v_off + s * vs0 + h * vs2 + j * vs3] - sum8(kd)) * beta[be_off + s * bes0 + h * bes2];
            float8 acc = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                const float8 old = POOL_LOAD8(pool, src + 8 * u);
                if (n_written > 1) POOL_STORE8(pool, dst0 + plane_step + 8 * u, old);
                const float8 gu = per_key_gate ? vload8(u, gp) : (float8)(gp[0]);
                const float8 mu = old * gu + vload8(u, kp) * delta;
                acc += mu * vload8(u, qp);
                POOL_STORE8(pool, dst0 + 8 * u, mu);
            }
            o[o_off + (s * n_head_v + h) * S + j] = scale * sum8(acc);
            continue;
        }

        float8 m[MAX_S / 8];
        for (long u = 0; u < nv; ++u) m[u] = POOL_LOAD8(pool, src + 8 * u);
        if (n_written > n_t) {
            const long p = dst0 + n_t * plane_step;
            for (long u = 0; u < nv; ++u) POOL_STORE8(pool, p + 8 * u, m[u]);
        }
        for (long t = 0; t < n_t; ++t) {
            __global const float *kp = k + k_off + s * ks0 + t * ks1 + hk * ks2;
            __global const float *qp = q + q_off + s * qs0 + t * qs1 + hk * qs2;
            __global const float *gp = gate + ((s * n_t + t) * n_head_v + h) * (per_key_gate ? S : 1);
            float8 kd = (float8)(0.0f);
            if (per_key_gate) {
                for (long u = 0; u < nv; ++u) {
                    m[u] *= vload8(u, gp);
                    kd += m[u] * vload8(u, kp);
                }
            } else {
                const float decay = gp[0];
                for (long u = 0; u < nv; ++u) {
                    m[u] *= decay;
                    kd += m[u] * vload8(u, kp);
                }
            }
            const float delta = (v[v_off + s * vs0 + t * vs1 + h * vs2 + j * vs3] - sum8(kd)) *
                                beta[be_off + s * bes0 + t * bes1 + h * bes2];
            float8 acc = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                m[u] += vload8(u, kp) * delta;
                acc += m[u] * vload8(u, qp);
            }
            o[o_off + ((s * n_t + t) * n_head_v + h) * S + j] = scale * sum8(acc);
            const long jj = n_t - 1 - t;
            if (jj < n_written) {
                const long p = dst0 + jj * plane_step;
                for (long u = 0; u < nv; ++u) POOL_STORE8(pool, p + 8 * u, m[u]);
            }
        }
    }
}
