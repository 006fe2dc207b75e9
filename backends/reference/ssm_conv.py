"""Depthwise causal conv over concat(window, x), with window snapshots."""

from __future__ import annotations

import numpy as np


def ssm_conv(shp, pool, start, dst, x, weight, bias, y, apply_silu):  # type: ignore[no-untyped-def]
    n_s, n_t, ch, W = shp.n_seqs, shp.n_tokens, shp.channels, shp.window
    w = weight.astype(np.float64)  # [ch, d_conv]
    # Read every start window before writing anything (a start row may be a
    # destination of the same sequence).
    windows = pool[start].astype(np.float64).reshape(n_s, ch, W)
    for s in range(n_s):
        ext = np.concatenate([windows[s], x[s].astype(np.float64).T], axis=1)  # [ch, W + n_t]
        out = np.empty((n_t, ch), dtype=np.float64)
        for t in range(n_t):
            out[t] = np.sum(ext[:, t : t + shp.d_conv] * w, axis=1)
        if bias is not None:
            out += bias.astype(np.float64)[None, :]
        if apply_silu:
            out = out / (1.0 + np.exp(-out))
        y[s] = out.astype(np.float32)
        for j in range(shp.n_written):
            row = int(dst[s]) + j * shp.plane_stride
            pool[row] = ext[:, n_t - j : n_t - j + W].reshape(-1).astype(np.float32).astype(pool.dtype)
