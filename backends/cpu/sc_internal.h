/* Helpers shared by the kernel files: dtype conversion, a vectorisable exp,
 * softplus, and the deterministic split of work units over threads.
 * Not part of the ABI. */
#ifndef SC_INTERNAL_H
#define SC_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "statecache_cpu.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX__
#include <immintrin.h>
#endif
#if defined(__F16C__) && defined(__AVX__)
#define SC_HAVE_F16C 1
#endif

#define SC_ALIGN 64
#define SC_RESTRICT __restrict__

static inline size_t sc_dtype_size(sc_dtype d) { return d == SC_F32 ? 4 : 2; }

static inline uint32_t sc_f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float sc_u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f16 -> f32 is exact. */
static inline float sc_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)man * 0x1p-24f; /* subnormal halves are exact floats */
        return sc_u2f(sc_f2u(v) | sign);
    }
    if (exp == 31) return sc_u2f(sign | 0x7f800000u | (man << 13));
    return sc_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

/* f32 -> f16 exactly as NumPy rounds: nearest-even, overflow to inf, NaN
 * keeps the top of its payload (and stays NaN) without being quietened. */
static inline uint16_t sc_float_to_half(float x) {
    uint32_t f = sc_f2u(x);
    uint16_t h_sgn = (uint16_t)((f & 0x80000000u) >> 16);
    uint32_t f_exp = f & 0x7f800000u, f_sig;
    if (f_exp >= 0x47800000u) {
        if (f_exp == 0x7f800000u && (f & 0x007fffffu)) {
            uint16_t ret = (uint16_t)(0x7c00u + ((f & 0x007fffffu) >> 13));
            return (uint16_t)(h_sgn + (ret == 0x7c00u ? 0x7c01u : ret));
        }
        return (uint16_t)(h_sgn + 0x7c00u);
    }
    if (f_exp <= 0x38000000u) {
        if (f_exp < 0x33000000u) return h_sgn;
        f_exp >>= 23;
        f_sig = 0x00800000u + (f & 0x007fffffu);
        f_sig >>= (113 - f_exp);
        /* Round to nearest even; the shift above may have dropped sticky bits. */
        if (((f_sig & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu)) f_sig += 0x00001000u;
        return (uint16_t)(h_sgn + (uint16_t)(f_sig >> 13));
    }
    uint32_t h_exp = (f_exp - 0x38000000u) >> 13;
    f_sig = f & 0x007fffffu;
    if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;
    /* A carry out of the significand bumps the exponent: still correct. */
    return (uint16_t)(h_sgn + (uint16_t)(h_exp + (f_sig >> 13)));
}

static inline float sc_bf16_to_float(uint16_t b) { return sc_u2f((uint32_t)b << 16); }

/* f32 -> bf16 as ml_dtypes (Eigen): nearest-even; NaN becomes the canonical
 * quiet NaN with the input's sign. */
static inline uint16_t sc_float_to_bf16(float x) {
    uint32_t u = sc_f2u(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u & 0x80000000u) ? 0xffc0u : 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Load n elements of a storage row (element offset applied by the caller)
 * into float32, and the reverse. */
static inline void sc_load_f32(const void *SC_RESTRICT src, sc_dtype dt, float *SC_RESTRICT dst, int64_t n) {
    if (dt == SC_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == SC_BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = sc_u2f((uint32_t)s[i] << 16);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        int64_t i = 0;
#ifdef SC_HAVE_F16C
        const __m128i abs_mask = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
            /* F16C quietens signalling NaNs, NumPy keeps them: NaN blocks go scalar. */
            if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, abs_mask), inf))) {
                for (int64_t j = i; j < i + 8; j++) dst[j] = sc_half_to_float(s[j]);
                continue;
            }
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
        }
#endif
        for (; i < n; i++) dst[i] = sc_half_to_float(s[i]);
    }
}

static inline void sc_store_f32(const float *SC_RESTRICT src, void *SC_RESTRICT dst, sc_dtype dt, int64_t n) {
    if (dt == SC_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == SC_BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = sc_f2u(src[i]);
            uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            uint32_t nan = (u & 0x80000000u) ? 0xffc0u : 0x7fc0u;
            d[i] = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : r);
        }
    } else {
        uint16_t *d = (uint16_t *)dst;
        int64_t i = 0;
#ifdef SC_HAVE_F16C
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(src + i);
            /* F16C rounds like NumPy except that it quietens NaNs: blocks
             * holding a NaN go scalar. */
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
                for (int64_t j = i; j < i + 8; j++) d[j] = sc_float_to_half(src[j]);
                continue;
            }
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        }
#endif
        for (; i < n; i++) d[i] = sc_float_to_half(src[i]);
    }
}

/* exp(x) in float32 written so the compiler vectorises it inside
 * `omp simd` loops (libm's expf is a scalar call).  Cephes polynomial, about
 * 1 ulp where the result is a normal float.  Non-finite arguments give what
 * exp gives (the reference backend's float64 math): NaN stays NaN (every
 * comparison with it is false, so the clamps let it through), and the clamps
 * to [-88, 89] put 2^n at 2^-127 (bits 0: the result is 0, as for -Inf) and
 * 2^128 (bits of +Inf: the result is +Inf, as for +Inf) at the ends.  Below
 * -87.68 the result is 0 rather than a subnormal, and above 88.38 +Inf where
 * float32's own overflow starts at 88.72: no decay or gate here can tell. */
static inline float sc_exp(float x) {
    x = x < -88.0f ? -88.0f : x;
    x = x > 89.0f ? 89.0f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    /* 2^n from the shifter's low mantissa bits (n + 127 in [0, 255]; wraps to
     * 0 for n = -127), as sc_exp8 does: no float-to-int conversion of a NaN */
    return y * sc_u2f((sc_f2u(t) << 23) + (127u << 23));
}

/* softplus(z) = z above 20 (upstream's threshold), else log1p(exp(z)),
 * computed as max(z, 0) + log1p(exp(-|z|)) with log1p(u) = 2 atanh(u / (2 + u))
 * so that every step is a vectorisable polynomial without cancellation. */
static inline float sc_softplus(float z) {
    float az = z < 0.0f ? -z : z;
    float u = sc_exp(-az);
    float s = u / (2.0f + u); /* s in (0, 1/3] */
    float s2 = s * s;
    float p = 1.0f / 17.0f;
    p = p * s2 + 1.0f / 15.0f;
    p = p * s2 + 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    float l = 2.0f * s * (1.0f + p * s2);
    float pos = z > 0.0f ? z : 0.0f;
    return z > 20.0f ? z : pos + l;
}

/* AVX2 + FMA versions of the hot helpers.  The kernels use them on the
 * x86-64-v3 build (what build.py picks on any AVX2 machine) and keep portable
 * loops, which the compiler vectorises as far as it can, for other builds. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SC_HAVE_AVX2 1

/* sc_exp on 8 lanes, same constants and clamps.  2^n is built from the
 * shifter's mantissa bits, which hold n after the add.  max/min return their
 * second operand when either is NaN: the constant goes first, so a NaN lane
 * passes the clamps and stays NaN. */
static inline __m256 sc_exp8(__m256 x) {
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-88.0f), x));
    __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shifter);
    __m256 n = _mm256_sub_ps(t, shifter);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(t), 23), _mm256_set1_epi32(127 << 23));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* sc_softplus on 8 lanes. */
static inline __m256 sc_softplus8(__m256 z) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 az = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
    __m256 u = sc_exp8(_mm256_sub_ps(zero, az));
    __m256 s = _mm256_div_ps(u, _mm256_add_ps(_mm256_set1_ps(2.0f), u));
    __m256 s2 = _mm256_mul_ps(s, s);
    __m256 p = _mm256_set1_ps(1.0f / 17.0f);
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 15.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 13.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 11.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 9.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 7.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 5.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f / 3.0f));
    __m256 l = _mm256_mul_ps(_mm256_add_ps(s, s), _mm256_fmadd_ps(p, s2, _mm256_set1_ps(1.0f)));
    __m256 res = _mm256_add_ps(_mm256_max_ps(z, zero), l);
    return _mm256_blendv_ps(res, z, _mm256_cmp_ps(z, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
}

/* x * sigmoid(x) = x / (1 + exp(-x)) on 8 lanes.  exp(-x) is sc_exp8's
 * (same clamps, range reduction and polynomial) written for the SiLU: the
 * reduced argument is kept negated (-r = x + n ln2, so the polynomial takes
 * alternating signs and no lane is negated first), the polynomial is one
 * Horner chain, and 1 + p 2^n is one FMA; 19 vector operations instead of
 * 24, which is what a prefill's conv is bound by.  The reciprocal is the
 * 12-bit estimate refined by one Newton step (two FMAs, within 2 ulp of the
 * quotient), folded into the product with x: a divide occupies its port for
 * several cycles per vector, and in a prefill's conv it cost as much as the
 * exp.  Past x ~ -87 the estimate of 1 / (1 + exp(-x)) flushes to zero, so y
 * is -0 (and NaN for -Inf), as x / (1 + exp(-x)) gives in double
 * precision. */
static inline __m256 sc_silu8(__m256 x) {
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3f)), _mm256_set1_ps(87.3f));
    const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(-1.44269504088896341f), shifter);
    const __m256 n = _mm256_sub_ps(t, shifter);
    __m256 rn = _mm256_fmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    rn = _mm256_fmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), rn);
    __m256 p = _mm256_set1_ps(-1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(-8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(-1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(-1.0f));
    p = _mm256_fmadd_ps(p, rn, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(t), 23), _mm256_set1_epi32(127 << 23));
    const __m256 d = _mm256_fmadd_ps(p, _mm256_castsi256_ps(e), _mm256_set1_ps(1.0f));
    const __m256 r0 = _mm256_rcp_ps(d);
    const __m256 xr0 = _mm256_mul_ps(x, r0);
    return _mm256_fmadd_ps(xr0, _mm256_fnmadd_ps(d, r0, _mm256_set1_ps(1.0f)), xr0);
}

/* A whole 64-byte line of a streamed row (`lo`, `hi` to out[0..16), out
 * 32-byte aligned, both stores back to back so the line is complete at once)
 * and its part of a dot product: acc + lo . c + hi . c8, in that order. */
static inline __m256 sc_stream_line(float *out, __m256 lo, __m256 hi, __m256 c, __m256 c8, __m256 acc) {
    _mm256_stream_ps(out, lo);
    _mm256_stream_ps(out + 8, hi);
    return _mm256_fmadd_ps(hi, c8, _mm256_fmadd_ps(lo, c, acc));
}

/* Horizontal sums of four vectors: lane i of the result is sum(v_i). */
static inline __m128 sc_hsum4x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    __m256 a = _mm256_hadd_ps(v0, v1); /* v0 pairs, v1 pairs (per 128-bit half) */
    __m256 b = _mm256_hadd_ps(v2, v3);
    __m256 c = _mm256_hadd_ps(a, b); /* per half: v0 v1 v2 v3 partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}
#endif

/* Calls streaming at least this many bytes of state write rows other than
 * the ones they read (rotated planes) with non-temporal stores: such state
 * is out of cache, where a normal store first reads the line it writes.
 * Smaller calls keep normal stores: their rows may still be in cache when
 * the next step reads them. */
#define SC_STREAM_MIN_BYTES ((int64_t)4 << 20)
extern int64_t sc_stream_min_bytes; /* SC_STREAM_MIN_BYTES unless a test changed it */

/* A decode call (one token per sequence) streams its rows from this much
 * state on: one layer's call is small, but a decode step walks every layer
 * before it reads the rows again, so a rotated plane's destination is out of
 * cache whenever the model's state is (a 5376-channel conv window of 8
 * sequences is 516 KiB per layer, 132 MiB over 256 layers; with normal
 * stores each line was read before it was written, 1.5x the bytes). */
#define SC_DECODE_STREAM_MIN_BYTES ((int64_t)256 << 10)

/* Whether a call writes rows other than the ones it reads with non-temporal
 * stores: `work_bytes` of state moved in all, `state_bytes` of state per
 * sequence. */
static inline int sc_stream_rows(const sc_state *st, int64_t work_bytes, int64_t state_bytes) {
    if (work_bytes >= sc_stream_min_bytes) return 1;
    return st->max_tokens == 1 && st->n_seqs * state_bytes >= SC_DECODE_STREAM_MIN_BYTES;
}

/* Orders a thread's non-temporal (streamed) stores before what follows. */
static inline void sc_stream_fence(void) {
#ifdef SC_HAVE_AVX2
    _mm_sfence();
#endif
}

/* Units [lo, hi) of n for thread tid of nt: contiguous, fixed by (n, nt). */
static inline void sc_split(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}

static inline int sc_thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int sc_team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Threads for a stateful call: n_units independent units (each a (sequence,
 * head) slice, so the result never depends on the split), streaming about
 * work_bytes of state in all.  Below SC_STATE_PARALLEL_MIN_BYTES one thread
 * runs everything: waking a parked OpenMP worker costs a futex wake (a few
 * us) plus a cold start on its core.  Measured with `bench/primitives.py`
 * on 2 cores, fastest of 4 rounds: one-sequence decode of Mamba-2 (1 MiB of
 * state) 30 -> 26 us, GDN (1 MiB) 41 -> 32 us, Mamba-1 (320 KiB) 57 -> 40 us
 * when split; below ~256 KiB in all the wake costs what the split saves. */
#define SC_STATE_PARALLEL_MIN_BYTES ((int64_t)512 << 10)
extern int64_t sc_state_parallel_min_bytes; /* SC_STATE_PARALLEL_MIN_BYTES unless a test changed it */
static inline int sc_state_team(int64_t n_units, int64_t work_bytes, int n_threads) {
    if (n_threads < 1 || work_bytes < sc_state_parallel_min_bytes) return 1;
    return n_units < n_threads ? (int)n_units : n_threads;
}

/* Runs fn(arg, tid, team) on each thread of a team of `team`, or
 * fn(arg, 0, 1) on the calling thread when team is 1: an OpenMP region of
 * one thread (`if (team > 1)`) still builds and ends a team, about 0.2 us of
 * a decode call that may take 10.  The thread id and team size are passed,
 * not asked for inside: called within some outer parallel region, fn would
 * otherwise see that region's team. */
static inline void sc_team_run(int team, void (*fn)(void *, int, int), void *arg) {
#ifdef _OPENMP
    if (team > 1) {
#pragma omp parallel num_threads(team)
        fn(arg, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    (void)team;
    fn(arg, 0, 1);
}

/* The row sequence s writes its state after n_t(s) - j tokens to, or -1. */
static inline int64_t sc_snap_row(const sc_state *st, int64_t s, int64_t j) {
    return j < st->n_cols ? (int64_t)st->snap_rows[s * st->n_cols + j] : -1;
}

/* Pointer to element `elem` of pool row `row`. */
static inline char *sc_pool_at(const sc_state *st, int64_t row, int64_t elem) {
    return (char *)st->pool + ((size_t)row * (size_t)st->row_elems + (size_t)elem) * sc_dtype_size((sc_dtype)st->pool_dtype);
}

/* Columns written at most per sequence: min(longest + 1, n_cols). */
static inline int64_t sc_max_written(const sc_state *st) {
    return st->max_tokens + 1 < st->n_cols ? st->max_tokens + 1 : st->n_cols;
}

/* sc_store_f32 of a state into a pool row; `stream` (a call past
 * SC_STREAM_MIN_BYTES) writes an aligned f32 row with non-temporal stores:
 * the row is out of cache, and a normal store would first read each line.
 * The caller fences (sc_stream_fence) before the kernel returns. */
static inline void sc_store_state(const float *src, void *dst, sc_dtype dt, int64_t n, int stream) {
#ifdef SC_HAVE_AVX2
    if (stream && dt == SC_F32 && ((uintptr_t)dst & 31) == 0) {
        float *d = (float *)dst;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(src + i));
        for (; i < n; i++) d[i] = src[i];
        return;
    }
#endif
    (void)stream;
    sc_store_f32(src, dst, dt, n);
}

/* Copy a state slice from the start row to the input-state column
 * (j = n_t) when that column is written and is another row. */
static inline void sc_copy_input_state(const sc_state *st, int64_t s, int64_t n_t, int64_t elem, const void *loaded,
                                       int64_t n) {
    const int64_t r = sc_snap_row(st, s, n_t);
    if (r < 0) return;
    void *dst = sc_pool_at(st, r, elem);
    if (loaded) {
        sc_store_f32((const float *)loaded, dst, (sc_dtype)st->pool_dtype, n);
    } else { /* f32 pool: a plain copy from the start row */
        const void *src = sc_pool_at(st, st->start_rows[s], elem);
        if (dst != src) memcpy(dst, src, (size_t)n * 4);
    }
}

static inline float sc_silu(float x) { return x / (1.0f + sc_exp(-x)); }

/* Token rows of one head lie a whole token's width apart, so each starts
 * in another page, where the hardware prefetchers find no stream: loops
 * that walk such rows fetch the row SC_PREFETCH_ROWS ahead of the one they
 * read (a run of n floats at element stride es). */
#define SC_PREFETCH_ROWS 8
static inline void sc_prefetch_run(const float *p, int64_t n, int64_t es) {
    const char *c = (const char *)p;
    const int64_t bytes = (n - 1) * es * (int64_t)sizeof(float);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
    __builtin_prefetch(c + bytes);
}

/* A streamed decode (rows read from one plane, written to another with
 * non-temporal stores) fetches its source rows this far ahead of the group
 * it reads: the write-combining buffers of the streamed lines are the line
 * fill buffers the loads need, so fewer loads are in flight than in an
 * in-place update, whose written lines leave the core as evictions.  With the
 * source already on its way, a rotated decode over 512 MiB of state (2
 * threads, CPU time) ran at 1.0-1.2x of the in-place one instead of 1.5-2x
 * (Mamba-2 and GDN, bench/primitives.py --only rotate). */
#define SC_STREAM_PREFETCH_BYTES 4096
static inline void sc_prefetch_ahead(const float *p, int64_t bytes) {
    const char *c = (const char *)p + SC_STREAM_PREFETCH_BYTES;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

/* The token counts after which sequence s's state is wanted, ascending:
 * n_t - j for every column 1 <= j < n_t that has a snapshot row, then n_t
 * (column 0, and where every token's output is due).  A chunked form ends a
 * chunk at each of them, so every snapshot is a state the recurrence passes
 * through, not one recomputed another way.  `stops` has room for n_cols + 1
 * entries; returns their count, and in *longest the most tokens between two
 * consecutive stops (or from the start to the first). */
static inline int64_t sc_state_stops(const sc_state *st, int64_t s, int64_t n_t, int64_t *stops, int64_t *longest) {
    int64_t n = 0, prev = 0, most = 0;
    for (int64_t j = (n_t - 1 < st->n_cols - 1 ? n_t - 1 : st->n_cols - 1); j >= 1; j--)
        if (sc_snap_row(st, s, j) >= 0) stops[n++] = n_t - j;
    stops[n++] = n_t;
    for (int64_t i = 0; i < n; i++) {
        most = stops[i] - prev > most ? stops[i] - prev : most;
        prev = stops[i];
    }
    *longest = most;
    return n;
}

/* 1 when none of rows x n elements (row stride rs, element stride es) is
 * NaN or infinite.  The chunked forms mix tokens inside matrix products
 * (a masked-out zero times an infinity is NaN, and a sum of infinities of
 * both signs is NaN where the recurrence keeps one infinity), so a unit
 * whose inputs are not all finite runs the token loop, which puts NaN and
 * Inf exactly where the definition does. */
static inline int sc_all_finite(const float *p, int64_t rows, int64_t rs, int64_t n, int64_t es) {
    int ok = 1;
    for (int64_t r = 0; r < rows && ok; r++) {
        const float *row = p + r * rs;
        if (r + SC_PREFETCH_ROWS < rows) sc_prefetch_run(row + SC_PREFETCH_ROWS * rs, n, es);
        int64_t i = 0;
        /* x - x is 0 exactly when x is finite (NaN for NaN and for +-Inf). */
        if (es == 1) {
#ifdef __AVX__
            __m256 bad = _mm256_setzero_ps();
            for (; i + 8 <= n; i += 8) {
                const __m256 x = _mm256_loadu_ps(row + i);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_NEQ_UQ));
            }
            ok = !_mm256_movemask_ps(bad);
#endif
            for (; i < n; i++) ok &= row[i] - row[i] == 0.0f;
        } else {
            for (; i < n; i++) ok &= row[i * es] - row[i * es] == 0.0f;
        }
    }
    return ok;
}


/* NaN-preserving clamp (the comparisons are false for NaN). */
static inline float sc_clamp(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline void *sc_alloc(size_t bytes) {
    size_t rounded = (bytes + SC_ALIGN - 1) / SC_ALIGN * SC_ALIGN;
    return aligned_alloc(SC_ALIGN, rounded ? rounded : SC_ALIGN);
}

/* Activations in f16/bf16: the kernels compute on float32 views, so a
 * non-f32 input is first widened into a contiguous float32 copy (one pass
 * over the activations, far fewer bytes than the state a call streams) and
 * a non-f32 output narrowed from a float32 scratch at the end. */

/* The [n0][n1][n2] elements of view v (strides[0..2]; n2 innermost) as a
 * contiguous float32 array in `out`. */
static inline void sc_widen_into(const sc_view *v, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                                 int64_t s2, float *out) {
    const sc_dtype dt = (sc_dtype)v->dtype;
    const char *base = (const char *)v->data;
    const size_t es = sc_dtype_size(dt);
    for (int64_t i0 = 0; i0 < n0; i0++)
        for (int64_t i1 = 0; i1 < n1; i1++) {
            const char *row = base + (size_t)(i0 * s0 + i1 * s1) * es;
            float *o = out + (i0 * n1 + i1) * n2;
            if (s2 == 1) {
                sc_load_f32(row, dt, o, n2);
            } else {
                for (int64_t i2 = 0; i2 < n2; i2++) sc_load_f32(row + (size_t)(i2 * s2) * es, dt, o + i2, 1);
            }
        }
}

/* A float32 view of a 3-D input [n0, n1, n2]: the view itself when it is
 * float32 (or absent), else a widened copy whose allocation goes to *owned. */
static inline sc_view sc_widen3(const sc_view *v, int64_t n0, int64_t n1, int64_t n2, float **owned) {
    *owned = NULL;
    if (v->data == NULL || v->dtype == SC_F32) return *v;
    float *buf = (float *)sc_alloc(sizeof(float) * (size_t)(n0 * n1 * n2 > 0 ? n0 * n1 * n2 : 1));
    sc_widen_into(v, n0, n1, n2, v->strides[0], v->strides[1], v->strides[2], buf);
    sc_view out = {buf, {n1 * n2, n2, 1, 0}, SC_F32, 0};
    *owned = buf;
    return out;
}

/* The same for a 2-D input [n0, n1]. */
static inline sc_view sc_widen2(const sc_view *v, int64_t n0, int64_t n1, float **owned) {
    *owned = NULL;
    if (v->data == NULL || v->dtype == SC_F32) return *v;
    float *buf = (float *)sc_alloc(sizeof(float) * (size_t)(n0 * n1 > 0 ? n0 * n1 : 1));
    sc_widen_into(v, n0, 1, n1, v->strides[0], 0, v->strides[1], buf);
    sc_view out = {buf, {n1, 1, 0, 0}, SC_F32, 0};
    *owned = buf;
    return out;
}

/* Where a kernel writes an output of n elements: the output itself when it
 * is float32, else a float32 scratch that sc_narrow_output stores into it. */
static inline float *sc_output_f32(void *out, sc_dtype dt, int64_t n) {
    return dt == SC_F32 ? (float *)out : (float *)sc_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
}

static inline void sc_narrow_output(float *scratch, void *out, sc_dtype dt, int64_t n) {
    if (dt == SC_F32) return;
    sc_store_f32(scratch, out, dt, n);
    free(scratch);
}

#endif
