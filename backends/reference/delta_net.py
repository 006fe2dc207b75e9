"""Gated delta rule (GDN, and KDA with a per-key gate) with snapshot planes."""

from __future__ import annotations

import numpy as np


def gated_delta_net(shp, pool, start, dst, q, k, v, g, beta, o, scale):  # type: ignore[no-untyped-def]
    n_s, n_t, Hk, Hv, S = shp.n_seqs, shp.n_tokens, shp.n_head_k, shp.n_head_v, shp.head_size
    qk_head = np.arange(Hv) % Hk  # value head h uses q/k head h % H_k (tiling)
    # Storage per head is [j, i] = M[i][j]; work on M[h, i, j].
    states = pool[start].astype(np.float64).reshape(n_s, Hv, S, S).transpose(0, 1, 3, 2)
    for s in range(n_s):
        M = states[s].copy()
        snaps = {}
        if n_t < shp.n_snap:
            snaps[n_t] = M.copy()
        for t in range(n_t):
            qt = q[s, t].astype(np.float64)[qk_head]  # [Hv, S]
            kt = k[s, t].astype(np.float64)[qk_head]
            vt = v[s, t].astype(np.float64)
            gt = g[s, t].astype(np.float64)
            bt = beta[s, t].astype(np.float64)  # [Hv]
            if shp.variant == "kda":
                M = M * np.exp(gt)[:, :, None]
            else:
                M = M * np.exp(gt)[:, None, None]
            delta = (vt - np.einsum("hij,hi->hj", M, kt)) * bt[:, None]
            M = M + kt[:, :, None] * delta[:, None, :]
            o[s, t] = (scale * np.einsum("hij,hi->hj", M, qt)).astype(np.float32)
            j = n_t - 1 - t
            if j < shp.n_snap:
                snaps[j] = M.copy()
        for j, state in snaps.items():
            row = state.transpose(0, 2, 1).reshape(-1)
            pool[int(dst[s]) + j * shp.plane_stride] = row.astype(np.float32).astype(pool.dtype)
