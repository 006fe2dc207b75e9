/* Row primitives: gather, scatter, copy, zero, with f32/f16/bf16 storage.
 *
 * Work is cut into chunks of at most SC_ROW_CHUNK bytes of destination so
 * that two threads share even a single large row; chunks are split over
 * threads contiguously.  Row ops are pure data movement, so the result does
 * not depend on the split. */
#include "sc_internal.h"

#define SC_ROW_CHUNK_ELEMS ((int64_t)16384)
/* Below this many bytes a second thread costs more than it saves. */
#define SC_PARALLEL_MIN_BYTES ((int64_t)1 << 17)

int sc_cpu_abi_version(void) { return SC_CPU_ABI_VERSION; }

#ifndef SC_BUILD_ISA
#define SC_BUILD_ISA "default"
#endif

const char *sc_cpu_isa(void) { return SC_BUILD_ISA; }

/* Compiled for the baseline so that it can run before we know the CPU has
 * the features the rest of the library was compiled for. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("arch=x86-64")))
#endif
int sc_cpu_isa_supported(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
#if defined(__AVX2__)
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
#endif
#if defined(__F16C__)
    if (!__builtin_cpu_supports("f16c")) return 0;
#endif
#if defined(__SSE4_2__)
    if (!__builtin_cpu_supports("sse4.2")) return 0;
#endif
#endif
    return 1;
}

int64_t sc_state_parallel_min_bytes = SC_STATE_PARALLEL_MIN_BYTES;
int64_t sc_stream_min_bytes = SC_STREAM_MIN_BYTES;

int64_t sc_set_stream_min_bytes(int64_t bytes) {
    const int64_t previous = sc_stream_min_bytes;
    sc_stream_min_bytes = bytes < 0 ? 0 : bytes;
    return previous;
}

int64_t sc_set_state_parallel_min_bytes(int64_t bytes) {
    const int64_t previous = sc_state_parallel_min_bytes;
    sc_state_parallel_min_bytes = bytes < 0 ? 0 : bytes;
    return previous;
}

int sc_cpu_has_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void sc_convert(const void *src, sc_dtype src_dtype, void *dst, sc_dtype dst_dtype, int64_t n) {
    if (src_dtype == dst_dtype) {
        memcpy(dst, src, (size_t)n * sc_dtype_size(src_dtype));
        return;
    }
    float tmp[1024];
    size_t ss = sc_dtype_size(src_dtype), ds = sc_dtype_size(dst_dtype);
    for (int64_t i = 0; i < n; i += 1024) {
        int64_t m = n - i < 1024 ? n - i : 1024;
        const char *s = (const char *)src + (size_t)i * ss;
        char *d = (char *)dst + (size_t)i * ds;
        if (src_dtype == SC_F32) {
            sc_store_f32((const float *)s, d, dst_dtype, m);
        } else if (dst_dtype == SC_F32) {
            sc_load_f32(s, src_dtype, (float *)d, m);
        } else {
            sc_load_f32(s, src_dtype, tmp, m);
            sc_store_f32(tmp, d, dst_dtype, m);
        }
    }
}

static int team_for(int64_t bytes, int n_threads) {
    if (n_threads < 1) return 1;
    return bytes < SC_PARALLEL_MIN_BYTES ? 1 : n_threads;
}

/* The row calls run their bodies through sc_team_run, so that a call below
 * SC_PARALLEL_MIN_BYTES (a decode step's rows) runs on the calling thread:
 * an OpenMP region of one thread (`if (team > 1)`) still builds and ends a
 * team, about 0.3 us of a gather that moves a few hundred bytes. */
typedef struct {
    const void *src;
    sc_dtype src_dtype;
    const int32_t *src_rows;
    void *dst;
    sc_dtype dst_dtype;
    const int32_t *dst_rows;
    int64_t n, row_elems;
} copy_rows_job;

static void copy_rows_thread(void *arg, int tid, int nt) {
    const copy_rows_job *j = (const copy_rows_job *)arg;
    const int64_t row_elems = j->row_elems;
    const int64_t chunks_per_row = (row_elems + SC_ROW_CHUNK_ELEMS - 1) / SC_ROW_CHUNK_ELEMS;
    const size_t ss = sc_dtype_size(j->src_dtype), ds = sc_dtype_size(j->dst_dtype);
    int64_t lo, hi;
    sc_split(j->n * chunks_per_row, tid, nt, &lo, &hi);
    for (int64_t c = lo; c < hi; c++) {
        int64_t i = c / chunks_per_row, e0 = (c % chunks_per_row) * SC_ROW_CHUNK_ELEMS;
        int64_t m = row_elems - e0 < SC_ROW_CHUNK_ELEMS ? row_elems - e0 : SC_ROW_CHUNK_ELEMS;
        int64_t rs = j->src_rows ? j->src_rows[i] : i, rd = j->dst_rows ? j->dst_rows[i] : i;
        const char *s = (const char *)j->src + ((size_t)rs * (size_t)row_elems + (size_t)e0) * ss;
        char *d = (char *)j->dst + ((size_t)rd * (size_t)row_elems + (size_t)e0) * ds;
        sc_convert(s, j->src_dtype, d, j->dst_dtype, m);
    }
}

void sc_copy_rows(const void *src, sc_dtype src_dtype, const int32_t *src_rows, void *dst, sc_dtype dst_dtype,
                  const int32_t *dst_rows, int64_t n, int64_t row_elems, int n_threads) {
    const size_t ss = sc_dtype_size(src_dtype), ds = sc_dtype_size(dst_dtype);
    copy_rows_job job = {src, src_dtype, src_rows, dst, dst_dtype, dst_rows, n, row_elems};
    sc_team_run(team_for(n * row_elems * (int64_t)(ss + ds), n_threads), copy_rows_thread, &job);
}

typedef struct {
    void *dst;
    sc_dtype dtype;
    const int32_t *rows;
    int64_t n, row_elems;
} zero_rows_job;

static void zero_rows_thread(void *arg, int tid, int nt) {
    const zero_rows_job *j = (const zero_rows_job *)arg;
    const int64_t row_elems = j->row_elems;
    const size_t es = sc_dtype_size(j->dtype);
    const int64_t chunks_per_row = (row_elems + SC_ROW_CHUNK_ELEMS - 1) / SC_ROW_CHUNK_ELEMS;
    int64_t lo, hi;
    sc_split(j->n * chunks_per_row, tid, nt, &lo, &hi);
    for (int64_t c = lo; c < hi; c++) {
        int64_t i = c / chunks_per_row, e0 = (c % chunks_per_row) * SC_ROW_CHUNK_ELEMS;
        int64_t m = row_elems - e0 < SC_ROW_CHUNK_ELEMS ? row_elems - e0 : SC_ROW_CHUNK_ELEMS;
        memset((char *)j->dst + ((size_t)j->rows[i] * (size_t)row_elems + (size_t)e0) * es, 0, (size_t)m * es);
    }
}

void sc_zero_rows(void *dst, sc_dtype dtype, const int32_t *rows, int64_t n, int64_t row_elems, int n_threads) {
    /* Duplicate rows are allowed: two threads may zero the same bytes, and
     * both write zeros, so the result is still defined. */
    zero_rows_job job = {dst, dtype, rows, n, row_elems};
    sc_team_run(team_for(n * row_elems * (int64_t)sc_dtype_size(dtype), n_threads), zero_rows_thread, &job);
}

typedef struct {
    void *dst;
    const void *src;
    int64_t nbytes;
} memcpy_job;

static void memcpy_thread(void *arg, int tid, int nt) {
    const memcpy_job *j = (const memcpy_job *)arg;
    /* Split on 64-byte boundaries so no two threads share a cache line. */
    int64_t lines = (j->nbytes + 63) / 64, lo, hi;
    sc_split(lines, tid, nt, &lo, &hi);
    int64_t b0 = lo * 64, b1 = hi * 64 < j->nbytes ? hi * 64 : j->nbytes;
    if (b1 > b0) memcpy((char *)j->dst + b0, (const char *)j->src + b0, (size_t)(b1 - b0));
}

void sc_memcpy(void *dst, const void *src, int64_t nbytes, int n_threads) {
    memcpy_job job = {dst, src, nbytes};
    sc_team_run(team_for(nbytes, n_threads), memcpy_thread, &job);
}
