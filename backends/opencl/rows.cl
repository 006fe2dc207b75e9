// Row primitives: gather, scatter, copy (with dtype conversion through float32)
// and zero.  One work-item per element of a row (dimension 0), one row per
// index (dimension 1).  A NULL index array means "row i" (identity), which
// lets one kernel serve get_rows (dst identity), set_rows (src identity) and
// copy_rows.  Offsets are in elements of the buffer's own dtype.

// Same dtype on both sides: copy raw bits, so f32 NaN payloads, -0.0 and
// denormals survive exactly.
#define RAW_COPY_KERNEL(NAME, UNIT)                                                        \
    __kernel void NAME(__global const UNIT *src, long src_off, __global const int *src_rows, \
                       __global UNIT *dst, long dst_off, __global const int *dst_rows,       \
                       long row_len) {                                                     \
        long e = get_global_id(0);                                                         \
        long i = get_global_id(1);                                                         \
        if (e >= row_len) return;                                                          \
        long sr = src_rows ? (long)src_rows[i] : i;                                        \
        long dr = dst_rows ? (long)dst_rows[i] : i;                                        \
        dst[dst_off + dr * row_len + e] = src[src_off + sr * row_len + e];                 \
    }

RAW_COPY_KERNEL(copy_rows_u32, uint)
RAW_COPY_KERNEL(copy_rows_u16, ushort)

__kernel void copy_rows_convert(__global const uchar *src, long src_off, int src_dtype,
                                __global const int *src_rows, __global uchar *dst, long dst_off,
                                int dst_dtype, __global const int *dst_rows, long row_len) {
    long e = get_global_id(0);
    long i = get_global_id(1);
    if (e >= row_len) return;
    long sr = src_rows ? (long)src_rows[i] : i;
    long dr = dst_rows ? (long)dst_rows[i] : i;
    store_any(dst, dst_dtype, dst_off + dr * row_len + e, load_any(src, src_dtype, src_off + sr * row_len + e));
}

// Zero is all-zero bits in f32, f16 and bf16, so two unit widths cover every dtype.
#define ZERO_KERNEL(NAME, UNIT)                                                                  \
    __kernel void NAME(__global UNIT *dst, long dst_off, __global const int *rows, long row_len) { \
        long e = get_global_id(0);                                                               \
        long i = get_global_id(1);                                                               \
        if (e >= row_len) return;                                                                \
        dst[dst_off + (long)rows[i] * row_len + e] = (UNIT)0;                                    \
    }

ZERO_KERNEL(zero_rows_u32, uint)
ZERO_KERNEL(zero_rows_u16, ushort)

// The fast path of the raw copy and the zero: rows whose byte length is a
// multiple of 16 and whose offsets are 4-byte aligned, moved as uint4, each
// work-item taking a 1 KiB stretch of a row.  Offsets are in uints here.  On
// PoCL this runs at clEnqueueCopyBuffer speed, about 3x the per-element
// kernels above.
#define STRETCH 64  // uint4 per work-item

__kernel void copy_rows_v16(__global const uint *src, long src_off, __global const int *src_rows,
                            __global uint *dst, long dst_off, __global const int *dst_rows, long row_len4) {
    const long c = get_global_id(0);
    const long i = get_global_id(1);
    const long sr = src_rows ? (long)src_rows[i] : i;
    const long dr = dst_rows ? (long)dst_rows[i] : i;
    __global const uint *s = src + src_off + sr * row_len4 * 4;
    __global uint *d = dst + dst_off + dr * row_len4 * 4;
    const long end = min(row_len4, (c + 1) * STRETCH);
    for (long e = c * STRETCH; e < end; ++e) vstore4(vload4(e, s), e, d);
}

__kernel void zero_rows_v16(__global uint *dst, long dst_off, __global const int *rows, long row_len4) {
    const long c = get_global_id(0);
    const long i = get_global_id(1);
    __global uint *d = dst + dst_off + (long)rows[i] * row_len4 * 4;
    const long end = min(row_len4, (c + 1) * STRETCH);
    for (long e = c * STRETCH; e < end; ++e) vstore4((uint4)(0u), e, d);
}

// f16/bf16 activations of the stateful primitives: the kernels compute on
// float32 inputs, so a non-f32 input view [n0, n1, n2] (any strides, in
// elements) is widened into contiguous float32 scratch first, and a non-f32
// output is narrowed from float32 scratch after (one pass over activations,
// far fewer bytes than the states the kernels stream).
__kernel void widen_act(__global const uchar *src, long src_off, int dtype, long s0, long s1, long s2, long n1,
                        long n2, __global float *dst, long dst_off) {
    const long i2 = get_global_id(0), i1 = get_global_id(1), i0 = get_global_id(2);
    dst[dst_off + (i0 * n1 + i1) * n2 + i2] = load_any(src, dtype, src_off + i0 * s0 + i1 * s1 + i2 * s2);
}

__kernel void narrow_act(__global const float *src, long src_off, __global uchar *dst, long dst_off, int dtype,
                         long n) {
    const long i = get_global_id(0);
    if (i < n) store_any(dst, dtype, dst_off + i, src[src_off + i]);
}
