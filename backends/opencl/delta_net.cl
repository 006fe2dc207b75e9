// Gated delta rule (scalar gate = GDN, per-key gate = KDA) from start rows,
// writing the snapshot rows into the pool in one pass (protocol 2: packed
// tokens, sequence s owning tokens cu[s] .. cu[s + 1] - 1, snapshot table).
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
// The options are resolved before the main kernel: gates and beta by
// gated_delta_net_gate, L2-normalised q and k by gated_delta_net_l2norm
// (into scratch that the main kernel then reads as q and k); the q/k head
// map is an argument.

#ifndef MAX_S
#define MAX_S 256
#endif

#define DELTA_ARGS                                                                                          \
    __global pool_t *pool, long pool_off, long row_size, __global const int *start_rows, long start_off,   \
        __global const int *snap_rows, long snap_off, long n_cols, __global const int *cu, long cu_off,    \
        __global const float *q, long q_off, long qs0, long qs1, long qs2, __global const float *k,         \
        long k_off, long ks0, long ks1, long ks2, __global const float *v, long v_off, long vs0, long vs1,  \
        long vs2, __global const float *gate, long beta_at, __global float *o, long o_off, long n_head_k,   \
        long n_head_v, long S, int per_key_gate, int grouped, float scale, long rows_per_item

// Per (token, value head): exp of the log-decay for every gate element into
// gate[(tok * H_v + h) * per_head + i] (once per element instead of once per
// work-item that needs it: for KDA every work-item of a head needs all S),
// and beta into gate[beta_at + tok * H_v + h].  With A_log the gate is the
// raw projection a: log-decay = -exp(A_log[h]) * softplus(a + dt_bias);
// with beta_sigmoid beta is sigmoid(b).
__kernel void gated_delta_net_gate(__global const float *g, long g_off, long gs0, long gs1, long gs2,
                                   __global const float *beta, long be_off, long bes0, long bes1,
                                   __global const float *A_log, long al_off, long als0,
                                   __global const float *dt_bias, long db_off, long dbs0, long dbs1,
                                   int beta_sigmoid, __global float *gate, long beta_at, long n_tokens,
                                   long n_head_v, long per_head) {
    const long idx = get_global_id(0);
    if (idx >= n_tokens * n_head_v) return;
    const long h = idx % n_head_v;
    const long tok = idx / n_head_v;
    __global const float *gp = g + g_off + tok * gs0 + h * gs1;
    __global float *out = gate + idx * per_head;
    if (A_log) {
        const float rate = -exp(A_log[al_off + h * als0]);
        for (long i = 0; i < per_head; ++i) {
            float a = gp[i * gs2];
            if (dt_bias) a += dt_bias[db_off + h * dbs0 + i * dbs1];
            out[i] = exp(rate * softplus_f(a));
        }
    } else {
        long i = 0;
        for (; i + 8 <= per_head; i += 8) vstore8(exp(load8_strided(gp + i * gs2, gs2)), 0, out + i);
        for (; i < per_head; ++i) out[i] = exp(gp[i * gs2]);
    }
    const float b = beta[be_off + tok * bes0 + h * bes1];
    gate[beta_at + idx] = beta_sigmoid ? 1.0f / (1.0f + exp(-b)) : b;
}

// q and k divided by sqrt(sum of squares + eps), per (token, q/k head), into
// contiguous [T, H_k, S] blocks of `out` at qn_at and kn_at.
__kernel void gated_delta_net_l2norm(__global const float *q, long q_off, long qs0, long qs1, long qs2,
                                     __global const float *k, long k_off, long ks0, long ks1, long ks2,
                                     __global float *out, long qn_at, long kn_at, long n_tokens, long n_head_k,
                                     long S, float eps) {
    const long idx = get_global_id(0);
    if (idx >= 2 * n_tokens * n_head_k) return;
    const int is_k = (int)(idx % 2);
    const long rest = idx / 2;
    const long hk = rest % n_head_k, tok = rest / n_head_k;
    __global const float *src = is_k ? k + k_off + tok * ks0 + hk * ks1 : q + q_off + tok * qs0 + hk * qs1;
    const long stride = is_k ? ks2 : qs2;
    float ss = 0.0f;
    for (long i = 0; i < S; ++i) ss += src[i * stride] * src[i * stride];
    const float inv = 1.0f / sqrt(ss + eps);
    __global float *dst = out + (is_k ? kn_at : qn_at) + (tok * n_head_k + hk) * S;
    for (long i = 0; i < S; ++i) dst[i] = src[i * stride] * inv;
}

// Any strides, any head size up to MAX_S.
__kernel void gated_delta_net(DELTA_ARGS) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head_v * S);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        const int h = (int)r / (int)S;  // 32-bit division: a 64-bit one is slow on CPUs
        const int j = (int)r - h * (int)S;
        const int hk = grouped ? h / ((int)n_head_v / (int)n_head_k) : h % (int)n_head_k;

        float m[MAX_S];  // m[i] = M[i][j]
        const long src = pool_off + (long)start_rows[start_off + s] * row_size + r * S;
        for (long i = 0; i < S; ++i) m[i] = POOL_LOAD(pool, src + i);
        if (in_row >= 0) {  // the input state (undo of the whole call)
            const long p = pool_off + in_row * row_size + r * S;
            for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i, m[i]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long tok = t0 + t;
            const long kb = k_off + tok * ks0 + hk * ks1;
            const long qb = q_off + tok * qs0 + hk * qs1;
            const long gb = (tok * n_head_v + h) * (per_key_gate ? S : 1);
            float kd = 0.0f;
            if (per_key_gate) {
                for (long i = 0; i < S; ++i) {
                    m[i] *= gate[gb + i];
                    kd += m[i] * k[kb + i * ks2];
                }
            } else {
                const float decay = gate[gb];
                for (long i = 0; i < S; ++i) {
                    m[i] *= decay;
                    kd += m[i] * k[kb + i * ks2];
                }
            }
            const float delta = (v[v_off + tok * vs0 + h * vs1 + j * vs2] - kd) * gate[beta_at + tok * n_head_v + h];
            float acc = 0.0f;
            for (long i = 0; i < S; ++i) {
                m[i] += k[kb + i * ks2] * delta;
                acc += m[i] * q[qb + i * qs2];
            }
            o[o_off + (tok * n_head_v + h) * S + j] = scale * acc;
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);  // m: n_t - 1 - t before the end
            if (row >= 0) {
                const long p = pool_off + row * row_size + r * S;
                for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i, m[i]);
            }
        }
    }
}

// The same, 8 key elements per vector operation: S % 8 == 0 and q, k
// contiguous along the head dimension, which is every real model.
__kernel void gated_delta_net_vec8(DELTA_ARGS) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    // A work-item walks rows_per_item consecutive rows: on CPU devices work-groups are
    // single work-items, so the OpenCL runtime has no work-item loop to vectorise (see device.py).
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head_v * S);
    for (long r = get_global_id(0) * rows_per_item; r < r_end; ++r) {
        const int h = (int)r / (int)S;
        const int j = (int)r - h * (int)S;
        const int hk = grouped ? h / ((int)n_head_v / (int)n_head_k) : h % (int)n_head_k;
        const long nv = S / 8;
        const long src = pool_off + (long)start_rows[start_off + s] * row_size + r * S;

        if (n_t == 1) {
            // Decode: two streaming passes over the column instead of a private
            // copy (the second re-reads it from cache).  Each 8-element block
            // is read before the same block of any output row is written.
            const long r0 = snap_row(snap_rows, snap_off, n_cols, s, 0);
            const long p0 = pool_off + r0 * row_size + r * S, p1 = pool_off + in_row * row_size + r * S;
            __global const float *kp = k + k_off + t0 * ks0 + hk * ks1;
            __global const float *qp = q + q_off + t0 * qs0 + hk * qs1;
            __global const float *gp = gate + (t0 * n_head_v + h) * (per_key_gate ? S : 1);
            float8 kd = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                const float8 gu = per_key_gate ? vload8(u, gp) : (float8)(gp[0]);
                kd += (POOL_LOAD8(pool, src + 8 * u) * gu) * vload8(u, kp);
            }
            const float delta = (v[v_off + t0 * vs0 + h * vs1 + j * vs2] - sum8(kd)) * gate[beta_at + t0 * n_head_v + h];
            float8 acc = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                const float8 old = POOL_LOAD8(pool, src + 8 * u);
                if (in_row >= 0) POOL_STORE8(pool, p1 + 8 * u, old);
                const float8 gu = per_key_gate ? vload8(u, gp) : (float8)(gp[0]);
                const float8 mu = old * gu + vload8(u, kp) * delta;
                acc += mu * vload8(u, qp);
                if (r0 >= 0) POOL_STORE8(pool, p0 + 8 * u, mu);
            }
            o[o_off + (t0 * n_head_v + h) * S + j] = scale * sum8(acc);
            continue;
        }

        float8 m[MAX_S / 8];
        for (long u = 0; u < nv; ++u) m[u] = POOL_LOAD8(pool, src + 8 * u);
        if (in_row >= 0) {
            const long p = pool_off + in_row * row_size + r * S;
            for (long u = 0; u < nv; ++u) POOL_STORE8(pool, p + 8 * u, m[u]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long tok = t0 + t;
            __global const float *kp = k + k_off + tok * ks0 + hk * ks1;
            __global const float *qp = q + q_off + tok * qs0 + hk * qs1;
            __global const float *gp = gate + (tok * n_head_v + h) * (per_key_gate ? S : 1);
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
            const float delta = (v[v_off + tok * vs0 + h * vs1 + j * vs2] - sum8(kd)) * gate[beta_at + tok * n_head_v + h];
            float8 acc = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                m[u] += vload8(u, kp) * delta;
                acc += m[u] * vload8(u, qp);
            }
            o[o_off + (tok * n_head_v + h) * S + j] = scale * sum8(acc);
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
            if (row >= 0) {
                const long p = pool_off + row * row_size + r * S;
                for (long u = 0; u < nv; ++u) POOL_STORE8(pool, p + 8 * u, m[u]);
            }
        }
    }
}
