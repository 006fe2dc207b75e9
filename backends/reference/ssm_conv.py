"""Depthwise causal conv over concat(window, x), with window snapshots (packed form)."""

from __future__ import annotations

import numpy as np


def ssm_conv(shp, pool, start, snap, cu, x, weight, bias, y, apply_silu):  # type: ignore[no-untyped-def]
    ch, W = shp.channels, shp.window
    w = weight.astype(np.float64)  # [ch, d_conv]
    snap = snap.reshape(shp.n_seqs, shp.n_cols)
    # Read every start window before writing anything (a start row may be a
    # destination of the same sequence).
    windows = pool[start].astype(np.float64).reshape(shp.n_seqs, ch, W)
    for s in range(shp.n_seqs):
        t0, n_t = int(cu[s]), int(cu[s + 1] - cu[s])
        ext = np.concatenate([windows[s], x[t0 : t0 + n_t].astype(np.float64).T], axis=1)  # [ch, W + n_t]
        out = np.empty((n_t, ch), dtype=np.float64)
        for t in range(n_t):
            out[t] = np.sum(ext[:, t : t + shp.d_conv] * w, axis=1)
        if bias is not None:
            out += bias.astype(np.float64)[None, :]
        if apply_silu:
            out = out / (1.0 + np.exp(-out))
        y[t0 : t0 + n_t] = out.astype(np.float32).astype(y.dtype)
        for j in range(min(n_t + 1, shp.n_cols)):
            row = int(snap[s, j])
            if row >= 0:
                pool[row] = ext[:, n_t - j : n_t - j + W].reshape(-1).astype(np.float32).astype(pool.dtype)
