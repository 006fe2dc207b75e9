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
#include "sc_gemm.h"

/* Rows of a Mamba-2 tile: as many as fit 32 KiB of f32 (L1), at most this. */
#define SC_SCAN_TILE 256
#define SC_SCAN_TILE_BYTES 32768
/* Heads of a Mamba-1 unit: a prefill walks them token by token with their
 * state (heads x 16 floats) and A (as many) in L1.  At 256 heads the two
 * filled Zen 4's whole 32 KiB L1d and every token's x, dt, y, B and C lines
 * evicted some of them: 128 heads ran a 512-token prefill 2-10% faster (one
 * thread, alternating calls), decode the same. */
#define SC_M1_HEADS 128

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
/* Four rows of one token, lanes across N (see update_rows).  `stream`: `o0`
 * are disjoint pool rows (N % 16 == 0, 32-byte aligned) written with
 * non-temporal stores, a whole 64-byte line of a row per store pair so that
 * every line is complete as soon as it is started, with the source fetched
 * ahead (sc_prefetch_ahead); the same operations in the same order, so the
 * results are bitwise those of the plain stores. */
static inline __attribute__((always_inline)) void update_rows4(const float *i0, float *o0, int64_t N,
                                                               const float *SC_RESTRICT Bt,
                                                               const float *SC_RESTRICT Ct, __m256 av,
                                                               const float *xd, float *yt, const int stream) {
    const float *i1 = i0 + N, *i2 = i1 + N, *i3 = i2 + N;
    float *o1 = o0 + N, *o2 = o1 + N, *o3 = o2 + N;
    const __m256 x0 = _mm256_set1_ps(xd[0]), x1 = _mm256_set1_ps(xd[1]);
    const __m256 x2 = _mm256_set1_ps(xd[2]), x3 = _mm256_set1_ps(xd[3]);
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    if (stream) {
        sc_prefetch_ahead(i0, 4 * N * (int64_t)sizeof(float));
        for (int64_t k = 0; k < N; k += 16) {
            const __m256 b = _mm256_loadu_ps(Bt + k), c = _mm256_loadu_ps(Ct + k);
            const __m256 b8 = _mm256_loadu_ps(Bt + k + 8), c8 = _mm256_loadu_ps(Ct + k + 8);
            c0 = sc_stream_line(o0 + k, _mm256_fmadd_ps(_mm256_loadu_ps(i0 + k), av, _mm256_mul_ps(b, x0)),
                                _mm256_fmadd_ps(_mm256_loadu_ps(i0 + k + 8), av, _mm256_mul_ps(b8, x0)), c, c8, c0);
            c1 = sc_stream_line(o1 + k, _mm256_fmadd_ps(_mm256_loadu_ps(i1 + k), av, _mm256_mul_ps(b, x1)),
                                _mm256_fmadd_ps(_mm256_loadu_ps(i1 + k + 8), av, _mm256_mul_ps(b8, x1)), c, c8, c1);
            c2 = sc_stream_line(o2 + k, _mm256_fmadd_ps(_mm256_loadu_ps(i2 + k), av, _mm256_mul_ps(b, x2)),
                                _mm256_fmadd_ps(_mm256_loadu_ps(i2 + k + 8), av, _mm256_mul_ps(b8, x2)), c, c8, c2);
            c3 = sc_stream_line(o3 + k, _mm256_fmadd_ps(_mm256_loadu_ps(i3 + k), av, _mm256_mul_ps(b, x3)),
                                _mm256_fmadd_ps(_mm256_loadu_ps(i3 + k + 8), av, _mm256_mul_ps(b8, x3)), c, c8, c3);
        }
        _mm_storeu_ps(yt, sc_hsum4x8(c0, c1, c2, c3));
        return;
    }
    for (int64_t k = 0; k < N; k += 8) {
        const __m256 b = _mm256_loadu_ps(Bt + k), c = _mm256_loadu_ps(Ct + k);
        __m256 v0 = _mm256_fmadd_ps(_mm256_loadu_ps(i0 + k), av, _mm256_mul_ps(b, x0));
        __m256 v1 = _mm256_fmadd_ps(_mm256_loadu_ps(i1 + k), av, _mm256_mul_ps(b, x1));
        __m256 v2 = _mm256_fmadd_ps(_mm256_loadu_ps(i2 + k), av, _mm256_mul_ps(b, x2));
        __m256 v3 = _mm256_fmadd_ps(_mm256_loadu_ps(i3 + k), av, _mm256_mul_ps(b, x3));
        _mm256_storeu_ps(o0 + k, v0);
        _mm256_storeu_ps(o1 + k, v1);
        _mm256_storeu_ps(o2 + k, v2);
        _mm256_storeu_ps(o3 + k, v3);
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
 * slower than updating in place.  Streamed, it moves the same bytes.
 *
 * Each streamed line must be finished as soon as it is started: the
 * write-combining buffers of open lines are the line fill buffers the loads
 * of the next rows need.  Measured over 384 MiB of state (one thread, CPU
 * time, 4-row groups of 128-float rows): rows interleaved 32 bytes at a time
 * (four half-written lines open at once) ran at 0.45x of in-place updates,
 * whole lines in order at 0.81x.  So with N % 16 == 0 update_rows4 (stream)
 * writes a whole line of each row per step and fetches the source ahead
 * (over 512 MiB of state, 2 threads: 1.5-2.1x the in-place time before,
 * 1.0-1.2x after, whereas copying the rows through an L1 scratch first left
 * the loads and the stores in separate bursts); otherwise the four rows go to
 * `scratch` (4 * N floats, L1) and from there to `out` as one contiguous run
 * of streamed stores (sc_store_state).  The caller fences (sc_stream_fence)
 * before the kernel returns.
 *
 * `in_pool`: `in` is a pool row (the first token of a decode or prefill), so
 * in a model it comes from memory: a decode's state is every layer's, far
 * more than the L3.  Updated in place, its rows are then fetched 4 KiB ahead
 * too.  Four rows read 32 bytes at a time are four interleaved streams, and
 * on Zen 4 the hardware prefetchers fed them at less than half the rate of
 * one sequential pass: 32 MiB of state from memory (Mamba-2, 32 sequences,
 * one thread) took 4.2-4.5 ms against 1.2-1.3 ms for an in-place pass over the
 * same bytes, and 2.0-2.9 ms fetched ahead; with the state in L3 (8 MiB) the
 * prefetches cost 0-5%. */
static inline void update_rows(const float *in, float *out, int64_t ir, int64_t N, const float *SC_RESTRICT Bt,
                               const float *SC_RESTRICT Ct, float a, const float *xd, float *yt, int to_pool,
                               float *scratch, int in_pool) {
    int64_t r = 0;
#ifdef SC_HAVE_AVX2
    if (N % 8 == 0) {
        const __m256 av = _mm256_set1_ps(a);
        if (to_pool && out != in && ((uintptr_t)out & 31) == 0 && N % 16 == 0) {
            for (; r + 4 <= ir; r += 4) update_rows4(in + r * N, out + r * N, N, Bt, Ct, av, xd + r, yt + r, 1);
        } else if (to_pool && scratch && out != in && ((uintptr_t)out & 31) == 0) {
            for (; r + 4 <= ir; r += 4) {
                update_rows4(in + r * N, scratch, N, Bt, Ct, av, xd + r, yt + r, 0);
                sc_store_state(scratch, out + r * N, SC_F32, 4 * N, 1);
            }
        } else if (in_pool) {
            for (; r + 4 <= ir; r += 4) {
                sc_prefetch_ahead(in + r * N, 4 * N * (int64_t)sizeof(float));
                update_rows4(in + r * N, out + r * N, N, Bt, Ct, av, xd + r, yt + r, 0);
            }
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

/* `quad`: 4 * N floats of scratch (see update_rows). */
static void scan_mamba2_unit(const scan_call *c, int64_t s, int64_t h, float *dbuf, float *abuf, float *bpack,
                             float *cpack, float *tile, float *quad) {
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
            update_rows(in, out, ir, N, Bs + t * bts, Cs + t * cts, a, xd, yt, c->stream && out != tile, quad,
                        in != tile);
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

/* The dot products of eight heads, p[h] their 8-lane partial sums, as one
 * vector of y: each head's sum in mamba1_heads' order, ((p0 + p4) + (p2 + p6))
 * + ((p1 + p5) + (p3 + p7)), so the result is bitwise the one-head reduction,
 * but the eight are reduced together: 11 shuffles and adds for eight heads
 * where one head alone takes 6 plus a scalar store.  Pairs (h, h + 4) share
 * a vector through the first two steps, so the last one leaves the heads in
 * order. */
static inline __m256 mamba1_hsum8(const __m256 *p) {
    __m256 q[4];
    for (int i = 0; i < 4; i++) /* lanes [p_i lo + p_i hi | p_{i+4} lo + p_{i+4} hi] */
        q[i] = _mm256_add_ps(_mm256_permute2f128_ps(p[i], p[i + 4], 0x20), _mm256_permute2f128_ps(p[i], p[i + 4], 0x31));
    /* per 128-bit half: [u0 + u2, u1 + u3, w0 + w2, w1 + w3] */
    const __m256 r0 = _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], 0x44), _mm256_shuffle_ps(q[0], q[1], 0xEE));
    const __m256 r1 = _mm256_add_ps(_mm256_shuffle_ps(q[2], q[3], 0x44), _mm256_shuffle_ps(q[2], q[3], 0xEE));
    /* per half: [r0_0 + r0_1, r0_2 + r0_3, r1_0 + r1_1, r1_2 + r1_3]: heads 0-3 | 4-7 */
    return _mm256_add_ps(_mm256_shuffle_ps(r0, r1, 0x88), _mm256_shuffle_ps(r0, r1, 0xDD));
}

/* d_state 16, eight heads per iteration, two at a time: the four exp
 * polynomials of a pair are independent chains of ~15 dependent FMAs each,
 * and interleaving them keeps the FMA units busy where one head at a time
 * would wait on latency.  Each head's x dt is one scalar product made before
 * its pair (d and x dt are broadcast from memory, a load rather than a
 * shuffle), and the eight heads' dot products share one reduction
 * (mamba1_hsum8) with one vector store of y.  Outside the exps, the loop is
 * what the kernel adds to the exp rate: on Zen 4 (where the FP pipes, not
 * the loads, decide) one head's own reduction and scalar store were ~7 of
 * the ~31 vector operations per 8 state elements. */
static inline void mamba1_heads16(const float *A, const float *in, float *out, const float *b, const float *c,
                                  const float *dvec, const float *xr, int64_t xs, float *yt, int64_t hb) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    const __m256 c0 = _mm256_loadu_ps(c), c1 = _mm256_loadu_ps(c + 8);
    float xd[8];
    int64_t hh = 0;
    for (; hh + 8 <= hb; hh += 8) {
        const float *Ah = A + hh * 16, *Si = in + hh * 16;
        float *So = out + hh * 16;
        for (int h = 0; h < 8; h++) xd[h] = xr[(hh + h) * xs] * dvec[hh + h];
        __m256 p[8];
        for (int h = 0; h < 8; h += 2) {
            const __m256 dA = _mm256_broadcast_ss(dvec + hh + h), dB = _mm256_broadcast_ss(dvec + hh + h + 1);
            const __m256 xA = _mm256_broadcast_ss(xd + h), xB = _mm256_broadcast_ss(xd + h + 1);
            const __m256 e0 = sc_exp8(_mm256_mul_ps(dA, _mm256_loadu_ps(Ah + 16 * h)));
            const __m256 e1 = sc_exp8(_mm256_mul_ps(dA, _mm256_loadu_ps(Ah + 16 * h + 8)));
            const __m256 e2 = sc_exp8(_mm256_mul_ps(dB, _mm256_loadu_ps(Ah + 16 * h + 16)));
            const __m256 e3 = sc_exp8(_mm256_mul_ps(dB, _mm256_loadu_ps(Ah + 16 * h + 24)));
            const __m256 v0 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 16 * h), e0, _mm256_mul_ps(b0, xA));
            const __m256 v1 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 16 * h + 8), e1, _mm256_mul_ps(b1, xA));
            const __m256 v2 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 16 * h + 16), e2, _mm256_mul_ps(b0, xB));
            const __m256 v3 = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 16 * h + 24), e3, _mm256_mul_ps(b1, xB));
            _mm256_storeu_ps(So + 16 * h, v0);
            _mm256_storeu_ps(So + 16 * h + 8, v1);
            _mm256_storeu_ps(So + 16 * h + 16, v2);
            _mm256_storeu_ps(So + 16 * h + 24, v3);
            /* Same order as mamba1_heads: acc = v_lo * c_lo, then + v_hi * c_hi. */
            p[h] = _mm256_fmadd_ps(v1, c1, _mm256_mul_ps(v0, c0));
            p[h + 1] = _mm256_fmadd_ps(v3, c1, _mm256_mul_ps(v2, c0));
        }
        _mm256_storeu_ps(yt + hh, mamba1_hsum8(p));
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
 * of L tokens the same recurrence is mamba_ssm's block decomposition (SSD):
 *
 *   y_t   = lam_t (S C_t) + sum_{u<=t} D[t][u] (C_t . B_u) xd_u
 *   S_end = lam_end S + sum_u D[end][u] xd_u B_u^T
 *
 * with xd_u = x_u dt_u, D[t][u] = exp(sum_{v=u+1..t} dA_v) the decay from
 * token u to token t and lam_t = exp(sum_{v<=t} dA_v) the decay of the
 * chunk's start state.  Per chunk that is four small matrix products
 * (sc_gemm) in the state's own [head_dim][d_state] layout, with the chunk's
 * B, C and xd transposed:
 *
 *   G   = C B^T masked by D             [L x L], lower triangular
 *   Y^T = S (C lam)^T + xd^T G^T       [P x L], G^T upper triangular
 *   S   = lam_end S + (xd D[end])^T B  [P x N]
 *
 * The decay exponents are running sums (segsum), never differences of
 * cumulative sums, which would lose the short-range decays to cancellation.
 * Chunks end at every snapshot position (sc_state_stops), so snapshots are
 * states the recurrence passes through; the rounding differs from the token
 * loop by the order of the sums only.  A unit is still one (sequence, head),
 * walked chunk by chunk by one thread, so the result is the same for any
 * thread count; a unit whose inputs or start state are not all finite takes
 * the token loop (see sc_all_finite). */
#ifndef SC_CHUNK
#define SC_CHUNK 16
#endif
/* A unit takes the chunked form when some run between its stops is at least
 * this long; shorter runs of such a unit are chunks of their own. */
#ifndef SC_CHUNK_MIN
#define SC_CHUNK_MIN 16
#endif

/* Heads of one group a chunked unit walks together: they share the chunk's
 * transposed B and C and the product C B^T (mamba_ssm's bmm_chunk), which
 * then cost once per block instead of once per head.  Fixed, so units (and
 * results) never depend on the thread count. */
#define SC_M2_HEADS 8

/* Scratch of one thread for the chunked form (arrays [.][L] have row stride
 * SC_CHUNK, [hh] indexes the heads of a block). */
typedef struct {
    float *S;         /* [hh][P][N] states: the block's slice of a pool row */
    float *dA;        /* [hh][n_t] dt_t A_h */
    float *d;         /* [hh][n_t] dt_t */
    float *Bc, *Cc;   /* [L][N] the chunk's B and C rows */
    float *CT, *BT;   /* [N][L] the same, transposed */
    float *G0, *G;    /* [L][L] C B^T, and masked by a head's decays */
    float *GT;        /* [L][L] */
    float *xdT, *wT;  /* [P][L] a head's xd transposed, and times D[end][u] */
    float *YT;        /* [P][L] */
    float *seg, *lam; /* [L] */
    float *D;         /* [L][L] */
    int64_t *stops;   /* [n_cols + 1] */
} m2_chunk_ws;

static inline int64_t round8(int64_t n) { return (n + 7) & ~(int64_t)7; }

/* Rows [0, n) of a token-major input (row stride rs, element stride es)
 * copied into dst [n][w]; `next` (or NULL), the rows the caller reads next,
 * is prefetched meanwhile. */
static void pack_rows(const float *src, int64_t n, int64_t rs, int64_t w, int64_t es, float *dst, const float *next,
                      int64_t n_next) {
    for (int64_t t = 0; t < n; t++) {
        if (next && t < n_next) sc_prefetch_run(next + t * rs, w, es);
        if (es == 1)
            memcpy(dst + t * w, src + t * rs, sizeof(float) * (size_t)w);
        else
            for (int64_t i = 0; i < w; i++) dst[t * w + i] = src[t * rs + i * es];
    }
}

/* Head h's chunk [c0, c0 + L) (its state S, its decays dA and dt d): S
 * advances over the chunk and y is written.  w->Bc, Cc, BT, CT and G0 hold
 * the chunk's shared part. */
static void mamba2_head_chunk(const scan_call *c, m2_chunk_ws *w, float *S, const float *dA, const float *d,
                              int64_t t0, int64_t h, int64_t c0, int64_t L) {
    const int64_t P = c->P, N = c->N, LD = SC_CHUNK, Lp = round8(L);
    const sc_view *x = c->x;
    sc_chunk_decays(dA, L, w->seg, w->D, LD, w->lam);
    for (int64_t t = L; t < Lp; t++) w->lam[t] = 0.0f;
    /* G = (C B^T) o D, zero above the diagonal (where G0 was not computed:
     * selected, not multiplied by D's zeros); then its transpose. */
    for (int64_t t = 0; t < L; t++)
        for (int64_t u = 0; u < Lp; u += 8) {
            const __m256 dv = _mm256_loadu_ps(w->D + t * LD + u);
            const __m256 below = _mm256_cmp_ps(dv, _mm256_setzero_ps(), _CMP_GT_OQ);
            const __m256 gv = _mm256_mul_ps(_mm256_loadu_ps(w->G0 + t * LD + u), dv);
            _mm256_storeu_ps(w->G + t * LD + u, _mm256_and_ps(below, gv));
        }
    sc_transpose(w->G, LD, w->GT, LD, L, L);
    for (int64_t u = 0; u < L; u++)
        for (int64_t t = L; t < Lp; t++) w->GT[u * LD + t] = 0.0f;
    /* xd^T: the chunk's x rows of head h transposed, columns scaled by dt. */
    const float *xs = x->data + (t0 + c0) * x->strides[0] + h * x->strides[1];
    if (x->strides[2] == 1) {
        sc_transpose(xs, x->strides[0], w->xdT, LD, L, P);
    } else {
        for (int64_t t = 0; t < L; t++)
            for (int64_t p = 0; p < P; p++) w->xdT[p * LD + t] = xs[t * x->strides[0] + p * x->strides[2]];
    }
    const float *Dend = w->D + (L - 1) * LD;
    for (int64_t p = 0; p < P; p++) {
        float *xr = w->xdT + p * LD, *wr = w->wT + p * LD;
        for (int64_t t = 0; t < L; t++) xr[t] *= d[t];
        for (int64_t t = L; t < Lp; t++) xr[t] = 0.0f;
        for (int64_t t = 0; t < Lp; t += 8)
            _mm256_storeu_ps(wr + t, _mm256_mul_ps(_mm256_loadu_ps(xr + t), _mm256_loadu_ps(Dend + t)));
    }
    /* Y^T = (S C^T) lam + xd^T G^T, then y = Y. */
    sc_gemm(P, Lp, N, S, N, w->CT, LD, w->YT, LD, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_DENSE, 0);
    for (int64_t p = 0; p < P; p++)
        for (int64_t t = 0; t < Lp; t += 8)
            _mm256_storeu_ps(w->YT + p * LD + t,
                             _mm256_mul_ps(_mm256_loadu_ps(w->YT + p * LD + t), _mm256_loadu_ps(w->lam + t)));
    sc_gemm(P, Lp, L, w->xdT, LD, w->GT, LD, w->YT, LD, SC_GEMM_SCALE, 1.0f, NULL, SC_GEMM_B_UPPER, 0);
    sc_transpose(w->YT, LD, c->y + ((t0 + c0) * c->H + h) * P, c->H * P, P, L);
    /* S = lam_end S + (xd D[end])^T B. */
    sc_gemm(P, N, L, w->wT, LD, w->Bc, N, S, N, SC_GEMM_SCALE, w->lam[L - 1], NULL, SC_GEMM_DENSE, 0);
}

/* The token loop over tokens [t, n_t) of heads [h0, h0 + hb), from the
 * block's states in w->S, with the snapshots at stops[i..]: the rest of a
 * unit from a chunk whose inputs are not all finite on, so that NaN and Inf
 * land where the definition puts them. */
static void mamba2_tokens_from(const scan_call *c, m2_chunk_ws *w, int64_t s, int64_t h0, int64_t hb, int64_t t,
                               const int64_t *stops, int64_t i, int64_t n_stops) {
    const sc_state *st = c->st;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t H = c->H, P = c->P, N = c->N, g = h0 / (H / c->G), off = h0 * P * N;
    const sc_view *x = c->x, *B = c->B, *C = c->C;
    for (; t < n_t; t++) {
        const int64_t tt = t0 + t;
        pack_rows(B->data + tt * B->strides[0] + g * B->strides[1], 1, 0, N, B->strides[2], w->Bc, NULL, 0);
        pack_rows(C->data + tt * C->strides[0] + g * C->strides[1], 1, 0, N, C->strides[2], w->Cc, NULL, 0);
        for (int64_t hh = 0; hh < hb; hh++) {
            const float *xr = x->data + tt * x->strides[0] + (h0 + hh) * x->strides[1];
            const float d = w->d[hh * n_t + t];
            for (int64_t p = 0; p < P; p++) w->xdT[p] = xr[p * x->strides[2]] * d;
            float *S = w->S + hh * P * N;
            update_rows(S, S, P, N, w->Bc, w->Cc, sc_exp(w->dA[hh * n_t + t]), w->xdT,
                        c->y + (tt * H + h0 + hh) * P, 0, NULL, 0);
        }
        for (; i < n_stops && stops[i] <= t + 1; i++) {
            const int64_t r = sc_snap_row(st, s, n_t - stops[i]);
            if (r >= 0) sc_store_state(w->S, sc_pool_at(st, r, off), (sc_dtype)st->pool_dtype, hb * P * N, c->stream);
        }
    }
}

/* Unit (sequence s, heads [h0, h0 + hb) of one group) in chunks ending at
 * `stops`, or 0 (nothing written) when a start state is not all finite.
 * Each chunk's inputs are checked as it starts (and its successor's x rows
 * fetched meanwhile); from a chunk with non-finite inputs on, the token loop
 * runs instead. */
static int scan_mamba2_chunked_unit(const scan_call *c, int64_t s, int64_t h0, int64_t hb, const int64_t *stops,
                                    int64_t n_stops, float *abuf, m2_chunk_ws *w) {
    const sc_state *st = c->st;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const int64_t H = c->H, P = c->P, N = c->N, g = h0 / (H / c->G), LD = SC_CHUNK;
    const sc_view *x = c->x, *B = c->B, *C = c->C;
    const float *Bs = B->data + t0 * B->strides[0] + g * B->strides[1];
    const float *Cs = C->data + t0 * C->strides[0] + g * C->strides[1];
    const float *xs = x->data + t0 * x->strides[0] + h0 * x->strides[1];
    const int64_t off = h0 * P * N;
    const int side_by_side = x->strides[2] == 1 && x->strides[1] == P; /* one run of hb * P per token */
    sc_load_f32(sc_pool_at(st, st->start_rows[s], off), pdt, w->S, hb * P * N);
    if (!sc_all_finite(w->S, 1, 0, hb * P * N, 1)) return 0;
    for (int64_t hh = 0; hh < hb; hh++) prep_dt(c, t0, n_t, h0 + hh, w->d + hh * n_t, abuf, w->dA + hh * n_t);
    sc_copy_input_state(st, s, n_t, off, w->S, hb * P * N);
    int64_t pos = 0;
    for (int64_t i = 0; i < n_stops; i++) {
        for (; pos < stops[i]; pos += LD) {
            const int64_t L = stops[i] - pos < LD ? stops[i] - pos : LD, Lp = round8(L);
            const int64_t n_next = n_t - pos - L < LD ? n_t - pos - L : LD;
            pack_rows(Bs + pos * B->strides[0], L, B->strides[0], N, B->strides[2], w->Bc,
                      Bs + (pos + L) * B->strides[0], n_next);
            pack_rows(Cs + pos * C->strides[0], L, C->strides[0], N, C->strides[2], w->Cc,
                      Cs + (pos + L) * C->strides[0], n_next);
            int finite = sc_all_finite(w->Bc, 1, 0, L * N, 1) && sc_all_finite(w->Cc, 1, 0, L * N, 1);
            for (int64_t hh = 0; hh < hb && finite; hh++) finite = sc_all_finite(w->dA + hh * n_t + pos, 1, 0, L, 1);
            if (side_by_side)
                finite = finite && sc_all_finite(xs + pos * x->strides[0], L, x->strides[0], hb * P, 1);
            else
                for (int64_t hh = 0; hh < hb && finite; hh++)
                    finite = sc_all_finite(xs + hh * x->strides[1] + pos * x->strides[0], L, x->strides[0], P,
                                           x->strides[2]);
            if (!finite) {
                mamba2_tokens_from(c, w, s, h0, hb, pos, stops, i, n_stops);
                scan_epilogue(c, t0, n_t, h0, hb);
                return 1;
            }
            sc_transpose(w->Cc, N, w->CT, LD, L, N);
            sc_transpose(w->Bc, N, w->BT, LD, L, N);
            for (int64_t n = 0; n < N; n++)
                for (int64_t t = L; t < Lp; t++) w->CT[n * LD + t] = w->BT[n * LD + t] = 0.0f;
            sc_gemm(L, Lp, N, w->Cc, N, w->BT, LD, w->G0, LD, SC_GEMM_SET, 0.0f, NULL, SC_GEMM_C_LOWER, 1);
            for (int64_t hh = 0; hh < hb; hh++) {
                const float *xn = xs + hh * x->strides[1] + (pos + L) * x->strides[0];
                for (int64_t t = 0; t < n_next; t++) sc_prefetch_run(xn + t * x->strides[0], P, x->strides[2]);
                mamba2_head_chunk(c, w, w->S + hh * P * N, w->dA + hh * n_t + pos, w->d + hh * n_t + pos, t0,
                                  h0 + hh, pos, L);
            }
        }
        pos = stops[i];
        const int64_t r = sc_snap_row(st, s, n_t - stops[i]);
        if (r >= 0) sc_store_state(w->S, sc_pool_at(st, r, off), pdt, hb * P * N, c->stream);
    }
    scan_epilogue(c, t0, n_t, h0, hb);
    return 1;
}

static void m2_chunk_ws_alloc(m2_chunk_ws *w, int64_t P, int64_t N, int64_t t_max, int64_t n_cols) {
    const size_t L = SC_CHUNK, f = sizeof(float), tm = (size_t)t_max, hb = SC_M2_HEADS;
    w->S = (float *)sc_alloc(f * hb * (size_t)(P * N));
    w->dA = (float *)sc_alloc(f * hb * tm);
    w->d = (float *)sc_alloc(f * hb * tm);
    w->Bc = (float *)sc_alloc(f * L * (size_t)N);
    w->Cc = (float *)sc_alloc(f * L * (size_t)N);
    w->CT = (float *)sc_alloc(f * (size_t)N * L);
    w->BT = (float *)sc_alloc(f * (size_t)N * L);
    w->G0 = (float *)sc_alloc(f * L * L);
    w->G = (float *)sc_alloc(f * L * L);
    w->GT = (float *)sc_alloc(f * L * L);
    w->xdT = (float *)sc_alloc(f * (size_t)P * L);
    w->wT = (float *)sc_alloc(f * (size_t)P * L);
    w->YT = (float *)sc_alloc(f * (size_t)P * L);
    w->seg = (float *)sc_alloc(f * L);
    w->lam = (float *)sc_alloc(f * L);
    w->D = (float *)sc_alloc(f * L * L);
    w->stops = (int64_t *)sc_alloc(sizeof(int64_t) * (size_t)(n_cols + 1));
}

static void m2_chunk_ws_free(m2_chunk_ws *w) {
    float *all[] = {w->S,  w->dA,  w->d,  w->Bc, w->Cc,  w->CT,  w->BT, w->G0,
                    w->G,  w->GT,  w->xdT, w->wT, w->YT, w->seg, w->lam, w->D};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]);
    free(w->stops);
}
#endif

/* Thread tid of n_team runs its share of a Mamba-1 call's units (sequence,
 * block of SC_M1_HEADS heads). */
static void scan_mamba1_worker(const scan_call *c, int64_t n_blocks, int64_t n_units, int rows_path, int tid,
                               int n_team) {
    const int64_t H = c->H, N = c->N;
    /* d_state <= 16 (every Mamba-1 model): the scratch (17 KiB) on the
     * stack, not five aligned_alloc/free pairs per thread and call. */
    float small[(3 + SC_M1_HEADS) * 16 + SC_M1_HEADS] __attribute__((aligned(64)));
    const int on_stack = N <= 16;
    float *dvec = on_stack ? small : (float *)sc_alloc(sizeof(float) * (size_t)SC_M1_HEADS);
    float *bvec = on_stack ? small + SC_M1_HEADS : (float *)sc_alloc(sizeof(float) * (size_t)N);
    float *cvec = on_stack ? small + SC_M1_HEADS + 16 : (float *)sc_alloc(sizeof(float) * (size_t)N);
    float *decay = on_stack ? small + SC_M1_HEADS + 32 : (float *)sc_alloc(sizeof(float) * (size_t)N);
    float *state =
        on_stack ? small + SC_M1_HEADS + 48 : (float *)sc_alloc(sizeof(float) * (size_t)(SC_M1_HEADS * N));
    memset(dvec, 0, sizeof(float) * SC_M1_HEADS); /* lanes past a short block stay finite */
    int64_t lo, hi;
    sc_split(n_units, tid, n_team, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t s = u / n_blocks, h0 = (u % n_blocks) * SC_M1_HEADS;
        const int64_t hb = H - h0 < SC_M1_HEADS ? H - h0 : SC_M1_HEADS;
#ifdef SC_HAVE_AVX2
        if (rows_path) {
            scan_mamba1_rows(c, s, h0, hb, dvec, bvec, cvec, state);
            continue;
        }
#endif
        scan_mamba1_unit(c, s, h0, hb, dvec, bvec, cvec, decay, state);
    }
    (void)rows_path;
    if (!on_stack) {
        free(dvec);
        free(bvec);
        free(cvec);
        free(decay);
        free(state);
    }
}

/* Thread tid of n_team runs its share of a Mamba-2 call's units (see scan_f32). */
static void scan_mamba2_worker(const scan_call *c, int need_pack, int may_chunk, int64_t Hg, int64_t per_block,
                               int64_t blocks, int64_t n_units, int tid, int n_team) {
    const sc_state *st = c->st;
    const int64_t P = c->P, N = c->N, n_group = c->G, n_t_max = st->max_tokens;
    (void)P;
    const size_t tmax = (size_t)(n_t_max > 0 ? n_t_max : 1);
    /* Decode with d_state <= 256: the scratch (a 32 KiB tile and a few
     * KiB) on the stack, not four aligned_alloc/free pairs per thread and
     * call; longer calls and larger states allocate it. */
    float small[SC_SCAN_TILE_BYTES / 4 + 4 * 256 + 16] __attribute__((aligned(64)));
    const int on_stack = tmax == 1 && N <= 256 && tile_rows(N) * N <= SC_SCAN_TILE_BYTES / 4;
    float *dbuf = on_stack ? small + SC_SCAN_TILE_BYTES / 4 + 4 * 256 : (float *)sc_alloc(sizeof(float) * tmax);
    float *abuf = on_stack ? small + SC_SCAN_TILE_BYTES / 4 + 4 * 256 + 8 : (float *)sc_alloc(sizeof(float) * tmax);
    float *bpack = need_pack ? (float *)sc_alloc(sizeof(float) * tmax * (size_t)N) : NULL;
    float *cpack = need_pack ? (float *)sc_alloc(sizeof(float) * tmax * (size_t)N) : NULL;
    float *tile = on_stack ? small : (float *)sc_alloc(sizeof(float) * (size_t)(tile_rows(N) * N));
    float *quad = on_stack ? small + SC_SCAN_TILE_BYTES / 4 : (float *)sc_alloc(sizeof(float) * (size_t)(4 * N));
#ifdef SC_HAVE_AVX2
    m2_chunk_ws w = {0};
    if (may_chunk) m2_chunk_ws_alloc(&w, P, N, (int64_t)tmax, st->n_cols);
#endif
    int64_t lo, hi;
    sc_split(n_units, tid, n_team, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t s = u / (n_group * blocks), gb = u % (n_group * blocks);
        const int64_t h0 = gb / blocks * Hg + gb % blocks * per_block;
        const int64_t hb = Hg - gb % blocks * per_block < per_block ? Hg - gb % blocks * per_block : per_block;
#ifdef SC_HAVE_AVX2
        const int64_t n_t = st->cu_seqlens[s + 1] - st->cu_seqlens[s];
        if (may_chunk && n_t >= SC_CHUNK_MIN) {
            int64_t longest;
            const int64_t n_stops = sc_state_stops(st, s, n_t, w.stops, &longest);
            if (longest >= SC_CHUNK_MIN && scan_mamba2_chunked_unit(c, s, h0, hb, w.stops, n_stops, abuf, &w))
                continue;
        }
#endif
        for (int64_t h = h0; h < h0 + hb; h++) scan_mamba2_unit(c, s, h, dbuf, abuf, bpack, cpack, tile, quad);
    }
    sc_stream_fence(); /* this thread's streamed rows are visible before it joins */
    (void)may_chunk;
    free(bpack);
    free(cpack);
    if (!on_stack) {
        free(dbuf);
        free(abuf);
        free(tile);
        free(quad);
    }
#ifdef SC_HAVE_AVX2
    if (may_chunk) m2_chunk_ws_free(&w);
#endif
}

/* The two workers as sc_team_run calls them: their arguments in one struct. */
typedef struct {
    const scan_call *c;
    int64_t n_blocks, n_units;
    int rows_path;
} mamba1_job;

static void mamba1_thread(void *arg, int tid, int n_team) {
    const mamba1_job *j = (const mamba1_job *)arg;
    scan_mamba1_worker(j->c, j->n_blocks, j->n_units, j->rows_path, tid, n_team);
}

typedef struct {
    const scan_call *c;
    int need_pack, may_chunk;
    int64_t Hg, per_block, blocks, n_units;
} mamba2_job;

static void mamba2_thread(void *arg, int tid, int n_team) {
    const mamba2_job *j = (const mamba2_job *)arg;
    scan_mamba2_worker(j->c, j->need_pack, j->may_chunk, j->Hg, j->per_block, j->blocks, j->n_units, tid, n_team);
}

static void scan_f32(const sc_state *st, const sc_view *x, const sc_view *dt, const float *A, int a_per_state,
                     const sc_view *B, const sc_view *C, float *y, const sc_scan_options *opt, int64_t n_head,
                     int64_t head_dim, int64_t d_state, int64_t n_group, int n_threads) {
    const int64_t H = n_head, P = head_dim, N = d_state, n_s = st->n_seqs, n_t_max = st->max_tokens;
    /* State streamed: every token passes over the state, plus the rows written. */
    const int64_t work_bytes = H * P * N * (int64_t)sizeof(float) * (st->n_tokens + n_s * sc_max_written(st));
    const scan_call c = {st, x, dt, B, C, A, y, opt, H, P, N, n_group,
                         sc_stream_rows(st, work_bytes, H * P * N * (int64_t)sizeof(float))};
    if (a_per_state) {
        const int64_t n_blocks = (H + SC_M1_HEADS - 1) / SC_M1_HEADS, n_units = n_s * n_blocks;
        const int team = sc_state_team(n_units, work_bytes, n_threads);
#ifdef SC_HAVE_AVX2
        const int rows_path = N % 8 == 0;
#else
        const int rows_path = 0;
#endif
        mamba1_job job = {&c, n_blocks, n_units, rows_path};
        sc_team_run(team, mamba1_thread, &job); /* one thread: the body on this thread, no region */
        return;
    }
    const int need_pack = B->strides[2] != 1 || C->strides[2] != 1;
#ifdef SC_HAVE_AVX2
    const int may_chunk = N % 8 == 0 && P % 8 == 0 && n_t_max >= SC_CHUNK_MIN;
#else
    const int may_chunk = 0;
    (void)n_t_max;
#endif
    /* Units: (sequence, head), or in calls that may chunk (sequence, block
     * of up to SC_M2_HEADS heads of one group); a head's token loop is the
     * same in either. */
    const int64_t Hg = H / n_group, per_block = may_chunk ? SC_M2_HEADS : 1;
    const int64_t blocks = (Hg + per_block - 1) / per_block, n_units = n_s * n_group * blocks;
    const int team = sc_state_team(n_units, work_bytes, n_threads);
    mamba2_job job = {&c, need_pack, may_chunk, Hg, per_block, blocks, n_units};
    sc_team_run(team, mamba2_thread, &job);
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
