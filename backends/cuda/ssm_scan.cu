// Mamba-1 / Mamba-2 selective scan from start rows, with snapshot rows.
//
// Protocol 2: tokens packed (sequence s owns tokens cu_seqlens[s] ..
// cu_seqlens[s + 1] - 1), the state after n_t - j tokens goes to the row in
// column j of the snapshot table (none where it holds -1).  dt_bias and the
// dt clamp are applied before the recurrence, the D skip and the z gate to y.
//
// One thread block per (sequence, head).  The head's state is [head_dim,
// d_state]; its rows (one per head_dim index i) evolve independently, so a
// reduction group of LANES lanes owns one row at a time: lane l holds
// elements k = l + m * LANES (m < NPL) in registers, which makes every load
// and store of the group one coalesced run.  The group streams the row from
// the start row of the pool, runs all tokens, reduces y[i] = sum_k S[i,k] C[k]
// with warp shuffles, and writes the snapshot rows straight into the pool in
// the same pass: decode is bandwidth-bound,
// and reading plus writing the state once is the whole cost.
//
// Read-before-write: each pool element is read and written by one lane only,
// and that lane reads it before writing; other sequences never write this
// sequence's start row (the validator refuses it), so in-place decode and
// rollback from a snapshot plane need no copy.
#include "common.cuh"

namespace sc {

template <typename T, int NPL, int LANES>
SC_HD void scan_write_row(const statecache_cuda_scan_args &a, const float *S, int64_t row, int h, int i, int lane) {
    const statecache_cuda_state_args &st = a.state;
    const int P = a.head_dim, N = a.d_state;
    T *p = (T *)st.pool + row * st.row_size + ((int64_t)h * P + i) * N;
#pragma unroll
    for (int m = 0; m < NPL; ++m) {
        const int k = lane + m * LANES;
        if (k < N) store(p + k, S[m]);
    }
}

// The work of thread `tid` of the block for (s, h); `nthreads` is the block
// size, a multiple of LANES.  Every thread runs the same number of row rounds
// and tokens so that the shuffles in group_sum see the whole warp.
template <typename T, int NPL, int LANES>
SC_HD void scan_block(const statecache_cuda_scan_args &a, int s, int h, int tid, int nthreads) {
    const statecache_cuda_state_args &st = a.state;
    const int P = a.head_dim, N = a.d_state, H = a.n_head;
    const int g = h / (H / a.n_group);  // repeat-interleave of groups over heads
    const int lane = tid % LANES;
    const int group = tid / LANES;
    const int groups = nthreads / LANES;
    const int t0 = st.cu_seqlens[s];
    const int n_t = st.cu_seqlens[s + 1] - t0;
    const int64_t in_row = snap_row(st, s, n_t);  // the input state's row, or -1
    const T *src = (const T *)st.pool + (int64_t)st.start_rows[s] * st.row_size + (int64_t)h * P * N;

    float A_k[NPL];  // Mamba-1: one decay rate per state element
    const float A_h = a.mamba1 ? 0.0f : at(a.A, h);
#pragma unroll
    for (int m = 0; m < NPL; ++m) {
        const int k = lane + m * LANES;
        A_k[m] = (a.mamba1 && k < N) ? at(a.A, h, k) : 0.0f;
    }
    const float dt_bias = a.dt_bias.data ? at(a.dt_bias, h) : 0.0f;

    for (int r0 = 0; r0 < P; r0 += groups) {
        const int i = r0 + group;
        const bool active = i < P;
        float S[NPL];
#pragma unroll
        for (int m = 0; m < NPL; ++m) {
            const int k = lane + m * LANES;
            S[m] = (active && k < N) ? load(src + (int64_t)i * N + k) : 0.0f;
        }
        // The input state, so undoing the whole call is exact.
        if (active && in_row >= 0) scan_write_row<T, NPL, LANES>(a, S, in_row, h, i, lane);

        for (int t = 0; t < n_t; ++t) {
            const int64_t tok = t0 + t;
            float d = softplus(a.dt_bias.data ? at(a.dt, tok, h) + dt_bias : at(a.dt, tok, h));
            if (a.dt_clamp) d = clamp_keep_nan(d, a.dt_lo, a.dt_hi);
            const float xv = active ? at(a.x, tok, h, i) : 0.0f;
            const float xd = xv * d;
            const float decay_h = a.mamba1 ? 0.0f : expf(d * A_h);
            float partial = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int k = lane + m * LANES;
                if (k < N) {
                    const float decay = a.mamba1 ? expf(d * A_k[m]) : decay_h;
                    S[m] = S[m] * decay + at(a.B, tok, g, k) * xd;
                    partial += S[m] * at(a.C, tok, g, k);
                }
            }
            float y = group_sum<LANES>(partial);
            if (active && lane == 0) {
                if (a.D.data) y += at(a.D, h, i) * xv;
                if (a.z.data) y *= silu(at(a.z, tok, h, i));
                out_store(a.y, a.y_dtype, (tok * H + h) * P + i, y);
            }
            const int64_t row = snap_row(st, s, n_t - 1 - t);
            if (active && row >= 0) scan_write_row<T, NPL, LANES>(a, S, row, h, i, lane);
        }
    }
}

template <typename T, int NPL, int LANES>
__global__ void __launch_bounds__(256, 4) ssm_scan_kernel(const statecache_cuda_scan_args a) {
    for (int s = blockIdx.y; s < a.state.n_seqs; s += gridDim.y)
        scan_block<T, NPL, LANES>(a, s, blockIdx.x, threadIdx.x, blockDim.x);
}

static int check_scan(const statecache_cuda_scan_args *a) {
    if (a->struct_size != sizeof(statecache_cuda_scan_args)) return STATECACHE_CUDA_EABI;
    if (a->d_state < 1 || a->d_state > kMaxStateDim || a->head_dim < 1 || a->n_head < 1 || a->n_group < 1 ||
        a->n_head % a->n_group)
        return STATECACHE_CUDA_ESHAPE;
    return 0;
}

template <typename T, int NPL, int LANES>
static void launch_scan(const statecache_cuda_scan_args &a, cudaStream_t stream) {
    // 256 threads when the head has enough rows, fewer (whole warps) otherwise.
    int rows = 256 / LANES;
    if (a.head_dim < rows) rows = a.head_dim;
    int threads = ((rows * LANES + kWarp - 1) / kWarp) * kWarp;
    const int n_seqs = a.state.n_seqs;
    const dim3 grid((unsigned)a.n_head, (unsigned)(n_seqs > 65535 ? 65535 : n_seqs));
    ssm_scan_kernel<T, NPL, LANES><<<grid, threads, 0, stream>>>(a);
}

}  // namespace sc

using namespace sc;

extern "C" int statecache_cuda_ssm_scan(const statecache_cuda_scan_args *args, void *stream_ptr) {
    if (int bad = check_scan(args)) return bad;
    if (args->state.n_seqs <= 0) return 0;
    cudaStream_t stream = (cudaStream_t)stream_ptr;
#define SC_LAUNCH(NPL, LANES) launch_scan<T, NPL, LANES>(*args, stream)
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T, SC_STATE_DIM_SHAPES(args->d_state, SC_LAUNCH))
#undef SC_LAUNCH
    return launch_status();
}

// Host emulation: one lane per group (the reduction is then a plain sum in one
// lane), blocks of 3 groups so the row-round loop and a partial last round
// run as they do on the GPU.
extern "C" int statecache_cuda_host_ssm_scan(const statecache_cuda_scan_args *args) {
    if (int bad = check_scan(args)) return bad;
    const int nthreads = 3;
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T,
                      for (int s = 0; s < args->state.n_seqs; ++s) for (int h = 0; h < args->n_head; ++h)
                          for (int tid = 0; tid < nthreads; ++tid)
                              scan_block<T, kMaxStateDim, 1>(*args, s, h, tid, nthreads))
    return 0;
}
