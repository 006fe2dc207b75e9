"""Checks that need a CUDA GPU (marked ``cuda``; skipped, with the CUDA
runtime's reason, only where no device exists).

The kernel-by-kernel comparison against the reference runs in
test_cuda_kernels.py on the GPU too; here: launch geometries of the real
model shapes (several row rounds per block, 8/16/32-lane groups), async
ordering on the stream, device-to-device copy, and zero-copy export to torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from statecache.dtypes import DType

pytestmark = pytest.mark.cuda


@pytest.fixture
def ref():
    from statecache.registry import BackendRegistry

    return BackendRegistry(allowlist=["reference"]).get_device("reference")


def nmse(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sum((got - want) ** 2) / max(np.sum(want**2), 1e-30))


@pytest.mark.parametrize(
    ("n_s", "n_t", "H", "P", "N", "G", "n_snap"),
    [
        (4, 32, 1024, 1, 16, 1, 1),  # Mamba-1 (spec §9)
        (4, 32, 16, 64, 128, 2, 1),  # Mamba-2
        (4, 32, 8, 64, 256, 2, 1),  # Falcon-H1
        (32, 1, 32, 64, 128, 1, 4),  # decode with snapshot planes, 32 sequences
    ],
)
def test_scan_model_shapes(gpu, ref, rng, n_s, n_t, H, P, N, G, n_snap):
    ps = n_s
    dst = 1 + rng.permutation(n_s)
    start = 1 + n_snap * n_s + rng.permutation(n_s)
    n_rows = 2 + (n_snap + 1) * n_s
    pool_host = rng.normal(size=(n_rows, H * P * N)).astype(np.float32)
    x_host = rng.normal(size=(n_s, n_t, H, P)).astype(np.float32)
    dt_host = rng.normal(size=(n_s, n_t, H)).astype(np.float32)
    A_host = -np.exp(rng.normal(size=(H, N) if P == 1 else (H,))).astype(np.float32)
    B_host = rng.normal(size=(n_s, n_t, G, N)).astype(np.float32)
    C_host = rng.normal(size=(n_s, n_t, G, N)).astype(np.float32)
    outs = []
    for dev in (gpu, ref):
        pool = dev.upload(pool_host)
        y = dev.alloc((n_s, n_t, H, P))
        dev.ssm_scan(
            pool, dev.indices(start), dev.indices(dst), dev.upload(x_host), dev.upload(dt_host),
            dev.upload(A_host), dev.upload(B_host), dev.upload(C_host), y, n_snap=n_snap, plane_stride=ps,
        )  # fmt: skip
        outs.append((pool.numpy(), y.numpy()))
    assert nmse(outs[0][1], outs[1][1]) <= 1e-7
    assert nmse(outs[0][0], outs[1][0]) <= 1e-7
    untouched = sorted(set(range(n_rows)) - {int(d) + j * ps for d in dst for j in range(min(n_t + 1, n_snap))})
    np.testing.assert_array_equal(outs[0][0][untouched], pool_host[untouched])


def test_large_rows_and_copy_buffer(gpu, rng):
    rows = 32
    E = 1 << 18  # 1 MiB of f32 per row
    host = rng.normal(size=(rows, E)).astype(np.float32)
    src = gpu.upload(host)
    idx = rng.permutation(rows)
    out = gpu.alloc((rows, E))
    gpu.get_rows(src, gpu.indices(idx), out)
    back = gpu.alloc((rows, E))
    gpu.set_rows(back, gpu.indices(idx), out)
    copy = gpu.alloc((rows, E))
    gpu.copy_buffer(back, copy)
    np.testing.assert_array_equal(out.numpy(), host[idx])
    np.testing.assert_array_equal(copy.numpy(), host)


def test_launches_are_ordered_on_the_stream(gpu):
    # A chain of dependent async operations with no synchronize in between.
    buf = gpu.upload(np.arange(8, dtype=np.float32).reshape(4, 2))
    other = gpu.alloc((4, 2))
    for _ in range(50):
        gpu.copy_rows(buf, gpu.indices([0, 1, 2, 3]), other, gpu.indices([1, 2, 3, 0]))
        gpu.copy_rows(other, gpu.indices([0, 1, 2, 3]), buf, gpu.indices([0, 1, 2, 3]))
    expected = np.arange(8, dtype=np.float32).reshape(4, 2)
    for _ in range(50):
        expected = expected[[3, 0, 1, 2]]
    np.testing.assert_array_equal(buf.numpy(), expected)


def test_zero_copy_with_torch(gpu):
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA support")
    buf = gpu.upload(np.arange(6, dtype=np.float32).reshape(2, 3))
    t = torch.from_dlpack(buf)
    assert t.device.type == "cuda" and t.data_ptr() == buf.data_ptr()
    t.mul_(2)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(buf.numpy(), 2 * np.arange(6, dtype=np.float32).reshape(2, 3))
    t2 = torch.as_tensor(buf.view((2, 2), (3, 1), 1), device="cuda")  # __cuda_array_interface__
    assert t2.data_ptr() == buf.data_ptr() + 4
    bf = gpu.upload(np.ones(4, dtype=np.float32), DType.BF16)
    assert torch.from_dlpack(bf).dtype == torch.bfloat16
