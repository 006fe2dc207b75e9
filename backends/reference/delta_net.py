"""Gated delta rule (GDN, and KDA with a per-key gate) with snapshot rows (packed form)."""

from __future__ import annotations

import numpy as np

from statecache.backends.reference.ssm_scan import softplus
from statecache.primitives import L2NORM_EPS


def _l2norm(a: np.ndarray) -> np.ndarray:
    return a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + L2NORM_EPS)


def gated_delta_net(shp, pool, start, snap, cu, q, k, v, g, beta, o, A_log, dt_bias):  # type: ignore[no-untyped-def]
    Hv, S = shp.n_head_v, shp.head_size
    qk_head = np.array([shp.qk_head(h) for h in range(Hv)])
    snap = snap.reshape(shp.n_seqs, shp.n_cols)
    # Storage per head is [j, i] = M[i][j]; work on M[h, i, j].
    states = pool[start].astype(np.float64).reshape(shp.n_seqs, Hv, S, S).transpose(0, 1, 3, 2)
    for s in range(shp.n_seqs):
        t0, n_t = int(cu[s]), int(cu[s + 1] - cu[s])
        M = states[s].copy()
        snaps = {n_t: M.copy()} if n_t < shp.n_cols else {}
        for t in range(t0, t0 + n_t):
            qt = q[t].astype(np.float64)[qk_head]  # [Hv, S]
            kt = k[t].astype(np.float64)[qk_head]
            if shp.qk_l2norm:
                qt, kt = _l2norm(qt), _l2norm(kt)
            vt = v[t].astype(np.float64)
            gt = g[t].astype(np.float64)
            if shp.raw_gate:
                a = gt if dt_bias is None else gt + dt_bias.astype(np.float64)
                decay_rate = np.exp(A_log.astype(np.float64))
                gt = -(decay_rate[:, None] if shp.variant == "kda" else decay_rate) * softplus(a)
            bt = beta[t].astype(np.float64)  # [Hv]
            if shp.beta_sigmoid:
                bt = 1.0 / (1.0 + np.exp(-bt))
            if shp.variant == "kda":
                M = M * np.exp(gt)[:, :, None]
            else:
                M = M * np.exp(gt)[:, None, None]
            delta = (vt - np.einsum("hij,hi->hj", M, kt)) * bt[:, None]
            M = M + kt[:, :, None] * delta[:, None, :]
            o[t] = (shp.scale * np.einsum("hij,hi->hj", M, qt)).astype(np.float32).astype(o.dtype)
            j = t0 + n_t - 1 - t
            if j < shp.n_cols:
                snaps[j] = M.copy()
        for j, state in snaps.items():
            row = int(snap[s, j])
            if row >= 0:
                pool[row] = state.transpose(0, 2, 1).reshape(-1).astype(np.float32).astype(pool.dtype)
