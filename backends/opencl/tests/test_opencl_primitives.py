"""Every primitive of the OpenCL backend against the reference backend.

Each case builds the same inputs on both devices from one set of host
arrays: pools and outputs live inside larger storages whose guard rows and
unwritten rows are filled with garbage, so a stray write anywhere shows up
as a mismatch, and inputs may be strided or overlapping views.  Row ops must
be bit-exact; computed states and outputs must reach NMSE <= 1e-7 in f32
(looser for states rounded to f16/bf16 storage, where one ulp of rounding
is the expected difference); conv windows are copies, so bit-exact.
Shapes are small: PoCL compiles slowly and every shape costs only run time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from statecache import ArgumentError, DType
from statecache.backend import DeviceKind

pytestmark = pytest.mark.opencl

GUARD = 3  # garbage rows before and after every pool
Y_GUARD = 17  # garbage elements before and after every output

STATE_NMSE = {DType.F32: 1e-7, DType.F16: 1e-6, DType.BF16: 1e-4}


def nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    denom = float(np.sum(e * e))
    return float(np.sum((a - e) ** 2)) / (denom if denom else 1.0)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    a = actual.view(np.uint8)
    e = expected.view(np.uint8)
    if not np.array_equal(a, e):
        bad = np.argwhere(actual.view(f"u{actual.itemsize}") != expected.view(f"u{expected.itemsize}"))
        raise AssertionError(f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}")


class Twin:
    """The same storages on the OpenCL device and on the reference device."""

    def __init__(self, devices, rng):
        self.devices = devices
        self.rng = rng
        self.storages: dict[str, tuple[list, str]] = {}

    def upload(self, host, dtype=None):
        return [dev.upload(host, dtype) for dev in self.devices]

    def indices(self, values):
        return [dev.indices(values) for dev in self.devices]

    def pool(self, name, rows, row_size, dtype):
        """A pool of ``rows`` rows inside a garbage-filled storage with guard rows."""
        host = self.rng.uniform(-1.0, 1.0, size=(rows + 2 * GUARD, row_size)).astype(np.float32)
        storages = self.upload(host, dtype)
        self.storages[name] = (storages, "pool")
        return [s.view((rows, row_size), offset=GUARD * row_size) for s in storages]

    def output(self, name, shape):
        """A float32 output inside a garbage-filled storage with guard elements."""
        n = math.prod(shape)
        host = self.rng.uniform(-1e3, 1e3, size=n + 2 * Y_GUARD).astype(np.float32)
        storages = self.upload(host)
        self.storages[name] = (storages, "output")
        return [s.view(shape, offset=Y_GUARD) for s in storages]

    def strided(self, host, *, pad_last=0, transpose=None):
        """Upload ``host`` as a non-contiguous view: padded last axis, or axes permuted in memory."""
        out = []
        for dev in self.devices:
            if transpose is not None:
                mem = np.ascontiguousarray(np.transpose(host, transpose))
                buf = dev.upload(mem)
                inverse = np.argsort(transpose)
                strides = tuple(buf.strides[i] for i in inverse)
                out.append(buf.view(host.shape, strides))
            else:
                padded = np.zeros((*host.shape[:-1], host.shape[-1] + pad_last), dtype=np.float32)
                padded[..., : host.shape[-1]] = host
                buf = dev.upload(padded)
                out.append(buf.view(host.shape, buf.strides))
        return out

    def download(self, name):
        storages, _ = self.storages[name]
        return [s.numpy() for s in storages]


def check_pool(twin, name, written_rows, dtype, exact=False, copied_rows=()):
    """Unwritten rows and guards bit-exact; written rows exact or within NMSE;
    ``copied_rows`` (input-state planes, copies of a start row) bit-exact."""
    got, want = twin.download(name)
    mask = np.zeros(got.shape[0], dtype=bool)
    mask[np.asarray(written_rows, dtype=np.int64) + GUARD] = True
    assert_bits_equal(got[~mask], want[~mask], f"{name}: rows the call must not write")
    copied = np.asarray(copied_rows, dtype=np.int64) + GUARD
    assert_bits_equal(got[copied], want[copied], f"{name}: input-state planes")
    if exact:
        assert_bits_equal(got[mask], want[mask], f"{name}: written rows")
    else:
        err = nmse(got[mask].astype(np.float32), want[mask].astype(np.float32))
        assert err <= STATE_NMSE[dtype], f"{name}: NMSE {err:.3e} of written rows"


def check_output(twin, name, tol=1e-7):
    got, want = twin.download(name)
    assert_bits_equal(got[:Y_GUARD], want[:Y_GUARD], f"{name}: leading guard")
    assert_bits_equal(got[-Y_GUARD:], want[-Y_GUARD:], f"{name}: trailing guard")
    err = nmse(got[Y_GUARD:-Y_GUARD], want[Y_GUARD:-Y_GUARD])
    assert err <= tol, f"{name}: NMSE {err:.3e}"


def written(dst, n_t, n_snap, plane_stride):
    n_written = min(n_t + 1, n_snap)
    return [int(d) + j * plane_stride for d in dst for j in range(n_written)]


def input_planes(dst, n_t, n_snap, plane_stride):
    """Rows that receive the input state (plane n_t, written when n_t < n_snap)."""
    return [int(d) + n_t * plane_stride for d in dst] if n_t < n_snap else []


@pytest.fixture
def twin(cl_device, ref_dev, rng):
    return Twin([cl_device, ref_dev], rng)


@pytest.fixture(params=["cpu", "gpu"])
def geometry(request, cl_device, monkeypatch):
    """Run the row-parallel kernels with both launch geometries: single-work-item
    groups walking many rows (CPU devices) and groups of 64 rows (GPUs)."""
    monkeypatch.setattr(cl_device, "kind", DeviceKind.CPU if request.param == "cpu" else DeviceKind.GPU)
    return request.param


# -- rows ---------------------------------------------------------------------

DTYPES = [DType.F32, DType.F16, DType.BF16]


def tricky_values(rng, shape):
    """Random values plus the cases conversions get wrong: ties at the f16 and
    bf16 rounding points, f16 subnormals and overflow, signed zeros, infinities."""
    vals = rng.uniform(-4.0, 4.0, size=math.prod(shape)).astype(np.float32)
    bits = vals.view(np.uint32)
    bits[0::7] = (bits[0::7] & 0xFFFF0000) | 0x8000  # bf16 ties (to even, both parities)
    bits[1::7] = (bits[1::7] & 0xFFFFE000) | 0x1000  # f16 ties
    vals[2::7] = rng.uniform(-6e-5, 6e-5, size=vals[2::7].size).astype(np.float32)  # f16 subnormals
    vals[3::11] = np.float32(7e4)  # overflows f16 to inf
    vals[4::13] = -0.0
    vals[5::17] = np.inf
    vals[6::19] = -np.inf
    return vals.reshape(shape)


@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [37, 600])  # per-element kernels | uint4 kernels over several 1 KiB stretches
def test_row_ops_bit_exact(twin, rng, src_dtype, dst_dtype, E):
    with np.errstate(over="ignore"):  # 7e4 overflows f16 on purpose (NumPy would warn)
        _row_ops(twin, rng, src_dtype, dst_dtype, E)


def _row_ops(twin, rng, src_dtype, dst_dtype, E):
    R, N = 9, 5
    src_host = tricky_values(rng, (R, E))
    rows = rng.permutation(R)[:N]

    # get_rows: gather N rows of src into a fresh [N, E]
    src = twin.upload(src_host, src_dtype)
    gathered = twin.pool("gathered", N, E, dst_dtype)
    idx = twin.indices(rows)
    for dev, s, i, d in zip(twin.devices, src, idx, gathered):
        dev.get_rows(s, i, d)
    check_pool(twin, "gathered", range(N), dst_dtype, exact=True)

    # set_rows: scatter N rows into a garbage pool
    small = twin.upload(src_host[:N], src_dtype)
    scattered = twin.pool("scattered", R, E, dst_dtype)
    for dev, s, i, d in zip(twin.devices, small, idx, scattered):
        dev.set_rows(d, i, s)
    check_pool(twin, "scattered", rows, dst_dtype, exact=True)

    # copy_rows between two pools (other rows of dst untouched)
    dst_rows = rng.permutation(R)[:N]
    copied = twin.pool("copied", R, E, dst_dtype)
    didx = twin.indices(dst_rows)
    for dev, s, i, d, di in zip(twin.devices, src, idx, copied, didx):
        dev.copy_rows(s, i, d, di)
    check_pool(twin, "copied", dst_rows, dst_dtype, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("E", [23, 24, 520])
def test_zero_rows_and_copy_between_planes(twin, rng, dtype, E):
    R = 10
    pool = twin.pool("pool", R, E, dtype)
    zero = twin.indices([7, 2, 7])  # duplicates are harmless when zeroing
    for dev, p, z in zip(twin.devices, pool, zero):
        dev.zero_rows(p, z)
    check_pool(twin, "pool", [2, 7], dtype, exact=True)
    got, _ = twin.download("pool")
    assert not np.any(got[[2 + GUARD, 7 + GUARD]].astype(np.float32))
    # copies between planes of the same pool
    s_idx, d_idx = twin.indices([0, 1, 2]), twin.indices([5, 6, 9])
    for dev, p, si, di in zip(twin.devices, pool, s_idx, d_idx):
        dev.copy_rows(p, si, p, di)
    check_pool(twin, "pool", [2, 5, 6, 7, 9], dtype, exact=True)


def test_nan_survives_conversions(cl_device):
    host = np.array([[np.nan, -np.nan, 1.0, 3.0]], dtype=np.float32)
    for dst_dtype in DTYPES:
        for src_dtype in DTYPES:
            src = cl_device.upload(host, src_dtype)
            dst = cl_device.alloc((1, 4), dst_dtype)
            cl_device.get_rows(src, cl_device.indices([0]), dst)
            out = dst.numpy().astype(np.float32)
            assert np.isnan(out[0, :2]).all(), (src_dtype, dst_dtype, out)
            assert out[0, 2:].tolist() == [1.0, 3.0]


# -- ssm_conv -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "d_conv", "n_t", "n_snap", "bias", "silu", "strided"),
    [
        (DType.F32, 4, 1, 1, True, True, False),  # decode
        (DType.F32, 4, 5, 3, False, False, True),  # prefill, snapshots < n_t
        (DType.F32, 2, 3, 6, True, False, True),  # n_snap > n_t: input window kept
        (DType.F16, 4, 3, 4, True, True, False),
        (DType.BF16, 3, 2, 4, False, True, True),
    ],
)
def test_ssm_conv(twin, geometry, rng, dtype, d_conv, n_t, n_snap, bias, silu, strided):
    n_s, ch, R, stride = 3, 43, 16, 4  # 43: a partial block of 8 in the vector SiLU
    W = d_conv - 1
    x_host = rng.uniform(-1, 1, (n_s, n_t, ch)).astype(np.float32)
    w_host = rng.uniform(-1, 1, (ch, d_conv)).astype(np.float32)
    b_host = rng.uniform(-1, 1, ch).astype(np.float32)
    dst = np.array([0, 1, 2])
    # seq 0 decodes in place, seq 1 starts from its own plane 2 (rollback),
    # seq 2 from a row nobody writes.
    start = np.array([0, 1 + 2 * stride, 15])
    pool = twin.pool("pool", R, ch * W, dtype)
    y = twin.output("y", (n_s, n_t, ch))
    x = twin.strided(x_host, pad_last=3) if strided else twin.upload(x_host)
    w = twin.strided(w_host, transpose=(1, 0)) if strided else twin.upload(w_host)
    b = twin.upload(b_host) if bias else [None, None]
    for i, dev in enumerate(twin.devices):
        dev.ssm_conv(
            pool[i],
            dev.indices(start),
            dev.indices(dst),
            x[i],
            w[i],
            y[i],
            bias=b[i],
            apply_silu=silu,
            n_snap=n_snap,
            plane_stride=stride,
        )
    check_output(twin, "y")
    check_pool(twin, "pool", written(dst, n_t, n_snap, stride), dtype, exact=True)


# -- ssm_scan -----------------------------------------------------------------


def scan_inputs(rng, n_s, n_t, H, P, N, G, mamba1=False):
    x = rng.uniform(-1, 1, (n_s, n_t, H, P)).astype(np.float32)
    dt = rng.uniform(-3, 1.5, (n_s, n_t, H)).astype(np.float32)
    dt.flat[::5] = 25.0  # beyond the softplus threshold
    A_shape = (H, N) if mamba1 else (H,)
    A = -np.exp(rng.uniform(-1, 1, A_shape)).astype(np.float32)
    B = rng.uniform(-1, 1, (n_s, n_t, G, N)).astype(np.float32)
    C = rng.uniform(-1, 1, (n_s, n_t, G, N)).astype(np.float32)
    return x, dt, A, B, C


@pytest.mark.parametrize(
    ("dtype", "H", "P", "N", "G", "n_t", "n_snap", "bc_layout"),
    [
        (DType.F32, 4, 8, 16, 2, 1, 1, "contiguous"),  # Mamba-2 decode
        (DType.F32, 4, 8, 16, 2, 1, 3, "contiguous"),  # decode keeping the input state as plane 1
        (DType.BF16, 2, 8, 32, 2, 1, 2, "contiguous"),
        (DType.F16, 2, 4, 16, 1, 1, 2, "transposed"),  # decode on the scalar kernel
        (DType.F32, 2, 4, 264, 1, 4, 3, "contiguous"),  # d_state beyond one private chunk (256)
        (DType.F32, 1, 2, 260, 1, 2, 3, "contiguous"),  # the same on the scalar kernel
        (DType.F32, 4, 4, 16, 4, 2, 5, "contiguous"),  # n_snap > n_t
        (DType.F32, 2, 4, 20, 2, 2, 3, "contiguous"),  # d_state not a multiple of 8: scalar kernel
        (DType.F32, 2, 4, 16, 1, 3, 2, "transposed"),  # B/C strided along d_state: scalar kernel
        (DType.F16, 4, 8, 16, 2, 3, 4, "contiguous"),
        (DType.F16, 2, 4, 12, 1, 2, 3, "contiguous"),
        (DType.BF16, 2, 8, 32, 2, 2, 2, "contiguous"),
        (DType.BF16, 2, 4, 16, 2, 2, 3, "transposed"),
        (DType.F32, 12, 2, 16, 3, 2, 2, "dt_heads_outer"),  # 8 + 4 heads in the vector prep; dt strided
        (DType.F32, 16, 2, 16, 2, 1, 1, "contiguous"),
    ],
)
def test_ssm_scan_mamba2(twin, geometry, rng, dtype, H, P, N, G, n_t, n_snap, bc_layout):
    n_s, stride = 3, 5
    R = 4 * stride
    host = scan_inputs(rng, n_s, n_t, H, P, N, G)
    dst = np.array([2, 0, 1])
    start = np.array([2 + stride, 0, 3 * stride + 3])  # own rollback plane, in place, untouched row
    pool = twin.pool("pool", R, H * P * N, dtype)
    y = twin.output("y", (n_s, n_t, H, P))
    ins = [twin.upload(a) for a in host]
    if bc_layout == "transposed":  # d_state outermost in memory
        ins[3], ins[4] = (twin.strided(a, transpose=(3, 0, 1, 2)) for a in host[3:])
    if bc_layout == "dt_heads_outer":
        ins[1] = twin.strided(host[1], transpose=(2, 0, 1))
    for i, dev in enumerate(twin.devices):
        dev.ssm_scan(
            pool[i],
            dev.indices(start),
            dev.indices(dst),
            *(a[i] for a in ins),
            y[i],
            n_snap=n_snap,
            plane_stride=stride,
        )
    check_output(twin, "y")
    check_pool(
        twin, "pool", written(dst, n_t, n_snap, stride), dtype, copied_rows=input_planes(dst, n_t, n_snap, stride)
    )


@pytest.mark.parametrize(
    ("dtype", "N", "n_t", "dt_layout"),
    [
        (DType.F32, 16, 3, "contiguous"),
        (DType.F16, 16, 3, "contiguous"),
        (DType.BF16, 16, 3, "contiguous"),
        (DType.F32, 12, 3, "contiguous"),
        (DType.F32, 16, 1, "contiguous"),
        (DType.F32, 16, 2, "heads_outer"),  # dt and A strided along the heads
    ],
    ids=str,
)
def test_ssm_scan_mamba1(twin, geometry, rng, dtype, N, n_t, dt_layout):
    n_s, H = 2, 70  # 70 rows (heads): not a multiple of the work-group size nor of 8
    host = scan_inputs(rng, n_s, n_t, H, 1, N, 1, mamba1=True)
    pool = twin.pool("pool", 4, H * N, dtype)
    y = twin.output("y", (n_s, n_t, H, 1))
    ins = [twin.upload(a) for a in host]
    if dt_layout == "heads_outer":
        ins[1] = twin.strided(host[1], transpose=(2, 0, 1))
        ins[2] = twin.strided(host[2], transpose=(1, 0))
    for i, dev in enumerate(twin.devices):
        dev.ssm_scan(pool[i], dev.indices([3, 1]), dev.indices([3, 0]), *(a[i] for a in ins), y[i])
    check_output(twin, "y")
    check_pool(twin, "pool", [3, 0], dtype)


def test_ssm_scan_overlapping_views_and_permuted_starts(twin, rng):
    """x, B and C as overlapping views of one packed buffer (as an in_proj emits
    them), dt padded, and start rows a permutation of the destinations, which
    the caller copies aside first (as the recurrent step does)."""
    n_s, n_t, H, P, N, G = 4, 3, 4, 4, 16, 2
    row = H * P + 2 * G * N
    packed = rng.uniform(-1, 1, (n_s, n_t, row)).astype(np.float32)
    bufs = twin.upload(packed)
    x = [b.view((n_s, n_t, H, P), (n_t * row, row, P, 1), 0) for b in bufs]
    B = [b.view((n_s, n_t, G, N), (n_t * row, row, N, 1), H * P) for b in bufs]
    # C overlaps B's last group: read-only inputs may alias.
    C = [b.view((n_s, n_t, G, N), (n_t * row, row, N, 1), H * P + N) for b in bufs]
    _, dt_host, A_host, _, _ = scan_inputs(rng, n_s, n_t, H, P, N, G)
    dt = twin.strided(dt_host, pad_last=2)
    A = twin.upload(A_host)
    R = 12
    pool = twin.pool("pool", R, H * P * N, DType.F32)
    y = twin.output("y", (n_s, n_t, H, P))
    perm = rng.permutation(n_s)
    for i, dev in enumerate(twin.devices):
        aside = dev.indices(8 + np.arange(n_s))
        dev.copy_rows(pool[i], dev.indices(perm), pool[i], aside)
        dev.ssm_scan(pool[i], aside, dev.indices(np.arange(n_s)), x[i], dt[i], A[i], B[i], C[i], y[i])
    check_output(twin, "y")
    check_pool(twin, "pool", list(range(n_s)) + list(range(8, 8 + n_s)), DType.F32)


def test_ssm_scan_snapshot_planes_replay(cl_device, rng):
    """Each snapshot plane equals a rerun from the start state over fewer tokens,
    and the input plane equals the start state bit for bit."""
    n_t, H, P, N, G, stride = 4, 2, 4, 16, 1, 2
    x, dt, A, B, C = scan_inputs(rng, 1, n_t, H, P, N, G)
    start_state = rng.uniform(-1, 1, (1, H * P * N)).astype(np.float32)
    pool = cl_device.alloc((12, H * P * N))
    cl_device.write(pool, np.zeros((12, H * P * N), np.float32))
    cl_device.copy_rows(cl_device.upload(start_state), cl_device.indices([0]), pool, cl_device.indices([11]))
    y = cl_device.alloc((1, n_t, H, P))
    up = [cl_device.upload(a) for a in (x, dt, A, B, C)]
    cl_device.ssm_scan(
        pool, cl_device.indices([11]), cl_device.indices([0]), *up, y, n_snap=n_t + 1, plane_stride=stride
    )
    planes = pool.numpy()
    assert_bits_equal(planes[n_t * stride], start_state[0], "input plane")
    for m in range(1, n_t + 1):
        sub = [cl_device.upload(np.ascontiguousarray(a[:, :m])) for a in (x, dt)]
        bc = [cl_device.upload(np.ascontiguousarray(a[:, :m])) for a in (B, C)]
        ym = cl_device.alloc((1, m, H, P))
        p2 = cl_device.upload(np.vstack([start_state, np.zeros_like(start_state)]))
        cl_device.ssm_scan(p2, cl_device.indices([0]), cl_device.indices([1]), sub[0], sub[1], up[2], bc[0], bc[1], ym)
        # Same float32 operations in the same order: identical bits.
        assert_bits_equal(planes[(n_t - m) * stride], p2.numpy()[1], f"plane {n_t - m}")


# -- gated_delta_net ----------------------------------------------------------


def delta_inputs(rng, n_s, n_t, Hk, Hv, S, kda):
    def l2(a):
        return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)

    q = l2(rng.uniform(-1, 1, (n_s, n_t, Hk, S)))
    k = l2(rng.uniform(-1, 1, (n_s, n_t, Hk, S)))
    v = rng.uniform(-0.3, 5, (n_s, n_t, Hv, S)).astype(np.float32)
    g_shape = (n_s, n_t, Hv, S) if kda else (n_s, n_t, Hv)
    g = rng.uniform(-3, -1e-4, g_shape).astype(np.float32)
    beta = rng.uniform(0, 1, (n_s, n_t, Hv)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize(
    ("dtype", "kda", "Hk", "Hv", "S", "n_t", "n_snap", "layout"),
    [
        (DType.F32, False, 2, 2, 16, 1, 1, "contiguous"),  # decode
        (DType.F32, True, 1, 2, 16, 1, 3, "heads_outer"),  # KDA decode keeping the input state as plane 1
        (DType.BF16, False, 2, 2, 16, 1, 2, "contiguous"),
        (DType.F32, False, 1, 2, 32, 4, 3, "heads_outer"),  # GQA, snapshots, permuted q/k/v
        (DType.F32, True, 2, 4, 16, 3, 5, "contiguous"),  # KDA, n_snap > n_t
        (DType.F32, True, 1, 2, 12, 2, 3, "contiguous"),  # S % 8 != 0: scalar kernel
        (DType.F32, True, 2, 2, 16, 2, 2, "keys_outer"),  # q/k strided along S: scalar kernel
        (DType.F16, True, 2, 2, 16, 2, 2, "heads_outer"),
        (DType.F16, False, 1, 1, 12, 2, 3, "keys_outer"),
        (DType.BF16, False, 1, 1, 16, 3, 4, "contiguous"),
        (DType.BF16, True, 1, 2, 12, 1, 2, "contiguous"),
    ],
)
def test_gated_delta_net(twin, geometry, rng, dtype, kda, Hk, Hv, S, n_t, n_snap, layout):
    n_s, stride = 2, 4
    R = 4 * stride
    q, k, v, g, beta = delta_inputs(rng, n_s, n_t, Hk, Hv, S, kda)
    dst = np.array([1, 0])
    start = np.array([1 + stride, R - 1])  # own rollback plane; a row nobody writes
    pool = twin.pool("pool", R, Hv * S * S, dtype)
    o = twin.output("o", (n_s, n_t, Hv, S))
    if layout == "heads_outer":  # a permuted view of [H, n_s, n_t, S]
        qkv = [twin.strided(a, transpose=(2, 0, 1, 3)) for a in (q, k, v)]
    elif layout == "keys_outer":  # the head dimension outermost: strided along S
        qkv = [twin.strided(a, transpose=(3, 0, 1, 2)) for a in (q, k, v)]
    else:
        qkv = [twin.upload(a) for a in (q, k, v)]
    if layout == "keys_outer" and kda:  # the per-key gate strided along S too
        gb = [twin.strided(g, transpose=(3, 0, 1, 2)), twin.upload(beta)]
    else:
        gb = [twin.strided(g, pad_last=1), twin.upload(beta)]
    for i, dev in enumerate(twin.devices):
        dev.gated_delta_net(
            pool[i],
            dev.indices(start),
            dev.indices(dst),
            *(a[i] for a in qkv),
            *(a[i] for a in gb),
            o[i],
            n_snap=n_snap,
            plane_stride=stride,
        )
    check_output(twin, "o")
    check_pool(
        twin, "pool", written(dst, n_t, n_snap, stride), dtype, copied_rows=input_planes(dst, n_t, n_snap, stride)
    )


# -- validation happens before anything is queued -----------------------------


def test_invalid_arguments_raise_before_any_enqueue(cl_device, rng, monkeypatch):
    n_s, n_t, H, P, N, G = 2, 1, 2, 4, 8, 1
    x, dt, A, B, C = (cl_device.upload(a) for a in scan_inputs(rng, n_s, n_t, H, P, N, G))
    pool = cl_device.upload(rng.uniform(-1, 1, (6, H * P * N)).astype(np.float32))
    before = pool.numpy()
    y = cl_device.alloc((n_s, n_t, H, P))
    start, dup, oob = cl_device.indices([0, 1]), cl_device.indices([3, 3]), cl_device.indices([2, 6])

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was requested before validation finished")

    def no_download(*args, **kwargs):
        raise AssertionError("index validation read an index buffer back from the device")

    monkeypatch.setattr(cl_device, "kernel", no_launch)
    monkeypatch.setattr(cl_device, "_read", no_download)
    with pytest.raises(ArgumentError, match="dst_rows: duplicate destination row 3"):
        cl_device.ssm_scan(pool, start, dup, x, dt, A, B, C, y)
    with pytest.raises(ArgumentError, match="dst_rows: index 6 out of range"):
        cl_device.ssm_scan(pool, start, oob, x, dt, A, B, C, y)
    with pytest.raises(ArgumentError, match="start_rows: sequence 0 starts from row 3"):
        cl_device.ssm_scan(pool, cl_device.indices([3, 1]), cl_device.indices([0, 3]), x, dt, A, B, C, y)
    with pytest.raises(ArgumentError, match="y: shares storage with pool"):
        cl_device.ssm_scan(pool, start, cl_device.indices([2, 4]), x, dt, A, B, C, pool.view((n_s, n_t, H, P)))
    with pytest.raises(ArgumentError, match="rows: index 9 out of range"):
        cl_device.zero_rows(pool, cl_device.indices([9]))
    monkeypatch.undo()
    assert_bits_equal(pool.numpy(), before, "pool after refused calls")


def test_copy_buffer_is_a_native_copy(cl_device, rng):
    host = rng.uniform(-1, 1, 1000).astype(np.float32)
    src = cl_device.upload(host)
    dst = cl_device.alloc(1000)
    cl_device.copy_buffer(src, dst)
    cl_device.synchronize()
    assert_bits_equal(dst.numpy(), host, "copy")
    with pytest.raises(ArgumentError, match="dst"):
        cl_device.copy_buffer(src, cl_device.alloc(999))


def test_strided_and_offset_index_buffers(cl_device, ref_dev, rng):
    """Start rows as a strided view and a 2-D snapshot table at an offset
    inside a larger index buffer: the kernels index the right elements."""
    H, P_, N, n_s = 2, 8, 8, 3
    pool_host = rng.uniform(-1, 1, (12, H * P_ * N)).astype(np.float32)
    host = {
        "x": rng.uniform(-1, 1, (5, H, P_)),
        "dt": rng.uniform(-2, 1, (5, H)),
        "A": -rng.uniform(0.1, 1, H),
        "B": rng.uniform(-1, 1, (5, 1, N)),
        "C": rng.uniform(-1, 1, (5, 1, N)),
    }
    results = []
    for dev in (cl_device, ref_dev):
        pool = dev.upload(pool_host)
        start = dev.indices([9, 99, 10, 99, 11]).view((n_s,), (2,), 0)  # rows 9, 10, 11
        tables = dev.indices([[-7, -7], [0, 3], [1, -1], [2, 5]])
        table = tables.view((n_s, 2), offset=2)  # skips the first (junk) row of the buffer
        cu = dev.indices([7, 0, 2, 3, 5]).view((4,), offset=1)  # [0, 2, 3, 5]
        y = dev.alloc((5, H, P_))
        b = {k: dev.upload(v.astype(np.float32)) for k, v in host.items()}
        dev.ssm_scan(pool, start, table, b["x"], b["dt"], b["A"], b["B"], b["C"], y, cu_seqlens=cu)
        results.append((dev.download(pool), dev.download(y)))
    assert nmse(results[0][0], results[1][0]) <= 1e-7
    assert nmse(results[0][1], results[1][1]) <= 1e-7
    assert_bits_equal(np.delete(results[0][0], [0, 1, 2, 3, 5], 0), np.delete(pool_host, [0, 1, 2, 3, 5], 0), "rows")
