// Depthwise causal conv over concat(window, x), with window snapshots.
//
// Protocol 2: packed tokens (sequence s owns tokens cu_seqlens[s] ..
// cu_seqlens[s + 1] - 1) and a snapshot table.  One thread per (sequence,
// channel).  The thread keeps the sliding window (d_conv - 1 values) and the
// channel's weights in registers (arrays indexed only by unrolled constants),
// reads its window from the start row once, and writes the window after
// token t to its row of column n_t - 1 - t when the table has one.  A thread reads its window completely before it writes anything, and
// no other thread touches those pool elements, so a start row that is one of
// the sequence's own destination rows is safe.
#include "common.cuh"

namespace sc {

template <typename T>
SC_HD void conv_write_window(const statecache_cuda_conv_args &a, const float *win, int64_t row, int c) {
    const statecache_cuda_state_args &st = a.state;
    const int W = a.d_conv - 1;
    T *p = (T *)st.pool + row * st.row_size + (int64_t)c * W;
#pragma unroll
    for (int k = 0; k < kMaxDConv - 1; ++k)
        if (k < W) store(p + k, win[k]);
}

template <typename T>
SC_HD void conv_thread(const statecache_cuda_conv_args &a, int s, int c) {
    const statecache_cuda_state_args &st = a.state;
    const int W = a.d_conv - 1;
    const int t0 = st.cu_seqlens[s];
    const int n_t = st.cu_seqlens[s + 1] - t0;
    const T *src = (const T *)st.pool + (int64_t)st.start_rows[s] * st.row_size + (int64_t)c * W;

    // win[k] = ext[t + k] for k < W before token t; w[k] = weight[c, k].
    float win[kMaxDConv];
    float w[kMaxDConv];
#pragma unroll
    for (int k = 0; k < kMaxDConv; ++k) {
        win[k] = k < W ? load(src + k) : 0.0f;
        w[k] = k < a.d_conv ? at(a.weight, c, k) : 0.0f;
    }
    const float bias = a.bias.data ? at(a.bias, c) : 0.0f;
    // The input window, so undoing the whole call is exact.
    const int64_t in_row = snap_row(st, s, n_t);
    if (in_row >= 0) conv_write_window<T>(a, win, in_row, c);

    for (int t = 0; t < n_t; ++t) {
        const int64_t tok = t0 + t;
        const float xt = at(a.x, tok, c);
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxDConv; ++k) {
            if (k < W) acc += win[k] * w[k];
            if (k == W) acc += xt * w[k];
        }
        acc += bias;
        if (a.apply_silu) acc = acc / (1.0f + expf(-acc));
        out_store(a.y, a.y_dtype, tok * a.channels + c, acc);
        // Slide: the window now ends at token t.
#pragma unroll
        for (int k = 0; k < kMaxDConv - 1; ++k)
            if (k < W) win[k] = k + 1 < W ? win[k + 1] : xt;
        const int64_t row = snap_row(st, s, n_t - 1 - t);
        if (row >= 0) conv_write_window<T>(a, win, row, c);
    }
}

template <typename T>
__global__ void ssm_conv_kernel(const statecache_cuda_conv_args a) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= a.channels) return;
    for (int s = blockIdx.y; s < a.state.n_seqs; s += gridDim.y) conv_thread<T>(a, s, c);
}

static int check_conv(const statecache_cuda_conv_args *a) {
    if (a->struct_size != sizeof(statecache_cuda_conv_args)) return STATECACHE_CUDA_EABI;
    if (a->d_conv < 2 || a->d_conv > kMaxDConv || a->channels < 1) return STATECACHE_CUDA_ESHAPE;
    return 0;
}

}  // namespace sc

using namespace sc;

extern "C" int statecache_cuda_ssm_conv(const statecache_cuda_conv_args *args, void *stream_ptr) {
    if (int bad = check_conv(args)) return bad;
    if (args->state.n_seqs <= 0) return 0;
    const int threads = 128;
    const int n_seqs = args->state.n_seqs;
    const dim3 grid((unsigned)((args->channels + threads - 1) / threads), (unsigned)(n_seqs > 65535 ? 65535 : n_seqs));
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T,
                      ssm_conv_kernel<T><<<grid, threads, 0, (cudaStream_t)stream_ptr>>>(*args))
    return launch_status();
}

extern "C" int statecache_cuda_host_ssm_conv(const statecache_cuda_conv_args *args) {
    if (int bad = check_conv(args)) return bad;
    SC_DISPATCH_DTYPE(args->state.pool_dtype, T,
                      for (int s = 0; s < args->state.n_seqs; ++s) for (int c = 0; c < args->channels; ++c)
                          conv_thread<T>(*args, s, c))
    return 0;
}
