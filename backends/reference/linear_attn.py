"""RWKV-6, RWKV-7 and gated linear attention with snapshot rows (packed form).

Every per-token tensor is [T, H, S]; state blocks [H, S, S] (see the
docstrings of :meth:`statecache.backend.Device.rwkv_wkv6` and siblings for
each layout).  Decays and gates arrive in log space.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

State = np.ndarray  # [H, S, S], float64
Step = Callable[[State, int], tuple[State, np.ndarray]]  # (state, token) -> (new state, output [H, S])


def _run(shp, pool, start, snap, cu, o, step: Step) -> None:  # type: ignore[no-untyped-def]
    """Advance every sequence token by token with ``step``, writing outputs
    and snapshot rows.  Every start state is read before anything is written
    (a start row may be one of its own sequence's destinations)."""
    H, S = shp.n_head, shp.head_size
    snap = snap.reshape(shp.n_seqs, shp.n_cols)
    states = pool[start].astype(np.float64).reshape(shp.n_seqs, H, S, S)
    for s in range(shp.n_seqs):
        t0, n_t = int(cu[s]), int(cu[s + 1] - cu[s])
        state = states[s].copy()
        snaps = {n_t: state.copy()} if n_t < shp.n_cols else {}
        for t in range(t0, t0 + n_t):
            state, out = step(state, t)
            o[t] = (shp.scale * out).astype(np.float32).astype(o.dtype)
            j = t0 + n_t - 1 - t
            if j < shp.n_cols:
                snaps[j] = state.copy()
        for j, kept in snaps.items():
            row = int(snap[s, j])
            if row >= 0:
                pool[row] = kept.reshape(-1).astype(np.float32).astype(pool.dtype)


def _f64(a: np.ndarray, t: int) -> np.ndarray:
    return a[t].astype(np.float64)


def rwkv_wkv6(shp, pool, start, snap, cu, r, k, v, w, u, o):  # type: ignore[no-untyped-def]
    bonus = u.astype(np.float64)[:, :, None]  # [H, S (key), 1]

    def step(state: State, t: int) -> tuple[State, np.ndarray]:  # state[h, i key, j value]
        kv = _f64(k, t)[:, :, None] * _f64(v, t)[:, None, :]
        out = np.einsum("hi,hij->hj", _f64(r, t), state + bonus * kv)
        return state * np.exp(_f64(w, t))[:, :, None] + kv, out

    _run(shp, pool, start, snap, cu, o, step)


def rwkv_wkv7(shp, pool, start, snap, cu, r, w, k, v, a, b, o):  # type: ignore[no-untyped-def]
    def step(state: State, t: int) -> tuple[State, np.ndarray]:  # state[h, i value, j key]
        sa = np.einsum("hij,hj->hi", state, _f64(a, t))
        new = (
            state * np.exp(_f64(w, t))[:, None, :]
            + sa[:, :, None] * _f64(b, t)[:, None, :]
            + _f64(v, t)[:, :, None] * _f64(k, t)[:, None, :]
        )
        return new, np.einsum("hij,hj->hi", new, _f64(r, t))

    _run(shp, pool, start, snap, cu, o, step)


def gated_linear_attn(shp, pool, start, snap, cu, q, k, v, g, o):  # type: ignore[no-untyped-def]
    def step(state: State, t: int) -> tuple[State, np.ndarray]:  # state[h, i key, j value]
        new = state * np.exp(_f64(g, t))[:, :, None] + _f64(k, t)[:, :, None] * _f64(v, t)[:, None, :]
        return new, np.einsum("hi,hij->hj", _f64(q, t), new)

    _run(shp, pool, start, snap, cu, o, step)
