// Gated delta rule (GDN; per-key gate = KDA) from start rows, with snapshot rows
// (protocol 2: packed tokens and a snapshot table, see ssm_scan.cu).
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
SC_HD void delta_write_row(const statecache_cuda_delta_args &a, const float *M, int64_t row, int h, int j, int lane) {
    const statecache_cuda_state_args &st = a.state;
    const int S = a.head_size;
    T *p = (T *)st.pool + row * st.row_size + ((int64_t)h * S + j) * S;
#pragma unroll
    for (int m = 0; m < NPL; ++m) {
        const int i = lane + m * LANES;
        if (i < S) store(p + i, M[m]);
    }
}

// exp of the log-decay: g itself, or from the raw projection a (A_log given):
// -exp(A_log[h]) * softplus(a + dt_bias).
SC_HD float delta_decay(const statecache_cuda_delta_args &a, float g, float rate, float bias) {
    return expf(a.A_log.data ? rate * softplus(g + bias) : g);
}

template <typename T, int NPL, int LANES>
SC_HD void delta_block(const statecache_cuda_delta_args &a, int s, int h, int tid, int nthreads) {
    const statecache_cuda_state_args &st = a.state;
    const int S = a.head_size, Hv = a.n_head_v;
    const int kh = a.grouped ? h / (Hv / a.n_head_k) : h % a.n_head_k;  // the q/k head of value head h
    const int lane = tid % LANES;
    const int group = tid / LANES;
    const int groups = nthreads / LANES;
    const int t0 = st.cu_seqlens[s];
    const int n_t = st.cu_seqlens[s + 1] - t0;
    const int64_t in_row = snap_row(st, s, n_t);
    const T *src = (const T *)st.pool + (int64_t)st.start_rows[s] * st.row_size + (int64_t)h * S * S;
    const float rate = a.A_log.data ? -expf(at(a.A_log, h)) : 0.0f;

    for (int r0 = 0; r0 < S; r0 += groups) {
        const int j = r0 + group;
        const bool active = j < S;
        float M[NPL];  // M[m] = M[i = lane + m * LANES][j]
#pragma unroll
        for (int m = 0; m < NPL; ++m) {
            const int i = lane + m * LANES;
            M[m] = (active && i < S) ? load(src + (int64_t)j * S + i) : 0.0f;
        }
        if (active && in_row >= 0) delta_write_row<T, NPL, LANES>(a, M, in_row, h, j, lane);

        for (int t = 0; t < n_t; ++t) {
            const int64_t tok = t0 + t;
            float beta = at(a.beta, tok, h);
            if (a.beta_sigmoid) beta = 1.0f / (1.0f + expf(-beta));
            const float vj = active ? at(a.v, tok, h, j) : 0.0f;
            const float decay_h =
                a.kda ? 0.0f : delta_decay(a, at(a.g, tok, h), rate, a.dt_bias.data ? at(a.dt_bias, h) : 0.0f);
            float kk[NPL], qq[NPL];
            float ksq = 0.0f, qsq = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int i = lane + m * LANES;
                kk[m] = i < S ? at(a.k, tok, kh, i) : 0.0f;
                qq[m] = i < S ? at(a.q, tok, kh, i) : 0.0f;
                ksq += kk[m] * kk[m];
                qsq += qq[m] * qq[m];
            }
            if (a.qk_l2norm) {
                const float kinv = 1.0f / sqrtf(group_sum<LANES>(ksq) + a.l2norm_eps);
                const float qinv = 1.0f / sqrtf(group_sum<LANES>(qsq) + a.l2norm_eps);
#pragma unroll
                for (int m = 0; m < NPL; ++m) {
                    kk[m] *= kinv;
                    qq[m] *= qinv;
                }
            }
            float kv = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; ++m) {
                const int i = lane + m * LANES;
                if (i < S) {
                    M[m] *= a.kda ? delta_decay(a, at(a.g, tok, h, i), rate,
                                                a.dt_bias.data ? at(a.dt_bias, h, i) : 0.0f)
                                  : decay_h;
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
            if (active && lane == 0) out_store(a.o, a.o_dtype, (tok * Hv + h) * S + j, o);
            const int64_t row = snap_row(st, s, n_t - 1 - t);
            if (active && row >= 0) delta_write_row<T, NPL, LANES>(a, M, row, h, j, lane);
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
    if (args->state.n_seqs <= 0) return 0;
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
