// RWKV-6, RWKV-7 and gated linear attention (GLA) from start rows, writing
// the snapshot rows into the pool in one pass (protocol 2: packed tokens,
// sequence s owning tokens cu[s] .. cu[s + 1] - 1, snapshot table).
//
// linear_attn_prep first turns the log-decays into decays, e = exp(w) (or
// exp(g)), into contiguous scratch [T, H, S], and for RWKV-6 the time-first
// bonus of each (token, head), scale * sum_i r[i] u[i] k[i], after them.
//
// RWKV-6 and GLA store a head as [key i][value j] (j fastest): for a fixed
// token column j evolves on its own (S[i][j] = e[i] S[i][j] + k[i] v[j]) and
// o[j] sums down it, so a work-item owns columns: one (h, j) in
// linear_attn_kv, eight neighbouring ones as float8 in linear_attn_kv_vec8.
// RWKV-7 stores a head as [value i][key j] and row i evolves on its own
// (sa = a . S[i]; S[i][j] = S[i][j] e[j] + sa b[j] + v[i] k[j]; o[i] = S[i] . r),
// so a work-item owns rows, as in delta_net.cl.  Work-items never
// synchronise; each reads its whole start slice into private memory before
// writing any of it (decode streams it instead, block by block, each block
// read before the same block of any output row is written), and no other
// work-item touches that slice, so in-place and rollback starts are safe.

#ifndef MAX_S
#define MAX_S 256
#endif

#define LA_ROWS                                                                                           \
    __global pool_t *pool, long pool_off, long row_size, __global const int *start_rows, long start_off, \
        __global const int *snap_rows, long snap_off, long n_cols, __global const int *cu, long cu_off

#define LA_VIEW(n) __global const float *n, long n##_off, long n##s0, long n##s1, long n##s2

// Per (token, head): e = exp(log-decay) into e_out[(tok * H + h) * S + i], and with
// `bonus_at` >= 0 (RWKV-6) scale * sum_i r[i] u[i] k[i] into e_out[bonus_at + tok * H + h].
__kernel void linear_attn_prep(LA_VIEW(w), LA_VIEW(r), LA_VIEW(k), __global const float *u, long u_off, long us0,
                               long us1, __global float *e_out, long bonus_at, float scale, long n_tokens,
                               long n_head, long S) {
    const long idx = get_global_id(0);
    if (idx >= n_tokens * n_head) return;
    const long h = idx % n_head, tok = idx / n_head;
    __global const float *wp = w + w_off + tok * ws0 + h * ws1;
    __global float *out = e_out + idx * S;
    for (long i = 0; i < S; ++i) out[i] = exp(wp[i * ws2]);
    if (bonus_at >= 0) {
        __global const float *rp = r + r_off + tok * rs0 + h * rs1;
        __global const float *kp = k + k_off + tok * ks0 + h * ks1;
        __global const float *up = u + u_off + h * us0;
        float acc = 0.0f;
        for (long i = 0; i < S; ++i) acc += rp[i * rs2] * up[i * us1] * kp[i * ks2];
        e_out[bonus_at + idx] = scale * acc;
    }
}

// RWKV-6 (gla == 0: the output reads the state before the token, plus the
// bonus) and GLA (gla == 1: the state after): one column per work-item, any
// strides, any head size up to MAX_S.  q is r for RWKV-6.
__kernel void linear_attn_kv(LA_ROWS, LA_VIEW(q), LA_VIEW(k), LA_VIEW(v), __global const float *e, long bonus_at,
                             __global float *o, long o_off, long n_head, long S, int gla, float scale,
                             long cols_per_item) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    const long c_end = min((long)(get_global_id(0) + 1) * cols_per_item, n_head * S);
    for (long c = get_global_id(0) * cols_per_item; c < c_end; ++c) {
        const int h = (int)c / (int)S;  // 32-bit division: a 64-bit one is slow on CPUs
        const int j = (int)c - h * (int)S;
        const long col = (long)h * S * S + j;  // element (i, j) of the head block is col + i * S
        float m[MAX_S];  // m[i] = S[i][j]
        const long src = pool_off + (long)start_rows[start_off + s] * row_size + col;
        for (long i = 0; i < S; ++i) m[i] = POOL_LOAD(pool, src + i * S);
        if (in_row >= 0) {  // the input state (undo of the whole call)
            const long p = pool_off + in_row * row_size + col;
            for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i * S, m[i]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long tok = t0 + t;
            __global const float *qp = q + q_off + tok * qs0 + h * qs1;
            __global const float *kp = k + k_off + tok * ks0 + h * ks1;
            __global const float *ep = e + (tok * n_head + h) * S;
            const float vj = v[v_off + tok * vs0 + h * vs1 + j * vs2];
            float acc = 0.0f;
            for (long i = 0; i < S; ++i) {
                const float x = m[i];
                const float n = x * ep[i] + kp[i * ks2] * vj;
                m[i] = n;
                acc += qp[i * qs2] * (gla ? n : x);
            }
            const float bonus = gla ? 0.0f : e[bonus_at + tok * n_head + h];
            o[o_off + (tok * n_head + h) * S + j] = scale * acc + bonus * vj;
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
            if (row >= 0) {
                const long p = pool_off + row * row_size + col;
                for (long i = 0; i < S; ++i) POOL_STORE(pool, p + i * S, m[i]);
            }
        }
    }
}

// The same, eight neighbouring columns per work-item as float8: S % 8 == 0
// and q, k, v contiguous along the head dimension (every real model).
__kernel void linear_attn_kv_vec8(LA_ROWS, LA_VIEW(q), LA_VIEW(k), LA_VIEW(v), __global const float *e,
                                  long bonus_at, __global float *o, long o_off, long n_head, long S, int gla,
                                  float scale, long cols_per_item) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    const long blocks = n_head * (S / 8);
    const long c_end = min((long)(get_global_id(0) + 1) * cols_per_item, blocks);
    for (long c = get_global_id(0) * cols_per_item; c < c_end; ++c) {
        const int h = (int)c / (int)(S / 8);
        const int j = ((int)c - h * (int)(S / 8)) * 8;
        const long col = (long)h * S * S + j;
        const long src = pool_off + (long)start_rows[start_off + s] * row_size + col;
        if (n_t == 1) {
            // Decode: stream the columns, each block read before it is written.
            const long r0 = snap_row(snap_rows, snap_off, n_cols, s, 0);
            const long p0 = pool_off + r0 * row_size + col, p1 = pool_off + in_row * row_size + col;
            __global const float *qp = q + q_off + t0 * qs0 + h * qs1;
            __global const float *kp = k + k_off + t0 * ks0 + h * ks1;
            __global const float *ep = e + (t0 * n_head + h) * S;
            const float8 vj = vload8(0, v + v_off + t0 * vs0 + h * vs1 + j);
            float8 acc = (float8)(0.0f);
            for (long i = 0; i < S; ++i) {
                const float8 x = POOL_LOAD8(pool, src + i * S);
                if (in_row >= 0) POOL_STORE8(pool, p1 + i * S, x);
                const float8 n = x * ep[i] + kp[i] * vj;
                acc += qp[i] * (gla ? n : x);
                if (r0 >= 0) POOL_STORE8(pool, p0 + i * S, n);
            }
            const float bonus = gla ? 0.0f : e[bonus_at + t0 * n_head + h];
            vstore8(scale * acc + bonus * vj, 0, o + o_off + (t0 * n_head + h) * S + j);
            continue;
        }
        float8 m[MAX_S];
        for (long i = 0; i < S; ++i) m[i] = POOL_LOAD8(pool, src + i * S);
        if (in_row >= 0) {
            const long p = pool_off + in_row * row_size + col;
            for (long i = 0; i < S; ++i) POOL_STORE8(pool, p + i * S, m[i]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long tok = t0 + t;
            __global const float *qp = q + q_off + tok * qs0 + h * qs1;
            __global const float *kp = k + k_off + tok * ks0 + h * ks1;
            __global const float *ep = e + (tok * n_head + h) * S;
            const float8 vj = vload8(0, v + v_off + tok * vs0 + h * vs1 + j);
            float8 acc = (float8)(0.0f);
            for (long i = 0; i < S; ++i) {
                const float8 x = m[i];
                const float8 n = x * ep[i] + kp[i] * vj;
                m[i] = n;
                acc += qp[i] * (gla ? n : x);
            }
            const float bonus = gla ? 0.0f : e[bonus_at + tok * n_head + h];
            vstore8(scale * acc + bonus * vj, 0, o + o_off + (tok * n_head + h) * S + j);
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
            if (row >= 0) {
                const long p = pool_off + row * row_size + col;
                for (long i = 0; i < S; ++i) POOL_STORE8(pool, p + i * S, m[i]);
            }
        }
    }
}

#define WKV7_ARGS                                                                                          \
    LA_ROWS, LA_VIEW(r), LA_VIEW(k), LA_VIEW(v), LA_VIEW(a), LA_VIEW(b), __global const float *e,         \
        __global float *o, long o_off, long n_head, long S, float scale, long rows_per_item

// RWKV-7: one state row (h, value index i) per loop step, any strides.
__kernel void rwkv_wkv7(WKV7_ARGS) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head * S);
    for (long rr = get_global_id(0) * rows_per_item; rr < r_end; ++rr) {
        const int h = (int)rr / (int)S;
        const int i = (int)rr - h * (int)S;
        float m[MAX_S];  // m[j] = S[i][j]
        const long src = pool_off + (long)start_rows[start_off + s] * row_size + rr * S;
        for (long j = 0; j < S; ++j) m[j] = POOL_LOAD(pool, src + j);
        if (in_row >= 0) {
            const long p = pool_off + in_row * row_size + rr * S;
            for (long j = 0; j < S; ++j) POOL_STORE(pool, p + j, m[j]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long tok = t0 + t;
            __global const float *rp = r + r_off + tok * rs0 + h * rs1;
            __global const float *kp = k + k_off + tok * ks0 + h * ks1;
            __global const float *ap = a + a_off + tok * as0 + h * as1;
            __global const float *bp = b + b_off + tok * bs0 + h * bs1;
            __global const float *ep = e + (tok * n_head + h) * S;
            const float vi = v[v_off + tok * vs0 + h * vs1 + i * vs2];
            float sa = 0.0f;
            for (long j = 0; j < S; ++j) sa += ap[j * as2] * m[j];
            float acc = 0.0f;
            for (long j = 0; j < S; ++j) {
                const float n = m[j] * ep[j] + (sa * bp[j * bs2] + vi * kp[j * ks2]);
                m[j] = n;
                acc += n * rp[j * rs2];
            }
            o[o_off + (tok * n_head + h) * S + i] = scale * acc;
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
            if (row >= 0) {
                const long p = pool_off + row * row_size + rr * S;
                for (long j = 0; j < S; ++j) POOL_STORE(pool, p + j, m[j]);
            }
        }
    }
}

// The same, 8 key elements per vector operation: S % 8 == 0 and r, k, a, b
// contiguous along the head dimension.
__kernel void rwkv_wkv7_vec8(WKV7_ARGS) {
    const long s = get_global_id(1);
    const long t0 = cu[cu_off + s], n_t = cu[cu_off + s + 1] - t0;
    const long in_row = snap_row(snap_rows, snap_off, n_cols, s, n_t);
    const long nv = S / 8;
    const long r_end = min((long)(get_global_id(0) + 1) * rows_per_item, n_head * S);
    for (long rr = get_global_id(0) * rows_per_item; rr < r_end; ++rr) {
        const int h = (int)rr / (int)S;
        const int i = (int)rr - h * (int)S;
        const long src = pool_off + (long)start_rows[start_off + s] * row_size + rr * S;
        if (n_t == 1) {
            // Decode: two streaming passes over the row instead of a private copy.
            const long r0 = snap_row(snap_rows, snap_off, n_cols, s, 0);
            const long p0 = pool_off + r0 * row_size + rr * S, p1 = pool_off + in_row * row_size + rr * S;
            __global const float *rp = r + r_off + t0 * rs0 + h * rs1;
            __global const float *kp = k + k_off + t0 * ks0 + h * ks1;
            __global const float *ap = a + a_off + t0 * as0 + h * as1;
            __global const float *bp = b + b_off + t0 * bs0 + h * bs1;
            __global const float *ep = e + (t0 * n_head + h) * S;
            const float vi = v[v_off + t0 * vs0 + h * vs1 + i * vs2];
            float8 sa8 = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) sa8 += vload8(u, ap) * POOL_LOAD8(pool, src + 8 * u);
            const float sa = sum8(sa8);
            float8 acc = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                const float8 old = POOL_LOAD8(pool, src + 8 * u);
                if (in_row >= 0) POOL_STORE8(pool, p1 + 8 * u, old);
                const float8 n = old * vload8(u, ep) + (sa * vload8(u, bp) + vi * vload8(u, kp));
                acc += n * vload8(u, rp);
                if (r0 >= 0) POOL_STORE8(pool, p0 + 8 * u, n);
            }
            o[o_off + (t0 * n_head + h) * S + i] = scale * sum8(acc);
            continue;
        }
        float8 m[MAX_S / 8];
        for (long u = 0; u < nv; ++u) m[u] = POOL_LOAD8(pool, src + 8 * u);
        if (in_row >= 0) {
            const long p = pool_off + in_row * row_size + rr * S;
            for (long u = 0; u < nv; ++u) POOL_STORE8(pool, p + 8 * u, m[u]);
        }
        for (long t = 0; t < n_t; ++t) {
            const long tok = t0 + t;
            __global const float *rp = r + r_off + tok * rs0 + h * rs1;
            __global const float *kp = k + k_off + tok * ks0 + h * ks1;
            __global const float *ap = a + a_off + tok * as0 + h * as1;
            __global const float *bp = b + b_off + tok * bs0 + h * bs1;
            __global const float *ep = e + (tok * n_head + h) * S;
            const float vi = v[v_off + tok * vs0 + h * vs1 + i * vs2];
            float8 sa8 = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) sa8 += vload8(u, ap) * m[u];
            const float sa = sum8(sa8);
            float8 acc = (float8)(0.0f);
            for (long u = 0; u < nv; ++u) {
                const float8 n = m[u] * vload8(u, ep) + (sa * vload8(u, bp) + vi * vload8(u, kp));
                m[u] = n;
                acc += n * vload8(u, rp);
            }
            o[o_off + (tok * n_head + h) * S + i] = scale * sum8(acc);
            const long row = snap_row(snap_rows, snap_off, n_cols, s, n_t - 1 - t);
            if (row >= 0) {
                const long p = pool_off + row * row_size + rr * S;
                for (long u = 0; u < nv; ++u) POOL_STORE8(pool, p + 8 * u, m[u]);
            }
        }
    }
}
