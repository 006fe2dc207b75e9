/* statecache CPU backend: the C entry points, one family per source file.
 *
 * Conventions shared by every entry point:
 *  - Pools and row buffers are contiguous [rows, row_elems] arrays of one
 *    storage dtype (sc_dtype); states are always computed in float32.
 *  - Inputs that may be strided views are passed as an sc_view: a base
 *    pointer (already offset to element 0) and strides in elements, outermost
 *    first, one per dimension of the primitive's documented shape.
 *  - Index arrays have been validated by the Python side (range, duplicates,
 *    start-row aliasing); C trusts them and never touches Python objects.
 *  - n_threads is the exact team size; work is split into fixed units so the
 *    result is bitwise identical for any n_threads.
 *
 * The block between cdef-begin and cdef-end is also the cffi cdef (build.py
 * reads it), so this header is the single declaration of the ABI.
 */
#ifndef STATECACHE_CPU_H
#define STATECACHE_CPU_H

#include <stdint.h>
#include <stddef.h>

/* cdef-begin */
/* Bump on any change of a signature, struct or enum below. */
#define SC_CPU_ABI_VERSION 3

typedef enum { SC_F32 = 0, SC_F16 = 1, SC_BF16 = 2 } sc_dtype;

/* A read-only input: element 0 (offset applied) and strides in elements,
 * outermost first; `dtype` is the sc_dtype of its elements. */
typedef struct {
    const float *data;
    int64_t strides[4];
    int32_t dtype;
    int32_t reserved;
} sc_view;

/* The rows and token layout of a stateful call (protocol 2: packed tokens).
 * Sequence s owns tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1 of every
 * per-token input and output, starts from pool row start_rows[s] and writes
 * its state after n_t(s) - j tokens to row snap_rows[s * n_cols + j] for
 * each column j whose entry is not -1 (j = n_t(s): the input state). */
typedef struct {
    void *pool;
    int32_t pool_dtype;
    int32_t n_cols;
    int64_t row_elems;
    const int32_t *start_rows;
    const int32_t *snap_rows;
    const int32_t *cu_seqlens;
    int64_t n_seqs;
    int64_t n_tokens;   /* cu_seqlens[n_seqs] */
    int64_t max_tokens; /* the longest sequence */
} sc_state;

/* Fused epilogues of the scan (each NULL / 0 when not asked for):
 * d = clamp(softplus(dt + dt_bias)), y = (y + D * x) * silu(z). */
typedef struct {
    const float *dt_bias; /* [n_head] */
    const float *D;       /* [n_head], or [n_head, head_dim] when d_per_dim */
    int32_t d_per_dim;
    int32_t dt_clamp;
    float dt_lo, dt_hi;
    sc_view z; /* [T, n_head, head_dim]; z.data NULL when absent */
} sc_scan_options;

/* Options of the delta rule: q/k head map (grouped: h / (Hv / Hk), else
 * h % Hk), in-kernel L2 normalisation of q and k, the raw gate
 * g = -exp(A_log[h]) * softplus(a + dt_bias) (A_log non-NULL; dt_bias [Hv]
 * or [Hv, S] for KDA, or NULL), beta = sigmoid(b), and the output scale. */
typedef struct {
    int32_t grouped;
    int32_t qk_l2norm;
    int32_t beta_sigmoid;
    int32_t reserved;
    const float *A_log;
    const float *dt_bias;
    float scale;
    float l2norm_eps;
} sc_delta_options;

int sc_cpu_abi_version(void);
/* 1 when this CPU runs the instruction set the library was compiled for. */
int sc_cpu_isa_supported(void);
/* The -march the library was compiled for, e.g. "x86-64-v3". */
const char *sc_cpu_isa(void);
/* 1 when built with OpenMP (threads), else 0. */
int sc_cpu_has_threads(void);
/* Stateful calls streaming fewer bytes of state than this run on one thread
 * (default 512 KiB); returns the previous value.  Tests set 0 to exercise
 * the thread split on small shapes. */
int64_t sc_set_state_parallel_min_bytes(int64_t bytes);
/* Calls streaming at least this much state (default 4 MiB) write rows other
 * than the ones they read with non-temporal stores; returns the previous
 * value.  Tests set 0 to exercise those stores on small shapes. */
int64_t sc_set_stream_min_bytes(int64_t bytes);

/* rows.c: dst[dst_rows[i]] = convert(src[src_rows[i]]), i < n.  A NULL index
 * array means the identity (get_rows passes dst_rows = NULL, set_rows passes
 * src_rows = NULL).  Same dtype copies are memcpy, so bit-exact. */
void sc_copy_rows(const void *src, sc_dtype src_dtype, const int32_t *src_rows, void *dst, sc_dtype dst_dtype,
                  const int32_t *dst_rows, int64_t n, int64_t row_elems, int n_threads);
void sc_zero_rows(void *dst, sc_dtype dtype, const int32_t *rows, int64_t n, int64_t row_elems, int n_threads);
/* Plain copy of nbytes, split over threads (the memcpy bound of benchmarks). */
void sc_memcpy(void *dst, const void *src, int64_t nbytes, int n_threads);
/* Element conversions, exposed for tests (f16 as NumPy, bf16 as ml_dtypes). */
void sc_convert(const void *src, sc_dtype src_dtype, void *dst, sc_dtype dst_dtype, int64_t n);

/* Per-token inputs (x, dt, B, C, z; q, k, v, g, beta) may be f32, f16 or
 * bf16 (their view's dtype); outputs (y, o) are contiguous of y_dtype /
 * o_dtype.  Math is float32 either way. */

/* ssm_conv.c: x [T, ch] (2 strides), weight [ch, d_conv], bias [ch] or NULL,
 * y [T, ch] contiguous, pool rows [ch, d_conv - 1]. */
void sc_ssm_conv(const sc_state *st, const sc_view *x, const float *weight, const float *bias, void *y,
                 sc_dtype y_dtype, int64_t channels, int64_t d_conv, int apply_silu, int n_threads);

/* ssm_scan.c: x [T, H, P], dt [T, H], B/C [T, G, N] (views), A [H] (mamba2)
 * or [H, N] (mamba1: P == 1, G == 1), y [T, H, P] contiguous, pool rows
 * [H, P, N]. */
void sc_ssm_scan(const sc_state *st, const sc_view *x, const sc_view *dt, const float *A, int a_per_state,
                 const sc_view *B, const sc_view *C, void *y, sc_dtype y_dtype, const sc_scan_options *opt,
                 int64_t n_head, int64_t head_dim, int64_t d_state, int64_t n_group, int n_threads);

/* delta_net.c: q/k [T, Hk, S], v [T, Hv, S], g [T, Hv] or [T, Hv, S]
 * (kda != 0), beta [T, Hv], o [T, Hv, S] contiguous, pool rows [Hv, S, S]
 * with block [j, i] = M[i][j]. */
void sc_gated_delta_net(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                        int kda, const sc_view *beta, void *o, sc_dtype o_dtype, const sc_delta_options *opt,
                        int64_t n_head_k, int64_t n_head_v, int64_t head_size, int n_threads);
/* linear_attn.c: RWKV-6 (r, k, v, w; u [H, S] time-first bonus), RWKV-7
 * (r, w, k, v, a, b) and GLA (q, k, v, g): every per-token input [T, H, S]
 * (views), o [T, H, S] contiguous, pool rows [H, S, S] with block [i][j]
 * = S[key i][value j] (RWKV-6, GLA) or S[value i][key j] (RWKV-7); decays
 * and gates in log space; `scale` multiplies the output. */
void sc_rwkv_wkv6(const sc_state *st, const sc_view *r, const sc_view *k, const sc_view *v, const sc_view *w,
                  const float *u, void *o, sc_dtype o_dtype, float scale, int64_t n_head, int64_t head_size,
                  int n_threads);
void sc_rwkv_wkv7(const sc_state *st, const sc_view *r, const sc_view *w, const sc_view *k, const sc_view *v,
                  const sc_view *a, const sc_view *b, void *o, sc_dtype o_dtype, float scale, int64_t n_head,
                  int64_t head_size, int n_threads);
void sc_gated_linear_attn(const sc_state *st, const sc_view *q, const sc_view *k, const sc_view *v, const sc_view *g,
                          void *o, sc_dtype o_dtype, float scale, int64_t n_head, int64_t head_size, int n_threads);
/* cdef-end */

#endif
