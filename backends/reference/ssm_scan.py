"""Mamba-1 / Mamba-2 selective scan from start rows, with snapshot rows (packed form)."""

from __future__ import annotations

import numpy as np


def softplus(z: np.ndarray) -> np.ndarray:
    # Upstream's threshold: above 20 softplus(z) == z to float precision.
    return np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))


def silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def ssm_scan(shp, pool, start, snap, cu, x, dt, A, B, C, y, D, z, dt_bias):  # type: ignore[no-untyped-def]
    H, P, N, G = shp.n_head, shp.head_dim, shp.d_state, shp.n_group
    group_of_head = np.arange(H) // (H // G)  # repeat-interleave
    A64 = A.astype(np.float64)
    if shp.variant == "mamba2":
        A64 = np.repeat(A64[:, None], N, axis=1)  # [H, N]
    D64 = None if D is None else D.astype(np.float64).reshape(H, -1)  # [H, 1] or [H, P]
    bias64 = None if dt_bias is None else dt_bias.astype(np.float64)
    snap = snap.reshape(shp.n_seqs, shp.n_cols)
    # Read every start state before writing anything (a start row may be a
    # destination of the same sequence).
    states = pool[start].astype(np.float64).reshape(shp.n_seqs, H, P, N)
    for s in range(shp.n_seqs):
        t0, n_t = int(cu[s]), int(cu[s + 1] - cu[s])
        S = states[s].copy()
        snaps = {n_t: S.copy()} if n_t < shp.n_cols else {}
        for t in range(t0, t0 + n_t):
            zt = dt[t].astype(np.float64)
            if bias64 is not None:
                zt = zt + bias64
            d = softplus(zt)  # [H]
            if shp.dt_limit is not None:
                d = np.clip(d, *shp.dt_limit)  # NaN stays NaN
            Bt = B[t].astype(np.float64)[group_of_head]  # [H, N]
            Ct = C[t].astype(np.float64)[group_of_head]
            xt = x[t].astype(np.float64)  # [H, P]
            decay = np.exp(d[:, None] * A64)  # [H, N]
            S = S * decay[:, None, :] + (xt * d[:, None])[:, :, None] * Bt[:, None, :]
            out = np.einsum("hpn,hn->hp", S, Ct)
            if D64 is not None:
                out = out + D64 * xt
            if z is not None:
                out = out * silu(z[t].astype(np.float64))
            y[t] = out.astype(np.float32).astype(y.dtype)
            j = t0 + n_t - 1 - t
            if j < shp.n_cols:
                snaps[j] = S.copy()
        for j, state in snaps.items():
            row = int(snap[s, j])
            if row >= 0:
                pool[row] = state.reshape(-1).astype(np.float32).astype(pool.dtype)
