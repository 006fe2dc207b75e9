/* Small dense matrix products for the chunked (block) forms of the scans:
 * a register-blocked AVX2 + FMA kernel over operands that stay in L1/L2.
 *
 * Over a chunk of L tokens a recurrence with a matrix state becomes a few
 * products of [L x d] and [d x d] matrices (d = head size, L <= 64), where
 * every loaded operand feeds many FMAs; token by token each state element
 * costs a load and a store per two or three FMAs, far below the FMA peak.
 *
 * One product: C = A B with A [M][K] (row stride lda), B [K][N] (row stride
 * ldb, N a multiple of 8), C [M][N] (row stride ldc).  The micro-kernel
 * keeps a 6 x 16 tile of C in 12 ymm accumulators, so each k step costs two
 * loads of B and six broadcasts of A for twelve independent FMAs (enough
 * chains to cover the FMA latency on two ports).  Row blocks run in order
 * and each C element is one chain of FMAs over k in order, so the result
 * does not depend on anything but the operands.  Not part of the ABI. */
#ifndef SC_GEMM_H
#define SC_GEMM_H

#include "sc_internal.h"

#ifdef SC_HAVE_AVX2

/* What happens to C before the products are added. */
enum {
    SC_GEMM_SET = 0,    /* C = A B (C is not read) */
    SC_GEMM_SCALE = 1,  /* C = c_scale C + A B (c_scale 1: accumulate) */
    SC_GEMM_ROWS = 2,   /* C = c_rows[i] C + A B (a scale per row of C) */
};

/* Structure of a triangular product: which part is skipped. */
enum {
    SC_GEMM_DENSE = 0,
    /* A is zero right of column i + off in row i: a row block [i0, i1) sums
     * k < min(K, i1 + off) only (the zeros it still reads add exact zeros). */
    SC_GEMM_A_LOWER = 1,
    /* Only C[i][j] with j < i + off are wanted: a row block [i0, i1) computes
     * the column blocks of 8 that start below i1 - 1 + off; the columns past
     * them are left as they were. */
    SC_GEMM_C_LOWER = 2,
    /* B is zero below row j + off in column j: a column block [j0, j1) sums
     * k < min(K, j1 + off) only. */
    SC_GEMM_B_UPPER = 3,
};

static inline __attribute__((always_inline)) void sc_gemm_tile(const int mr, const int nv, int64_t K, const float *A,
                                                               int64_t lda, const float *B, int64_t ldb, float *C,
                                                               int64_t ldc, int mode, float c_scale,
                                                               const float *c_rows) {
    __m256 acc[6][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) {
            if (mode == SC_GEMM_SET) {
                acc[i][j] = _mm256_setzero_ps();
            } else {
                const __m256 c = _mm256_loadu_ps(C + i * ldc + 8 * j);
                const float f = mode == SC_GEMM_ROWS ? c_rows[i] : c_scale;
                acc[i][j] = f == 1.0f ? c : _mm256_mul_ps(_mm256_set1_ps(f), c);
            }
        }
    for (int64_t k = 0; k < K; k++) {
        __m256 b[2];
        for (int j = 0; j < nv; j++) b[j] = _mm256_loadu_ps(B + k * ldb + 8 * j);
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
            for (int j = 0; j < nv; j++) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(C + i * ldc + 8 * j, acc[i][j]);
}

/* k steps of the column block [j, j + w): all K, or (b_off >= 0, SC_GEMM_B_UPPER)
 * those above the block's last row of nonzeros. */
static inline int64_t sc_gemm_ksteps(int64_t K, int64_t j, int64_t w, int64_t b_off) {
    if (b_off == INT64_MIN) return K;
    const int64_t k = j + w + b_off;
    return k < 0 ? 0 : k > K ? K : k;
}

/* One row block of mr rows over columns [0, n) (n % 8 == 0). */
static inline __attribute__((always_inline)) void sc_gemm_rows(const int mr, int64_t n, int64_t K, const float *A,
                                                               int64_t lda, const float *B, int64_t ldb, float *C,
                                                               int64_t ldc, int mode, float c_scale,
                                                               const float *c_rows, int64_t b_off) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        sc_gemm_tile(mr, 2, sc_gemm_ksteps(K, j, 16, b_off), A, lda, B + j, ldb, C + j, ldc, mode, c_scale, c_rows);
    if (j < n)
        sc_gemm_tile(mr, 1, sc_gemm_ksteps(K, j, 8, b_off), A, lda, B + j, ldb, C + j, ldc, mode, c_scale, c_rows);
}

/* C = (mode) + A B over M x N x K, with the triangular structure `tri`
 * (SC_GEMM_*) and its offset.  N % 8 == 0. */
static void sc_gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                    float *C, int64_t ldc, int mode, float c_scale, const float *c_rows, int tri, int64_t off) {
    for (int64_t i0 = 0; i0 < M; i0 += 6) {
        const int mr = M - i0 < 6 ? (int)(M - i0) : 6;
        int64_t kk = K, nn = N;
        if (tri == SC_GEMM_A_LOWER) {
            kk = i0 + mr + off;
            kk = kk < 0 ? 0 : kk > K ? K : kk;
        } else if (tri == SC_GEMM_C_LOWER) {
            nn = (i0 + mr - 1 + off + 7) / 8 * 8;
            nn = nn < 0 ? 0 : nn > N ? N : nn;
        }
        const float *Ai = A + i0 * lda;
        float *Ci = C + i0 * ldc;
        const float *ri = c_rows ? c_rows + i0 : NULL;
        const int64_t bo = tri == SC_GEMM_B_UPPER ? off : INT64_MIN;
        switch (mr) {
        case 6: sc_gemm_rows(6, nn, kk, Ai, lda, B, ldb, Ci, ldc, mode, c_scale, ri, bo); break;
        case 5: sc_gemm_rows(5, nn, kk, Ai, lda, B, ldb, Ci, ldc, mode, c_scale, ri, bo); break;
        case 4: sc_gemm_rows(4, nn, kk, Ai, lda, B, ldb, Ci, ldc, mode, c_scale, ri, bo); break;
        case 3: sc_gemm_rows(3, nn, kk, Ai, lda, B, ldb, Ci, ldc, mode, c_scale, ri, bo); break;
        case 2: sc_gemm_rows(2, nn, kk, Ai, lda, B, ldb, Ci, ldc, mode, c_scale, ri, bo); break;
        default: sc_gemm_rows(1, nn, kk, Ai, lda, B, ldb, Ci, ldc, mode, c_scale, ri, bo); break;
        }
    }
}

/* The decays of a chunk of L tokens with log decays a[0..L): row t of D
 * (row stride ld) holds D[t][u] = exp(a[u+1] + ... + a[t]) for u <= t and
 * zeros up to column round8(L); lam[t] = exp(a[0] + ... + a[t]).  The
 * exponents are running sums (segsum; `seg` is [L] scratch), never
 * differences of cumulative sums, which lose short-range decays to
 * cancellation.  Used by Mamba-2's SSD blocks and the scalar-gate delta rule. */
static void sc_chunk_decays(const float *a, int64_t L, float *seg, float *D, int64_t ld, float *lam) {
    const int64_t Lp = (L + 7) & ~(int64_t)7;
    float total = 0.0f;
    for (int64_t t = 0; t < L; t++) {
        for (int64_t u = 0; u < t; u++) seg[u] += a[t];
        seg[t] = 0.0f;
        total += a[t];
        float *Dt = D + t * ld;
        int64_t u = 0;
        for (; u + 8 <= t + 1; u += 8) _mm256_storeu_ps(Dt + u, sc_exp8(_mm256_loadu_ps(seg + u)));
        for (; u <= t; u++) Dt[u] = sc_exp(seg[u]);
        for (; u < Lp; u++) Dt[u] = 0.0f;
        lam[t] = sc_exp(total);
    }
}

/* One 8 x 8 block: dst[j][i] = src[i][j]. */
static inline void sc_transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* dst [n][m] (row stride ldd) = src [m][n] (row stride lds) transposed. */
static void sc_transpose(const float *src, int64_t lds, float *dst, int64_t ldd, int64_t m, int64_t n) {
    for (int64_t i0 = 0; i0 < m; i0 += 8)
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            if (i0 + 8 <= m && j0 + 8 <= n) {
                sc_transpose8(src + i0 * lds + j0, lds, dst + j0 * ldd + i0, ldd);
                continue;
            }
            const int64_t i1 = i0 + 8 < m ? i0 + 8 : m, j1 = j0 + 8 < n ? j0 + 8 : n;
            for (int64_t j = j0; j < j1; j++)
                for (int64_t i = i0; i < i1; i++) dst[j * ldd + i] = src[i * lds + j];
        }
}

#endif
#endif
