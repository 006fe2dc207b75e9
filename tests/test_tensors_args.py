"""Torch tensors (any DLPack object) wherever a primitive takes a Buffer.

Every check compares against the same call made with Buffers on the same
device, bitwise: taking a tensor must change nothing but who owns the
memory.  The conformance cases ``device.tensors.*`` hold every backend to the
same behaviour with NumPy arrays; here torch's own tensors, parameters that
require grad, the launch memo's safety when tensors come and go, and the
refusals.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_launch_memo import _count_checks

from statecache.conformance.tensor_cases import buffers, primitive_calls, results, run
from statecache.dtypes import DType
from statecache.errors import ArgumentError
from statecache.registry import get_device

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

HOST_DEVICES = ["reference", "cpu"]
OPS = ("get_rows", "set_rows", "zero_rows", "copy_rows", "ssm_conv", "ssm_scan", "gated_delta_net")


@pytest.fixture(params=HOST_DEVICES)
def dev(request):  # type: ignore[no-untyped-def]
    return get_device(request.param)


def _tensor(host: np.ndarray):  # type: ignore[no-untyped-def]
    """A torch tensor holding ``host`` (bf16 through its bits), sharing nothing with it."""
    if host.dtype == DType.BF16.numpy:
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def _host(t) -> np.ndarray:  # type: ignore[no-untyped-def]
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(DType.BF16.numpy).copy()
    return t.numpy().copy()


@pytest.mark.parametrize("op", OPS)
def test_every_primitive_takes_torch_tensors(dev, op) -> None:  # type: ignore[no-untyped-def]
    call = primitive_calls(11)[op]
    want = results(dev, call, run(dev, call, buffers(dev)))
    passed = run(dev, call, lambda name, host: _tensor(host))
    for name in call.written:
        np.testing.assert_array_equal(_host(passed[name]), want[name], err_msg=f"{op} {name}")


# -- any mix of Buffers, tensors, strided views and arrays ------------------------------

_SCAN = dict(H=2, P=4, N=8, G=1)


def _stateful_hosts(op: str, rng: np.random.Generator, n_s: int) -> tuple[dict[str, np.ndarray], set[str], set[str]]:
    """(args in call order, token-input names, output names) of a decode call
    with every fused option the host devices have."""
    u = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)  # noqa: E731
    rows = rng.permutation(4)[:n_s].astype(np.int64)
    if op == "ssm_conv":
        ch, d_conv = 6, 4
        args = {"pool": u(4, ch * 3), "start_rows": rows, "dst_rows": rows, "x": u(n_s, 1, ch),
                "weight": u(ch, d_conv), "y": u(n_s, 1, ch), "bias": u(ch)}  # fmt: skip
        return args, {"x"}, {"y"}
    if op == "ssm_scan":
        H, Pd, N = _SCAN["H"], _SCAN["P"], _SCAN["N"]
        args = {"pool": u(4, H * Pd * N), "start_rows": rows, "dst_rows": rows, "x": u(n_s, 1, H, Pd),
                "dt": u(n_s, 1, H), "A": -np.abs(u(H)) - 0.5, "B": u(n_s, 1, 1, N), "C": u(n_s, 1, 1, N),
                "y": u(n_s, 1, H, Pd), "D": u(H), "z": u(n_s, 1, H, Pd), "dt_bias": u(H)}  # fmt: skip
        return args, {"x", "dt", "B", "C", "z"}, {"y"}
    Hv, S = 2, 4
    args = {"pool": u(4, Hv * S * S), "start_rows": rows, "dst_rows": rows, "q": u(n_s, 1, Hv, S),
            "k": u(n_s, 1, Hv, S) / 2, "v": u(n_s, 1, Hv, S), "g": -np.abs(u(n_s, 1, Hv)),
            "beta": np.abs(u(n_s, 1, Hv)), "o": u(n_s, 1, Hv, S)}  # fmt: skip
    return args, {"q", "k", "v", "g", "beta"}, {"o"}


_POSITIONAL = {
    "ssm_conv": ("pool", "start_rows", "dst_rows", "x", "weight", "y"),
    "ssm_scan": ("pool", "start_rows", "dst_rows", "x", "dt", "A", "B", "C", "y"),
    "gated_delta_net": ("pool", "start_rows", "dst_rows", "q", "k", "v", "g", "beta", "o"),
}


def _padded(host: np.ndarray, pad: int) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...], int]:
    """``host`` inside a larger array whose last axis has ``pad`` extra
    elements: (the larger array, then the view's shape, strides, offset in elements)."""
    big = np.zeros((*host.shape[:-1], host.shape[-1] + pad), dtype=host.dtype)
    big[..., 1 : 1 + host.shape[-1]] = host
    strides = tuple(s // host.itemsize for s in big.strides)
    return big, host.shape, strides, 1


def _make(dev, host: np.ndarray, kind: str, strided: bool):  # type: ignore[no-untyped-def]
    """One argument as ``kind`` ("buffer", "tensor", "array"), optionally a
    strided view; the geometry is the same whatever the kind."""
    if host.dtype.kind == "i":
        return dev.indices(host) if kind == "buffer" else host if kind == "array" else torch.from_numpy(host.copy())
    if not strided:
        if kind == "buffer":
            return dev.upload(host, DType.parse(host.dtype))
        return host.copy() if kind == "array" else _tensor(host)
    big, shape, strides, offset = _padded(host, 3)
    if kind == "buffer":
        return dev.upload(big, DType.parse(big.dtype)).view(shape, strides, offset)
    if kind == "array":
        return big[..., 1 : 1 + shape[-1]]
    return _tensor(big)[..., 1 : 1 + shape[-1]]


def _read(dev, value) -> np.ndarray:  # type: ignore[no-untyped-def]
    if isinstance(value, np.ndarray):
        return value.copy()
    if hasattr(value, "detach"):
        return _host(value)
    return dev.download(value)


@given(
    op=st.sampled_from(["ssm_conv", "ssm_scan", "gated_delta_net"]),
    device=st.sampled_from(HOST_DEVICES),
    n_s=st.integers(1, 3),
    dtype=st.sampled_from([DType.F32, DType.F16, DType.BF16]),
    kinds=st.lists(st.sampled_from(["buffer", "tensor", "array"]), min_size=13, max_size=13),
    strided=st.lists(st.booleans(), min_size=13, max_size=13),
    index_dtype=st.sampled_from([np.int32, np.int64]),
    seed=st.integers(0, 2**16),
)
def test_any_mix_of_buffers_tensors_and_views_gives_the_buffer_result(  # type: ignore[no-untyped-def]
    op, device, n_s, dtype, kinds, strided, index_dtype, seed
) -> None:
    dev = get_device(device)
    rng = np.random.default_rng(seed)
    hosts, token_inputs, outputs = _stateful_hosts(op, rng, n_s)
    for name in token_inputs | outputs:  # activations in the drawn dtype, the same on both sides
        hosts[name] = hosts[name].astype(dtype.numpy)
    for name in ("start_rows", "dst_rows"):
        hosts[name] = hosts[name].astype(index_dtype)
    calls = []
    for mixed in (False, True):
        args = {}
        for i, (name, host) in enumerate(hosts.items()):
            kind = kinds[i] if mixed else "buffer"
            if name in outputs or name == "pool":
                view = False  # written: contiguous
            else:
                view = strided[i] and name in token_inputs
            args[name] = _make(dev, host, kind, view)
        if hosts["start_rows"] is not None and kinds[1] == kinds[2] and mixed:
            args["dst_rows"] = args["start_rows"]  # one object as both, as decode passes it
        positional = [args[n] for n in _POSITIONAL[op]]
        keywords = {n: v for n, v in args.items() if n not in _POSITIONAL[op]}
        getattr(dev, op)(*positional, **keywords)
        calls.append({name: _read(dev, args[name]) for name in ("pool", *outputs)})
    for name, want in calls[0].items():
        np.testing.assert_array_equal(calls[1][name], want, err_msg=f"{op} {name} on {device}")


# -- indices ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_index_tensors_int32_and_int64(dev, dtype) -> None:  # type: ignore[no-untyped-def]
    call = primitive_calls(5)["copy_rows"]
    want = results(dev, call, run(dev, call, buffers(dev)))
    passed = run(dev, call, lambda name, host: torch.from_numpy(host).to(dtype) if name.endswith("rows") else host)
    np.testing.assert_array_equal(passed["dst"], want["dst"])


def test_index_past_int32_is_refused_naming_the_argument(dev) -> None:  # type: ignore[no-untyped-def]
    src, dst = dev.upload(np.ones((4, 3), np.float32)), dev.alloc((2, 3))
    with pytest.raises(ArgumentError, match="rows: index 4294967296 does not fit in int32"):
        dev.get_rows(src, torch.tensor([0, 2**32]), dst)
    with pytest.raises(ArgumentError, match=r"rows: dtype bool is not an index type"):
        dev.get_rows(src, torch.tensor([True, False]), dst)
    np.testing.assert_array_equal(dev.download(dst), np.zeros((2, 3), np.float32))


def _scan_setup(dev, n_s: int = 2):  # type: ignore[no-untyped-def]
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(3), n_s)
    for name in ("D", "z", "dt_bias"):
        hosts.pop(name)
    return hosts


def _scan(dev, hosts, **over):  # type: ignore[no-untyped-def]
    args = {n: over.get(n, hosts[n]) for n in _POSITIONAL["ssm_scan"]}
    dev.ssm_scan(*args.values())
    return args


def test_index_tensor_freed_and_reused_at_its_address_is_read_again(dev) -> None:  # type: ignore[no-untyped-def]
    """The launch memo remembers validated index values; an index tensor freed
    and reallocated at the same address with the same geometry (same
    fingerprint) but other contents must be validated again."""
    hosts = _scan_setup(dev)
    pool = dev.upload(hosts["pool"])
    memory = np.array([0, 1], dtype=np.int64)  # the "allocator": every tensor below lives here
    first = torch.from_numpy(memory)
    _scan(dev, hosts, pool=pool, start_rows=first, dst_rows=first)
    _scan(dev, hosts, pool=pool, start_rows=first, dst_rows=first)  # remembered now
    address = first.data_ptr()
    del first
    gc.collect()
    before = dev.download(pool)
    memory[:] = [0, 9]
    second = torch.from_numpy(memory)
    assert second.data_ptr() == address
    with pytest.raises(ArgumentError, match="index 9 out of range"):
        _scan(dev, hosts, pool=pool, start_rows=second, dst_rows=second)
    np.testing.assert_array_equal(dev.download(pool), before)
    memory[:] = [3, 2]  # valid again, other rows: the call must use them
    third = torch.from_numpy(memory)
    _scan(dev, hosts, pool=pool, start_rows=third, dst_rows=third)
    ref = dev.upload(before)
    rows = dev.indices([3, 2])
    _scan(dev, hosts, pool=ref, start_rows=rows, dst_rows=rows)
    np.testing.assert_array_equal(dev.download(pool), dev.download(ref))


def test_index_tensor_rewritten_in_place_takes_effect(dev) -> None:  # type: ignore[no-untyped-def]
    src = dev.upload(np.arange(12, dtype=np.float32).reshape(4, 3))
    dst = torch.zeros(2, 3)
    rows = torch.tensor([3, 1])
    dev.get_rows(src, rows, dst)
    dev.get_rows(src, rows, dst)
    rows.copy_(torch.tensor([0, 2]))
    dev.get_rows(src, rows, dst)
    np.testing.assert_array_equal(dst.numpy(), np.arange(12, dtype=np.float32).reshape(4, 3)[[0, 2]])
    rows[1] = 4
    with pytest.raises(ArgumentError, match="rows: index 4 out of range"):
        dev.get_rows(src, rows, dst)


def test_float_input_freed_and_reused_at_its_address_reads_the_new_values(dev) -> None:  # type: ignore[no-untyped-def]
    src = dev.upload(np.arange(12, dtype=np.float32).reshape(4, 3))
    rows = dev.indices([1, 0])
    memory = np.zeros((4, 3), np.float32)
    for fill in (1.0, 2.0):
        memory[:] = fill
        t = torch.from_numpy(memory)  # the same address and geometry every time
        dev.copy_rows(src, rows, t, rows)
        np.testing.assert_array_equal(memory[:2], np.arange(12, dtype=np.float32).reshape(4, 3)[[0, 1]])
        np.testing.assert_array_equal(memory[2:], fill)
        del t


# -- grad, memo, lifetimes -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad_enabled"])
def test_parameters_that_require_grad(dev, mode) -> None:  # type: ignore[no-untyped-def]
    hosts = _scan_setup(dev)
    want_pool = dev.upload(hosts["pool"])
    want_y = dev.alloc(hosts["y"].shape)
    _scan(dev, hosts, pool=want_pool, y=want_y, start_rows=dev.indices(hosts["start_rows"]),
          dst_rows=dev.indices(hosts["dst_rows"]))  # fmt: skip
    A = torch.nn.Parameter(torch.from_numpy(hosts["A"].copy()))
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    pool = dev.upload(hosts["pool"])
    with ctx() if ctx else torch.enable_grad():
        y = torch.zeros(hosts["y"].shape)
        _scan(dev, hosts, pool=pool, y=y, A=A)
    assert A.requires_grad and A.grad is None and y.grad_fn is None
    np.testing.assert_array_equal(y.numpy(), dev.download(want_y))
    np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool))


def test_fresh_tensors_every_call_are_validated_once(dev, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What nn.Linear returns: new tensors every step.  Kept alive here, so
    each step's land at new addresses: remembered by geometry."""
    calls = _count_checks(monkeypatch)
    hosts = _scan_setup(dev)
    pool, rows = dev.upload(hosts["pool"]), dev.indices(hosts["start_rows"])
    ref_pool = dev.upload(hosts["pool"])
    keep = []
    for step in range(4):
        fresh = {n: torch.from_numpy(hosts[n] * (step + 1)) for n in ("x", "dt", "B", "C")}
        y, ref_y = torch.zeros(hosts["y"].shape), dev.alloc(hosts["y"].shape)
        _scan(dev, hosts, pool=pool, start_rows=rows, dst_rows=rows, y=y, **fresh)
        keep.append((fresh, y))
        bufs = {n: dev.upload(t.numpy()) for n, t in fresh.items()}
        _scan(dev, hosts, pool=ref_pool, start_rows=rows, dst_rows=rows, y=ref_y, **bufs)
        np.testing.assert_array_equal(y.numpy(), dev.download(ref_y))
    assert len({t["x"].data_ptr() for t, _ in keep}) == 4
    # The tensor calls: validated once; the Buffer calls: once per step (new Buffers each step).
    assert calls[0] == 1 + 4
    np.testing.assert_array_equal(dev.download(pool), dev.download(ref_pool))


def _temporary(host: np.ndarray, freed: list[str], name: str):  # type: ignore[no-untyped-def]
    """A tensor holding ``host`` that says in ``freed`` when it is collected."""
    t = torch.from_numpy(host.copy())
    weakref.finalize(t, freed.append, name)
    return t


def test_temporary_tensors_stay_allocated_until_the_kernel_ran(dev, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``dev.ssm_scan(..., torch.empty(...))``: the caller keeps no reference,
    so the primitive's own parameters are the last ones; none may be dropped
    before the kernel ran (regression: rebinding them to Buffers freed the
    tensors mid-call, the kernel wrote into memory the allocator had handed
    out again, and the process crashed later)."""
    hosts = _scan_setup(dev)
    pool, rows = dev.upload(hosts["pool"]), dev.indices(hosts["start_rows"])
    freed: list[str] = []
    at_launch: list[list[str]] = []
    impl = dev._ssm_scan

    def launch(*args):  # type: ignore[no-untyped-def]
        at_launch.append(list(freed))
        impl(*args)

    monkeypatch.setattr(dev, "_ssm_scan", launch)
    monkeypatch.setattr(dev, "_prepare_launch", lambda op, args: None)  # every launch through _ssm_scan
    h = hosts
    # Written out, not unpacked from a sequence: a caller's tuple would keep them alive.
    dev.ssm_scan(
        pool, rows, rows, _temporary(h["x"], freed, "x"), _temporary(h["dt"], freed, "dt"),
        _temporary(h["A"], freed, "A"), _temporary(h["B"], freed, "B"), _temporary(h["C"], freed, "C"),
        _temporary(np.zeros_like(h["y"]), freed, "y"),
    )  # fmt: skip
    gc.collect()
    assert at_launch == [[]]
    assert sorted(freed) == ["A", "B", "C", "dt", "x", "y"]


def test_wraps_do_not_keep_tensors_alive(dev) -> None:  # type: ignore[no-untyped-def]
    src = torch.arange(12.0).reshape(4, 3)
    dst = torch.zeros(2, 3)
    dev.get_rows(src, torch.tensor([1, 2]), dst)
    refs = [weakref.ref(src), weakref.ref(dst)]
    del src, dst
    gc.collect()
    assert all(r() is None for r in refs)


def test_buffer_only_calls_pass_through_untouched(dev) -> None:  # type: ignore[no-untyped-def]
    buf = dev.alloc((2, 2))
    args = (buf, None, buf)
    assert dev._tensors_in("a b c*", *args) == args
    assert dev._wraps is None or all(w.buffer is not buf for w in dev._wraps._wraps.values())


# -- refusals --------------------------------------------------------------------------


def test_overlapping_tensor_views_are_refused(dev) -> None:  # type: ignore[no-untyped-def]
    hosts = _scan_setup(dev)
    pool = dev.upload(hosts["pool"])
    before = dev.download(pool)
    shape = hosts["x"].shape
    n = int(np.prod(shape))
    storage = torch.zeros(2 * n)
    x = storage[:n].view(shape)
    y_over_x = storage[n // 2 : n // 2 + n].view(shape)  # another tensor over part of x's memory
    with pytest.raises(ArgumentError, match="y: shares storage with x"):
        _scan(dev, hosts, pool=pool, x=x, y=y_over_x)
    # a pool given as a tensor over an input's memory
    flat = torch.zeros(hosts["pool"].size + n)
    pool_t = flat[: hosts["pool"].size].view(hosts["pool"].shape)
    x_in_pool = flat[hosts["pool"].size - n // 2 :][:n].view(shape)
    with pytest.raises(ArgumentError, match="x: overlaps the state pool"):
        _scan(dev, hosts, pool=pool_t, x=x_in_pool)
    np.testing.assert_array_equal(dev.download(pool), before)
    # disjoint views of one storage are fine (x, B, C split from one conv output)
    y_apart = storage[n:].view(shape)
    _scan(dev, hosts, pool=pool, x=x, y=y_apart)


def test_overlap_is_checked_again_when_a_remembered_shape_comes_back(dev) -> None:  # type: ignore[no-untyped-def]
    """A call remembered by geometry (tensors at new addresses) must not skip
    the overlap check: the same shapes may now share memory."""
    hosts = _scan_setup(dev)
    pool = dev.upload(hosts["pool"])
    shape = hosts["x"].shape
    n = int(np.prod(shape))
    apart = torch.zeros(2 * n)
    _scan(dev, hosts, pool=pool, x=apart[:n].view(shape), y=apart[n:].view(shape))
    over = torch.zeros(2 * n)
    with pytest.raises(ArgumentError, match="y: shares storage with x"):
        _scan(dev, hosts, pool=pool, x=over[:n].view(shape), y=over[1 : 1 + n].view(shape))


def test_copy_rows_between_overlapping_tensors_is_refused(dev) -> None:  # type: ignore[no-untyped-def]
    storage = torch.arange(24.0)
    a, b = storage[:18].view(6, 3), storage[6:].view(6, 3)
    with pytest.raises(ArgumentError, match="dst: overlaps src"):
        dev.copy_rows(a, torch.tensor([0]), b, torch.tensor([5]))
    # one tensor as both: rows are compared (planes of one pool)
    dev.copy_rows(a, torch.tensor([0]), a, torch.tensor([5]))
    np.testing.assert_array_equal(storage[15:18].numpy(), [0.0, 1.0, 2.0])


def test_bad_tensors_are_named(dev) -> None:  # type: ignore[no-untyped-def]
    src = dev.upload(np.ones((4, 3), np.float32))
    rows = dev.indices([0, 1])
    with pytest.raises(ArgumentError, match="dst: dtype float64 must be float32, float16 or bfloat16"):
        dev.get_rows(src, rows, torch.zeros(2, 3, dtype=torch.float64))
    # a float index tensor: the message also names the index dtypes
    with pytest.raises(ArgumentError, match=r"rows: dtype float64 must be .* or int32/int64 \(row indices\)"):
        dev.get_rows(src, torch.zeros(2, dtype=torch.float64), dev.alloc((2, 3)))
    with pytest.raises(ArgumentError, match="dst: expected a Buffer, got list"):
        dev.get_rows(src, rows, [[0.0] * 3] * 2)
    frozen = np.zeros((2, 3), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ArgumentError, match="dst: is a read-only tensor"):
        dev.get_rows(src, rows, frozen)
    with pytest.raises(ArgumentError, match="src: has negative strides"):
        dev.get_rows(np.ones((4, 3), np.float32)[::-1], rows, dev.alloc((2, 3)))
    dev.get_rows(frozen, rows, dev.alloc((2, 3)))  # read-only is fine where the primitive only reads


class _LyingTensor:
    """A DLPack producer with torch-like methods whose data_ptr is wrong."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype
        self.device = "cpu"

    def data_ptr(self) -> int:
        return 64  # not where the elements are

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def __dlpack__(self, **kwargs):  # type: ignore[no-untyped-def]
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):  # type: ignore[no-untyped-def]
        return self.array.__dlpack_device__()


def test_a_type_whose_methods_disagree_with_its_export_is_exported_every_call(dev) -> None:  # type: ignore[no-untyped-def]
    from statecache import dlpack

    src = dev.upload(np.arange(12, dtype=np.float32).reshape(4, 3))
    rows = dev.indices([2, 0])
    for fill in (1.0, 2.0):
        out = np.full((2, 3), fill, np.float32)
        dev.get_rows(src, rows, _LyingTensor(out))
        np.testing.assert_array_equal(out, np.arange(12, dtype=np.float32).reshape(4, 3)[[2, 0]])
    assert dlpack.reader_for(_LyingTensor) is dlpack.export_fingerprint


def test_opencl_copies_host_inputs_in_and_refuses_host_outputs() -> None:
    try:
        dev = get_device("opencl")
    except Exception as exc:  # any reason the backend is missing
        pytest.skip(f"no opencl device: {exc}")
    host = np.arange(12, dtype=np.float32).reshape(4, 3)
    src = torch.from_numpy(host.copy())
    dst = dev.alloc((2, 3))
    rows = torch.tensor([3, 1])
    dev.get_rows(src, rows, dst)
    src.mul_(10)  # the same tensor, changed in place: copied in again
    dev.get_rows(src, rows, dst)
    np.testing.assert_array_equal(dev.download(dst), 10 * host[[3, 1]])
    with pytest.raises(ArgumentError, match="dst: is a host tensor, which opencl:0 cannot write in place"):
        dev.get_rows(dev.upload(host), rows, torch.zeros(2, 3))


def test_a_torch_negative_view_is_refused_not_read_without_its_sign(dev) -> None:  # type: ignore[no-untyped-def]
    """torch exports a lazy negation view's memory as it is (the values
    without their sign); reading it would hand the kernel the wrong numbers.
    Refused, also in a geometry the device has read before."""
    rows = dev.indices([0, 1])
    src = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    dst = dev.alloc((2, 3))
    dev.get_rows(src, rows, dst)  # the geometry is now known
    assert np.array_equal(dev.download(dst), src.numpy()[:2])
    neg = torch.arange(12, dtype=torch.float32).reshape(4, 3)._neg_view()
    assert neg.is_neg()
    before = dev.download(dst).copy()
    with pytest.raises(ArgumentError, match=r"src: .*negative bit"):
        dev.get_rows(neg, rows, dst)
    assert np.array_equal(dev.download(dst), before)
    dev.get_rows(neg.resolve_neg(), rows, dst)
    assert np.array_equal(dev.download(dst), -src.numpy()[:2])
    # A view of the very tensor read before: its address, shape and strides too.
    for _ in range(3):
        dev.get_rows(src, rows, dst)
    with pytest.raises(ArgumentError, match=r"src: .*negative bit"):
        dev.get_rows(src._neg_view(), rows, dst)
    assert np.array_equal(dev.download(dst), src.numpy()[:2])
