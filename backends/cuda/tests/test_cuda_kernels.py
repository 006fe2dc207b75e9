"""The CUDA kernels against the reference backend: on the GPU when there is
one (``cuda`` marker), and always through the host emulation.

Each kernel is written as a __host__ __device__ function of (block, thread);
the library exports host twins that run those bodies one emulated thread at
a time (one lane per reduction group, blocks of three groups so the row
rounds run as on the GPU).  Driving them through CudaDevice's own marshalling
checks, without a GPU: view offsets and strides, the argument structs, start
rows from any plane, snapshot mapping, in-place and rollback starts, guard
rows, and the f16/bf16 conversions (bit-exact against NumPy / ml_dtypes).
What this cannot check is the warp shuffle reduction and the launch
geometry; the `cuda`-marked tests and the conformance suite do, on a GPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from statecache.dtypes import DType

STORAGE = [DType.F32, DType.F16, DType.BF16]
# NMSE bounds of a stored pool after one rounding to the storage dtype.
NMSE = {DType.F32: 1e-7, DType.F16: 1e-6, DType.BF16: 1e-4}


@pytest.fixture
def ref():
    from statecache.registry import BackendRegistry

    return BackendRegistry(allowlist=["reference"]).get_device("reference")


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    got = got.astype(np.float64)
    want = want.astype(np.float64)
    return float(np.sum((got - want) ** 2) / max(np.sum(want**2), 1e-30))


# -- conversions ------------------------------------------------------------------


def _convert(runtime, src: np.ndarray, src_code: int, dst_dtype: np.dtype, dst_code: int) -> np.ndarray:
    ffi = runtime.ffi
    src = np.ascontiguousarray(src)
    out = np.empty(src.shape, dtype=dst_dtype)
    status = runtime.lib.statecache_cuda_host_convert(
        ffi.cast("void *", src.ctypes.data), src_code, ffi.cast("void *", out.ctypes.data), dst_code, src.size
    )
    assert status == 0
    return out


def _edge_floats(rng) -> np.ndarray:
    """float32 values around every rounding decision of f16 and bf16."""
    bits = [
        0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
        0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345, 0x7FA00000, 0x7F80FFFF,
        0x477FEFFF, 0x477FF000, 0x477FF001, 0x477FE000, 0x47800000,  # f16 overflow edge (65520)
        0x33000000, 0x33000001, 0x337FFFFF, 0x33800000, 0x33C00000,  # f16 smallest subnormal region
        0x387FC000, 0x387FE000, 0x38800000, 0x38FFF000,  # f16 subnormal/normal boundary
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # bf16 ties
        0x3F801000, 0x3F803000, 0x3F801001,  # f16 ties
    ]  # fmt: skip
    edges = np.array(bits, dtype=np.uint32)
    # Every rounding remainder pattern near the f16 subnormal range and normal range.
    sub = (np.arange(0x33000000, 0x38800000, 0x1FFF, dtype=np.uint64)).astype(np.uint32)
    rand = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([edges, sub, rand, edges | 0x80000000]).view(np.float32)


def test_f32_to_f16_and_bf16_bit_exact(runtime, rng):
    values = _edge_floats(rng)
    with np.errstate(all="ignore"):
        want_f16 = values.astype(np.float16).view(np.uint16)
        want_bf16 = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    got_f16 = _convert(runtime, values, 0, np.dtype(np.uint16), 1)
    got_bf16 = _convert(runtime, values, 0, np.dtype(np.uint16), 2)
    bad = np.flatnonzero(got_f16 != want_f16)
    assert bad.size == 0, f"f16: {values.view(np.uint32)[bad[:5]]} -> {got_f16[bad[:5]]} want {want_f16[bad[:5]]}"
    bad = np.flatnonzero(got_bf16 != want_bf16)
    assert bad.size == 0, f"bf16: {values.view(np.uint32)[bad[:5]]} -> {got_bf16[bad[:5]]} want {want_bf16[bad[:5]]}"


@pytest.mark.parametrize(("code", "dtype"), [(1, np.float16), (2, ml_dtypes.bfloat16)])
def test_every_16_bit_pattern_widens_and_narrows_exactly(runtime, code, dtype):
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    wide = _convert(runtime, patterns, code, np.dtype(np.uint32), 0)
    with np.errstate(all="ignore"):
        want = patterns.view(dtype).astype(np.float32).view(np.uint32)
        np.testing.assert_array_equal(wide, want)
        # f16 <-> bf16 goes through float32, as the reference does.
        other_code, other = (2, ml_dtypes.bfloat16) if code == 1 else (1, np.float16)
        cross = _convert(runtime, patterns, code, np.dtype(np.uint16), other_code)
        np.testing.assert_array_equal(cross, patterns.view(dtype).astype(np.float32).astype(other).view(np.uint16))


# -- rows -------------------------------------------------------------------------


def _pair(emu, ref, host: np.ndarray, dtype: DType):
    return emu.upload(host, dtype), ref.upload(host, dtype)


@pytest.mark.parametrize("src_dt", STORAGE)
@pytest.mark.parametrize("dst_dt", STORAGE)
@pytest.mark.parametrize("row_size", [1, 3, 8, 1000])
def test_row_ops_bit_exact(dut, ref, rng, src_dt, dst_dt, row_size):
    R, n = 13, 5
    src_host = rng.normal(size=(R, row_size)).astype(np.float32) * 100
    dst_host = rng.normal(size=(R, row_size)).astype(np.float32)
    rows = rng.permutation(R)[:n]
    other = rng.permutation(R)[:n]
    results = []
    for dev in (dut, ref):
        src = dev.upload(src_host, src_dt)
        dst = dev.upload(dst_host, dst_dt)
        small = dev.upload(src_host[:n], src_dt)
        gathered = dev.alloc((n, row_size), dst_dt)
        dev.fill_bytes(gathered, 3)
        dev.get_rows(src, dev.indices(rows), gathered)
        dev.set_rows(dst, dev.indices(rows), small)
        dev.copy_rows(src, dev.indices(rows), dst, dev.indices(other))
        dev.zero_rows(dst, dev.indices([rows[0], rows[0], other[1]]))
        results.append((gathered.numpy(), dst.numpy()))
    for got, want in zip(results[0], results[1]):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_rows_through_offset_views_and_strided_indices(dut, ref, rng):
    host = rng.normal(size=(10, 6)).astype(np.float32)
    idx_host = np.array([9, 0, 7, 3, 1, 2], dtype=np.int32)
    results = []
    for dev in (dut, ref):
        big = dev.upload(host, DType.F16)
        src = big.view((8, 6), offset=12)  # rows 2..9, a 2-byte-aligned offset view
        idx_all = dev.indices(idx_host)
        idx = idx_all.view((3,), strides=(2,), offset=1)  # [0, 3, 2]: strided index view
        out = dev.alloc((3, 6), DType.F32)
        dev.get_rows(src, idx, out)
        results.append(out.numpy())
    np.testing.assert_array_equal(results[0], results[1])


# -- stateful primitives ----------------------------------------------------------


def _rows_layout(rng, n_s: int, n_snap: int, start_mode: str):
    """dst rows (plane 0), plane stride, start rows and pool height.

    Row 0 is a guard; planes j of sequence s sit at dst[s] + j * n_s; a spare
    region of n_s rows after the planes holds fresh start states."""
    ps = n_s
    dst = 1 + rng.permutation(n_s)
    spare = 1 + n_snap * n_s + rng.permutation(n_s)
    if start_mode == "fresh":
        start = spare
    elif start_mode == "inplace":
        start = dst.copy()
    elif start_mode == "rollback":
        start = dst + min(2, n_snap - 1) * ps
    else:
        raise AssertionError(start_mode)
    n_rows = 1 + (n_snap + 1) * n_s + 1  # + trailing guard
    return dst, ps, start, n_rows


def _compare_pools(got: np.ndarray, want: np.ndarray, written: set[int], dtype: DType) -> None:
    for r in range(want.shape[0]):
        if r in written:
            err = nmse(got[r].astype(np.float32), want[r].astype(np.float32))
            assert err <= NMSE[dtype], f"row {r}: NMSE {err:.3g}"
        else:
            np.testing.assert_array_equal(got[r].view(np.uint8), want[r].view(np.uint8), err_msg=f"guard row {r}")


def _written(dst, ps, n_t, n_snap) -> set[int]:
    n_written = min(n_t + 1, n_snap)
    return {int(d) + j * ps for d in dst for j in range(n_written)}


SCAN_CASES = [
    # (n_s, n_t, n_head, head_dim, d_state, n_group, n_snap, mamba1)
    (3, 4, 16, 1, 16, 1, 1, True),  # Mamba-1 (head_dim 1, per-state A)
    (2, 5, 4, 8, 32, 2, 3, False),  # Mamba-2, n_t above n_snap
    (3, 2, 4, 5, 40, 4, 4, False),  # n_t below n_snap: the input state is plane n_t
    (1, 1, 2, 4, 128, 1, 2, False),  # decode with one snapshot plane
    (2, 3, 2, 3, 256, 2, 1, False),  # widest d_state
]


@pytest.mark.parametrize("case", SCAN_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("start_mode", ["fresh", "inplace", "rollback"])
def test_ssm_scan_matches_reference(dut, ref, rng, case, dtype, start_mode):
    n_s, n_t, H, P, N, G, n_snap, mamba1 = case
    dst, ps, start, n_rows = _rows_layout(rng, n_s, n_snap, start_mode)
    row = H * P * N
    pool_host = rng.normal(size=(n_rows, row)).astype(np.float32)
    D = H * P + 2 * G * N + 3  # x | B | C | padding packed per token: strided, overlapping-style views
    xbc = rng.normal(size=(n_s, n_t, D)).astype(np.float32)
    dt_host = rng.normal(size=(n_s, n_t, H + 2)).astype(np.float32)
    A_host = -np.exp(rng.normal(size=(H, N) if mamba1 else (H,))).astype(np.float32)
    outs = []
    for dev in (dut, ref):
        pool = dev.upload(pool_host, dtype)
        packed = dev.upload(xbc)
        x = packed.view((n_s, n_t, H, P), (n_t * D, D, P, 1), 0)
        B = packed.view((n_s, n_t, G, N), (n_t * D, D, N, 1), H * P)
        C = packed.view((n_s, n_t, G, N), (n_t * D, D, N, 1), H * P + G * N)
        dt_all = dev.upload(dt_host)
        dt = dt_all.view((n_s, n_t, H), (n_t * (H + 2), H + 2, 1), 1)
        y = dev.alloc((n_s, n_t, H, P))
        dev.ssm_scan(
            pool, dev.indices(start), dev.indices(dst), x, dt, dev.upload(A_host), B, C, y,
            n_snap=n_snap, plane_stride=ps,
        )  # fmt: skip
        outs.append((pool.numpy(), y.numpy()))
    (pool_e, y_e), (pool_r, y_r) = outs
    assert nmse(y_e, y_r) <= 1e-7 if dtype is DType.F32 else nmse(y_e, y_r) <= 1e-5
    _compare_pools(pool_e, pool_r, _written(dst, ps, n_t, n_snap), dtype)


CONV_CASES = [
    # (n_s, n_t, channels, d_conv, n_snap)
    (3, 5, 7, 4, 3),
    (2, 1, 33, 3, 2),
    (2, 2, 5, 9, 4),
    (1, 20, 3, 16, 1),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("start_mode", ["fresh", "inplace", "rollback"])
@pytest.mark.parametrize("fused", [False, True])
def test_ssm_conv_matches_reference(dut, ref, rng, case, dtype, start_mode, fused):
    n_s, n_t, ch, d_conv, n_snap = case
    W = d_conv - 1
    dst, ps, start, n_rows = _rows_layout(rng, n_s, n_snap, start_mode)
    pool_host = rng.normal(size=(n_rows, ch * W)).astype(np.float32)
    x_host = rng.normal(size=(n_s, n_t, ch + 3)).astype(np.float32)
    w_host = rng.normal(size=(ch, d_conv)).astype(np.float32)
    b_host = rng.normal(size=(ch,)).astype(np.float32)
    outs = []
    for dev in (dut, ref):
        pool = dev.upload(pool_host, dtype)
        x = dev.upload(x_host).view((n_s, n_t, ch), (n_t * (ch + 3), ch + 3, 1), 2)
        y = dev.alloc((n_s, n_t, ch))
        dev.ssm_conv(
            pool, dev.indices(start), dev.indices(dst), x, dev.upload(w_host), y,
            bias=dev.upload(b_host) if fused else None, apply_silu=fused, n_snap=n_snap, plane_stride=ps,
        )  # fmt: skip
        outs.append((pool.numpy(), y.numpy()))
    (pool_e, y_e), (pool_r, y_r) = outs
    assert nmse(y_e, y_r) <= 1e-7 if dtype is DType.F32 else nmse(y_e, y_r) <= 1e-5
    written = _written(dst, ps, n_t, n_snap)
    if dtype is DType.F32:
        # Windows are copies of inputs: exact, not just close.
        for r in written:
            np.testing.assert_array_equal(pool_e[r], pool_r[r])
    _compare_pools(pool_e, pool_r, written, dtype)


DELTA_CASES = [
    # (n_s, n_t, H_k, H_v, S, n_snap, kda)
    (2, 3, 2, 2, 16, 1, False),
    (3, 4, 1, 3, 8, 3, True),  # value-head repeat, KDA gate, n_t above n_snap
    (2, 2, 2, 4, 40, 4, False),  # n_t below n_snap
    (1, 1, 1, 1, 128, 2, True),  # decode
]


@pytest.mark.parametrize("case", DELTA_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("start_mode", ["fresh", "inplace", "rollback"])
def test_gated_delta_net_matches_reference(dut, ref, rng, case, dtype, start_mode):
    n_s, n_t, Hk, Hv, S, n_snap, kda = case
    dst, ps, start, n_rows = _rows_layout(rng, n_s, n_snap, start_mode)
    pool_host = (rng.normal(size=(n_rows, Hv * S * S)) * 0.1).astype(np.float32)

    def unit(shape):
        a = rng.normal(size=shape).astype(np.float32)
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    # q/k/v stored [n_s, n_t, S, H] and viewed [n_s, n_t, H, S]: permuted inputs.
    q_host, k_host = unit((n_s, n_t, Hk, S)), unit((n_s, n_t, Hk, S))
    v_host = rng.uniform(-0.3, 5, size=(n_s, n_t, Hv, S)).astype(np.float32)
    g_host = rng.uniform(-2, -1e-4, size=(n_s, n_t, Hv, S) if kda else (n_s, n_t, Hv)).astype(np.float32)
    beta_host = rng.uniform(0, 1, size=(n_s, n_t, Hv)).astype(np.float32)

    def permuted(dev, a):
        n0, n1, h, s = a.shape
        buf = dev.upload(np.ascontiguousarray(a.transpose(0, 1, 3, 2)))
        return buf.view((n0, n1, h, s), (n1 * s * h, s * h, 1, h))

    outs = []
    for dev in (dut, ref):
        pool = dev.upload(pool_host, dtype)
        o = dev.alloc((n_s, n_t, Hv, S))
        dev.gated_delta_net(
            pool, dev.indices(start), dev.indices(dst), permuted(dev, q_host), permuted(dev, k_host),
            permuted(dev, v_host), dev.upload(g_host), dev.upload(beta_host), o, n_snap=n_snap, plane_stride=ps,
        )  # fmt: skip
        outs.append((pool.numpy(), o.numpy()))
    (pool_e, o_e), (pool_r, o_r) = outs
    assert nmse(o_e, o_r) <= 1e-7 if dtype is DType.F32 else nmse(o_e, o_r) <= 1e-5
    _compare_pools(pool_e, pool_r, _written(dst, ps, n_t, n_snap), dtype)


def test_shape_limits_are_refused_before_launch(emu):
    assert not emu.supports("ssm_scan", d_state=512)
    assert not emu.supports("gated_delta_net", head_size=300)
    assert not emu.supports("ssm_conv", d_conv=17)
    assert emu.supports("ssm_scan", d_state=256)


# -- zero-copy interfaces -------------------------------------------------------


def test_dlpack_export_is_zero_copy(emu):
    from statecache.backends.cuda.device import dlpack_live_count

    before = dlpack_live_count()
    buf = emu.upload(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = buf.view((3, 2), (4, 2), 1)  # strided view keeps its type and strides
    arr = np.from_dlpack(view)
    np.testing.assert_array_equal(arr, [[1, 3], [5, 7], [9, 11]])
    arr_full = np.from_dlpack(buf)
    emu.write(buf, np.full((3, 4), 42.0, dtype=np.float32))  # the imports see the write: no copy
    assert (arr_full == 42.0).all() and (arr == 42.0).all()
    assert arr_full.ctypes.data == buf.data_ptr() and arr.ctypes.data == view.data_ptr()
    del arr, arr_full
    assert dlpack_live_count() == before
    capsule = buf.__dlpack__()  # never consumed: the capsule releases it
    assert dlpack_live_count() == before + 1
    del capsule
    assert dlpack_live_count() == before


def test_cuda_array_interface_describes_views(emu):
    buf = emu.upload(np.zeros((4, 6), dtype=np.float16), DType.F16)
    cai = buf.__cuda_array_interface__
    assert cai["shape"] == (4, 6) and cai["typestr"] == "<f2" and cai["strides"] is None and cai["version"] == 3
    assert cai["data"] == (buf.storage.ptr, False)
    view = buf.view((2, 3), (12, 2), 5)
    cai = view.__cuda_array_interface__
    assert cai["strides"] == (24, 4) and cai["data"][0] == buf.storage.ptr + 10
    bf = emu.alloc((2,), DType.BF16)
    assert not hasattr(bf, "__cuda_array_interface__")
