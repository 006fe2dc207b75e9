/* Depthwise causal conv over concat(window, x), with window snapshots.
 *
 * Tokens are packed (sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s+1]-1)
 * and a sequence's path depends only on its own length, so a packed call
 * computes every sequence exactly as a call of its own would.
 *
 * A work unit is (sequence, block of up to SC_CONV_BLOCK channels; conv_f32
 * picks the width).  Each unit transposes its windows into a time-major
 * scratch `ext[t][c]` and reads x rows in place (strided x is packed into
 * ext), so that the taps, bias and SiLU vectorise over channels (8-lane
 * AVX2 loop, portable loops for the channel tail and other builds); then it
 * writes outputs and snapshot windows straight back into the pool.  Decode
 * (one token) on AVX2 skips the transposes: with d_conv == 4 it shuffles
 * windows and weights in registers (f32 pools read and written in place),
 * other widths gather them.  Each part of the start row's slice is read
 * before anything is written over it, and no other unit touches that slice,
 * so in-place decode and rollback are safe under any thread split. */
#include "sc_internal.h"

/* 1 KiB of each x and y row per token: long contiguous runs for the
 * prefetchers (rows are a whole channel count apart), and still enough units
 * to split a 3k-channel prefill evenly over two threads. */
#define SC_CONV_BLOCK 256
#define SC_CONV_MAX_TAPS 16
/* Work of one channel of one token, in bytes of state moved (see conv_f32). */
#define SC_CONV_TOKEN_BYTES 96

#ifdef SC_HAVE_AVX2
/* x * sigmoid(x) on 8 lanes, the conv's own SiLU (every AVX2 conv path uses
 * it, so decode, prefill rows and the general loop agree bitwise).  It is
 * sc_silu8 (same clamps, range reduction -u = x + n ln2, 2^n from the
 * shifter's bits, reciprocal estimate and Newton step, and so the same
 * results for non-finite inputs) with a shorter polynomial for
 * e^-u, u in [-ln2/2, ln2/2]: 1 - u + u^2 q(u), q cubic, fitted for the
 * least maximum relative error (1.1e-7, under one float ulp, where the
 * degree-7 Taylor polynomial of sc_silu8 gives 1e-9 that float rounding
 * hides anyway).  Its two halves run side by side (Estrin), not as one
 * Horner chain.  12 FMA-port operations instead of 15, which is what a
 * prefill's conv is bound by, and a dependency chain ~20 cycles shorter,
 * which is what a decode (a few vectors per sequence's window) waits on. */
static inline __m256 conv_silu8(__m256 x) {
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3f)), _mm256_set1_ps(87.3f));
    const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(-1.44269504088896341f), shifter);
    const __m256 n = _mm256_sub_ps(t, shifter);
    __m256 u = _mm256_fmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    u = _mm256_fmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), u);
    const __m256 u2 = _mm256_mul_ps(u, u);
    const __m256 q_lo = _mm256_fmadd_ps(u, _mm256_set1_ps(-0.16667111f), _mm256_set1_ps(0.49999243f));
    const __m256 q_hi = _mm256_fmadd_ps(u, _mm256_set1_ps(-0.008312836f), _mm256_set1_ps(0.041889235f));
    const __m256 q = _mm256_fmadd_ps(q_hi, u2, q_lo);
    const __m256 p = _mm256_fmadd_ps(q, u2, _mm256_sub_ps(_mm256_set1_ps(1.0f), u));
    const __m256i e = _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(t), 23), _mm256_set1_epi32(127 << 23));
    const __m256 d = _mm256_fmadd_ps(p, _mm256_castsi256_ps(e), _mm256_set1_ps(1.0f));
    const __m256 r0 = _mm256_rcp_ps(d);
    const __m256 xr0 = _mm256_mul_ps(x, r0);
    return _mm256_fmadd_ps(xr0, _mm256_fnmadd_ps(d, r0, _mm256_set1_ps(1.0f)), xr0);
}

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
        if (apply_silu) acc = conv_silu8(acc);
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

/* 8 outputs: streamed (`stream`, dst 32-byte aligned) or stored. */
static inline void conv_store8(float *dst, __m256 v, int stream) {
    if (stream)
        _mm256_stream_ps(dst, v);
    else
        _mm256_storeu_ps(dst, v);
}

/* Tap k of the 8 channels at kc ([8][4] weights, 32 floats) in k[0..3],
 * channel order kept: each 128-bit half is a 4x4 transpose, channels 0-3 in
 * the low halves and 4-7 in the high ones.  vshufps rather than vunpck*: it
 * issues on two ports here, the unpacks on one, which the lane permutes below
 * already keep busy. */
static inline void conv4_taps(const float *kc, __m256 k[4]) {
    const __m256 r0 = _mm256_loadu2_m128(kc + 16, kc), r1 = _mm256_loadu2_m128(kc + 20, kc + 4);
    const __m256 r2 = _mm256_loadu2_m128(kc + 24, kc + 8), r3 = _mm256_loadu2_m128(kc + 28, kc + 12);
    const __m256 t0 = _mm256_shuffle_ps(r0, r1, 0x44), t1 = _mm256_shuffle_ps(r2, r3, 0x44); /* taps 0, 1 */
    const __m256 t2 = _mm256_shuffle_ps(r0, r1, 0xee), t3 = _mm256_shuffle_ps(r2, r3, 0xee); /* taps 2, 3 */
    k[0] = _mm256_shuffle_ps(t0, t1, 0x88);
    k[1] = _mm256_shuffle_ps(t0, t1, 0xdd);
    k[2] = _mm256_shuffle_ps(t2, t3, 0x88);
    k[3] = _mm256_shuffle_ps(t2, t3, 0xdd);
}

/* Decode with d_conv == 4 (Mamba's kernel) without gathers.  Eight channels'
 * windows are 24 contiguous floats, three plain loads; two blends and a lane
 * permute pull out each tap for the 8 channels.  The weights come from `wT`
 * ([4][SC_CONV_BLOCK], this block's taps already transposed, when a thread
 * runs the block for several sequences) or are transposed in registers.  The
 * taps then go through the same mul/FMA chain and bias (then SiLU, in
 * conv4_decode_block) as the multi-token path and the gather path above, so
 * all three agree bitwise.  The new window [s1 s2 x] per channel is the input
 * stream read one float later with x blended into every third slot.
 *
 * `win` is read and `nwin` (and `old`, a copy of the input window, unless
 * NULL) written per 8 channels, every load of a group before any store: they
 * may be the same pool row (in-place decode, or a start row that is one of
 * the destination planes).  No load reaches past the group's 24 floats, which
 * keeps the last group off the next unit's slice.  x is contiguous here (the
 * caller packs a strided one). */
static inline __attribute__((always_inline)) void conv4_decode_loop(const float *win, float *nwin, float *old,
                                                                    const float *xr, const float *weight,
                                                                    const float *wT, const float *bias, float *yr,
                                                                    int64_t c_vec, const int transposed,
                                                                    const int stream) {
    /* After the blends, tap k of channel j sits in lane perm_k[j]. */
    const __m256i perm0 = _mm256_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5);
    const __m256i perm1 = _mm256_setr_epi32(1, 4, 7, 2, 5, 0, 3, 6);
    const __m256i perm2 = _mm256_setr_epi32(2, 5, 0, 3, 6, 1, 4, 7);
    const __m256i shift1 = _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 7);
    for (int64_t c = 0; c < c_vec; c += 8) {
        const float *wc = win + c * 3;
        const __m256 va = _mm256_loadu_ps(wc), vb = _mm256_loadu_ps(wc + 8), vc = _mm256_loadu_ps(wc + 16);
        const __m256 na = _mm256_loadu_ps(wc + 1), nb = _mm256_loadu_ps(wc + 9);
        const __m256 xv = _mm256_loadu_ps(xr + c);
        __m256 k[4];
        if (transposed) {
            for (int t = 0; t < 4; t++) k[t] = _mm256_load_ps(wT + t * SC_CONV_BLOCK + c);
        } else {
            conv4_taps(weight + c * 4, k);
        }
        const __m256 s0 = _mm256_permutevar8x32_ps(_mm256_blend_ps(_mm256_blend_ps(va, vb, 0x92), vc, 0x24), perm0);
        const __m256 s1 = _mm256_permutevar8x32_ps(_mm256_blend_ps(_mm256_blend_ps(va, vb, 0x24), vc, 0x49), perm1);
        const __m256 s2 = _mm256_permutevar8x32_ps(_mm256_blend_ps(_mm256_blend_ps(va, vb, 0x49), vc, 0x92), perm2);
        __m256 acc = _mm256_mul_ps(s0, k[0]);
        acc = _mm256_fmadd_ps(s1, k[1], acc);
        acc = _mm256_fmadd_ps(s2, k[2], acc);
        acc = _mm256_fmadd_ps(xv, k[3], acc);
        if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + c));
        if (old) {
            conv_store8(old + c * 3, va, stream);
            conv_store8(old + c * 3 + 8, vb, stream);
            conv_store8(old + c * 3 + 16, vc, stream);
        }
        /* x of channel j goes to stream slot 3j + 2: lanes 2, 5 of the first
         * vector, 0, 3, 6 of the second, 1, 4, 7 of the third, which one
         * permute (perm2's) serves for all three. */
        const __m256 xs = _mm256_permutevar8x32_ps(xv, perm2);
        conv_store8(nwin + c * 3, _mm256_blend_ps(na, xs, 0x24), stream);
        conv_store8(nwin + c * 3 + 8, _mm256_blend_ps(nb, xs, 0x49), stream);
        conv_store8(nwin + c * 3 + 16, _mm256_blend_ps(_mm256_permutevar8x32_ps(vc, shift1), xs, 0x92), stream);
        _mm256_storeu_ps(yr + c, acc);
    }
}

/* `stream`: nwin and old are pool rows other than win, 32-byte aligned, in a
 * call large enough to stream (see conv_f32): written with non-temporal
 * stores, in order, three whole vectors per group. */
static void conv4_decode_block(const float *win, float *nwin, float *old, const float *xr, int64_t xs2,
                               const float *weight, const float *wT, const float *bias, float *yr, int64_t c0,
                               int64_t cb, int apply_silu, int stream) {
    const int64_t c_vec = cb - cb % 8;
    float xpack[SC_CONV_BLOCK];
    const float *xc = xr;
    if (xs2 != 1) {
        for (int64_t c = 0; c < c_vec; c++) xpack[c] = xr[c * xs2];
        xc = xpack;
    }
    /* Copies of the loop, so that none tests the weights' source or the stores per group. */
    const float *b = bias ? bias + c0 : NULL;
    if (wT && stream)
        conv4_decode_loop(win, nwin, old, xc, NULL, wT, b, yr, c_vec, 1, 1);
    else if (wT)
        conv4_decode_loop(win, nwin, old, xc, NULL, wT, b, yr, c_vec, 1, 0);
    else if (stream)
        conv4_decode_loop(win, nwin, old, xc, weight + c0 * 4, NULL, b, yr, c_vec, 0, 1);
    else
        conv4_decode_loop(win, nwin, old, xc, weight + c0 * 4, NULL, b, yr, c_vec, 0, 0);
    /* The SiLU in a second pass over the block's outputs (in L1).  In the tap
     * loop, even a group behind the taps, its dependency chain (~50 cycles)
     * on top of the group's loads and shuffles left the reorder buffer room
     * for only a few groups, so the loop ran at the latency of that chain;
     * here every vector is independent and the pass runs at the FMA ports'
     * rate.  Kernel alone, one thread, CPU clock, Zen 4: 5376 channels, one
     * sequence 5.58 -> 4.88 us, 32 sequences 131 -> 122 us. */
    if (apply_silu)
        for (int64_t c = 0; c < c_vec; c += 8) _mm256_storeu_ps(yr + c, conv_silu8(_mm256_loadu_ps(yr + c)));
    for (int64_t c = c_vec; c < cb; c++) {
        const float *kc = weight + (c0 + c) * 4;
        const float w0 = win[c * 3], w1 = win[c * 3 + 1], w2 = win[c * 3 + 2], xt = xr[c * xs2];
        /* fmaf, not a contracted a * b + c * d: the same roundings as a lane above. */
        float acc = w0 * kc[0];
        acc = fmaf(w1, kc[1], acc);
        acc = fmaf(w2, kc[2], acc);
        acc = fmaf(xt, kc[3], acc);
        if (bias) acc += bias[c0 + c];
        if (apply_silu) acc = acc / (1.0f + sc_exp(-acc));
        if (old) {
            old[c * 3] = w0;
            old[c * 3 + 1] = w1;
            old[c * 3 + 2] = w2;
        }
        nwin[c * 3] = w1;
        nwin[c * 3 + 1] = w2;
        nwin[c * 3 + 2] = xt;
        yr[c] = acc;
    }
}

/* Taps and bias of the 8 channels at c of one row of conv4_silu_rows. */
static inline __attribute__((always_inline)) __m256 conv4_taps8(const float *p0, const float *p1, const float *p2,
                                                                const float *p3, const float *wT, const float *b,
                                                                int64_t c, const int has_bias) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(p0 + c), _mm256_load_ps(wT + c));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(p1 + c), _mm256_load_ps(wT + SC_CONV_BLOCK + c), acc);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(p2 + c), _mm256_load_ps(wT + 2 * SC_CONV_BLOCK + c), acc);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(p3 + c), _mm256_load_ps(wT + 3 * SC_CONV_BLOCK + c), acc);
    return has_bias ? _mm256_add_ps(acc, _mm256_loadu_ps(b + c)) : acc;
}

/* One row of conv4_silu_rows: taps and bias of row t into `cur`, and (`silu`)
 * the SiLU of row t - 1 from `prev` into its output row, streamed (`nt`) or
 * stored.  The flags are constants at every call, so each copy of the loop
 * tests nothing per vector.  Two vectors a step: the two halves of a 64-byte
 * output line are stored back to back (one thread, the prefill below:
 * 880-940 -> 830-850 us; four a step: 860-900 us). */
static inline __attribute__((always_inline)) void conv4_row(const float *p0, const float *p1, const float *p2,
                                                            const float *p3, const float *wT, const float *b,
                                                            float *cur, const float *prev, float *y_prev,
                                                            int64_t c_vec, const int has_bias, const int silu,
                                                            const int nt) {
    int64_t c = 0;
    for (; c + 16 <= c_vec; c += 16) {
        const __m256 a0 = conv4_taps8(p0, p1, p2, p3, wT, b, c, has_bias);
        const __m256 a1 = conv4_taps8(p0, p1, p2, p3, wT, b, c + 8, has_bias);
        _mm256_store_ps(cur + c, a0);
        _mm256_store_ps(cur + c + 8, a1);
        if (silu) {
            const __m256 s0 = conv_silu8(_mm256_load_ps(prev + c)), s1 = conv_silu8(_mm256_load_ps(prev + c + 8));
            conv_store8(y_prev + c, s0, nt);
            conv_store8(y_prev + c + 8, s1, nt);
        }
    }
    for (; c < c_vec; c += 8) {
        _mm256_store_ps(cur + c, conv4_taps8(p0, p1, p2, p3, wT, b, c, has_bias));
        if (silu) conv_store8(y_prev + c, conv_silu8(_mm256_load_ps(prev + c)), nt);
    }
}

/* The AVX2 rows of a multi-token unit with d_conv == 4, contiguous x and the
 * SiLU (every Mamba and GDN conv): conv_unit's general loop below, written
 * without its per-vector tests (tap count, bias, streaming) and with the tap
 * rows in locals, so that the loop keeps its pointers and the SiLU's
 * constants in registers instead of reloading them from the stack every
 * vector.  The same operations in the same order, so the same bits; the
 * prefill (3328 channels, 512 tokens, one thread, C harness, fastest of 100)
 * 1190-1230 -> 1020-1070 us with one vector a step (conv4_row now takes
 * two).  `ext` holds the window's W rows, `y` is row t0's output at channel
 * c0, `b` the block's bias or NULL. */
static void conv4_silu_rows(const float *ext, const float *xblock, int64_t xt, const float *wT, const float *b,
                            float *y, int64_t channels, int64_t n_t, int64_t cb, float *rowbuf, int stream) {
    const int64_t c_vec = cb - cb % 8;
    float *cur = rowbuf, *prev = rowbuf + SC_CONV_BLOCK; /* rows t and t - 1 before their SiLU */
    float *y_prev = NULL;                                /* output row t - 1 */
    int nt_prev = 0;
    for (int64_t t = 0; t < n_t; t++) {
        float *yr = y + t * channels;
        if (t + SC_PREFETCH_ROWS < n_t) sc_prefetch_run(xblock + (t + SC_PREFETCH_ROWS) * xt, cb, 1);
        const float *p0 = t < 3 ? ext + t * SC_CONV_BLOCK : xblock + (t - 3) * xt;
        const float *p1 = t < 2 ? ext + (t + 1) * SC_CONV_BLOCK : xblock + (t - 2) * xt;
        const float *p2 = t < 1 ? ext + 2 * SC_CONV_BLOCK : xblock + (t - 1) * xt;
        const float *p3 = xblock + t * xt;
        if (b) {
            if (!y_prev)
                conv4_row(p0, p1, p2, p3, wT, b, cur, prev, y_prev, c_vec, 1, 0, 0);
            else if (nt_prev)
                conv4_row(p0, p1, p2, p3, wT, b, cur, prev, y_prev, c_vec, 1, 1, 1);
            else
                conv4_row(p0, p1, p2, p3, wT, b, cur, prev, y_prev, c_vec, 1, 1, 0);
        } else if (!y_prev) {
            conv4_row(p0, p1, p2, p3, wT, b, cur, prev, y_prev, c_vec, 0, 0, 0);
        } else if (nt_prev) {
            conv4_row(p0, p1, p2, p3, wT, b, cur, prev, y_prev, c_vec, 0, 1, 1);
        } else {
            conv4_row(p0, p1, p2, p3, wT, b, cur, prev, y_prev, c_vec, 0, 1, 0);
        }
        float *swap = prev;
        prev = cur;
        cur = swap;
        y_prev = yr;
        nt_prev = stream && ((uintptr_t)yr & 31) == 0;
    }
    if (y_prev)
        for (int64_t c = 0; c < c_vec; c += 8) conv_store8(y_prev + c, conv_silu8(_mm256_load_ps(prev + c)), nt_prev);
}
#endif


/* Unit (s, channels [c0, c0 + cb)) of a sequence with n_t != 1 tokens (or
 * any count on builds without AVX2): windows through the time-major `ext`. */
static void conv_unit(const sc_state *st, int64_t s, int64_t c0, int64_t cb, const sc_view *x, const float *weight,
                      const float *bias, float *y, int64_t channels, int64_t d_conv, int apply_silu, float *ext,
                      float *win, float *wT, float *rowbuf, int stream) {
    const int64_t W = d_conv - 1;
    const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
    const sc_dtype pdt = (sc_dtype)st->pool_dtype;
    const int64_t xt = x->strides[0], xc = x->strides[1];
    const int64_t slice = c0 * W;
    /* Window [cb, W] (time fastest in the pool) -> ext[0..W)[c]. */
    sc_load_f32(sc_pool_at(st, st->start_rows[s], slice), pdt, win, cb * W);
    for (int64_t c = 0; c < cb; c++)
        for (int64_t m = 0; m < W; m++) ext[m * SC_CONV_BLOCK + c] = win[c * W + m];
    /* Time row q of concat(window, x) for this block: contiguous x is
     * read in place, strided x is packed into ext once. */
    const float *xblock = x->data + t0 * xt + c0 * xc;
#define EROW(q) ((q) < W || xc != 1 ? ext + (q) * SC_CONV_BLOCK : xblock + ((q) - W) * xt)
    if (xc != 1)
        for (int64_t t = 0; t < n_t; t++)
            for (int64_t c = 0; c < cb; c++) ext[(W + t) * SC_CONV_BLOCK + c] = xblock[t * xt + c * xc];
    for (int64_t k = 0; k < d_conv; k++)
        for (int64_t c = 0; c < cb; c++) wT[k * SC_CONV_BLOCK + c] = weight[(c0 + c) * d_conv + k];
    int64_t c_vec = 0; /* channels [0, c_vec) done by the AVX2 loop */
#ifdef SC_HAVE_AVX2
    c_vec = cb - cb % 8;
    float *cur = rowbuf, *prev = rowbuf + SC_CONV_BLOCK; /* rows t and t - 1 before their SiLU */
    float *y_prev = NULL;                                /* output row t - 1, once it is in `prev` */
    int nt_prev = 0;
    const int rows4 = d_conv == 4 && xc == 1 && apply_silu; /* conv4_silu_rows's case */
    if (rows4)
        conv4_silu_rows(ext, xblock, xt, wT, bias ? bias + c0 : NULL, y + t0 * channels + c0, channels, n_t, cb,
                        rowbuf, stream);
    for (int64_t t = 0; t < (rows4 ? 0 : n_t); t++) {
        float *yr = y + (t0 + t) * channels + c0;
        /* x rows are a whole channel count apart, each in a new page: fetched
         * ahead.  Outputs of a large call are streamed (see sc_store_state). */
        if (xc == 1 && t + SC_PREFETCH_ROWS < n_t) sc_prefetch_run(xblock + (t + SC_PREFETCH_ROWS) * xt, cb, 1);
        const int nt_store = stream && ((uintptr_t)yr & 31) == 0;
        const float *taps[SC_CONV_MAX_TAPS];
        const int64_t n_taps = d_conv < SC_CONV_MAX_TAPS ? d_conv : SC_CONV_MAX_TAPS;
        for (int64_t k = 0; k < n_taps; k++) taps[k] = EROW(t + k);
        /* Taps and bias of row t go to an L1 row buffer; the SiLU of row t - 1
         * (the other buffer) runs in the same loop.  The SiLU's ~90-cycle
         * dependency chain per vector, right behind the taps of the same
         * vector, left the out-of-order window room for too few vectors; in
         * a second pass over the row it no longer overlapped the taps'
         * loads.  Skewed by a row, each iteration holds independent work of
         * both kinds. */
        float *row = apply_silu ? cur : yr;
        const int nt_row = !apply_silu && nt_store;
        for (int64_t c = 0; c < c_vec; c += 8) {
            __m256 acc;
            if (d_conv == 4) {
                acc = _mm256_mul_ps(_mm256_loadu_ps(taps[0] + c), _mm256_load_ps(wT + c));
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps[1] + c), _mm256_load_ps(wT + SC_CONV_BLOCK + c), acc);
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps[2] + c), _mm256_load_ps(wT + 2 * SC_CONV_BLOCK + c), acc);
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps[3] + c), _mm256_load_ps(wT + 3 * SC_CONV_BLOCK + c), acc);
            } else {
                acc = _mm256_mul_ps(_mm256_loadu_ps(taps[0] + c), _mm256_load_ps(wT + c));
                for (int64_t k = 1; k < n_taps; k++)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps[k] + c), _mm256_load_ps(wT + k * SC_CONV_BLOCK + c),
                                          acc);
                for (int64_t k = n_taps; k < d_conv; k++)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(EROW(t + k) + c),
                                          _mm256_load_ps(wT + k * SC_CONV_BLOCK + c), acc);
            }
            if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + c0 + c));
            if (nt_row)
                _mm256_stream_ps(row + c, acc);
            else
                _mm256_storeu_ps(row + c, acc);
            if (y_prev) conv_store8(y_prev + c, conv_silu8(_mm256_load_ps(prev + c)), nt_prev);
        }
        if (apply_silu) {
            float *swap = prev;
            prev = cur;
            cur = swap;
            y_prev = yr;
            nt_prev = nt_store;
        }
    }
    if (y_prev)
        for (int64_t c = 0; c < c_vec; c += 8) conv_store8(y_prev + c, conv_silu8(_mm256_load_ps(prev + c)), nt_prev);
#endif
    for (int64_t t = 0; t < n_t && c_vec < cb; t++) {
        float *yr = y + (t0 + t) * channels + c0;
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
    /* Snapshot column j is the window ending j tokens before the end. */
    const int64_t n_written = n_t + 1 < st->n_cols ? n_t + 1 : st->n_cols;
    for (int64_t j = 0; j < n_written; j++) {
        const int64_t r = sc_snap_row(st, s, j);
        if (r < 0) continue;
        for (int64_t m = 0; m < W; m++) {
            const float *e = EROW(n_t - j + m);
            for (int64_t c = 0; c < cb; c++) win[c * W + m] = e[c];
        }
        sc_store_f32(win, sc_pool_at(st, r, slice), pdt, cb * W);
    }
#undef EROW
}

/* What every thread of a conv call needs (see conv_f32). */
typedef struct {
    const sc_state *st;
    const sc_view *x;
    const float *weight, *bias;
    float *y;
    int64_t channels, d_conv, width, n_blocks, n_units;
    int apply_silu, stream, rows_stream, all_decode4;
} conv_job;

/* Thread tid of n_team runs its share of the call's units. */
static void conv_worker(const conv_job *job, int tid, int n_team) {
    const sc_state *st = job->st;
    const sc_view *x = job->x;
    const float *weight = job->weight, *bias = job->bias;
    float *y = job->y;
    const int64_t channels = job->channels, d_conv = job->d_conv, width = job->width, n_blocks = job->n_blocks;
    const int64_t n_units = job->n_units, W = d_conv - 1, n_s = st->n_seqs;
    const int apply_silu = job->apply_silu, stream = job->stream, rows_stream = job->rows_stream;
    const int all_decode4 = job->all_decode4, block_major = all_decode4;
    const sc_dtype pool_dtype = (sc_dtype)st->pool_dtype;
    const int64_t xt = x->strides[0], xc = x->strides[1];
    (void)rows_stream; /* unused on builds without AVX2 */
    (void)xt;
    (void)pool_dtype;
    const size_t ext_elems = (size_t)((W + (xc == 1 ? 0 : st->max_tokens)) * SC_CONV_BLOCK);
    float *ext = all_decode4 ? NULL : (float *)sc_alloc(sizeof(float) * ext_elems);
    /* The per-thread scratch of d_conv <= 4 (12 KiB) lives on the stack:
     * four aligned_alloc/free pairs per thread were ~0.4 us of a call,
     * a tenth of a one-sequence decode. */
    float small[(3 + 4 + 3 + 2) * SC_CONV_BLOCK] __attribute__((aligned(64)));
    const int on_stack = d_conv <= 4;
    float *win = on_stack ? small : (float *)sc_alloc(sizeof(float) * (size_t)(W * SC_CONV_BLOCK));
    float *wT = on_stack ? small + 3 * SC_CONV_BLOCK
                         : (float *)sc_alloc(sizeof(float) * (size_t)(d_conv * SC_CONV_BLOCK));
    float *nwin = on_stack ? small + 7 * SC_CONV_BLOCK : (float *)sc_alloc(sizeof(float) * (size_t)(W * SC_CONV_BLOCK));
    float *rowbuf = on_stack ? small + 10 * SC_CONV_BLOCK : (float *)sc_alloc(sizeof(float) * 2 * SC_CONV_BLOCK);
#ifdef SC_HAVE_AVX2
    int64_t wT_c0 = -1; /* block whose taps wT holds (block-major decode) */
#endif
    int64_t lo, hi;
    sc_split(n_units, tid, n_team, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t s = block_major ? u % n_s : u / n_blocks;
        const int64_t c0 = (block_major ? u / n_s : u % n_blocks) * width;
        const int64_t cb = channels - c0 < width ? channels - c0 : width;
        const int64_t t0 = st->cu_seqlens[s], n_t = st->cu_seqlens[s + 1] - t0;
        const int64_t slice = c0 * W;
#ifdef SC_HAVE_AVX2
        if (n_t == 1) {
            /* Column 0 is the new window, column 1 the input one; either may be absent. */
            const char *src = sc_pool_at(st, st->start_rows[s], slice);
            const int64_t r0 = sc_snap_row(st, s, 0), r1 = sc_snap_row(st, s, 1);
            const float *xr = x->data + t0 * xt + c0 * xc;
            float *yr = y + t0 * channels + c0;
            if (d_conv == 4) {
                const float *taps = NULL;
                if (block_major) {
                    /* Transposed taps pay off from the second sequence of a run on. */
                    const int reuse = u + 1 < hi && (u + 1) / n_s == u / n_s;
                    if (wT_c0 != c0 && reuse) {
                        for (int64_t c = 0; c + 8 <= cb; c += 8) {
                            __m256 k[4];
                            conv4_taps(weight + (c0 + c) * 4, k);
                            for (int t = 0; t < 4; t++) _mm256_store_ps(wT + t * SC_CONV_BLOCK + c, k[t]);
                        }
                        wT_c0 = c0;
                    }
                    taps = wT_c0 == c0 ? wT : NULL;
                }
                if (pool_dtype == SC_F32) {
                    /* f32 windows are read and written in the pool, no scratch. */
                    float *fresh = r0 >= 0 ? (float *)sc_pool_at(st, r0, slice) : nwin;
                    float *old = r1 >= 0 ? (float *)sc_pool_at(st, r1, slice) : NULL;
                    old = old == (const float *)src ? NULL : old;
                    /* streamed: a destination row other than the start row (rotated
                     * planes), as every store of that row is a whole aligned vector */
                const int nt = rows_stream && r0 >= 0 && fresh != (const float *)src &&
                               ((uintptr_t)fresh & 31) == 0 && ((uintptr_t)(old ? old : fresh) & 31) == 0;
                    if (nt && block_major && u + 1 < hi) {
                        /* Streamed: fetch the next unit's window slice (another
                         * sequence's row, where no hardware prefetcher looks) while
                         * this one runs; the streamed lines hold fill buffers that
                         * its loads would otherwise wait for (see sc_prefetch_ahead). */
                        const int64_t s1 = (u + 1) % n_s, c1 = (u + 1) / n_s * width;
                        const int64_t cb1 = channels - c1 < width ? channels - c1 : width;
                        sc_prefetch_run((const float *)sc_pool_at(st, st->start_rows[s1], c1 * W), cb1 * W, 1);
                    }
                    conv4_decode_block((const float *)src, fresh, old, xr, xc, weight, taps, bias, yr, c0, cb,
                                       apply_silu, nt);
                    continue;
                }
                sc_load_f32(src, pool_dtype, win, cb * W);
                conv4_decode_block(win, nwin, NULL, xr, xc, weight, taps, bias, yr, c0, cb, apply_silu, 0);
            } else {
                sc_load_f32(src, pool_dtype, win, cb * W);
                conv_decode_block(win, nwin, xr, xc, weight, bias, yr, c0, cb, d_conv, apply_silu);
            }
            if (r0 >= 0) sc_store_f32(nwin, sc_pool_at(st, r0, slice), pool_dtype, cb * W);
            if (r1 >= 0) sc_store_f32(win, sc_pool_at(st, r1, slice), pool_dtype, cb * W);
            continue;
        }
#endif
        conv_unit(st, s, c0, cb, x, weight, bias, y, channels, d_conv, apply_silu, ext, win, wT, rowbuf, stream);
    }
    sc_stream_fence(); /* this thread's streamed outputs are visible before it joins */
    free(ext);
    if (!on_stack) {
        free(win);
        free(wT);
        free(nwin);
        free(rowbuf);
    }
}

/* conv_worker as sc_team_run calls it. */
static void conv_thread(void *job, int tid, int n_team) { conv_worker((const conv_job *)job, tid, n_team); }

static void conv_f32(const sc_state *st, const sc_view *x, const float *weight, const float *bias, float *y,
                     int64_t channels, int64_t d_conv, int apply_silu, int n_threads) {
    const int64_t W = d_conv - 1, n_s = st->n_seqs;
    int64_t n_blocks = (channels + SC_CONV_BLOCK - 1) / SC_CONV_BLOCK;
    /* Bytes moved: the window read and the rows written, plus x in and y out. */
    const int64_t work_bytes =
        channels * (int64_t)sizeof(float) * (n_s * W * (1 + sc_max_written(st)) + 2 * st->n_tokens);
    /* The conv does more per byte than the scans the state threshold was
     * measured on: every channel of every token costs a SiLU and the taps'
     * shuffles (about 1 ns a channel on one core here, where a scan streams
     * ~100 bytes of state).  So each channel-token counts as SC_CONV_TOKEN_BYTES
     * more bytes of work when choosing the team: a one-sequence 5376-channel
     * decode (172 KiB) splits, kernel alone 5.1-5.3 -> 3.6-4.0 us (2 cores,
     * C harness, fastest/median of 20000 calls); at 2048 channels two threads
     * only tie with one, at 512 they lose (0.9 -> 1.4 us). */
    const int team =
        sc_state_team(n_s * n_blocks, work_bytes + SC_CONV_TOKEN_BYTES * st->n_tokens * channels, n_threads);
    /* Units of equal width split evenly over the team: a 3328-channel prefill
     * is 13 blocks of 256, 7 for one thread and 6 for the other, where 14 of
     * 240 give each 7.  Widths stay multiples of 16 (the last block takes the
     * rest): a multiple of 8, so every channel goes through the same vector
     * lane or scalar tail whatever the split, and results do not depend on
     * the thread count; of 16, so that two threads' blocks never share the
     * 64-byte line of an x or y row where the row is line-aligned. */
    int64_t width = SC_CONV_BLOCK;
    for (int64_t nb = n_blocks; team > 1 && nb < n_blocks + team && nb * 16 <= channels; nb++) {
        const int64_t w = ((channels + nb - 1) / nb + 15) / 16 * 16;
        if ((n_s * ((channels + w - 1) / w)) % team == 0) {
            width = w;
            break;
        }
    }
    n_blocks = (channels + width - 1) / width;
    const int64_t n_units = n_s * n_blocks;
    const int stream = work_bytes >= sc_stream_min_bytes;
    const int rows_stream = sc_stream_rows(st, work_bytes, channels * W * (int64_t)sizeof(float));
#ifdef SC_HAVE_AVX2
    const int has_avx2 = 1;
#else
    const int has_avx2 = 0;
#endif
    /* A call where every sequence decodes one token with d_conv == 4 runs its
     * units block-major, so that a thread meets each block for a run of
     * sequences and transposes that block's weights once (a unit's result
     * never depends on which thread runs it, nor on the transposed copy). */
    const int all_decode4 = has_avx2 && d_conv == 4 && st->max_tokens == 1 && st->n_tokens == n_s;
    const conv_job job = {st, x, weight, bias, y, channels, d_conv, width, n_blocks, n_units,
                          apply_silu, stream, rows_stream, all_decode4};
    sc_team_run(team, conv_thread, (void *)&job); /* one thread: the body on this thread, no region */
}

void sc_ssm_conv(const sc_state *st, const sc_view *x, const float *weight, const float *bias, void *y,
                 sc_dtype y_dtype, int64_t channels, int64_t d_conv, int apply_silu, int n_threads) {
    const int64_t T = st->n_tokens;
    float *own;
    const sc_view xf = sc_widen2(x, T, channels, &own);
    float *yf = sc_output_f32(y, y_dtype, T * channels);
    conv_f32(st, &xf, weight, bias, yf, channels, d_conv, apply_silu, n_threads);
    sc_narrow_output(yf, y, y_dtype, T * channels);
    free(own);
}
