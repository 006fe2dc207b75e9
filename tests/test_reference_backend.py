"""The reference backend against naive per-element loops written here.

These loops are written independently of backends/reference (scalar Python,
float64, straight from the math in llama-memory-spec.md §7), so a mistake in
the vectorised reference shows up as a mismatch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from statecache import ArgumentError, DType


def softplus(z: float) -> float:
    return z if z > 20.0 else math.log1p(math.exp(z))


def naive_scan(state0, x, dt, A, B, C, n_snap):
    """state0 [n_s, H, P, N]; returns y [n_s, n_t, H, P] and snapshots {(s, j): state}."""
    n_s, n_t, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    y = np.zeros(x.shape)
    snaps = {}
    for s in range(n_s):
        S = state0[s].astype(np.float64).copy()
        if n_t < n_snap:
            snaps[(s, n_t)] = S.copy()
        for t in range(n_t):
            for h in range(H):
                g = h // (H // G)
                d = softplus(float(dt[s, t, h]))
                for i in range(P):
                    acc = 0.0
                    for k in range(N):
                        a = A[h] if A.ndim == 1 else A[h, k]
                        S[h, i, k] = S[h, i, k] * math.exp(d * a) + B[s, t, g, k] * x[s, t, h, i] * d
                        acc += S[h, i, k] * C[s, t, g, k]
                    y[s, t, h, i] = acc
            j = n_t - 1 - t
            if j < n_snap:
                snaps[(s, j)] = S.copy()
    return y, snaps


def naive_delta(state0, q, k, v, g, beta, n_snap, scale):
    """state0 [n_s, Hv, S(j), S(i)] storage layout; returns o and snapshots in storage layout."""
    n_s, n_t, Hv, S = v.shape
    Hk = q.shape[2]
    o = np.zeros(v.shape)
    snaps = {}
    for s in range(n_s):
        M = np.zeros((Hv, S, S))  # M[h, i, j]
        for h in range(Hv):
            for i in range(S):
                for j in range(S):
                    M[h, i, j] = state0[s, h, j, i]
        if n_t < n_snap:
            snaps[(s, n_t)] = M.transpose(0, 2, 1).copy()
        for t in range(n_t):
            for h in range(Hv):
                hk = h % Hk
                for i in range(S):
                    gate = g[s, t, h, i] if g.ndim == 4 else g[s, t, h]
                    for j in range(S):
                        M[h, i, j] *= math.exp(gate)
                delta = [0.0] * S
                for j in range(S):
                    dot = sum(M[h, i, j] * k[s, t, hk, i] for i in range(S))
                    delta[j] = (v[s, t, h, j] - dot) * beta[s, t, h]
                for i in range(S):
                    for j in range(S):
                        M[h, i, j] += k[s, t, hk, i] * delta[j]
                for j in range(S):
                    o[s, t, h, j] = scale * sum(M[h, i, j] * q[s, t, hk, i] for i in range(S))
            jj = n_t - 1 - t
            if jj < n_snap:
                snaps[(s, jj)] = M.transpose(0, 2, 1).copy()
    return o, snaps


def f32(rng, *shape, lo=-1.0, hi=1.0):
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "variant,n_head,head_dim,d_state,n_group,n_t,n_snap",
    [
        ("mamba1", 6, 1, 4, 1, 5, 1),
        ("mamba2", 4, 3, 5, 2, 5, 1),
        ("mamba2", 4, 3, 5, 2, 5, 3),  # n_t > K
        ("mamba2", 4, 2, 3, 4, 2, 4),  # n_t < K: the input state lands in plane n_t
        ("mamba2", 6, 2, 3, 3, 1, 3),  # decode
    ],
)
def test_ssm_scan_matches_naive_loops(ref_device, rng, variant, n_head, head_dim, d_state, n_group, n_t, n_snap):
    dev = ref_device
    n_s, size = 3, 6
    row = n_head * head_dim * d_state
    pool_np = f32(rng, size * n_snap, row)
    pool = dev.upload(pool_np)
    x = f32(rng, n_s, n_t, n_head, head_dim)
    dt = f32(rng, n_s, n_t, n_head, lo=-3, hi=3)
    dt[0, 0, 0] = 25.0  # softplus threshold branch
    A = -np.abs(f32(rng, n_head)) if variant == "mamba2" else -np.abs(f32(rng, n_head, d_state))
    B = f32(rng, n_s, n_t, n_group, d_state)
    C = f32(rng, n_s, n_t, n_group, d_state)
    # Permuted start rows, one of them the sequence's own destination (in place)
    # and, when planes exist, one read from plane 1.
    start = np.array([2 + (size if n_snap > 1 else 0), 0, 5])
    dst = np.array([3, 4, 5])
    y = dev.alloc((n_s, n_t, n_head, head_dim))
    args = [dev.upload(a) for a in (x, dt, A, B, C)]
    dev.ssm_scan(pool, dev.indices(start), dev.indices(dst), *args, y, n_snap=n_snap, plane_stride=size)
    state0 = pool_np[start].reshape(n_s, n_head, head_dim, d_state)
    y_ref, snaps = naive_scan(state0, x, dt, A, B, C, n_snap)
    close(y.numpy(), y_ref)
    out = pool.numpy()
    written = set()
    for (s, j), state in snaps.items():
        r = dst[s] + j * size
        written.add(r)
        close(out[r], state.reshape(-1))
    for r in range(out.shape[0]):
        if r not in written:
            np.testing.assert_array_equal(out[r], pool_np[r])  # untouched, bitwise


@pytest.mark.parametrize("kda,h_k,h_v,n_t,n_snap", [(False, 2, 2, 3, 1), (True, 1, 2, 3, 2), (True, 2, 4, 1, 3)])
def test_gated_delta_net_matches_naive_loops(ref_device, rng, kda, h_k, h_v, n_t, n_snap):
    dev = ref_device
    n_s, S, size = 2, 3, 2
    pool_np = f32(rng, size * n_snap + 1, h_v * S * S)
    pool = dev.upload(pool_np)
    q, k = f32(rng, n_s, n_t, h_k, S), f32(rng, n_s, n_t, h_k, S)
    v = f32(rng, n_s, n_t, h_v, S, lo=-0.3, hi=5)
    g = f32(rng, *((n_s, n_t, h_v, S) if kda else (n_s, n_t, h_v)), lo=-2, hi=-1e-4)
    beta = f32(rng, n_s, n_t, h_v, lo=0, hi=1)
    start, dst = np.array([1, 0]), np.array([1, 0])
    o = dev.alloc((n_s, n_t, h_v, S))
    dev.gated_delta_net(
        pool,
        dev.indices(start),
        dev.indices(dst),
        *(dev.upload(a) for a in (q, k, v, g, beta)),
        o,
        n_snap=n_snap,
        plane_stride=size,
    )
    state0 = pool_np[start].reshape(n_s, h_v, S, S)
    o_ref, snaps = naive_delta(state0, q, k, v, g, beta, n_snap, 1 / math.sqrt(S))
    close(o.numpy(), o_ref)
    out = pool.numpy()
    for (s, j), state in snaps.items():
        close(out[dst[s] + j * size], state.reshape(-1))


@pytest.mark.parametrize("n_t,n_snap,bias,silu", [(1, 1, False, False), (5, 3, True, True), (2, 4, False, True)])
def test_ssm_conv_matches_naive_loops(ref_device, rng, n_t, n_snap, bias, silu):
    dev = ref_device
    n_s, ch, d_conv, size = 2, 5, 4, 3
    W = d_conv - 1
    pool_np = f32(rng, size * n_snap, ch * W)
    pool = dev.upload(pool_np)
    x = f32(rng, n_s, n_t, ch)
    w = f32(rng, ch, d_conv)
    b = f32(rng, ch)
    start, dst = np.array([0, 2]), np.array([1, 2])
    y = dev.alloc((n_s, n_t, ch))
    dev.ssm_conv(
        pool,
        dev.indices(start),
        dev.indices(dst),
        dev.upload(x),
        dev.upload(w),
        y,
        bias=dev.upload(b) if bias else None,
        apply_silu=silu,
        n_snap=n_snap,
        plane_stride=size,
    )
    out = pool.numpy()
    for s in range(n_s):
        win = pool_np[start[s]].reshape(ch, W)
        ext = [[float(win[c, i]) for i in range(W)] + [float(x[s, t, c]) for t in range(n_t)] for c in range(ch)]
        for t in range(n_t):
            for c in range(ch):
                acc = sum(ext[c][t + kk] * float(w[c, kk]) for kk in range(d_conv))
                if bias:
                    acc += float(b[c])
                if silu:
                    acc = acc / (1 + math.exp(-acc))
                assert abs(y.numpy()[s, t, c] - acc) < 1e-5
        for j in range(min(n_t + 1, n_snap)):
            expect = np.array([ext[c][n_t - j : n_t - j + W] for c in range(ch)], dtype=np.float32).reshape(-1)
            np.testing.assert_array_equal(out[dst[s] + j * size], expect)  # windows are exact copies


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_row_ops_round_trip_and_convert(ref_device, rng, dtype):
    dev = ref_device
    src_np = f32(rng, 6, 7)
    src = dev.upload(src_np, dtype)
    out = dev.alloc((3, 7), "f32")
    dev.get_rows(src, dev.indices([5, 0, 5]), out)
    stored = src_np.astype(DType.parse(dtype).numpy)
    np.testing.assert_array_equal(out.numpy(), stored[[5, 0, 5]].astype(np.float32))
    dst = dev.alloc((6, 7), dtype)
    dev.set_rows(dst, dev.indices([4, 1, 2]), out)
    got = dst.numpy()
    np.testing.assert_array_equal(got[[4, 1, 2]], stored[[5, 0, 5]])
    assert not got[[0, 3, 5]].astype(np.float32).any()
    dev.zero_rows(src, dev.indices([1]))
    assert not src.numpy()[1].astype(np.float32).any()


def test_invalid_arguments_name_the_argument_and_write_nothing(ref_device, rng):
    dev = ref_device
    pool_np = f32(rng, 4, 6)
    pool = dev.upload(pool_np)
    dst = dev.alloc((2, 6))
    with pytest.raises(ArgumentError, match="rows: index 9 out of range"):
        dev.get_rows(pool, dev.indices([0, 9]), dst)
    with pytest.raises(ArgumentError, match="rows: duplicate destination row 1"):
        dev.set_rows(pool, dev.indices([1, 1]), dst)
    x = dev.upload(f32(rng, 1, 2, 6, 1))
    with pytest.raises(ArgumentError, match="n_snap"):
        dev.ssm_scan(
            dev.alloc((4, 6)),
            dev.indices([0]),
            dev.indices([0]),
            x,
            dev.upload(f32(rng, 1, 2, 6)),
            dev.upload(f32(rng, 6, 1)),
            dev.upload(f32(rng, 1, 2, 1, 1)),
            dev.upload(f32(rng, 1, 2, 1, 1)),
            dev.alloc((1, 2, 6, 1)),
            n_snap=0,  # (Mamba-1 scans write snapshot planes too: only the count is wrong here)
            plane_stride=2,
        )
    np.testing.assert_array_equal(pool.numpy(), pool_np)


def test_overlapping_input_views(ref_device, rng):
    """x, B and C as views of one packed buffer, as a Mamba-2 in_proj produces them."""
    dev = ref_device
    n_s, n_t, H, P, G, N = 2, 3, 2, 2, 1, 3
    packed = f32(rng, n_s, n_t, H * P + 2 * G * N)
    buf = dev.upload(packed)
    row = packed.shape[2]
    x_v = buf.view((n_s, n_t, H, P), (n_t * row, row, P, 1), 0)
    B_v = buf.view((n_s, n_t, G, N), (n_t * row, row, N, 1), H * P)
    C_v = buf.view((n_s, n_t, G, N), (n_t * row, row, N, 1), H * P + G * N)
    dt = f32(rng, n_s, n_t, H)
    A = -np.abs(f32(rng, H))
    pool_a, pool_b = dev.alloc((2, H * P * N)), dev.alloc((2, H * P * N))
    ya, yb = dev.alloc((n_s, n_t, H, P)), dev.alloc((n_s, n_t, H, P))
    idx = dev.indices([0, 1])
    dev.ssm_scan(pool_a, idx, idx, x_v, dev.upload(dt), dev.upload(A), B_v, C_v, ya)
    x_c = np.ascontiguousarray(packed[:, :, : H * P].reshape(n_s, n_t, H, P))
    B_c = np.ascontiguousarray(packed[:, :, H * P : H * P + N].reshape(n_s, n_t, G, N))
    C_c = np.ascontiguousarray(packed[:, :, H * P + N :].reshape(n_s, n_t, G, N))
    dev.ssm_scan(pool_b, idx, idx, *(dev.upload(a) for a in (x_c, dt, A, B_c, C_c)), yb)
    np.testing.assert_array_equal(ya.numpy(), yb.numpy())
    np.testing.assert_array_equal(pool_a.numpy(), pool_b.numpy())


def test_start_row_written_by_another_sequence_is_refused(ref_device, rng):
    dev = ref_device
    pool_np = f32(rng, 4, 2 * 3)
    pool = dev.upload(pool_np)
    x = dev.upload(f32(rng, 2, 1, 2))
    y = dev.alloc((2, 1, 2))
    with pytest.raises(ArgumentError, match="sequence 0 starts from row 1, which sequence 1 writes"):
        dev.ssm_conv(pool, dev.indices([1, 0]), dev.indices([0, 1]), x, dev.upload(f32(rng, 2, 4)), y)
    np.testing.assert_array_equal(pool.numpy(), pool_np)
    assert not y.numpy().any()


def test_index_validation_follows_rewritten_index_buffers(ref_device, rng):
    """Index facts are cached per upload; a rewrite must be validated afresh."""
    dev = ref_device
    src = dev.upload(f32(rng, 4, 3))
    out = dev.alloc((2, 3))
    rows = dev.indices([0, 1])
    dev.get_rows(src, rows, out)
    dev.write(rows, np.array([0, 99], dtype=np.int32))
    with pytest.raises(ArgumentError, match="index 99 out of range"):
        dev.get_rows(src, rows, out)
    dst = dev.alloc((4, 3))
    dev.write(rows, np.array([2, 2], dtype=np.int32))
    with pytest.raises(ArgumentError, match="duplicate destination row 2"):
        dev.set_rows(dst, rows, out)
