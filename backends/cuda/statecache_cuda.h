/* statecache CUDA backend: the C ABI of libstatecache_cuda.so.
 *
 * Loaded from Python with cffi in ABI mode (device.py holds the cdef that
 * mirrors this header; a test checks every symbol and every struct layout
 * against the built library, since ABI mode checks nothing by itself).
 *
 * Conventions:
 *  - Every entry point returns an int status: 0 on success, a cudaError_t
 *    value (> 0) from the runtime, or a negative STATECACHE_CUDA_E* code.
 *    statecache_cuda_error_string() turns either into text.
 *  - Pointers are device pointers (cudaMalloc) unless the name says host.
 *    A view's pointer already includes its element offset.
 *  - Strides are in elements, outermost dimension first.
 *  - Launches are asynchronous on the given stream (a cudaStream_t).
 *  - Argument structs start with struct_size; a caller compiled against
 *    another layout is refused with STATECACHE_CUDA_EABI.
 *
 * Bump STATECACHE_CUDA_ABI_VERSION on any change of a signature or struct.
 */
#ifndef STATECACHE_CUDA_H
#define STATECACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#define STATECACHE_CUDA_ABI_VERSION 3

/* Storage dtype codes (pool, rows buffers). */
#define STATECACHE_CUDA_F32 0
#define STATECACHE_CUDA_F16 1
#define STATECACHE_CUDA_BF16 2

/* Variants of statecache_cuda_linear_attn_args. */
#define STATECACHE_CUDA_RWKV6 0
#define STATECACHE_CUDA_RWKV7 1
#define STATECACHE_CUDA_GLA 2

/* Negative status codes (positive ones are cudaError_t). */
#define STATECACHE_CUDA_EABI (-1)      /* struct_size mismatch */
#define STATECACHE_CUDA_EDTYPE (-2)    /* unknown storage dtype code */
#define STATECACHE_CUDA_ESHAPE (-3)    /* a size the kernels do not handle */

#ifdef __cplusplus
extern "C" {
#endif

/* A read-only input view: up to 4 dims, unused trailing strides 0; `dtype`
 * is the storage dtype code of its elements (per-token activations may be
 * f16 or bf16; weights are f32).  `data` points at element 0 whatever the
 * dtype. */
typedef struct statecache_cuda_view {
    const float *data;
    int64_t strides[4];
    int32_t dtype;
    int32_t reserved;
} statecache_cuda_view;

/* Fields every stateful primitive shares (protocol 2, see Device.ssm_scan's
 * contract): tokens packed, sequence s owning tokens cu_seqlens[s] ..
 * cu_seqlens[s + 1] - 1; it reads row start_rows[s] and writes its state
 * after n_t(s) - j tokens to row snap_rows[s * n_cols + j] unless that is -1. */
typedef struct statecache_cuda_state_args {
    void *pool;                 /* [n_rows, row_size] of pool_dtype */
    const int32_t *start_rows;  /* [n_seqs] */
    const int32_t *snap_rows;   /* [n_seqs, n_cols] */
    const int32_t *cu_seqlens;  /* [n_seqs + 1] */
    int64_t row_size;
    int32_t pool_dtype;
    int32_t n_seqs;
    int32_t n_tokens;           /* T = cu_seqlens[n_seqs] */
    int32_t max_tokens;         /* the longest sequence */
    int32_t n_cols;
    int32_t reserved;
} statecache_cuda_state_args;

typedef struct statecache_cuda_conv_args {
    size_t struct_size;
    statecache_cuda_state_args state;
    statecache_cuda_view x;       /* [T, channels] */
    statecache_cuda_view weight;  /* [channels, d_conv] */
    statecache_cuda_view bias;    /* [channels]; data NULL when absent */
    void *y;                      /* [T, channels] of y_dtype, contiguous */
    int32_t y_dtype;
    int32_t channels;
    int32_t d_conv;
    int32_t apply_silu;
} statecache_cuda_conv_args;

typedef struct statecache_cuda_scan_args {
    size_t struct_size;
    statecache_cuda_state_args state;
    statecache_cuda_view x;        /* [T, n_head, head_dim] */
    statecache_cuda_view dt;       /* [T, n_head] */
    statecache_cuda_view A;        /* [n_head] (Mamba-2) or [n_head, d_state] (Mamba-1) */
    statecache_cuda_view B;        /* [T, n_group, d_state] */
    statecache_cuda_view C;        /* [T, n_group, d_state] */
    statecache_cuda_view D;        /* [n_head(, head_dim)], stride 0 along head_dim for [n_head]; data NULL: none */
    statecache_cuda_view z;        /* [T, n_head, head_dim]; data NULL: none */
    statecache_cuda_view dt_bias;  /* [n_head]; data NULL: none */
    void *y;                       /* [T, n_head, head_dim] of y_dtype, contiguous */
    int32_t y_dtype;
    int32_t n_head;
    int32_t head_dim;
    int32_t d_state;
    int32_t n_group;
    int32_t mamba1;                /* 1: A is [n_head, d_state] */
    int32_t dt_clamp;              /* 1: d = clamp(softplus(...), dt_lo, dt_hi), NaN kept */
    float dt_lo;
    float dt_hi;
    int32_t reserved;
} statecache_cuda_scan_args;

typedef struct statecache_cuda_delta_args {
    size_t struct_size;
    statecache_cuda_state_args state;
    statecache_cuda_view q;        /* [T, n_head_k, head_size] */
    statecache_cuda_view k;        /* [T, n_head_k, head_size] */
    statecache_cuda_view v;        /* [T, n_head_v, head_size] */
    statecache_cuda_view g;        /* [T, n_head_v(, head_size)] */
    statecache_cuda_view beta;     /* [T, n_head_v] */
    statecache_cuda_view A_log;    /* [n_head_v]; data NULL: g is the log-decay itself */
    statecache_cuda_view dt_bias;  /* [n_head_v(, head_size)]; data NULL: none */
    void *o;                       /* [T, n_head_v, head_size] of o_dtype, contiguous */
    int32_t o_dtype;
    float scale;
    float l2norm_eps;
    int32_t n_head_k;
    int32_t n_head_v;
    int32_t head_size;
    int32_t kda;                   /* 1: g has a per-key dimension */
    int32_t grouped;               /* 1: value head h reads q/k head h / (n_head_v / n_head_k), else h % n_head_k */
    int32_t qk_l2norm;             /* 1: q and k divided by sqrt(sum of squares + l2norm_eps) */
    int32_t beta_sigmoid;          /* 1: beta = sigmoid(beta) */
} statecache_cuda_delta_args;

/* RWKV-6, RWKV-7 and GLA (see Device.rwkv_wkv6 and siblings): every
 * per-token input [T, n_head, head_size]; decays and gates in log space.
 * Pool rows [n_head, head_size, head_size]: per head S[key i][value j]
 * (RWKV-6, GLA) or S[value i][key j] (RWKV-7), j fastest. */
typedef struct statecache_cuda_linear_attn_args {
    size_t struct_size;
    statecache_cuda_state_args state;
    statecache_cuda_view inputs[6]; /* RWKV-6: r k v w; RWKV-7: r w k v a b; GLA: q k v g */
    statecache_cuda_view u;         /* RWKV-6's time-first bonus [n_head, head_size]; data NULL otherwise */
    void *o;                        /* [T, n_head, head_size] of o_dtype, contiguous */
    int32_t o_dtype;
    int32_t variant;                /* STATECACHE_CUDA_RWKV6, _RWKV7 or _GLA */
    int32_t n_head;
    int32_t head_size;
    float scale;                    /* multiplies the output */
    int32_t reserved;
} statecache_cuda_linear_attn_args;

/* -- version and layout ------------------------------------------------- */
int statecache_cuda_abi_version(void);
/* sizeof / offsetof as compiled: "struct" or "struct.field"; -1 if unknown. */
int64_t statecache_cuda_layout(const char *name);
const char *statecache_cuda_error_string(int status);
/* Largest d_state / head_size the scan kernels take, and largest d_conv. */
int statecache_cuda_max_state_dim(void);
int statecache_cuda_max_d_conv(void);

/* -- runtime -------------------------------------------------------------- */
int statecache_cuda_runtime_version(int *version);
int statecache_cuda_driver_version(int *version);
int statecache_cuda_device_count(int *count);
/* name: caller's buffer of name_len bytes. */
int statecache_cuda_device_info(int device, char *name, size_t name_len, size_t *total_memory, int *cc_major,
                                int *cc_minor, int *multiprocessors);
int statecache_cuda_set_device(int device);
int statecache_cuda_stream_create(void **stream);
int statecache_cuda_stream_destroy(void *stream);
int statecache_cuda_stream_synchronize(void *stream);
/* *capturing = 1 while `stream` is being captured into a CUDA graph (any
 * capture mode), else 0: work that must not be recorded (allocation, host
 * copies, synchronisation) is refused before it is queued. */
int statecache_cuda_stream_is_capturing(void *stream, int *capturing);
int statecache_cuda_malloc(void **ptr, size_t nbytes);
int statecache_cuda_free(void *ptr);
int statecache_cuda_memset_async(void *ptr, int value, size_t nbytes, void *stream);
int statecache_cuda_memcpy_h2d_async(void *dst, const void *host_src, size_t nbytes, void *stream);
int statecache_cuda_memcpy_d2h_async(void *host_dst, const void *src, size_t nbytes, void *stream);
int statecache_cuda_memcpy_d2d_async(void *dst, const void *src, size_t nbytes, void *stream);

/* -- primitives (device) -------------------------------------------------- */
/* dst[dst_rows[i]] = convert(src[src_rows[i]]); a NULL index array means the
 * identity (get_rows: dst_rows NULL; set_rows: src_rows NULL). */
int statecache_cuda_copy_rows(const void *src, int32_t src_dtype, const int32_t *src_rows, void *dst,
                              int32_t dst_dtype, const int32_t *dst_rows, int64_t n, int64_t row_size,
                              void *stream);
int statecache_cuda_zero_rows(void *dst, int32_t dtype, const int32_t *rows, int64_t n, int64_t row_size,
                              void *stream);
int statecache_cuda_ssm_conv(const statecache_cuda_conv_args *args, void *stream);
int statecache_cuda_ssm_scan(const statecache_cuda_scan_args *args, void *stream);
int statecache_cuda_gated_delta_net(const statecache_cuda_delta_args *args, void *stream);
int statecache_cuda_linear_attn(const statecache_cuda_linear_attn_args *args, void *stream);

/* -- host emulation ---------------------------------------------------------
 * The same kernel bodies run on the CPU over host pointers, one emulated
 * thread at a time (the warp reductions degenerate to one lane).  Used by
 * tests on machines without a GPU to check indexing, strides, snapshot
 * mapping and dtype conversion against the reference backend. */
int statecache_cuda_host_convert(const void *src, int32_t src_dtype, void *dst, int32_t dst_dtype, int64_t n);
int statecache_cuda_host_copy_rows(const void *src, int32_t src_dtype, const int32_t *src_rows, void *dst,
                                   int32_t dst_dtype, const int32_t *dst_rows, int64_t n, int64_t row_size);
int statecache_cuda_host_zero_rows(void *dst, int32_t dtype, const int32_t *rows, int64_t n, int64_t row_size);
int statecache_cuda_host_ssm_conv(const statecache_cuda_conv_args *args);
int statecache_cuda_host_ssm_scan(const statecache_cuda_scan_args *args);
int statecache_cuda_host_gated_delta_net(const statecache_cuda_delta_args *args);
int statecache_cuda_host_linear_attn(const statecache_cuda_linear_attn_args *args);

#ifdef __cplusplus
}
#endif

#endif /* STATECACHE_CUDA_H */
