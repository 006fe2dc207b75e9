/* Mamba-1 / Mamba-2 selective scan from start rows, with snapshot rows.
 *
 * Tokens are packed (sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s+1]-1)
 * and every sequence is computed exactly as a call of its own would compute
 * it: which path a unit takes depends only on its own sequence.
 *
 * Mamba-2: a work unit is (sequence, head).  Rows i of a head's state
 * [head_dim, d_state] evolve independently (the per-token decay and B/C are
 * shared), so each unit walks a tile of rows (up to 32 KiB) through every token
 * with the tile in L1, vectorised over d_state, and writes the tile's slice
 * of each snapshot row when its token passes.  The AVX2 path updates four
 * rows per pass over d_state: B and C are loaded once for the four, and the
 * four dot products are independent FMA chains (one chain would leave the
 * FMA units waiting on its latency), reduced together at the end.  The decay
 * exp and softplus are computed once per head and token, never per element.
 * For f32 pools the first token reads the start row in place and the last
 * token writes column 0 in place, so decode makes one pass over the state.
 *
 * Mamba-1 (head_dim 1, d_inner heads, decay per state element): a unit is
 * (sequence, block of SC_M1_HEADS heads), walked token by token so that each
 * token's x, dt and y slices are long contiguous runs (short runs at a
 * d_inner stride defeat the prefetchers).  Softplus is vectorised over the
 * block's heads, the decay exps over d_state as 8-lane polynomials (the
 * AVX2 path; it also reads and writes f32 pools in place, so decode makes one
 * pass over the state).  Lanes across heads would save the horizontal sum
 * but need the state and A transposed per call, which costs decode more than
 * the sum costs prefill.  It writes snapshot columns like Mamba-2.
 *
 * The fused epilogues (dt_bias and the dt clamp before the recurrence, the
 * D skip and the z gate on y after it) run inside the same unit.
 *
 * A unit reads its slice of the start row before writing that slice of any
 * row, and no other unit touches the slice, so in-place decode and
 * rollback are safe and the result does not depend on the thread split. */
#include "sc_internal.h"

/* Rows of a Mamba-2 tile: as many as fit 32 KiB of f32 (L1), at most this. */
#define SC_SCAN_TILE 256
#define SC_SCAN_TILE_BYTES 32768
#define SC_M1_HEADS 256

/* Everything a unit needs to know about the call. */
typedef struct {
    const sc_state *st;
    const sc_view *x, *dt, *B, *C;
    const float *A;
    float *y;
    const sc_scan_options *opt;
    int64_t H, P, N, G;
    int stream; /* write disjoint destination rows with non-temporal stores */
} scan_call;

/* B[t0 .. t0 + n_t, g, :] as token rows at stride *t_stride: the view itself
 * when its last stride is 1, else a packed copy in `scratch`. */
static const float *tokens_of(const sc_view *v, int64_t t0, int64_t g, int64_t n_t, int64_t n, float *scratch,
                              int64_t *t_stride) {
    const float *base = v->data + t0 * v->strides[0] + g * v->strides[1];
    if (v->strides[2] == 1) {
        *t_stride = v->strides[0];
        return base;
    }
    for (int64_t t = 0; t < n_t; t++)
        for (int64_t k = 0; k < n; k++) scratch[t * n + k] = base[t * v->strides[0] + k * v->strides[2]];
    *t_stride = n;
    return scratch;
}

/* softplus(dt + dt_bias), clamped when asked, per token of head h; abuf gets
 * the Mamba-2 decay exp(d * A[h]) and dAbuf (if not NULL) d * A[h]. */
static void prep_dt(const scan_call *c, int64_t t0, int64_t n_t, int64_t h, float *dbuf, float *abuf, float *dAbuf) {
    const sc_view *dt = c->dt;
    const float Ah = c->A[h];
    const float *dtr = dt->data + t0 * dt->strides[0] + h * dt->strides[1];
    for (int64_t t = 0; t < n_t; t++) dbuf[t] = dtr[t * dt->strides[0]];
    if (c->opt->dt_bias) {
        const float bias = c->opt->dt_bias[h];
        for (int64_t t = 0; t < n_t; t++) dbuf[t] += bias;
    }
    const int clamp = c->opt->dt_clamp;
    const float lo = c->opt->dt_lo, hi = c->opt->dt_hi;
#pragma omp simd
    for (int64_t t = 0; t < n_t; t++) {
        float d = sc_softplus(dbuf[t]);
        if (clamp) d = sc_clamp(d, lo, hi);
        dbuf[t] = d;
        abuf[t] = sc_exp(d * Ah);
        if (dAbuf) dAbuf[t] = d * Ah;
    }
}

/* y = (y + D * x) * silu(z) over tokens [t0, t0 + n_t) and heads [h0, h0 + hb). */
static void scan_epilogue(const scan_call *c, int64_t t0, int64_t n_t, int64_t h0, int64_t hb) {
    const sc_scan_options *o = c->opt;
    if (!o->D && !o->z.data) return;
    const sc_view *x = c->x, *z = &o->z;
    const int64_t H = c->H, P = c->P;
    for (int64_t t = t0; t < t0 + n_t; t++) {
        for (int64_t h = h0; h < h0 + hb; h++) {
            float *yt = c->y + (t * H + h) * P;
            const float *xt = x->data + t * x->strides[0] + h * x->strides[1];
            const float *zt = o->z.data ? z->data + t * z->strides[0] + h * z->strides[1] : NULL;
            for (int64_t i = 0; i < P; i++) {
                float v = yt[i];
                if (o->D) v += o->D[o->d_per_dim ? h * P + i : h] * xt[i * x->strides[2]];
                if (zt) v *= sc_silu(zt[i * z->strides[2]]);
                yt[i] = v;
            }
        }
    }
}

/* One token over `ir` rows of N: out[r] = in[r] * a + B * xd[r] and
 * y[r] = out[r] . C.  `in` and `out` are either the same rows or disjoint. */
#ifdef SC_HAVE_AVX2
/* Four rows of one token, lanes across N; `stream` stores the results with
 * non-temporal stores (see update_rows). */
static inline __attribute__((always_inline)) void update_rows4(const float *i0, float *o0, int64_t N,
                                                               const float *SC_RESTRICT Bt,
                                                               const float *SC_RESTRICT Ct, __m256 av,
                                                               const float *xd, float *yt, const int stream) {
    const float *i1 = i0 + N, *i2 = i1 + N, *i3 = i2 + N;
    float *o1 = o0 + N, *o2 = o1 + N, *o3 = o2 + N;
    const __m256 x0 = _mm256_set1_ps(xd[0]), x1 = _mm256_set1_ps(xd[1]);
    const __m256 x2 = _mm256_set1_ps(xd[2]), x3 = _mm256_set1_ps(xd[3]);
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t k = 0; k < N; k += 8) {
        const __m256 b = _mm256_loadu_ps(Bt + k), c = _mm256_loadu_ps(Ct + k);
        __m256 v0 = _mm256_fmadd_ps(_mm256_loadu_ps(i0 + k), av, _mm256_mul_ps(b, x0));
        __m256 v1 = _mm256_fmadd_ps(_mm256_loadu_ps(i1 + k), av, _mm256_mul_ps(b, x1));
        __m256 v2 = _mm256_fmadd_ps(_mm256_loadu_ps(i2 + k), av, _mm256_mul_ps(b, x2));
        __m256 v3 = _mm256_fmadd_ps(_mm256_loadu_ps(i3 + k), av, _mm256_mul_ps(b, x3));
        if (stream) {
            _mm256_stream_ps(o0 + k, v0);
            _mm256_stream_ps(o1 + k, v1);
            _mm256_stream_ps(o2 + k, v2);
            _mm256_stream_ps(o3 + k, v3);
        } else {
            _mm256_storeu_ps(o0 + k, v0);
            _mm256_storeu_ps(o1 + k, v1);
            _mm256_storeu_ps(o2 + k, v2);
            _mm256_storeu_ps(o3 + k, v3);
        }
        c0 = _mm256_fmadd_ps(v0, c, c0);
        c1 = _mm256_fmadd_ps(v1, c, c1);
        c2 = _mm256_fmadd_ps(v2, c, c2);
        c3 = _mm256_fmadd_ps(v3, c, c3);
    }
    _mm_storeu_ps(yt, sc_hsum4x8(c0, c1, c2, c3));
}
#endif

/* One token over `ir` rows of N: out[r] = in[r] * a + B * xd[r] and
 * y[r] = out[r] . C.  `in` and `out` are either the same rows or disjoint;
 * `to_pool`: `out` is a pool row (not scratch that the next token rereads)
 * of a call large enough to stream (SC_STREAM_MIN_BYTES).
 *
 * Disjoint pool rows (a rotated plane, a copy-on-write destination) are written
 * with non-temporal stores when `out` is 32-byte aligned: a normal store to
 * a line out of cache waits for the line to be read first, and the store
 * buffer full of such stores stalls every later load at the same address
 * modulo 4 KiB (pool rows are multiples of 4 KiB apart, so the next rows'
 * loads all alias): reading one row and writing another was several times
 * slower than updating in place.  Streamed, it moves the same bytes.  The
 * caller fences (sc_stream_fence) before the kernel returns. */
static inline void update_rows(const float *in, float *out, int64_t ir, int64_t N, const float *SC_RESTRICT Bt,
                               const float *SC_RESTRICT Ct, float a, const float *xd, float *yt, int to_pool) {
    int64_t r = 0;
#ifdef SC_HAVE_AVX2
    if (N % 8 == 0) {
        const __m256 av = _mm256_set1_ps(a);
        if (to_pool && out != in && ((uintptr_t)out & 31) == 0) {
            for (; r + 4 <= ir; r += 4) update_rows4(in + r * N, out + r * N, N, Bt, Ct, av, xd + r, yt + r, 1);
        } else {
            for (; r + 4 <= ir; r += 4) update_rows4(in + r * N, out + r * N, N, Bt, Ct, av, xd + r, yt + r, 0);
        }
    }
#endif
    for (; r < ir; r++) {
        const float *S = in + r * N; /* may be O itself: elementwise, so fine */
        float *O = out + r * N;
        const float xr = xd[r];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < N; k++) {
            float v = S[k] * a + Bt[k] * xr;
            O[k] = v;
            acc += v * Ct[k];
        }
        yt[r] = acc;
    }
}

static inline int64_t tile_rows(int64_t N) {
    int64_t rows = SC_SCAN_TILE_BYTES / 4 / (N > 0 ? N : 1);
    rows -= rows % 4;
    return rows < 4 ? 4 : rows > SC_SCAN_TILE ? SC_SCAN_TILE : rows;
}

static void scan_mamba2_unit(const scan_call *c, int64_t s, int64_t h, float *dbuf, float *abuf, float *bpack,
                             float *cpack, float *tile) {
    const sc_state *st = c->st;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t H = c->H, P = c->P, N = c->N, g = h / (H / c->G);
    const sc_view *x = c->x;
    prep_dt(c, t0, n_t, h, dbuf, abuf, NULL);
    int64_t bts, cts;
    const float *Bs = tokens_of(c->B, t0, g, n_t, N, bpack, &bts);
    const float *Cs = tokens_of(c->C, t0, g, n_t, N, cpack, &cts);
    const float *xs = x->data + t0 * x->strides[0] + h * x->strides[1];
    const int64_t head_off = h * P * N, rows = tile_rows(N);
    const int64_t start_row = st->start_rows[s], r0 = sc_snap_row(st, s, 0);
    /* f32 pools: the first token reads the start row and the last writes
     * column 0 in place (no copy through the tile). */
    const int direct = pdt == SC_F32 && n_t > 0;
    for (int64_t i0 = 0; i0 < P; i0 += rows) {
        const int64_t ir = P - i0 < rows ? P - i0 : rows;
        const int64_t off = head_off + i0 * N;
        if (!direct) sc_load_f32(sc_pool_at(st, start_row, off), pdt, tile, ir * N);
        /* The input state, so that undoing the whole call is exact. */
        sc_copy_input_state(st, s, n_t, off, direct ? NULL : tile, ir * N);
        for (int64_t t = 0; t < n_t; t++) {
            const float a = abuf[t], d = dbuf[t];
            float *yt = c->y + ((t0 + t) * H + h) * P + i0;
            float xd[SC_SCAN_TILE];
            for (int64_t r = 0; r < ir; r++) xd[r] = xs[t * x->strides[0] + (i0 + r) * x->strides[2]] * d;
            const int64_t j = n_t - 1 - t;
            const float *in = t == 0 && direct ? (const float *)sc_pool_at(st, start_row, off) : tile;
            float *out = j == 0 && direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, off) : tile;
            update_rows(in, out, ir, N, Bs + t * bts, Cs + t * cts, a, xd, yt, c->stream && out != tile);
            const int64_t rj = sc_snap_row(st, s, j);
            if (out == tile && rj >= 0) sc_store_f32(tile, sc_pool_at(st, rj, off), pdt, ir * N);
        }
    }
    scan_epilogue(c, t0, n_t, h, 1);
}

/* softplus(dt + dt_bias), clamped when asked, for heads [h0, h0 + hb) of one token. */
static inline void mamba1_dt(const scan_call *c, const float *dtr, int64_t dts, int64_t h0, int64_t hb, float *dvec) {
    const sc_scan_options *o = c->opt;
    for (int64_t hh = 0; hh < hb; hh++) dvec[hh] = dtr[hh * dts];
    if (o->dt_bias)
        for (int64_t hh = 0; hh < hb; hh++) dvec[hh] += o->dt_bias[h0 + hh];
#ifdef SC_HAVE_AVX2
    for (int64_t hh = 0; hh < hb; hh += 8) _mm256_store_ps(dvec + hh, sc_softplus8(_mm256_load_ps(dvec + hh)));
#else
#pragma omp simd
    for (int64_t hh = 0; hh < hb; hh++) dvec[hh] = sc_softplus(dvec[hh]);
#endif
    if (o->dt_clamp)
        for (int64_t hh = 0; hh < hb; hh++) dvec[hh] = sc_clamp(dvec[hh], o->dt_lo, o->dt_hi);
}

static void scan_mamba1_unit(const scan_call *c, int64_t s, int64_t h0, int64_t hb, float *dvec, float *bvec,
                             float *cvec, float *decay, float *state) {
    const sc_state *st = c->st;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t H = c->H, N = c->N, off = h0 * N;
    const sc_view *x = c->x, *dt = c->dt, *B = c->B, *C = c->C;
    sc_load_f32(sc_pool_at(st, st->start_rows[s], off), pdt, state, hb * N);
    sc_copy_input_state(st, s, n_t, off, state, hb * N);
    for (int64_t t = 0; t < n_t; t++) {
        const int64_t tt = t0 + t;
        mamba1_dt(c, dt->data + tt * dt->strides[0] + h0 * dt->strides[1], dt->strides[1], h0, hb, dvec);
        const float *Br = B->data + tt * B->strides[0];
        const float *Cr = C->data + tt * C->strides[0];
        for (int64_t k = 0; k < N; k++) {
            bvec[k] = Br[k * B->strides[2]];
            cvec[k] = Cr[k * C->strides[2]];
        }
        const float *xr = x->data + tt * x->strides[0] + h0 * x->strides[1];
        float *yt = c->y + tt * H + h0;
        for (int64_t hh = 0; hh < hb; hh++) {
            const float d = dvec[hh], xd = xr[hh * x->strides[1]] * d;
            const float *SC_RESTRICT Ah = c->A + (h0 + hh) * N;
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
        const int64_t rj = sc_snap_row(st, s, n_t - 1 - t);
        if (rj >= 0) sc_store_f32(state, sc_pool_at(st, rj, off), pdt, hb * N);
    }
    scan_epilogue(c, t0, n_t, h0, hb);
}

#ifdef SC_HAVE_AVX2
/* One token of Mamba-1 for hb heads, lanes across d_state. */
static inline __attribute__((always_inline)) void mamba1_heads(const float *A, const float *in, float *out,
                                                               const float *b, const float *c, const float *dvec,
                                                               const float *xr, int64_t xs, float *yt, int64_t hb,
                                                               int64_t N) {
    for (int64_t hh = 0; hh < hb; hh++) {
        const __m256 d = _mm256_set1_ps(dvec[hh]), xd = _mm256_set1_ps(xr[hh * xs] * dvec[hh]);
        const float *Ah = A + hh * N, *Si = in + hh * N;
        float *So = out + hh * N;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < N; k += 8) {
            const __m256 e = sc_exp8(_mm256_mul_ps(d, _mm256_loadu_ps(Ah + k)));
            const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(Si + k), e, _mm256_mul_ps(_mm256_loadu_ps(b + k), xd));
            _mm256_storeu_ps(So + k, v);
            acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(c + k), acc);
        }
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        yt[hh] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
}

/* d_state 16, two heads per iteration: the four exp polynomials are
 * independent chains of ~15 dependent FMAs each, and interleaving them keeps
 * the FMA units busy where one head at a time would wait on latency. */
static inline void mamba1_heads16(const float *A, const float *in, float *out, const float *b, const float *c,
                                  const float *dvec, const float *xr, int64_t xs, float *yt, int64_t hb) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    const __m256 c0 = _mm256_loadu_ps(c), c1 = _mm256_loadu_ps(c + 8);
    int64_t hh = 0;
    for (; hh + 2 <= hb; hh += 2) {
        const float *Ah = A + hh * 16, *Si = in + hh * 16;
        float *So = out + hh * 16;
        const __m256 dA = _mm256_set1_ps(dvec[hh]), dB = _mm256_set1_ps(dvec[hh + 1]);
        const __m256 xA = _mm256_set1_ps(xr[hh * xs] * dvec[hh]), xB = _mm256_set1_ps(xr[(hh + 1) * xs] * dvec[hh + 1]);
        const __m256 e0 = sc_exp8(_mm256_mul_ps(dA, _mm256_loadu_ps(Ah)));
        const __m256 e1 = sc_exp8(_mm256_mul_ps(dA, _mm256_loadu_ps(Ah + 8)));
        const __m256 e2 = sc_exp8(_mm256_mul_ps(dB, _mm256_loadu_ps(Ah + 16)));
        const __m256 e3 = sc_exp8(_mm256_mul_ps(dB, _mm256_loadu_ps(Ah + 24)));
        const __m256 v0 = _mm256_fmadd_ps(_mm256_loadu_ps(Si), e0, _mm256_mul_ps(b0, xA));
        const __m256 v1 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 8), e1, _mm256_mul_ps(b1, xA));
        const __m256 v2 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 16), e2, _mm256_mul_ps(b0, xB));
        const __m256 v3 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 24), e3, _mm256_mul_ps(b1, xB));
        _mm256_storeu_ps(So, v0);
        _mm256_storeu_ps(So + 8, v1);
        _mm256_storeu_ps(So + 16, v2);
        _mm256_storeu_ps(So + 24, v3);
        /* Same order as mamba1_heads: acc = v_lo * c_lo, then + v_hi * c_hi. */
        const __m256 pA = _mm256_fmadd_ps(v1, c1, _mm256_mul_ps(v0, c0));
        const __m256 pB = _mm256_fmadd_ps(v3, c1, _mm256_mul_ps(v2, c0));
        __m128 hA = _mm_add_ps(_mm256_castps256_ps128(pA), _mm256_extractf128_ps(pA, 1));
        __m128 hB = _mm_add_ps(_mm256_castps256_ps128(pB), _mm256_extractf128_ps(pB, 1));
        hA = _mm_add_ps(hA, _mm_movehl_ps(hA, hA));
        hB = _mm_add_ps(hB, _mm_movehl_ps(hB, hB));
        yt[hh] = _mm_cvtss_f32(_mm_add_ss(hA, _mm_movehdup_ps(hA)));
        yt[hh + 1] = _mm_cvtss_f32(_mm_add_ss(hB, _mm_movehdup_ps(hB)));
    }
    if (hh < hb) mamba1_heads(A + hh * 16, in + hh * 16, out + hh * 16, b, c, dvec + hh, xr + hh * xs, xs, yt + hh,
                              hb - hh, 16);
}


/* Mamba-1 over heads [h0, h0 + hb) with lanes across d_state (N % 8 == 0):
 * no transposes, so it suits decode; `state` is [hb][N] scratch for
 * non-f32 pools and multi-token calls. */
static void scan_mamba1_rows(const scan_call *c, int64_t s, int64_t h0, int64_t hb, float *dvec, float *bvec,
                             float *cvec, float *state) {
    const sc_state *st = c->st;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t H = c->H, N = c->N, off = h0 * N;
    const sc_view *x = c->x, *dt = c->dt, *B = c->B, *C = c->C;
    const int64_t start_row = st->start_rows[s], r0 = sc_snap_row(st, s, 0);
    const int direct = pdt == SC_F32;
    if (!direct) sc_load_f32(sc_pool_at(st, start_row, off), pdt, state, hb * N);
    sc_copy_input_state(st, s, n_t, off, direct ? NULL : state, hb * N);
    const int64_t dts = dt->strides[1], xs = x->strides[1], bs = B->strides[2], cs = C->strides[2];
    for (int64_t t = 0; t < n_t; t++) {
        const int64_t tt = t0 + t;
        mamba1_dt(c, dt->data + tt * dt->strides[0] + h0 * dts, dts, h0, hb, dvec);
        const float *Bt = B->data + tt * B->strides[0];
        const float *Ct = C->data + tt * C->strides[0];
        if (bs != 1)
            for (int64_t k = 0; k < N; k++) bvec[k] = Bt[k * bs];
        if (cs != 1)
            for (int64_t k = 0; k < N; k++) cvec[k] = Ct[k * cs];
        const float *b = bs == 1 ? Bt : bvec, *cc = cs == 1 ? Ct : cvec;
        const float *xr = x->data + tt * x->strides[0] + h0 * xs;
        float *yt = c->y + tt * H + h0;
        const int64_t j = n_t - 1 - t;
        const float *in = t == 0 && direct ? (const float *)sc_pool_at(st, start_row, off) : state;
        float *out = j == 0 && direct && r0 >= 0 ? (float *)sc_pool_at(st, r0, off) : state;
        /* d_state 16 (every Mamba-1 model) gets its own copy of the loop,
         * unrolled with the constants hoisted. */
        if (N == 16)
            mamba1_heads16(c->A + h0 * N, in, out, b, cc, dvec, xr, xs, yt, hb);
        else
            mamba1_heads(c->A + h0 * N, in, out, b, cc, dvec, xr, xs, yt, hb, N);
        const int64_t rj = sc_snap_row(st, s, j);
        if (out == state && rj >= 0) sc_store_f32(state, sc_pool_at(st, rj, off), pdt, hb * N);
    }
    scan_epilogue(c, t0, n_t, h0, hb);
}
#endif

#ifdef SC_HAVE_AVX2
/* -- Mamba-2 prefill in chunked (SSD) form --------------------------------------
 *
 * Token by token, each state element costs a load, a store and three FMAs per
 * token, so the scan is load/store-bound far below the FMA peak.  Over a chunk
 * of L tokens the same recurrence is a few small matrix products whose
 * operands stay in registers for many FMAs each:
 *
 *   y_t   = lam_t (S C_t) + sum_{u<=t} D[t][u] (C_t . B_u) xd_u
 *   S_end = lam_end S + sum_u D[end][u] xd_u B_u^T
 *
 * with xd_u = x_u dt_u, D[t][u] = exp(sum_{v=u+1..t} dA_v) the decay from
 * token u to token t and lam_t = exp(sum_{v<=t} dA_v) the decay of the
 * chunk's start state.  The decay exponents are running sums (segsum), never
 * differences of cumulative sums, which would lose the short-range decays to
 * cancellation.  The rounding differs from the token loop but stays within a
 * few ulps of it per chunk.  A unit is still one (sequence, head), walked
 * chunk by chunk by one thread, so the result is the same for any thread
 * count. */
#ifndef SC_CHUNK
#define SC_CHUNK 64
#endif
/* Fewest chunked tokens for which the chunked form beats the token loop. */
#ifndef SC_CHUNK_MIN
#define SC_CHUNK_MIN 16
#endif

/* out[i][j] = sum_k A[i][k] B[j][k] for an mr x nr block (K % 8 == 0):
 * dot products, reduced horizontally once at the end. */
static inline __attribute__((always_inline)) void nt_block(int mr, int nr, int64_t K, const float *A, int64_t lda,
                                                            const float *B, int64_t ldb, float *out, int64_t ldo) {
    __m256 acc[3][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 a[3]; /* 12 accumulators + 3 rows of A + 1 of B: the 16 registers */
        for (int i = 0; i < mr; i++) a[i] = _mm256_loadu_ps(A + i * lda + k);
        for (int j = 0; j < nr; j++) {
            const __m256 b = _mm256_loadu_ps(B + j * ldb + k);
            for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) {
        if (nr == 4) {
            _mm_storeu_ps(out + i * ldo, sc_hsum4x8(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        } else {
            for (int j = 0; j < nr; j++) {
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                out[i * ldo + j] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
            }
        }
    }
}

/* out = A B^T for A [m][K], B [n][K] (K % 8 == 0), in 3 x 4 blocks. */
static void gemm_nt(int64_t m, int64_t n, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                    float *out, int64_t ldo) {
    int64_t i = 0;
    for (; i + 3 <= m; i += 3) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) nt_block(3, 4, K, A + i * lda, lda, B + j * ldb, ldb, out + i * ldo + j, ldo);
        for (; j < n; j++) nt_block(3, 1, K, A + i * lda, lda, B + j * ldb, ldb, out + i * ldo + j, ldo);
    }
    for (; i < m; i++) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) nt_block(1, 4, K, A + i * lda, lda, B + j * ldb, ldb, out + i * ldo + j, ldo);
        for (; j < n; j++) nt_block(1, 1, K, A + i * lda, lda, B + j * ldb, ldb, out + i * ldo + j, ldo);
    }
}

/* out[i][:] = beta out[i][:] + sum_k A[i][k] B[k][:] for an mr x (8 nv) block,
 * lanes across the columns. */
static inline __attribute__((always_inline)) void nn_block(int mr, int nv, int64_t K, const float *A, int64_t lda,
                                                            const float *B, int64_t ldb, float *out, int64_t ldo,
                                                            float beta) {
    __m256 acc[4][3];
    const __m256 bv = _mm256_set1_ps(beta);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++)
            acc[i][j] = _mm256_mul_ps(bv, _mm256_loadu_ps(out + i * ldo + 8 * j));
    for (int64_t k = 0; k < K; k++) {
        __m256 b[3];
        for (int j = 0; j < nv; j++) b[j] = _mm256_loadu_ps(B + k * ldb + 8 * j);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
            for (int j = 0; j < nv; j++) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(out + i * ldo + 8 * j, acc[i][j]);
}

/* out = beta out + A B for A [m][K], B [K][n] (n % 8 == 0), in 4 x 24 blocks.
 * Row i only sums k < kmax(i) = min(K, i_block_end + kpad) when `lower` is set:
 * A is lower triangular there and the rest of its row is zero. */
static void gemm_nn(int64_t m, int64_t n, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                    float *out, int64_t ldo, float beta, int lower) {
    int64_t i = 0;
    for (; i < m; i += 4) {
        const int mr = m - i < 4 ? (int)(m - i) : 4;
        const int64_t kk = lower ? (i + mr < K ? i + mr : K) : K;
        const float *Ai = A + i * lda;
        float *Oi = out + i * ldo;
        int64_t j = 0;
        if (mr == 4) {
            for (; j + 24 <= n; j += 24) nn_block(4, 3, kk, Ai, lda, B + j, ldb, Oi + j, ldo, beta);
            for (; j + 8 <= n; j += 8) nn_block(4, 1, kk, Ai, lda, B + j, ldb, Oi + j, ldo, beta);
        } else {
            for (; j + 24 <= n; j += 24)
                for (int r = 0; r < mr; r++)
                    nn_block(1, 3, kk, Ai + r * lda, lda, B + j, ldb, Oi + r * ldo + j, ldo, beta);
            for (; j + 8 <= n; j += 8)
                for (int r = 0; r < mr; r++)
                    nn_block(1, 1, kk, Ai + r * lda, lda, B + j, ldb, Oi + r * ldo + j, ldo, beta);
        }
    }
}

/* Scratch of one thread for scan_mamba2_chunks. */
typedef struct {
    float *seg;  /* [L] running decay exponents of the current row */
    float *D;    /* [L][L] decays, zero above the diagonal */
    float *M;    /* [L][L] (C_t . B_u) D[t][u] */
    float *xd;   /* [L][P] x_u dt_u */
    float *wT;   /* [P][L] D[end][u] xd_u, transposed */
    float *lam;  /* [L] */
} sc_chunk_scratch;


/* Advances the f32 state S [P][N] over tokens [0, n_c) of unit (s, h) in
 * chunks, writing y for those tokens.  d and dA hold softplus(dt) and
 * d * A for every token; Bs/Cs are token rows at strides bts/cts. */
static void scan_mamba2_chunks(float *S, const sc_view *x, const float *d, const float *dA, const float *Bs,
                               int64_t bts, const float *Cs, int64_t cts, float *y, int64_t t0, int64_t h, int64_t n_c,
                               int64_t H, int64_t P, int64_t N, sc_chunk_scratch *w) {
    const int64_t L = SC_CHUNK, ldy = H * P;
    const float *xs = x->data + t0 * x->strides[0] + h * x->strides[1];
    for (int64_t c0 = 0; c0 < n_c; c0 += L) {
        const int64_t Lc = n_c - c0 < L ? n_c - c0 : L;
        const float *Bc = Bs + c0 * bts, *Cc = Cs + c0 * cts;
        float *yc = y + ((t0 + c0) * H + h) * P;
        /* Decays: row t of D from row t-1 by adding dA_t (segsum). */
        float total = 0.0f;
        for (int64_t t = 0; t < Lc; t++) {
            const float a = dA[c0 + t];
            for (int64_t u = 0; u < t; u++) w->seg[u] += a;
            w->seg[t] = 0.0f;
            total += a;
            float *Dt = w->D + t * L;
            int64_t u = 0;
            for (; u + 8 <= t + 1; u += 8) _mm256_storeu_ps(Dt + u, sc_exp8(_mm256_loadu_ps(w->seg + u)));
            for (; u <= t; u++) Dt[u] = sc_exp(w->seg[u]);
            for (; u < L; u++) Dt[u] = 0.0f;
            w->lam[t] = sc_exp(total);
        }
        const float lam_end = w->lam[Lc - 1];
        const float *Dend = w->D + (Lc - 1) * L;
        for (int64_t u = 0; u < Lc; u++) {
            const float du = d[c0 + u];
            const float *xu = xs + (c0 + u) * x->strides[0];
            for (int64_t i = 0; i < P; i++) w->xd[u * P + i] = xu[i * x->strides[2]] * du;
        }
        for (int64_t i = 0; i < P; i++)
            for (int64_t u = 0; u < Lc; u++) w->wT[i * L + u] = Dend[u] * w->xd[u * P + i];
        /* y_t = lam_t (S C_t): dots over d_state, then the row scale. */
        gemm_nt(Lc, P, N, Cc, cts, S, N, yc, ldy);
        for (int64_t t = 0; t < Lc; t++) {
            float *yt = yc + t * ldy;
            const __m256 l = _mm256_set1_ps(w->lam[t]);
            for (int64_t i = 0; i < P; i += 8) _mm256_storeu_ps(yt + i, _mm256_mul_ps(l, _mm256_loadu_ps(yt + i)));
        }
        /* M = (C B^T) o D, computed on and below the diagonal in 3-row
         * blocks (D zeroes the block's columns past the diagonal) and zeroed
         * to the right, where gemm_nn's 4-row blocks still read. */
        for (int64_t t = 0; t < Lc; t += 3) {
            const int64_t mr = Lc - t < 3 ? Lc - t : 3;
            const int64_t nu = t + mr;
            gemm_nt(mr, nu, N, Cc + t * cts, cts, Bc, bts, w->M + t * L, L);
            for (int64_t r = t; r < t + mr; r++) {
                for (int64_t u = 0; u < nu; u++) w->M[r * L + u] *= w->D[r * L + u];
                for (int64_t u = nu; u < Lc; u++) w->M[r * L + u] = 0.0f;
            }
        }
        /* y += M xd, then S = lam_end S + wT B. */
        gemm_nn(Lc, P, Lc, w->M, L, w->xd, P, yc, ldy, 1.0f, 1);
        gemm_nn(P, N, Lc, w->wT, L, Bc, bts, S, N, lam_end, 0);
    }
}

/* The largest snapshot column below n_t that sequence s writes (0 if none):
 * the chunked form covers the tokens before it, the token loop the rest, so
 * every snapshot is a state the recurrence passes through exactly as the
 * token loop defines it. */
static int64_t last_snapshot(const sc_state *st, int64_t s, int64_t n_t) {
    int64_t j = (n_t - 1 < st->n_cols - 1 ? n_t - 1 : st->n_cols - 1);
    for (; j > 0; j--)
        if (sc_snap_row(st, s, j) >= 0) return j;
    return 0;
}

/* Mamba-2 unit (s, h) with the first n_t - jmax tokens in chunks and the
 * rest token by token (see last_snapshot).  The head's start slice is read
 * whole into S before any row is written. */
static void scan_mamba2_chunked_unit(const scan_call *c, int64_t s, int64_t h, int64_t jmax, float *dbuf, float *abuf,
                                     float *dAbuf, float *bpack, float *cpack, float *S, sc_chunk_scratch *w) {
    const sc_state *st = c->st;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t H = c->H, P = c->P, N = c->N, g = h / (H / c->G);
    const sc_view *x = c->x;
    prep_dt(c, t0, n_t, h, dbuf, abuf, dAbuf);
    int64_t bts, cts;
    const float *Bs = tokens_of(c->B, t0, g, n_t, N, bpack, &bts);
    const float *Cs = tokens_of(c->C, t0, g, n_t, N, cpack, &cts);
    const int64_t off = h * P * N, n_c = n_t - jmax;
    sc_load_f32(sc_pool_at(st, st->start_rows[s], off), pdt, S, P * N);
    sc_copy_input_state(st, s, n_t, off, S, P * N);
    scan_mamba2_chunks(S, x, dbuf, dAbuf, Bs, bts, Cs, cts, c->y, t0, h, n_c, H, P, N, w);
    const int64_t rc = sc_snap_row(st, s, jmax);
    if (rc >= 0) sc_store_f32(S, sc_pool_at(st, rc, off), pdt, P * N);
    const float *xs = x->data + t0 * x->strides[0] + h * x->strides[1];
    for (int64_t t = n_c; t < n_t; t++) {
        const float d = dbuf[t];
        for (int64_t i = 0; i < P; i++) w->xd[i] = xs[t * x->strides[0] + i * x->strides[2]] * d;
        update_rows(S, S, P, N, Bs + t * bts, Cs + t * cts, abuf[t], w->xd, c->y + ((t0 + t) * H + h) * P, 0);
        const int64_t rj = sc_snap_row(st, s, n_t - 1 - t);
        if (rj >= 0) sc_store_f32(S, sc_pool_at(st, rj, off), pdt, P * N);
    }
    scan_epilogue(c, t0, n_t, h, 1);
}
#endif

static void scan_f32(const sc_state *st, const sc_view *x, const sc_view *dt, const float *A, int a_per_state,
                     const sc_view *B, const sc_view *C, float *y, const sc_scan_options *opt, int64_t n_head,
                     int64_t head_dim, int64_t d_state, int64_t n_group, int n_threads) {
    const int64_t H = n_head, P = head_dim, N = d_state, n_s = st->n_seqs, n_t_max = st->max_tokens;
    /* State streamed: every token passes over the state, plus the rows written. */
    const int64_t work_bytes = H * P * N * (int64_t)sizeof(float) * (st->n_tokens + n_s * sc_max_written(st));
    const scan_call c = {st, x, dt, B, C, A, y, opt, H, P, N, n_group, work_bytes >= sc_stream_min_bytes};
    if (a_per_state) {
        const int64_t n_blocks = (H + SC_M1_HEADS - 1) / SC_M1_HEADS, n_units = n_s * n_blocks;
        const int team = sc_state_team(n_units, work_bytes, n_threads);
#ifdef SC_HAVE_AVX2
        const int rows_path = N % 8 == 0;
#else
        const int rows_path = 0;
#endif
#pragma omp parallel num_threads(team) if (team > 1)
        {
            float *dvec = (float *)sc_alloc(sizeof(float) * (size_t)SC_M1_HEADS);
            float *bvec = (float *)sc_alloc(sizeof(float) * (size_t)N);
            float *cvec = (float *)sc_alloc(sizeof(float) * (size_t)N);
            float *decay = (float *)sc_alloc(sizeof(float) * (size_t)N);
            float *state = (float *)sc_alloc(sizeof(float) * (size_t)(SC_M1_HEADS * N));
            memset(dvec, 0, sizeof(float) * SC_M1_HEADS); /* lanes past a short block stay finite */
            int64_t lo, hi;
            sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
            for (int64_t u = lo; u < hi; u++) {
                const int64_t s = u / n_blocks, h0 = (u % n_blocks) * SC_M1_HEADS;
                const int64_t hb = H - h0 < SC_M1_HEADS ? H - h0 : SC_M1_HEADS;
#ifdef SC_HAVE_AVX2
                if (rows_path) {
                    scan_mamba1_rows(&c, s, h0, hb, dvec, bvec, cvec, state);
                    continue;
                }
#endif
                scan_mamba1_unit(&c, s, h0, hb, dvec, bvec, cvec, decay, state);
            }
            (void)rows_path;
            free(dvec);
            free(bvec);
            free(cvec);
            free(decay);
            free(state);
        }
        return;
    }
    const int64_t n_units = n_s * H;
    const int need_pack = B->strides[2] != 1 || C->strides[2] != 1;
    const int team = sc_state_team(n_units, work_bytes, n_threads);
#ifdef SC_HAVE_AVX2
    const int may_chunk = N % 8 == 0 && P % 8 == 0 && n_t_max >= SC_CHUNK_MIN;
#else
    const int may_chunk = 0;
#endif
#pragma omp parallel num_threads(team) if (team > 1)
    {
        const size_t tmax = (size_t)(n_t_max > 0 ? n_t_max : 1);
        float *dbuf = (float *)sc_alloc(sizeof(float) * tmax);
        float *abuf = (float *)sc_alloc(sizeof(float) * tmax);
        float *bpack = need_pack ? (float *)sc_alloc(sizeof(float) * tmax * (size_t)N) : NULL;
        float *cpack = need_pack ? (float *)sc_alloc(sizeof(float) * tmax * (size_t)N) : NULL;
        float *tile = (float *)sc_alloc(sizeof(float) * (size_t)(tile_rows(N) * N));
#ifdef SC_HAVE_AVX2
        const int64_t L = SC_CHUNK;
        float *dAbuf = NULL, *S = NULL;
        sc_chunk_scratch w = {NULL, NULL, NULL, NULL, NULL, NULL};
        if (may_chunk) {
            dAbuf = (float *)sc_alloc(sizeof(float) * tmax);
            S = (float *)sc_alloc(sizeof(float) * (size_t)(P * N));
            w.seg = (float *)sc_alloc(sizeof(float) * (size_t)L);
            w.D = (float *)sc_alloc(sizeof(float) * (size_t)(L * L));
            w.M = (float *)sc_alloc(sizeof(float) * (size_t)(L * L));
            w.xd = (float *)sc_alloc(sizeof(float) * (size_t)(L * P));
            w.wT = (float *)sc_alloc(sizeof(float) * (size_t)(P * L));
            w.lam = (float *)sc_alloc(sizeof(float) * (size_t)L);
        }
#endif
        int64_t lo, hi;
        sc_split(n_units, sc_thread_id(), sc_team_size(), &lo, &hi);
        for (int64_t u = lo; u < hi; u++) {
            const int64_t s = u / H, h = u % H;
#ifdef SC_HAVE_AVX2
            if (may_chunk) {
                const int64_t n_t = st->cu_seqlens[s + 1] - st->cu_seqlens[s];
                const int64_t jmax = n_t > 0 ? last_snapshot(st, s, n_t) : 0;
                if (n_t - jmax >= SC_CHUNK_MIN) {
                    scan_mamba2_chunked_unit(&c, s, h, jmax, dbuf, abuf, dAbuf, bpack, cpack, S, &w);
                    continue;
                }
            }
#endif
            scan_mamba2_unit(&c, s, h, dbuf, abuf, bpack, cpack, tile);
        }
        sc_stream_fence(); /* this thread's streamed rows are visible before it joins */
        (void)may_chunk;
        free(dbuf);
        free(abuf);
        free(bpack);
        free(cpack);
        free(tile);
#ifdef SC_HAVE_AVX2
        free(dAbuf);
        free(S);
        free(w.seg);
        free(w.D);
        free(w.M);
        free(w.xd);
        free(w.wT);
        free(w.lam);
#endif
    }
}

void sc_ssm_scan(const sc_state *st, const sc_view *x, const sc_view *dt, const float *A, int a_per_state,
                 const sc_view *B, const sc_view *C, void *y, sc_dtype y_dtype, const sc_scan_options *opt,
                 int64_t n_head, int64_t head_dim, int64_t d_state, int64_t n_group, int n_threads) {
    const int64_t T = st->n_tokens, H = n_head, P = head_dim, N = d_state, G = n_group;
    float *own[5];
    const sc_view xf = sc_widen3(x, T, H, P, &own[0]), dtf = sc_widen2(dt, T, H, &own[1]);
    const sc_view Bf = sc_widen3(B, T, G, N, &own[2]), Cf = sc_widen3(C, T, G, N, &own[3]);
    sc_scan_options o = *opt;
    o.z = sc_widen3(&opt->z, T, H, P, &own[4]);
    float *yf = sc_output_f32(y, y_dtype, T * H * P);
    scan_f32(st, &xf, &dtf, A, a_per_state, &Bf, &Cf, yf, &o, H, P, N, G, n_threads);
    sc_narrow_output(yf, y, y_dtype, T * H * P);
    for (int i = 0; i < 5; i++) free(own[i]);
}
