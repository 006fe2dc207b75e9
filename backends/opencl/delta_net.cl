// Gated delta rule (scalar gate = GDN, per-key gate = KDA) from start rows,
// writing the destination row and snapshot planes into the pool in one pass.
//
// One work-group per (value head h, sequence s), one work-item per value
// index j (local size == head size S).  In storage, element [j, i] of a head
// block is M[i][j], so work-item j owns one contiguous storage row: column j
// of M.  Everything it computes (the decay, the dot with k, delta[j], the
// update, o[j]) needs only that column plus the shared k, q and gate vectors,
// which the group stages in local memory once per token.  The work-item
// reads its whole start column before writing anything, and no other
// work-item touches it, so in-place and rollback starts are safe.

#ifndef MAX_S
#define MAX_S 256
#endif

__kernel void gated_delta_net(__global pool_t *pool, long pool_off, long row_size,
                              __global const int *start_rows, __global const int *dst_rows,
                              __global const float *q, long q_off, long qs0, long qs1, long qs2, long qs3,
                              __global const float *k, long k_off, long ks0, long ks1, long ks2, long ks3,
                              __global const float *v, long v_off, long vs0, long vs1, long vs2, long vs3,
                              __global const float *g, long g_off, long gs0, long gs1, long gs2, long gs3,
                              __global const float *beta, long be_off, long bes0, long bes1, long bes2,
                              __global float *o, long o_off,
                              long n_t, long n_head_k, long n_head_v, long S, int per_key_gate,
                              long n_written, long plane_step, float scale) {
    const long j = get_local_id(0);
    const long h = get_group_id(0);
    const long s = get_group_id(1);
    const long hk = h % n_head_k;  // value head h uses q/k head h % H_k (tiling)

    __local float k_sh[MAX_S];
    __local float q_sh[MAX_S];
    __local float gate_sh[MAX_S];

    float m[MAX_S];  // m[i] = M[i][j]
    const long src = pool_off + (long)start_rows[s] * row_size + (h * S + j) * S;
    const long dst0 = pool_off + (long)dst_rows[s] * row_size + (h * S + j) * S;
    for (long i = 0; i < S; ++i) m[i] = POOL_LOAD(pool, src + i);
    if (n_written > n_t) {  // plane n_t: the input state (undo of the whole call)
        const long p = dst0 + n_t * plane_step;
        for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i, m[i]);
    }

    for (long t = 0; t < n_t; ++t) {
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous token's readers are done with the stage
        k_sh[j] = k[k_off + s * ks0 + t * ks1 + hk * ks2 + j * ks3];
        q_sh[j] = q[q_off + s * qs0 + t * qs1 + hk * qs2 + j * qs3];
        if (per_key_gate) gate_sh[j] = exp(g[g_off + s * gs0 + t * gs1 + h * gs2 + j * gs3]);
        barrier(CLK_LOCAL_MEM_FENCE);

        float kd = 0.0f;
        if (per_key_gate) {
            for (long i = 0; i < S; ++i) {
                m[i] *= gate_sh[i];
                kd += m[i] * k_sh[i];
            }
        } else {
            const float decay = exp(g[g_off + s * gs0 + t * gs1 + h * gs2]);
            for (long i = 0; i < S; ++i) {
                m[i] *= decay;
                kd += m[i] * k_sh[i];
            }
        }
        const float delta = (v[v_off + s * vs0 + t * vs1 + h * vs2 + j * vs3] - kd) *
                            beta[be_off + s * bes0 + t * bes1 + h * bes2];
        float acc = 0.0f;
        for (long i = 0; i < S; ++i) {
            m[i] += k_sh[i] * delta;
            acc += m[i] * q_sh[i];
        }
        o[o_off + ((s * n_t + t) * n_head_v + h) * S + j] = scale * acc;

        const long jj = n_t - 1 - t;  // m is now the state jj tokens before the end
        if (jj < n_written) {
            const long p = dst0 + jj * plane_step;
            for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i, m[i]);
        }
    }
}
