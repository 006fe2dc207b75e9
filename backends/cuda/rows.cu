// Row primitives: gather, scatter, copy (one kernel: either index array may be
// the identity) and zero.
//
// Same-dtype copies move raw bits in the widest unit the alignment allows
// (16 bytes for cudaMalloc'd rows of a multiple of 16 bytes): they are the
// state gather/scatter of decode and must run at copy bandwidth, and a raw
// copy is also what the reference does (no round trip through float32, which
// would canonicalise bf16 NaNs).  Mixed dtypes convert through float32.
#include "common.cuh"

namespace sc {

struct alignas(16) unit16 {
    uint32_t w[4];
};

// One element (or raw unit) of row i: the index math shared by GPU and host.
template <typename S, typename D>
SC_HD void copy_rows_at(const S *src, const int32_t *src_rows, D *dst, const int32_t *dst_rows, int64_t i,
                        int64_t e, int64_t row_units) {
    const int64_t sr = src_rows ? (int64_t)src_rows[i] : i;
    const int64_t dr = dst_rows ? (int64_t)dst_rows[i] : i;
    store(dst + dr * row_units + e, load(src + sr * row_units + e));
}

template <typename U>
SC_HD void copy_rows_raw_at(const U *src, const int32_t *src_rows, U *dst, const int32_t *dst_rows, int64_t i,
                            int64_t e, int64_t row_units) {
    const int64_t sr = src_rows ? (int64_t)src_rows[i] : i;
    const int64_t dr = dst_rows ? (int64_t)dst_rows[i] : i;
    dst[dr * row_units + e] = src[sr * row_units + e];
}

template <typename U>
SC_HD void zero_rows_at(U *dst, const int32_t *rows, int64_t i, int64_t e, int64_t row_units) {
    dst[(int64_t)rows[i] * row_units + e] = U{};
}

// grid.y strides over rows, grid.x (with the block) over units of a row.
#define SC_ROW_LOOP(n, units)                                                  \
    for (int64_t i = blockIdx.y; i < (n); i += gridDim.y)                      \
        for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < (units); \
             e += (int64_t)gridDim.x * blockDim.x)

template <typename S, typename D>
__global__ void copy_rows_kernel(const S *src, const int32_t *src_rows, D *dst, const int32_t *dst_rows, int64_t n,
                                 int64_t units) {
    SC_ROW_LOOP(n, units) copy_rows_at(src, src_rows, dst, dst_rows, i, e, units);
}

template <typename U>
__global__ void copy_rows_raw_kernel(const U *src, const int32_t *src_rows, U *dst, const int32_t *dst_rows,
                                     int64_t n, int64_t units) {
    SC_ROW_LOOP(n, units) copy_rows_raw_at(src, src_rows, dst, dst_rows, i, e, units);
}

template <typename U>
__global__ void zero_rows_kernel(U *dst, const int32_t *rows, int64_t n, int64_t units) {
    SC_ROW_LOOP(n, units) zero_rows_at(dst, rows, i, e, units);
}

static int dtype_size(int32_t code) {
    switch (code) {
        case STATECACHE_CUDA_F32:
            return 4;
        case STATECACHE_CUDA_F16:
        case STATECACHE_CUDA_BF16:
            return 2;
        default:
            return 0;
    }
}

// Widest raw unit (16, 4 or 2 bytes) that divides the row and both bases.
static int raw_unit(const void *a, const void *b, int64_t row_bytes) {
    const uintptr_t mix = (uintptr_t)a | (uintptr_t)b | (uintptr_t)row_bytes;
    if (mix % 16 == 0) return 16;
    if (mix % 4 == 0) return 4;
    return 2;
}

static dim3 row_grid(int64_t n, int64_t units, int threads) {
    const int64_t per_row = (units + threads - 1) / threads;
    const int64_t x = per_row < 1 ? 1 : (per_row > 0x7fffffff ? 0x7fffffff : per_row);
    const int64_t y = n < 1 ? 1 : (n > 65535 ? 65535 : n);
    return dim3((unsigned)x, (unsigned)y, 1);
}

static int row_threads(int64_t units) {
    // Short rows get a short block so fewer lanes idle; 256 otherwise.
    const int64_t t = ((units + 31) / 32) * 32;
    return (int)(t < 32 ? 32 : (t > 256 ? 256 : t));
}

template <typename U>
static void launch_raw(const void *src, const int32_t *src_rows, void *dst, const int32_t *dst_rows, int64_t n,
                       int64_t row_bytes, cudaStream_t stream) {
    const int64_t units = row_bytes / (int64_t)sizeof(U);
    const int threads = row_threads(units);
    copy_rows_raw_kernel<U><<<row_grid(n, units, threads), threads, 0, stream>>>(
        (const U *)src, src_rows, (U *)dst, dst_rows, n, units);
}

template <typename U>
static void host_raw(const void *src, const int32_t *src_rows, void *dst, const int32_t *dst_rows, int64_t n,
                     int64_t row_bytes) {
    const int64_t units = row_bytes / (int64_t)sizeof(U);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t e = 0; e < units; ++e) copy_rows_raw_at((const U *)src, src_rows, (U *)dst, dst_rows, i, e, units);
}

}  // namespace sc

using namespace sc;

extern "C" int statecache_cuda_copy_rows(const void *src, int32_t src_dtype, const int32_t *src_rows, void *dst,
                                         int32_t dst_dtype, const int32_t *dst_rows, int64_t n, int64_t row_size,
                                         void *stream_ptr) {
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    if (!dtype_size(src_dtype) || !dtype_size(dst_dtype)) return STATECACHE_CUDA_EDTYPE;
    if (n <= 0 || row_size <= 0) return 0;
    if (src_dtype == dst_dtype) {
        const int64_t row_bytes = row_size * dtype_size(src_dtype);
        switch (raw_unit(src, dst, row_bytes)) {
            case 16:
                launch_raw<unit16>(src, src_rows, dst, dst_rows, n, row_bytes, stream);
                break;
            case 4:
                launch_raw<uint32_t>(src, src_rows, dst, dst_rows, n, row_bytes, stream);
                break;
            default:
                launch_raw<uint16_t>(src, src_rows, dst, dst_rows, n, row_bytes, stream);
        }
        return launch_status();
    }
    const int threads = row_threads(row_size);
    const dim3 grid = row_grid(n, row_size, threads);
    SC_DISPATCH_DTYPE(src_dtype, S, SC_DISPATCH_DTYPE(dst_dtype, D,
        copy_rows_kernel<S, D><<<grid, threads, 0, stream>>>((const S *)src, src_rows, (D *)dst, dst_rows, n,
                                                             row_size)))
    return launch_status();
}

extern "C" int statecache_cuda_zero_rows(void *dst, int32_t dtype, const int32_t *rows, int64_t n, int64_t row_size,
                                         void *stream_ptr) {
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    if (!dtype_size(dtype)) return STATECACHE_CUDA_EDTYPE;
    if (n <= 0 || row_size <= 0) return 0;
    const int64_t row_bytes = row_size * dtype_size(dtype);
    const int unit = raw_unit(dst, dst, row_bytes);
    const int64_t units = row_bytes / unit;
    const int threads = row_threads(units);
    const dim3 grid = row_grid(n, units, threads);
    if (unit == 16)
        zero_rows_kernel<unit16><<<grid, threads, 0, stream>>>((unit16 *)dst, rows, n, units);
    else if (unit == 4)
        zero_rows_kernel<uint32_t><<<grid, threads, 0, stream>>>((uint32_t *)dst, rows, n, units);
    else
        zero_rows_kernel<uint16_t><<<grid, threads, 0, stream>>>((uint16_t *)dst, rows, n, units);
    return launch_status();
}

// -- host emulation -----------------------------------------------------------

extern "C" int statecache_cuda_host_convert(const void *src, int32_t src_dtype, void *dst, int32_t dst_dtype,
                                            int64_t n) {
    SC_DISPATCH_DTYPE(src_dtype, S, SC_DISPATCH_DTYPE(dst_dtype, D,
        for (int64_t e = 0; e < n; ++e) store((D *)dst + e, load((const S *)src + e))))
    return 0;
}

extern "C" int statecache_cuda_host_copy_rows(const void *src, int32_t src_dtype, const int32_t *src_rows, void *dst,
                                              int32_t dst_dtype, const int32_t *dst_rows, int64_t n,
                                              int64_t row_size) {
    if (!dtype_size(src_dtype) || !dtype_size(dst_dtype)) return STATECACHE_CUDA_EDTYPE;
    if (n <= 0 || row_size <= 0) return 0;
    if (src_dtype == dst_dtype) {
        const int64_t row_bytes = row_size * dtype_size(src_dtype);
        switch (raw_unit(src, dst, row_bytes)) {
            case 16:
                host_raw<unit16>(src, src_rows, dst, dst_rows, n, row_bytes);
                break;
            case 4:
                host_raw<uint32_t>(src, src_rows, dst, dst_rows, n, row_bytes);
                break;
            default:
                host_raw<uint16_t>(src, src_rows, dst, dst_rows, n, row_bytes);
        }
        return 0;
    }
    SC_DISPATCH_DTYPE(src_dtype, S, SC_DISPATCH_DTYPE(dst_dtype, D,
        for (int64_t i = 0; i < n; ++i) for (int64_t e = 0; e < row_size; ++e)
            copy_rows_at((const S *)src, src_rows, (D *)dst, dst_rows, i, e, row_size)))
    return 0;
}

extern "C" int statecache_cuda_host_zero_rows(void *dst, int32_t dtype, const int32_t *rows, int64_t n,
                                              int64_t row_size) {
    if (!dtype_size(dtype)) return STATECACHE_CUDA_EDTYPE;
    const int64_t row_bytes = row_size * dtype_size(dtype);
    const int unit = raw_unit(dst, dst, row_bytes);
    const int64_t units = row_bytes / unit;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t e = 0; e < units; ++e) {
            if (unit == 16)
                zero_rows_at((unit16 *)dst, rows, i, e, units);
            else if (unit == 4)
                zero_rows_at((uint32_t *)dst, rows, i, e, units);
            else
                zero_rows_at((uint16_t *)dst, rows, i, e, units);
        }
    return 0;
}
