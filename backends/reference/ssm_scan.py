"""Mamba-1 / Mamba-2 selective scan from start rows, with snapshot planes."""

from __future__ import annotations

import numpy as np


def softplus(z: np.ndarray) -> np.ndarray:
    # Upstream's threshold: above 20 softplus(z) == z to float precision.
    return np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))


def ssm_scan(shp, pool, start, dst, x, dt, A, B, C, y):  # type: ignore[no-untyped-def]
    n_s, n_t, H, P, N, G = shp.n_seqs, shp.n_tokens, shp.n_head, shp.head_dim, shp.d_state, shp.n_group
    group_of_head = np.arange(H) // (H // G)  # repeat-interleave
    A64 = A.astype(np.float64)
    if shp.variant == "mamba2":
        A64 = np.repeat(A64[:, None], N, axis=1)  # [H, N]
    states = pool[start].astype(np.float64).reshape(n_s, H, P, N)
    for s in range(n_s):
        S = states[s].copy()
        snaps = {}
        if n_t < shp.n_snap:
            snaps[n_t] = S.copy()
        for t in range(n_t):
            d = softplus(dt[s, t].astype(np.float64))  # [H]
            Bt = B[s, t].astype(np.float64)[group_of_head]  # [H, N]
            Ct = C[s, t].astype(np.float64)[group_of_head]
            xt = x[s, t].astype(np.float64)  # [H, P]
            decay = np.exp(d[:, None] * A64)  # [H, N]
            S = S * decay[:, None, :] + (xt * d[:, None])[:, :, None] * Bt[:, None, :]
            y[s, t] = np.einsum("hpn,hn->hp", S, Ct).astype(np.float32)
            j = n_t - 1 - t
            if j < shp.n_snap:
                snaps[j] = S.copy()
        for j, state in snaps.items():
            pool[int(dst[s]) + j * shp.plane_stride] = state.reshape(-1).astype(np.float32).astype(pool.dtype)
