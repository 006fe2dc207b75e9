// ABI version, layout table, status text, and thin CUDA runtime wrappers.
//
// Python reaches the runtime only through these, so the library (with cudart
// linked statically) is the one thing the backend loads: no libcudart on the
// library path, no torch, and no call into the driver until Python asks.
#include <stddef.h>

#include "common.cuh"

namespace {

struct layout_entry {
    const char *name;
    int64_t value;
};

#define SC_SIZE(S) {#S, (int64_t)sizeof(S)}
#define SC_FIELD(S, F) {#S "." #F, (int64_t)offsetof(S, F)}

// Every struct and field of the header: a test compares them with cffi's
// idea of the cdef, since ABI mode would silently pass misplaced fields.
const layout_entry kLayout[] = {
    SC_SIZE(statecache_cuda_view),
    SC_FIELD(statecache_cuda_view, data),
    SC_FIELD(statecache_cuda_view, strides),
    SC_FIELD(statecache_cuda_view, dtype),
    SC_FIELD(statecache_cuda_view, reserved),
    SC_SIZE(statecache_cuda_state_args),
    SC_FIELD(statecache_cuda_state_args, pool),
    SC_FIELD(statecache_cuda_state_args, start_rows),
    SC_FIELD(statecache_cuda_state_args, snap_rows),
    SC_FIELD(statecache_cuda_state_args, cu_seqlens),
    SC_FIELD(statecache_cuda_state_args, row_size),
    SC_FIELD(statecache_cuda_state_args, pool_dtype),
    SC_FIELD(statecache_cuda_state_args, n_seqs),
    SC_FIELD(statecache_cuda_state_args, n_tokens),
    SC_FIELD(statecache_cuda_state_args, max_tokens),
    SC_FIELD(statecache_cuda_state_args, n_cols),
    SC_FIELD(statecache_cuda_state_args, reserved),
    SC_SIZE(statecache_cuda_conv_args),
    SC_FIELD(statecache_cuda_conv_args, struct_size),
    SC_FIELD(statecache_cuda_conv_args, state),
    SC_FIELD(statecache_cuda_conv_args, x),
    SC_FIELD(statecache_cuda_conv_args, weight),
    SC_FIELD(statecache_cuda_conv_args, bias),
    SC_FIELD(statecache_cuda_conv_args, y),
    SC_FIELD(statecache_cuda_conv_args, y_dtype),
    SC_FIELD(statecache_cuda_conv_args, channels),
    SC_FIELD(statecache_cuda_conv_args, d_conv),
    SC_FIELD(statecache_cuda_conv_args, apply_silu),
    SC_SIZE(statecache_cuda_scan_args),
    SC_FIELD(statecache_cuda_scan_args, struct_size),
    SC_FIELD(statecache_cuda_scan_args, state),
    SC_FIELD(statecache_cuda_scan_args, x),
    SC_FIELD(statecache_cuda_scan_args, dt),
    SC_FIELD(statecache_cuda_scan_args, A),
    SC_FIELD(statecache_cuda_scan_args, B),
    SC_FIELD(statecache_cuda_scan_args, C),
    SC_FIELD(statecache_cuda_scan_args, D),
    SC_FIELD(statecache_cuda_scan_args, z),
    SC_FIELD(statecache_cuda_scan_args, dt_bias),
    SC_FIELD(statecache_cuda_scan_args, y),
    SC_FIELD(statecache_cuda_scan_args, y_dtype),
    SC_FIELD(statecache_cuda_scan_args, n_head),
    SC_FIELD(statecache_cuda_scan_args, head_dim),
    SC_FIELD(statecache_cuda_scan_args, d_state),
    SC_FIELD(statecache_cuda_scan_args, n_group),
    SC_FIELD(statecache_cuda_scan_args, mamba1),
    SC_FIELD(statecache_cuda_scan_args, dt_clamp),
    SC_FIELD(statecache_cuda_scan_args, dt_lo),
    SC_FIELD(statecache_cuda_scan_args, dt_hi),
    SC_FIELD(statecache_cuda_scan_args, reserved),
    SC_SIZE(statecache_cuda_delta_args),
    SC_FIELD(statecache_cuda_delta_args, struct_size),
    SC_FIELD(statecache_cuda_delta_args, state),
    SC_FIELD(statecache_cuda_delta_args, q),
    SC_FIELD(statecache_cuda_delta_args, k),
    SC_FIELD(statecache_cuda_delta_args, v),
    SC_FIELD(statecache_cuda_delta_args, g),
    SC_FIELD(statecache_cuda_delta_args, beta),
    SC_FIELD(statecache_cuda_delta_args, A_log),
    SC_FIELD(statecache_cuda_delta_args, dt_bias),
    SC_FIELD(statecache_cuda_delta_args, o),
    SC_FIELD(statecache_cuda_delta_args, o_dtype),
    SC_FIELD(statecache_cuda_delta_args, scale),
    SC_FIELD(statecache_cuda_delta_args, l2norm_eps),
    SC_FIELD(statecache_cuda_delta_args, n_head_k),
    SC_FIELD(statecache_cuda_delta_args, n_head_v),
    SC_FIELD(statecache_cuda_delta_args, head_size),
    SC_FIELD(statecache_cuda_delta_args, kda),
    SC_FIELD(statecache_cuda_delta_args, grouped),
    SC_FIELD(statecache_cuda_delta_args, qk_l2norm),
    SC_FIELD(statecache_cuda_delta_args, beta_sigmoid),
    SC_SIZE(statecache_cuda_linear_attn_args),
    SC_FIELD(statecache_cuda_linear_attn_args, struct_size),
    SC_FIELD(statecache_cuda_linear_attn_args, state),
    SC_FIELD(statecache_cuda_linear_attn_args, inputs),
    SC_FIELD(statecache_cuda_linear_attn_args, u),
    SC_FIELD(statecache_cuda_linear_attn_args, o),
    SC_FIELD(statecache_cuda_linear_attn_args, o_dtype),
    SC_FIELD(statecache_cuda_linear_attn_args, variant),
    SC_FIELD(statecache_cuda_linear_attn_args, n_head),
    SC_FIELD(statecache_cuda_linear_attn_args, head_size),
    SC_FIELD(statecache_cuda_linear_attn_args, scale),
    SC_FIELD(statecache_cuda_linear_attn_args, reserved),
};

}  // namespace

extern "C" int statecache_cuda_abi_version(void) { return STATECACHE_CUDA_ABI_VERSION; }

extern "C" int64_t statecache_cuda_layout(const char *name) {
    if (!name) return -1;
    for (const layout_entry &e : kLayout)
        if (strcmp(e.name, name) == 0) return e.value;
    return -1;
}

extern "C" const char *statecache_cuda_error_string(int status) {
    switch (status) {
        case 0:
            return "no error";
        case STATECACHE_CUDA_EABI:
            return "argument struct size does not match the library (ABI mismatch)";
        case STATECACHE_CUDA_EDTYPE:
            return "unknown storage dtype code";
        case STATECACHE_CUDA_ESHAPE:
            return "a size the CUDA kernels do not handle";
        default:
            return status > 0 ? cudaGetErrorString((cudaError_t)status) : "unknown statecache CUDA status";
    }
}

extern "C" int statecache_cuda_max_state_dim(void) { return sc::kMaxStateDim; }
extern "C" int statecache_cuda_max_d_conv(void) { return sc::kMaxDConv; }

extern "C" int statecache_cuda_runtime_version(int *version) { return (int)cudaRuntimeGetVersion(version); }
extern "C" int statecache_cuda_driver_version(int *version) { return (int)cudaDriverGetVersion(version); }
extern "C" int statecache_cuda_device_count(int *count) { return (int)cudaGetDeviceCount(count); }

extern "C" int statecache_cuda_device_info(int device, char *name, size_t name_len, size_t *total_memory,
                                           int *cc_major, int *cc_minor, int *multiprocessors) {
    cudaDeviceProp prop;
    const cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess) return (int)err;
    if (name && name_len) {
        strncpy(name, prop.name, name_len - 1);
        name[name_len - 1] = '\0';
    }
    if (total_memory) *total_memory = prop.totalGlobalMem;
    if (cc_major) *cc_major = prop.major;
    if (cc_minor) *cc_minor = prop.minor;
    if (multiprocessors) *multiprocessors = prop.multiProcessorCount;
    return 0;
}

extern "C" int statecache_cuda_set_device(int device) { return (int)cudaSetDevice(device); }

extern "C" int statecache_cuda_stream_create(void **stream) {
    cudaStream_t s = nullptr;
    // Non-blocking: our work must not serialise with the legacy default
    // stream that a host runtime (torch, CuPy) may use.
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *stream = (void *)s;
    return (int)err;
}

extern "C" int statecache_cuda_stream_destroy(void *stream) { return (int)cudaStreamDestroy((cudaStream_t)stream); }
extern "C" int statecache_cuda_stream_synchronize(void *stream) {
    return (int)cudaStreamSynchronize((cudaStream_t)stream);
}

extern "C" int statecache_cuda_stream_is_capturing(void *stream, int *capturing) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing((cudaStream_t)stream, &status);
    *capturing = err == cudaSuccess && status != cudaStreamCaptureStatusNone;
    return (int)err;
}

extern "C" int statecache_cuda_malloc(void **ptr, size_t nbytes) {
    // Plain device memory, never managed: the pool must stay resident on the
    // device, and page migration would hide bandwidth costs.
    return (int)cudaMalloc(ptr, nbytes ? nbytes : 1);
}

extern "C" int statecache_cuda_free(void *ptr) { return (int)cudaFree(ptr); }

extern "C" int statecache_cuda_memset_async(void *ptr, int value, size_t nbytes, void *stream) {
    return (int)cudaMemsetAsync(ptr, value, nbytes, (cudaStream_t)stream);
}

extern "C" int statecache_cuda_memcpy_h2d_async(void *dst, const void *host_src, size_t nbytes, void *stream) {
    return (int)cudaMemcpyAsync(dst, host_src, nbytes, cudaMemcpyHostToDevice, (cudaStream_t)stream);
}

extern "C" int statecache_cuda_memcpy_d2h_async(void *host_dst, const void *src, size_t nbytes, void *stream) {
    return (int)cudaMemcpyAsync(host_dst, src, nbytes, cudaMemcpyDeviceToHost, (cudaStream_t)stream);
}

extern "C" int statecache_cuda_memcpy_d2d_async(void *dst, const void *src, size_t nbytes, void *stream) {
    return (int)cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, (cudaStream_t)stream);
}
