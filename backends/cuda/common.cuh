// Shared by every kernel file: storage conversions, view indexing, the warp
// reduction, and the host-emulation switch.
//
// Every kernel body is a __host__ __device__ function so that the exact same
// index math also runs on the CPU (statecache_cuda_host_* entry points), one
// emulated thread at a time with one lane per reduction group.  That lets a
// GPU-less machine test the indexing, strides, snapshot mapping and dtype
// conversions of the code the GPU runs.
#ifndef STATECACHE_CUDA_COMMON_CUH
#define STATECACHE_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "statecache_cuda.h"

#define SC_HD __host__ __device__ __forceinline__

namespace sc {

// Largest d_state / head_size: lanes * elements-per-lane = 32 * 8.
constexpr int kMaxStateDim = 256;
constexpr int kMaxDConv = 16;
constexpr int kWarp = 32;

// -- storage types ---------------------------------------------------------
// Conversions are written on bit patterns (not CUDA intrinsics) so host and
// device round identically, and identically to NumPy / ml_dtypes, which the
// reference backend uses: round to nearest even, NaN payload rules included.
struct f16 {
    uint16_t bits;
};
struct bf16 {
    uint16_t bits;
};

SC_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

SC_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

SC_HD float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        // Subnormal (or zero): man * 2^-24, exact in float32.
        const float mag = (float)man * 5.9604644775390625e-8f;
        return bits_float(float_bits(mag) | sign);
    }
    if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN, payload kept
    return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

SC_HD uint16_t float_to_f16(float f) {
    const uint32_t u = float_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t exp = (u >> 23) & 0xffu;
    const uint32_t man = u & 0x7fffffu;
    if (exp == 255) {
        if (man == 0) return sign | 0x7c00u;
        // NaN: keep the top payload bits as NumPy does, never turn into inf.
        uint16_t r = (uint16_t)(0x7c00u | (man >> 13));
        return sign | (r == 0x7c00u ? (uint16_t)0x7c01u : r);
    }
    if (exp >= 143) return sign | 0x7c00u;  // |f| >= 2^16: overflow to inf
    if (exp >= 113) {
        // Normal half: rebias, round the 13 dropped bits to nearest even; a
        // carry runs into the exponent (and up to inf), which is correct.
        uint32_t h = ((exp - 112u) << 10) | (man >> 13);
        const uint32_t rem = man & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;
        return sign | (uint16_t)h;
    }
    // Subnormal half: value in units of 2^-24 is (1.man) * 2^(exp - 126).
    const uint32_t shift = 126u - exp;  // >= 14 here
    if (shift > 24) return sign;        // below half the smallest subnormal
    const uint32_t full = man | 0x800000u;
    uint32_t q = full >> shift;
    const uint32_t rem = full & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q += 1;
    return sign | (uint16_t)q;
}

SC_HD float bf16_to_float(uint16_t b) { return bits_float((uint32_t)b << 16); }

SC_HD uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);  // ml_dtypes' NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

SC_HD float load(const float *p) { return *p; }
SC_HD float load(const f16 *p) { return f16_to_float(p->bits); }
SC_HD float load(const bf16 *p) { return bf16_to_float(p->bits); }
SC_HD void store(float *p, float v) { *p = v; }
SC_HD void store(f16 *p, float v) { p->bits = float_to_f16(v); }
SC_HD void store(bf16 *p, float v) { p->bits = float_to_bf16(v); }

// -- views -------------------------------------------------------------------
// Element `off` of a view, widened to float32 from the view's dtype (the
// branch is uniform across a warp: one view, one dtype).
SC_HD float view_load(const statecache_cuda_view &v, int64_t off) {
    switch (v.dtype) {
        case STATECACHE_CUDA_F16:
            return f16_to_float(((const uint16_t *)v.data)[off]);
        case STATECACHE_CUDA_BF16:
            return bf16_to_float(((const uint16_t *)v.data)[off]);
        default:
            return v.data[off];
    }
}
SC_HD float at(const statecache_cuda_view &v, int64_t i0) { return view_load(v, i0 * v.strides[0]); }
SC_HD float at(const statecache_cuda_view &v, int64_t i0, int64_t i1) {
    return view_load(v, i0 * v.strides[0] + i1 * v.strides[1]);
}
SC_HD float at(const statecache_cuda_view &v, int64_t i0, int64_t i1, int64_t i2) {
    return view_load(v, i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2]);
}
SC_HD float at(const statecache_cuda_view &v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return view_load(v, i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2] + i3 * v.strides[3]);
}

// Element `off` of a contiguous output of dtype code `dtype` (y, o).
SC_HD void out_store(void *out, int32_t dtype, int64_t off, float v) {
    switch (dtype) {
        case STATECACHE_CUDA_F16:
            ((uint16_t *)out)[off] = float_to_f16(v);
            break;
        case STATECACHE_CUDA_BF16:
            ((uint16_t *)out)[off] = float_to_bf16(v);
            break;
        default:
            ((float *)out)[off] = v;
    }
}

// -- rows of a stateful call ---------------------------------------------------
// The row sequence s writes its state after n_t(s) - j tokens to, or -1.
SC_HD int64_t snap_row(const statecache_cuda_state_args &st, int s, int j) {
    return j < st.n_cols ? (int64_t)st.snap_rows[(int64_t)s * st.n_cols + j] : -1;
}

// -- math --------------------------------------------------------------------
SC_HD float softplus(float z) { return z > 20.0f ? z : log1pf(expf(z)); }
SC_HD float silu(float z) { return z / (1.0f + expf(-z)); }
// NaN-preserving clamp (the comparisons are false for NaN).
SC_HD float clamp_keep_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Sum over the `lanes` consecutive lanes of a reduction group (a power of two
// <= 32, aligned within the warp).  Every lane of the warp must call it (the
// kernels keep loop trip counts uniform across a warp).  On the host the
// emulation runs one lane per group, so the sum is the value itself.
template <int LANES>
SC_HD float group_sum(float v) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
#else
    static_assert(LANES == 1, "host emulation runs one lane per reduction group");
    return v;
#endif
}

inline int launch_status() { return (int)cudaGetLastError(); }

}  // namespace sc

// Entry points dispatch a storage-dtype code to a template instantiation.
#define SC_DISPATCH_DTYPE(code, T, ...)           \
    switch (code) {                               \
        case STATECACHE_CUDA_F32: {               \
            typedef float T;                      \
            __VA_ARGS__;                          \
            break;                                \
        }                                         \
        case STATECACHE_CUDA_F16: {               \
            typedef sc::f16 T;                    \
            __VA_ARGS__;                          \
            break;                                \
        }                                         \
        case STATECACHE_CUDA_BF16: {              \
            typedef sc::bf16 T;                   \
            __VA_ARGS__;                          \
            break;                                \
        }                                         \
        default:                                  \
            return STATECACHE_CUDA_EDTYPE;        \
    }

// Lane count and elements per lane from d_state (or head_size), as template
// arguments.  Groups have at least 8 lanes so that a small d_state (Mamba-1's
// 16) does not multiply the instantiations.
#define SC_STATE_DIM_SHAPES(DIM, LAUNCH)                  \
    do {                                             \
        const int dim_ = (DIM);                      \
        if (dim_ <= 8) {                             \
            LAUNCH(1, 8);                            \
        } else if (dim_ <= 16) {                     \
            LAUNCH(1, 16);                           \
        } else if (dim_ <= 32) {                     \
            LAUNCH(1, 32);                           \
        } else if (dim_ <= 64) {                     \
            LAUNCH(2, 32);                           \
        } else if (dim_ <= 128) {                    \
            LAUNCH(4, 32);                           \
        } else {                                     \
            LAUNCH(8, 32);                           \
        }                                            \
    } while (0)

#endif  // STATECACHE_CUDA_COMMON_CUH
