// Helpers shared by every kernel family; build.py prepends this file to each
// family's source (one program per family, so nothing is compiled twice).
//
// Storage dtype codes, matching build.DTYPE_CODES: 0 = f32, 1 = f16, 2 = bf16.
// f16 goes through vload_half / vstore_half_rte, which are core OpenCL C and
// need no cl_khr_fp16; bf16 is stored as ushort with an explicit
// round-to-nearest-even conversion, so both work on every device and round
// exactly like NumPy / ml_dtypes on the host.

#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

inline float bf16_to_f32(ushort v) { return as_float(((uint)v) << 16); }

inline ushort f32_to_bf16(float f) {
    uint u = as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (ushort)(((u >> 16) & 0x8000u) | 0x7fc0u);  // ml_dtypes: the quiet NaN, sign kept
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (ushort)(u >> 16);
}

// vstore_half_rte's NaN bits are implementation-defined (PoCL writes 0x7fff);
// NumPy keeps the sign and the top 10 payload bits, and never makes an inf.
inline ushort f16_nan_bits(float f) {
    const uint u = as_uint(f);
    ushort r = (ushort)(0x7c00u | ((u & 0x7fffffu) >> 13));
    if (r == 0x7c00u) r = 0x7c01u;
    return (ushort)(((u >> 16) & 0x8000u) | r);
}

// vload_half may quiet a signalling NaN; NumPy widens the bits unchanged.
inline float f16_nan_to_f32(ushort h) {
    return as_float(((uint)(h & 0x8000u) << 16) | 0x7f800000u | ((uint)(h & 0x3ffu) << 13));
}

inline float load_f16(size_t i, __global const half *p) {
    const ushort h = ((__global const ushort *)p)[i];
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) return f16_nan_to_f32(h);
    return vload_half(i, p);
}

inline float8 load_f16_8(size_t i, __global const half *p) {
    float8 v = vload_half8(0, p + i);
    if (any(isnan(v))) {  // rare: redo the NaN lanes bit by bit
        float w[8];
        vstore8(v, 0, w);
        for (int k = 0; k < 8; ++k) {
            if (isnan(w[k])) w[k] = f16_nan_to_f32(((__global const ushort *)p)[i + k]);
        }
        v = vload8(0, w);
    }
    return v;
}

inline void store_f16(float v, size_t i, __global half *p) {
    if (isnan(v)) {
        ((__global ushort *)p)[i] = f16_nan_bits(v);
    } else {
        vstore_half_rte(v, i, p);
    }
}

inline void store_f16_8(float8 v, size_t i, __global half *p) {
    vstore_half8_rte(v, 0, p + i);
    if (any(isnan(v))) {  // rare: patch the NaN lanes to NumPy's bits
        const float w[8] = {v.s0, v.s1, v.s2, v.s3, v.s4, v.s5, v.s6, v.s7};
        for (int k = 0; k < 8; ++k) {
            if (isnan(w[k])) ((__global ushort *)p)[i + k] = f16_nan_bits(w[k]);
        }
    }
}

// Runtime-typed access, for the row kernels (one build serves every pair).
inline float load_any(__global const uchar *base, int dtype, long i) {
    if (dtype == DT_F32) return ((__global const float *)base)[i];
    if (dtype == DT_F16) return load_f16((size_t)i, (__global const half *)base);
    return bf16_to_f32(((__global const ushort *)base)[i]);
}

inline void store_any(__global uchar *base, int dtype, long i, float v) {
    if (dtype == DT_F32) {
        ((__global float *)base)[i] = v;
    } else if (dtype == DT_F16) {
        store_f16(v, (size_t)i, (__global half *)base);
    } else {
        ((__global ushort *)base)[i] = f32_to_bf16(v);
    }
}

// Compile-time-typed access to a state pool, for the stateful kernels: the
// pool dtype is a build option (-DPOOL_DTYPE=n), so the inner loops carry no
// dtype switch.
#ifdef POOL_DTYPE
#if POOL_DTYPE == DT_F32
typedef float pool_t;
#define POOL_LOAD(p, i) ((p)[(i)])
#define POOL_STORE(p, i, v) ((p)[(i)] = (v))
#elif POOL_DTYPE == DT_F16
typedef half pool_t;
#define POOL_LOAD(p, i) load_f16((size_t)(i), (p))
#define POOL_STORE(p, i, v) store_f16((v), (size_t)(i), (p))
#else
typedef ushort pool_t;
#define POOL_LOAD(p, i) bf16_to_f32((p)[(i)])
#define POOL_STORE(p, i, v) ((p)[(i)] = f32_to_bf16(v))
#endif
#endif

// Upstream's softplus threshold: above 20, softplus(z) == z to float precision.
inline float softplus_f(float z) { return z > 20.0f ? z : log1p(exp(z)); }

// Vector access to a state pool, 8 elements at a time (the scan's fast path).
inline ushort8 f32_to_bf16_8(float8 f) {
    const uint8 u = as_uint8(f);
    const uint8 rounded = (u + (uint8)(0x7fffu) + ((u >> 16) & (uint8)(1u))) >> 16;
    const uint8 quiet_nan = ((u >> 16) & (uint8)(0x8000u)) | (uint8)(0x7fc0u);
    return convert_ushort8(select(rounded, quiet_nan, isnan(f)));
}

#ifdef POOL_DTYPE
#if POOL_DTYPE == DT_F32
#define POOL_LOAD8(p, i) vload8(0, (p) + (i))
#define POOL_STORE8(p, i, v) vstore8((v), 0, (p) + (i))
#elif POOL_DTYPE == DT_F16
#define POOL_LOAD8(p, i) load_f16_8((size_t)(i), (p))
#define POOL_STORE8(p, i, v) store_f16_8((v), (size_t)(i), (p))
#else
#define POOL_LOAD8(p, i) as_float8(convert_uint8(vload8(0, (p) + (i))) << 16)
#define POOL_STORE8(p, i, v) vstore8(f32_to_bf16_8(v), 0, (p) + (i))
#endif
#endif

inline float sum8(float8 v) {
    const float4 a = v.lo + v.hi;
    const float2 b = a.lo + a.hi;
    return b.x + b.y;
}

// Eight floats from p, p + stride, ... (a plain vector load when stride == 1).
inline float8 load8_strided(__global const float *p, long stride) {
    if (stride == 1) return vload8(0, p);
    return (float8)(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride], p[5 * stride], p[6 * stride],
                    p[7 * stride]);
}

// Snapshot table of a stateful call (protocol 2): the pool row sequence s
// writes its state after n_t(s) - j tokens to, or -1 (also past the table).
inline long snap_row(__global const int *snap_rows, long snap_off, long n_cols, long s, long j) {
    return j < n_cols ? (long)snap_rows[snap_off + s * n_cols + j] : -1L;
}

inline float silu_f(float v) { return v / (1.0f + exp(-v)); }

// NaN-preserving clamp: the comparisons are false for NaN.
inline float clamp_keep_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }
