// RWKV-6, RWKV-7 and gated linear attention (GLA) from start rows, with
// snapshot rows (protocol 2: packed tokens and a snapshot table, see
// ssm_scan.cu).  Decays and gates arrive in log space; every kernel takes exp.
//
// One thread block per (sequence, head), as the scans.
//
// RWKV-6 and GLA store a head as [key i][value j] (j fastest).  Column j
// evolves on its own (S[i][j] = exp(w[i]) S[i][j] + k[i] v[j]) and the output
// o[j] is a sum down it, so threads own columns: RP lanes share a column
// (row part p holds rows i = p + m * RP), and a warp covers 32 / RP
// neighbouring columns with the column fastest, so every load and store of a
// warp is RP runs of 32 / RP consecutive floats; the column sum is a shuffle
// over the row parts.  RWKV-6's bonus (sum_i r[i] u[i] k[i]) v[j] is the same
// shuffle over r * u * k.
//
// RWKV-7 stores a head as [value i][key j] and row i evolves on its own
// (sa = a . S[i]; S[i][j] = S[i][j] exp(w[j]) + sa b[j] + v[i] k[j];
// o[i] = S[i] . r), so a reduction group of LANES lanes owns a row, as in
// delta_net.cu, and lane l holds keys j = l + m * LANES.
//
// Read-before-write as in ssm_scan.cu: each pool element is read and written
// by one lane only, which reads it before writing it.
#include "common.cuh"

namespace sc {

// Inputs by variant (statecache_cuda_linear_attn_args.inputs).
constexpr int kR = 0;                                      // r (RWKV-6, RWKV-7) or q (GLA)
constexpr int kKvK = 1, kKvV = 2, kKvW = 3;                // RWKV-6 / GLA: k, v, w (or g)
constexpr int kW7 = 1, kK7 = 2, kV7 = 3, kA7 = 4, kB7 = 5;  // RWKV-7: w, k, v, a, b

// Sum over the RP row parts of a column: lanes p * (32 / RP) + c of a warp
// (the column c fastest).  Every lane of the warp must call it.  The host
// emulation runs one row part per column, so the sum is the value itself.
template <int RP>
SC_HD float parts_sum(float v) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int offset = kWarp / 2; offset >= kWarp / RP; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
#else
    static_assert(RP == 1, "host emulation runs one row part per column");
    return v;
#endif
}

template <typename T, int NPL, int RP>
SC_HD void kv_write_column(const statecache_cuda_linear_attn_args &a, const float *M, int64_t row, int h, int j,
                           int p) {
    const int S = a.head_size;
    T *col = (T *)a.state.pool + row * a.state.row_size + (int64_t)h * S * S + j;
#pragma unroll
    for (int m = 0; m < NPL; ++m) {
        const int i = p + m * RP;
        if (i < S) store(col + (int64_t)i * S, M[m]);
    }
}

// RWKV-6 (the output reads the state before the token, plus the bonus) and
// GLA (the state after).  The work of thread `tid` of the block for (s, h);
// every thread runs the same column rounds and tokens, so that the shuffles
// see the whole warp.
template <typename T, int NPL, int RP>
SC_HD void kv_block(const statecache_cuda_linear_attn_args &a, int s, int h, int tid, int nthreads) {
    const statecache_cuda_state_args &st = a.state;
    const int S = a.head_size, H = a.n_head;
    const bool gla = a.variant == STATECACHE_CUDA_GLA;
    constexpr int COLS = kWarp / RP;
    const int lane = tid % kWarp;
    const int c = (tid / kWarp) * COLS + lane % COLS;  // the column within a round
    const int p = lane / COLS;                          // the row part
    const int per_round = nthreads / RP;
    const int t0 = st.cu_seqlens[s];
    const int n_t = st.cu_seqlens[s + 1] - t0;
    const int64_t in_row = snap_row(st, s, n_t);
    const T *src = (const T *)st.pool + (int64_t)st.start_rows[s] * st.row_size + (int64_t)h * S * S;
    const statecache_cuda_view &q = a.inputs[kR], &k = a.inputs[kKvK], &v = a.inputs[kKvV], &w = a.inputs[kKvW];

    for (int j0 = 0; j0 < S; j0 += per_round) {
        const int j = j0 + c;
        const bool active = j < S;
        float M[NPL];  // M[m] = S[i = p + m * RP][j]
#pragma unroll
        for (int m = 0; m < NPL; ++m) {
            const int i = p + m * RP;
            M[m] = (active && i < S) ? load(src + (int64_t)i * S + j) : 0.0f;
        }
        if (active && in_row >= 0) kv_write_column<T, NPL, RP>(a, M, in_row, h, j, p);

        for (int t = 0; t < n_t; ++t) {
            const int64_t tok = t0 + t;
            const float vj = active ? at(v, tok, h, j) : 0.0f;
            float part = 0.0f, bonus_part = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int i = p + m * RP;
                if (i < S) {
                    const float ki = at(k, tok, h, i), qi = at(q, tok, h, i);
                    const float x = M[m];
                    const float n = x * expf(at(w, tok, h, i)) + ki * vj;
                    M[m] = n;
                    part += qi * (gla ? n : x);
                    if (!gla) bonus_part += qi * at(a.u, h, i) * ki;
                }
            }
            const float acc = parts_sum<RP>(part);
            const float bonus = gla ? 0.0f : parts_sum<RP>(bonus_part);
            if (active && p == 0) out_store(a.o, a.o_dtype, (tok * H + h) * S + j, a.scale * (acc + bonus * vj));
            const int64_t row = snap_row(st, s, n_t - 1 - t);
            if (active && row >= 0) kv_write_column<T, NPL, RP>(a, M, row, h, j, p);
        }
    }
}

template <typename T, int NPL, int LANES>
SC_HD void wkv7_write_row(const statecache_cuda_linear_attn_args &a, const float *M, int64_t row, int h, int i,
                          int lane) {
    const int S = a.head_size;
    T *r = (T *)a.state.pool + row * a.state.row_size + ((int64_t)h * S + i) * S;
#pragma unroll
    for (int m = 0; m < NPL; ++m) {
        const int j = lane + m * LANES;
        if (j < S) store(r + j, M[m]);
    }
}

template <typename T, int NPL, int LANES>
SC_HD void wkv7_block(const statecache_cuda_linear_attn_args &a, int s, int h, int tid, int nthreads) {
    const statecache_cuda_state_args &st = a.state;
    const int S = a.head_size, H = a.n_head;
    const int lane = tid % LANES;
    const int group = tid / LANES;
    const int groups = nthreads / LANES;
    const int t0 = st.cu_seqlens[s];
    const int n_t = st.cu_seqlens[s + 1] - t0;
    const int64_t in_row = snap_row(st, s, n_t);
    const T *src = (const T *)st.pool + (int64_t)st.start_rows[s] * st.row_size + (int64_t)h * S * S;
    const statecache_cuda_view &r = a.inputs[kR], &w = a.inputs[kW7], &k = a.inputs[kK7], &v = a.inputs[kV7];
    const statecache_cuda_view &va = a.inputs[kA7], &vb = a.inputs[kB7];

    for (int r0 = 0; r0 < S; r0 += groups) {
        const int i = r0 + group;
        const bool active = i < S;
        float M[NPL];  // M[m] = S[i][j = lane + m * LANES]
#pragma unroll
        for (int m = 0; m < NPL; ++m) {
            const int j = lane + m * LANES;
            M[m] = (active && j < S) ? load(src + (int64_t)i * S + j) : 0.0f;
        }
        if (active && in_row >= 0) wkv7_write_row<T, NPL, LANES>(a, M, in_row, h, i, lane);

        for (int t = 0; t < n_t; ++t) {
            const int64_t tok = t0 + t;
            const float vi = active ? at(v, tok, h, i) : 0.0f;
            float sa_part = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int j = lane + m * LANES;
                if (j < S) sa_part += at(va, tok, h, j) * M[m];
            }
            const float sa = group_sum<LANES>(sa_part);  // with the state before this token
            float o_part = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int j = lane + m * LANES;
                if (j < S) {
                    const float n = M[m] * expf(at(w, tok, h, j)) + (sa * at(vb, tok, h, j) + vi * at(k, tok, h, j));
                    M[m] = n;
                    o_part += n * at(r, tok, h, j);
                }
            }
            const float o = a.scale * group_sum<LANES>(o_part);
            if (active && lane == 0) out_store(a.o, a.o_dtype, (tok * H + h) * S + i, o);
            const int64_t row = snap_row(st, s, n_t - 1 - t);
            if (active && row >= 0) wkv7_write_row<T, NPL, LANES>(a, M, row, h, i, lane);
        }
    }
}

template <typename T, int NPL, int RP>
__global__ void __launch_bounds__(128, 4) kv_kernel(const statecache_cuda_linear_attn_args a) {
    for (int s = blockIdx.y; s < a.state.n_seqs; s += gridDim.y)
        kv_block<T, NPL, RP>(a, s, blockIdx.x, threadIdx.x, blockDim.x);
}

template <typename T, int NPL, int LANES>
__global__ void __launch_bounds__(256, 4) wkv7_kernel(const statecache_cuda_linear_attn_args a) {
    for (int s = blockIdx.y; s < a.state.n_seqs; s += gridDim.y)
        wkv7_block<T, NPL, LANES>(a, s, blockIdx.x, threadIdx.x, blockDim.x);
}

static int check_linear_attn(const statecache_cuda_linear_attn_args *a) {
    if (a->struct_size != sizeof(statecache_cuda_linear_attn_args)) return STATECACHE_CUDA_EABI;
    if (a->head_size < 1 || a->head_size > kMaxStateDim || a->n_head < 1) return STATECACHE_CUDA_ESHAPE;
    if (a->variant < STATECACHE_CUDA_RWKV6 || a->variant > STATECACHE_CUDA_GLA) return STATECACHE_CUDA_ESHAPE;
    if (a->variant == STATECACHE_CUDA_RWKV6 && !a->u.data) return STATECACHE_CUDA_ESHAPE;
    return 0;
}

static dim3 linear_attn_grid(const statecache_cuda_linear_attn_args &a) {
    const int n_seqs = a.state.n_seqs;
    return dim3((unsigned)a.n_head, (unsigned)(n_seqs > 65535 ? 65535 : n_seqs));
}

// 128 threads: four warps, 4 * 32 / RP columns per round.
template <typename T, int NPL, int RP>
static void launch_kv(const statecache_cuda_linear_attn_args &a, cudaStream_t stream) {
    kv_kernel<T, NPL, RP><<<linear_attn_grid(a), 128, 0, stream>>>(a);
}

template <typename T, int NPL, int LANES>
static void launch_wkv7(const statecache_cuda_linear_attn_args &a, cudaStream_t stream) {
    int rows = 256 / LANES;
    if (a.head_size < rows) rows = a.head_size;
    const int threads = ((rows * LANES + kWarp - 1) / kWarp) * kWarp;
    wkv7_kernel<T, NPL, LANES><<<linear_attn_grid(a), threads, 0, stream>>>(a);
}

}  // namespace sc

// Rows per lane and row parts per column of the key-major kernels: at most
// 32 state elements per lane, as many lanes per column as that needs.
#define SC_KV_SHAPES(DIM, LAUNCH) \
    do {                          \
        const int dim_ = (DIM);   \
        if (dim_ <= 8) {          \
            LAUNCH(8, 1);         \
        } else if (dim_ <= 16) {  \
            LAUNCH(16, 1);        \
        } else if (dim_ <= 32) {  \
            LAUNCH(32, 1);        \
        } else if (dim_ <= 64) {  \
            LAUNCH(32, 2);        \
        } else if (dim_ <= 128) { \
            LAUNCH(32, 4);        \
        } else {                  \
            LAUNCH(32, 8);        \
        }                         \
    } while (0)

using namespace sc;

extern "C" int statecache_cuda_linear_attn(const statecache_cuda_linear_attn_args *args, void *stream_ptr) {
    if (int bad = check_linear_attn(args)) return bad;
    if (args->state.n_seqs <= 0) return 0;
    cudaStream_t stream = (cudaStream_t)stream_ptr;
    if (args->variant == STATECACHE_CUDA_RWKV7) {
#define SC_LAUNCH(NPL, LANES) launch_wkv7<T, NPL, LANES>(*args, stream)
        SC_DISPATCH_DTYPE(args->state.pool_dtype, T, SC_STATE_DIM_SHAPES(args->head_size, SC_LAUNCH))
#undef SC_LAUNCH
    } else {
#define SC_LAUNCH(NPL, RP) launch_kv<T, NPL, RP>(*args, stream)
        SC_DISPATCH_DTYPE(args->state.pool_dtype, T, SC_KV_SHAPES(args->head_size, SC_LAUNCH))
#undef SC_LAUNCH
    }
    return launch_status();
}

// Host emulation, as for the scans: one lane per row (RWKV-7) or column
// (RWKV-6, GLA), blocks of 3 so the rounds and a partial last round run as on
// the GPU.
extern "C" int statecache_cuda_host_linear_attn(const statecache_cuda_linear_attn_args *args) {
    if (int bad = check_linear_attn(args)) return bad;
    const int nthreads = 3;
    const bool rwkv7 = args->variant == STATECACHE_CUDA_RWKV7;
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T,
                      for (int s = 0; s < args->state.n_seqs; ++s) for (int h = 0; h < args->n_head; ++h)
                          for (int tid = 0; tid < nthreads; ++tid) {
                              if (rwkv7)
                                  wkv7_block<T, kMaxStateDim, 1>(*args, s, h, tid, nthreads);
                              else
                                  kv_block<T, kMaxStateDim, 1>(*args, s, h, tid, nthreads);
                          })
    return 0;
}
