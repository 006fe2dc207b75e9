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


# -- torch tensors in, torch's stream, CUDA graphs ----------------------------------------


def _cuda_torch():  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA support")
    return torch


class _MambaStack:
    """A 4-layer Mamba-2 decode step as a runtime writes it: torch projections,
    fresh torch tensors into statecache's conv and scan, states in statecache."""

    def __init__(self, torch, gpu, n_s: int = 2, d_model: int = 64, H: int = 4, P: int = 16, N: int = 32) -> None:  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(0)
        dev = "cuda"
        self.torch, self.gpu, self.n_s, self.H, self.P, self.N = torch, gpu, n_s, H, P, N
        self.d_inner, self.conv_dim = H * P, H * P + 2 * N
        self.layers = []
        for _ in range(4):
            lay = {
                "in_proj": torch.nn.Linear(d_model, 2 * self.d_inner + 2 * N + H, bias=False).to(dev),
                "out_proj": torch.nn.Linear(self.d_inner, d_model, bias=False).to(dev),
                "conv_w": torch.nn.Parameter((torch.randn(self.conv_dim, 4, generator=gen) * 0.3).to(dev)),
                "conv_b": torch.nn.Parameter((torch.randn(self.conv_dim, generator=gen) * 0.1).to(dev)),
                "A": torch.nn.Parameter((-torch.rand(H, generator=gen) - 0.5).to(dev)),
                "D": torch.nn.Parameter(torch.randn(H, generator=gen).to(dev)),
                "dt_bias": torch.nn.Parameter((torch.randn(H, generator=gen) * 0.1).to(dev)),
                "conv_pool": gpu.alloc((n_s, self.conv_dim * 3)),
                "ssm_pool": gpu.alloc((n_s, H * P * N)),
            }
            self.layers.append(lay)
        self.rows = gpu.indices(list(range(n_s))[::-1])
        rng = np.random.default_rng(1)
        self.pool_init = [
            (
                rng.normal(size=lay["conv_pool"].shape).astype(np.float32),
                rng.normal(size=lay["ssm_pool"].shape).astype(np.float32),
            )
            for lay in self.layers
        ]

    def reset(self) -> None:
        for lay, (conv, ssm) in zip(self.layers, self.pool_init):
            self.gpu.write(lay["conv_pool"], conv)
            self.gpu.write(lay["ssm_pool"], ssm)
        self.gpu.synchronize()

    def pools(self) -> list[np.ndarray]:
        return [self.gpu.download(lay[k]) for lay in self.layers for k in ("conv_pool", "ssm_pool")]

    def step(self, h):  # type: ignore[no-untyped-def]
        torch, gpu, n_s, d = self.torch, self.gpu, self.n_s, self.d_inner
        for lay in self.layers:
            zx = lay["in_proj"](h)  # [n_s, 1, ...]: a fresh tensor
            z = zx[..., :d].view(n_s, 1, self.H, self.P)
            xbc = zx[..., d : d + self.conv_dim]
            dt = zx[..., d + self.conv_dim :]
            conv_out = torch.empty(n_s, 1, self.conv_dim, device="cuda")
            y = torch.empty(n_s, 1, self.H, self.P, device="cuda")
            gpu.ssm_conv(lay["conv_pool"], self.rows, self.rows, xbc, lay["conv_w"], conv_out, bias=lay["conv_b"],
                         apply_silu=True)  # fmt: skip
            x = conv_out[..., :d].view(n_s, 1, self.H, self.P)
            B = conv_out[..., d : d + self.N].view(n_s, 1, 1, self.N)
            C = conv_out[..., d + self.N :].view(n_s, 1, 1, self.N)
            gpu.ssm_scan(lay["ssm_pool"], self.rows, self.rows, x, dt, lay["A"], B, C, y, D=lay["D"], z=z,
                         dt_bias=lay["dt_bias"])  # fmt: skip
            h = lay["out_proj"](y.view(n_s, 1, d))
        return h


@pytest.mark.parametrize(
    "op", ["get_rows", "set_rows", "zero_rows", "copy_rows", "ssm_conv", "ssm_scan", "gated_delta_net"]
)
def test_torch_cuda_tensors_on_torch_stream_match_the_reference(gpu, ref, op):  # type: ignore[no-untyped-def]
    """Every argument a torch CUDA tensor (int64 CUDA index tensors included),
    queued on torch's current stream (a side stream here)."""
    from statecache.conformance.tensor_cases import buffers, primitive_calls, results, run

    torch = _cuda_torch()
    torch.cuda.set_device(gpu.index)
    call = primitive_calls(21)[op]
    want = results(ref, call, run(ref, call, buffers(ref)))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert gpu.launch_stream == side.cuda_stream  # torch's current stream, not the device's own
        passed = run(gpu, call, lambda name, host: torch.from_numpy(host).cuda())
    side.synchronize()
    for name in call.written:
        got = passed[name].cpu().numpy()
        if op.endswith("rows"):
            np.testing.assert_array_equal(got, want[name])
        else:
            assert nmse(got, want[name]) <= 1e-7, name


def test_decode_step_is_captured_in_a_cuda_graph(gpu):  # type: ignore[no-untyped-def]
    """A decode step of a torch runtime (projections, fresh tensors into
    statecache's conv and scan) captured with torch.cuda.graph and replayed:
    the same states and outputs as eager steps, and nothing allocated."""
    torch = _cuda_torch()
    from statecache.backends.cuda import device as cuda_device

    torch.cuda.set_device(gpu.index)
    stack = _MambaStack(torch, gpu)
    h = torch.randn(stack.n_s, 1, 64, device="cuda")
    allocations = [0]
    real_init = cuda_device.Allocation.__init__

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        allocations[0] += 1
        real_init(self, *args, **kwargs)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up as torch's docs say: wraps, validated calls, cached offsets
            stack.reset()
            for _ in range(3):
                stack.step(h)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        stack.reset()
        graph = torch.cuda.CUDAGraph()
        cuda_device.Allocation.__init__ = counting  # type: ignore[method-assign]
        try:
            with torch.cuda.graph(graph):
                out = stack.step(h)
        finally:
            cuda_device.Allocation.__init__ = real_init  # type: ignore[method-assign]
        assert allocations[0] == 0
        stack.reset()  # capturing ran nothing; start both runs from the same states
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        replayed_out, replayed_pools = out.cpu().numpy(), stack.pools()
        stack.reset()
        for _ in range(3):
            eager = stack.step(h)
        torch.cuda.synchronize()
    np.testing.assert_allclose(replayed_out, eager.cpu().numpy(), rtol=1e-4, atol=1e-5)
    for got, want in zip(replayed_pools, stack.pools()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
