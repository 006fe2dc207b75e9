// Gated delta rule (GDN; per-key gate = KDA) from start rows, with snapshots.
//
// Same structure as ssm_scan.cu: one thread block per (sequence, value head).
// A head's state block is stored [j, i] (value index j, key index i fastest),
// and column M[:, j] evolves independently of the others, so a reduction
// group owns one stored row j: lane l holds keys i = l + m * LANES.  Per token
// the group computes M^T k and then M^T q with two warp reductions, and writes
// the destination row and kept snapshot planes straight into the pool.  The
// read-before-write argument of ssm_scan.cu holds unchanged.
#include "common.cuh"

namespace sc {

template <typename T, int NPL, int LANES>
SC_HD void delta_write_row(const statecache_cuda_delta_args &a, const float *M, int s, int h, int j, int lane,
                           int plane) {
    const statecache_cuda_state_args &st = a.state;
    const int S = a.head_size;
    const int64_t row = (int64_t)st.dst_rows[s] + (int64_t)plane * st.plane_stride;
    T *p = (T *)st.pool + row * st.row_size + ((int64_t)h * S + j) * S;
#pragma unroll
    for (int m = 0; m < NPL; ++m) {
        const int i = lane + m * LANES;
        if (i < S) store(p + i, M[m]);
    }
}

template <typename T, int NPL, int LANES>
SC_HD void delta_block(const statecache_cuda_delta_args &a, int s, int h, int tid, int nthreads) {
    const statecache_cuda_state_args &st = a.state;
    const int S = a.head_size, Hv = a.n_head_v;
    const int kh = h % a.n_head_k;  // value head h uses q/k head h % H_k (tiling)
    const int lane = tid % LANES;
    const int group = tid / LANES;
    const int groups = nthreads / LANES;
    const int n_t = st.n_tokens;
    const int n_written = n_t + 1 < st.n_snap ? n_t + 1 : st.n_snap;
    const T *src = (const T *)st.pool + (int64_t)st.start_rows[s] * st.row_size + (int64_t)h * S * S;

    for (int r0 = 0; r0 < S; r0 += groups) {
        const int j = r0 + group;
        const bool active = j < S;
        float M[NPL];  // M[m] = M[i = lane + m * LANES][j]
#pragma unroll
        for (int m = 0; m < NPL; ++m) {
            const int i = lane + m * LANES;
            M[m] = (active && i < S) ? load(src + (int64_t)j * S + i) : 0.0f;
        }
        if (active && n_t < n_written) delta_write_row<T, NPL, LANES>(a, M, s, h, j, lane, n_t);

        for (int t = 0; t < n_t; ++t) {
            const float beta = at(a.beta, s, t, h);
            const float vj = active ? at(a.v, s, t, h, j) : 0.0f;
            const float decay_h = a.kda ? 0.0f : expf(at(a.g, s, t, h));
            float kk[NPL], qq[NPL];
            float kv = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int i = lane + m * LANES;
                kk[m] = 0.0f;
                qq[m] = 0.0f;
                if (i < S) {
                    M[m] *= a.kda ? expf(at(a.g, s, t, h, i)) : decay_h;
                    kk[m] = at(a.k, s, t, kh, i);
                    qq[m] = at(a.q, s, t, kh, i);
                    kv += M[m] * kk[m];
                }
            }
            const float delta = (vj - group_sum<LANES>(kv)) * beta;
            float oq = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                M[m] += kk[m] * delta;
                oq += M[m] * qq[m];
            }
            const float o = a.scale * group_sum<LANES>(oq);
            if (active && lane == 0) a.o[(((int64_t)s * n_t + t) * Hv + h) * S + j] = o;
            const int plane = n_t - 1 - t;
            if (active && plane < n_written) delta_write_row<T, NPL, LANES>(a, M, s, h, j, lane, plane);
        }
    }
}

template <typename T, int NPL, int LANES>
__global__ void __launch_bounds__(256, 4) delta_kernel(const statecache_cuda_delta_args a) {
    for (int s = blockIdx.y; s < a.state.n_seqs; s += gridDim.y)
        delta_block<T, NPL, LANES>(a, s, blockIdx.x, threadIdx.x, blockDim.x);
}

static int check_delta(const statecache_cuda_delta_args *a) {
    if (a->struct_size != sizeof(statecache_cuda_delta_args)) return STATECACHE_CUDA_EABI;
    if (a->head_size < 1 || a->head_size > kMaxStateDim || a->n_head_k < 1 || a->n_head_v < 1 ||
        a->n_head_v % a->n_head_k)
        return STATECACHE_CUDA_ESHAPE;
    return 0;
}

template <typename T, int NPL, int LANES>
static void launch_delta(const statecache_cuda_delta_args &a, cudaStream_t stream) {
    int rows = 256 / LANES;
    if (a.head_size < rows) rows = a.head_size;
    const int threads = ((rows * LANES + kWarp - 1) / kWarp) * kWarp;
    const int n_seqs = a.state.n_seqs;
    const dim3 grid((unsigned)a.n_head_v, (unsigned)(n_seqs > 65535 ? 65535 : n_seqs));
    delta_kernel<T, NPL, LANES><<<grid, threads, 0, stream>>>(a);
}

}  // namespace sc

using namespace sc;

extern "C" int statecache_cuda_gated_delta_net(const statecache_cuda_delta_args *args, void *stream_ptr) {
    if (int bad = check_delta(args)) return bad;
    if (args->state.n_seqs <= 0 || args->state.n_tokens <= 0) return 0;
    cudaStream_t stream = (cudaStream_t)stream_ptr;
#define SC_LAUNCH(NPL, LANES) launch_delta<T, NPL, LANES>(*args, stream)
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T, SC_STATE_DIM_SHAPES(args->head_size, SC_LAUNCH))
#undef SC_LAUNCH
    return launch_status();
}

// Host emulation, as for ssm_scan: one lane per group, blocks of 3 groups.
extern "C" int statecache_cuda_host_gated_delta_net(const statecache_cuda_delta_args *args) {
    if (int bad = check_delta(args)) return bad;
    const int nthreads = 3;
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T,
                      for (int s = 0; s < args->state.n_seqs; ++s) for (int h = 0; h < args->n_head_v; ++h)
                          for (int tid = 0; tid < nthreads; ++tid)
                              delta_block<T, kMaxStateDim, 1>(*args, s, h, tid, nthreads))
    return 0;
}
