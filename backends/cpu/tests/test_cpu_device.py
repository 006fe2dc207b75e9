"""CPU device beyond the primitive math: conversions, refusals that write
nothing, zero-copy with NumPy and torch, ABI and availability checks."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from cpu_cases import cpu_device

from statecache import settings
from statecache.backends.cpu import device as cpu_mod
from statecache.dtypes import DType
from statecache.errors import ArgumentError
from statecache.registry import BackendRegistry


def _special_floats() -> np.ndarray:
    """Every exponent, random mantissas, plus NaNs (quiet and signalling),
    infinities, zeros, subnormals and f16/bf16 rounding ties."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    extra = np.array(
        [0x7FC00000, 0x7F800001, 0xFFA00000, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF, 0x33000000,
         0x33000001, 0x387FE000, 0x38800000, 0x477FE000, 0x477FF000, 0x3F801000, 0x3F803000, 0x3F808000],
        dtype=np.uint32,
    )  # fmt: skip
    return np.concatenate([bits, extra]).view(np.float32)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
def test_conversions_match_numpy_and_ml_dtypes_bitwise(dtype: DType) -> None:
    ffi, lib, _ = cpu_mod.load_kernels()
    src = _special_floats()
    out = np.zeros(src.size, dtype=np.uint16)
    lib.sc_convert(ffi.from_buffer(src), 0, ffi.from_buffer(out), cpu_mod._DTYPE_CODE[dtype], src.size)
    with np.errstate(over="ignore", invalid="ignore"):
        want = src.astype(dtype.numpy).view(np.uint16)
    bad = np.flatnonzero(out != want)
    assert bad.size == 0, (
        f"{bad.size} differ, first {src.view(np.uint32)[bad[0]]:#x}: {out[bad[0]]:#x} != {want[bad[0]]:#x}"
    )
    # widening back is exact, NaN payloads included
    back = np.zeros(src.size, dtype=np.float32)
    lib.sc_convert(ffi.from_buffer(want), cpu_mod._DTYPE_CODE[dtype], ffi.from_buffer(back), 0, src.size)
    assert (back.view(np.uint32) == want.view(dtype.numpy).astype(np.float32).view(np.uint32)).all()


# -- refusals --------------------------------------------------------------------


def _scan_setup(dev):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    n_s, n_t, H, P, N, G = 2, 3, 4, 8, 16, 2
    f = lambda *shape: dev.upload(rng.uniform(-1, 1, shape).astype(np.float32))  # noqa: E731
    return dict(
        pool=f(8, H * P * N),
        start_rows=dev.indices([0, 1]),
        dst_rows=dev.indices([2, 3]),
        x=f(n_s, n_t, H, P),
        dt=f(n_s, n_t, H),
        A=f(H),
        B=f(n_s, n_t, G, N),
        C=f(n_s, n_t, G, N),
        y=f(n_s, n_t, H, P),
    )


def _snapshot(bufs: dict) -> dict:  # type: ignore[type-arg]
    return {k: np.asarray(v).copy() for k, v in bufs.items()}


@pytest.mark.parametrize(
    "change,argument",
    [
        (lambda d, b: b.update(dt=d.alloc((2, 3, 5))), "dt"),  # shape mismatch
        (lambda d, b: b.update(start_rows=d.indices([0, 99])), "start_rows"),  # out of range
        (lambda d, b: b.update(dst_rows=d.indices([2, 2])), "dst_rows"),  # duplicate destinations
        (lambda d, b: b.update(A=d.alloc((4, 16)), x=d.alloc((2, 3, 4, 1)), y=d.alloc((2, 3, 4, 1))), "A"),
        (lambda d, b: b.update(B=d.alloc((2, 3, 2, 16), "i32")), "B"),  # wrong dtype
        (lambda d, b: b.update(start_rows=d.indices([3, 1])), "start_rows"),  # another sequence's destination
    ],
)
def test_invalid_scan_arguments_raise_before_anything_is_written(change, argument: str) -> None:  # type: ignore[no-untyped-def]
    dev = cpu_device()
    bufs = _scan_setup(dev)
    change(dev, bufs)
    before = _snapshot(bufs)
    with pytest.raises(ArgumentError) as info:
        dev.ssm_scan(**bufs)
    assert info.value.argument == argument
    for name, value in _snapshot(bufs).items():
        np.testing.assert_array_equal(value.view(np.uint8), before[name].view(np.uint8), err_msg=name)


def test_mamba1_writes_snapshot_planes_like_the_reference() -> None:
    """Mamba-1 scans write snapshot planes (n_snap > 1), as Mamba-2 ones do."""
    from statecache.registry import get_device

    rng = np.random.default_rng(2)
    host = {
        "pool": rng.uniform(-1, 1, (8, 4 * 16)),
        "x": rng.uniform(-1, 1, (1, 2, 4, 1)),
        "dt": rng.uniform(-1, 1, (1, 2, 4)),
        "A": -rng.uniform(0.1, 1, (4, 16)),
        "B": rng.uniform(-1, 1, (1, 2, 1, 16)),
        "C": rng.uniform(-1, 1, (1, 2, 1, 16)),
    }
    pools = []
    for dev in (cpu_device(), get_device("reference")):
        b = {k: dev.upload(v.astype(np.float32)) for k, v in host.items()}
        y = dev.alloc((1, 2, 4, 1))
        dev.ssm_scan(b["pool"], dev.indices([0]), dev.indices([1]), b["x"], b["dt"], b["A"], b["B"], b["C"], y,
                     n_snap=3, plane_stride=2)  # fmt: skip
        pools.append(dev.download(b["pool"]))
    np.testing.assert_allclose(pools[0], pools[1], rtol=1e-5, atol=1e-6)
    # rows 1, 3 and 5 (final state, one token back, the input state) were written; nothing else
    np.testing.assert_array_equal(pools[0][[0, 2, 4, 6, 7]], host["pool"].astype(np.float32)[[0, 2, 4, 6, 7]])
    np.testing.assert_array_equal(pools[0][5], host["pool"].astype(np.float32)[0])


def test_duplicate_scatter_destination_is_refused() -> None:
    dev = cpu_device()
    dst = dev.upload(np.arange(12, dtype=np.float32).reshape(4, 3))
    with pytest.raises(ArgumentError, match="duplicate") as info:
        dev.set_rows(dst, dev.indices([1, 1]), dev.upload(np.ones((2, 3), np.float32)))
    assert info.value.argument == "rows"
    np.testing.assert_array_equal(np.asarray(dst), np.arange(12, dtype=np.float32).reshape(4, 3))
    with pytest.raises(ArgumentError, match="out of range"):
        dev.get_rows(dst, dev.indices([4]), dev.alloc((1, 3)))
    with pytest.raises(ArgumentError, match="storage dtype") as info:
        dev.get_rows(dev.alloc((2, 3), DType.I32), dev.indices([0]), dev.alloc((1, 3)))
    assert info.value.argument == "src"


# -- zero copy ---------------------------------------------------------------------


def test_numpy_sees_buffers_in_place_both_ways() -> None:
    dev = cpu_device()
    buf = dev.alloc((4, 8), "f32")
    view = np.asarray(buf)
    assert view.ctypes.data == buf.address and view.flags.writeable
    view[2, 3] = 7.0
    assert dev.download(buf)[2, 3] == 7.0
    host = np.zeros((5, 8), np.float32)
    wrapped = dev.from_numpy(host)
    dev.get_rows(buf, dev.indices([2]), wrapped.view((1, 8), offset=16))
    assert host[2, 3] == 7.0
    # a strided host array wraps as a strided view of the same memory
    strided = np.zeros((4, 16), np.float32)[:, ::2]
    sv = dev.from_numpy(strided)
    assert sv.strides == (16, 2) and np.shares_memory(np.asarray(sv), strided)
    with pytest.raises(ArgumentError, match="read-only"):
        ro = np.zeros(3, np.float32)
        ro.flags.writeable = False
        dev.from_numpy(ro)


def test_index_buffers_exported_for_writing_are_revalidated() -> None:
    dev = cpu_device()
    rows = dev.indices([0, 1])
    np.asarray(rows)[1] = 50  # written behind the validator's back
    with pytest.raises(ArgumentError, match="out of range"):
        dev.get_rows(dev.alloc((4, 2)), rows, dev.alloc((2, 2)))


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_zero_copy_with_torch_both_ways(dtype: str) -> None:
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    tdtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    dev = cpu_device()
    # device buffer -> torch
    buf = dev.upload(np.arange(24, dtype=np.float32).reshape(4, 6), dtype)
    t = torch.from_dlpack(buf)
    assert t.dtype == tdtype and t.shape == (4, 6) and t.data_ptr() == buf.address
    t[1, 2] = -3.0
    assert float(dev.download(buf)[1, 2]) == -3.0
    dev.zero_rows(buf, dev.indices([3]))
    assert bool((t[3] == 0).all())
    # torch -> device buffer: a kernel writes straight into the tensor
    target = torch.full((3, 6), 9.0, dtype=tdtype)
    wrapped = dev.from_dlpack(target)
    assert wrapped.dtype is DType.parse(dtype) and wrapped.address == target.data_ptr()
    dev.get_rows(buf, dev.indices([1, 0]), wrapped.view((2, 6), offset=6))
    np.testing.assert_array_equal(target[1:].float().numpy(), dev.download(buf)[[1, 0]].astype(np.float32))
    assert bool((target[0] == 9.0).all())
    # a non-contiguous tensor view keeps its strides
    cols = torch.zeros(4, 8, dtype=tdtype)[:, 1::2]
    wrapped = dev.from_dlpack(cols)
    assert wrapped.strides == (8, 2) and wrapped.address == cols.data_ptr()


def test_bf16_dlpack_roundtrip_without_torch() -> None:
    dev = cpu_device()
    buf = dev.upload(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), "bf16")
    again = dev.from_dlpack(buf)
    assert again.address == buf.address and again.dtype is DType.BF16
    assert np.asarray(again).dtype == np.dtype(ml_dtypes.bfloat16)


# -- ABI, build, availability -------------------------------------------------------------


def test_header_cdef_and_python_agree_on_the_abi_version() -> None:
    from statecache.backends.cpu import build

    _, lib, reason = cpu_mod.load_kernels()
    assert reason == ""
    header = build.cdef_source()
    declared = int(re.search(r"#define SC_CPU_ABI_VERSION (\d+)", header).group(1))  # type: ignore[union-attr]
    assert declared == lib.sc_cpu_abi_version() == lib.SC_CPU_ABI_VERSION == cpu_mod.ABI_VERSION
    for name in re.findall(r"\b(sc_\w+)\s*\(", header):
        assert hasattr(lib, name), f"{name} is declared in the header but not exported"


def test_mismatched_abi_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    built = cpu_mod.ABI_VERSION
    monkeypatch.setattr(cpu_mod, "ABI_VERSION", 999)
    cpu_mod.load_kernels.cache_clear()
    try:
        ok, reason = cpu_mod.CpuBackend().availability()
        assert not ok and f"ABI version {built}" in reason and "999" in reason
    finally:
        monkeypatch.undo()
        cpu_mod.load_kernels.cache_clear()


def test_the_loaded_kernels_were_built_from_the_sources_beside_them() -> None:
    # Fails on a stale editable build (sources edited or pulled since the
    # install), which would otherwise test an old binary against new sources.
    from statecache.backends.cpu import build

    ffi, lib, reason = cpu_mod.load_kernels()
    assert reason == ""
    assert ffi.string(lib.sc_cpu_source_digest()).decode() == build.source_digest()


def test_kernels_built_from_other_sources_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from statecache.backends.cpu import build

    # The same files with one byte of one source changed, as after an edit or a pull.
    for name in build.KERNEL_FILES:
        (tmp_path / name).write_bytes(pathlib.Path(build.HERE, name).read_bytes())
    (tmp_path / "rows.c").write_bytes((tmp_path / "rows.c").read_bytes() + b"\n")
    changed = build.source_digest(str(tmp_path))
    assert changed is not None and changed != build.source_digest()
    monkeypatch.setattr(build, "source_digest", lambda folder=build.HERE: changed)
    cpu_mod.load_kernels.cache_clear()
    try:
        ok, reason = cpu_mod.CpuBackend().availability()
        assert not ok and "built from other sources" in reason and changed in reason and "rebuild" in reason
    finally:
        monkeypatch.undo()
        cpu_mod.load_kernels.cache_clear()
    # A folder lacking a kernel file (an install without sources) gives no digest, so nothing to compare.
    (tmp_path / "rows.c").unlink()
    assert build.source_digest(str(tmp_path)) is None


def test_missing_compiled_module_makes_the_backend_unavailable_not_broken() -> None:
    # A fresh interpreter where the compiled module cannot be imported.
    code = (
        "import sys; sys.modules['statecache.backends.cpu._kernels'] = None\n"
        "from statecache.registry import BackendRegistry\n"
        "r = BackendRegistry(allowlist=['cpu', 'reference'])\n"
        "e = {x.name: x.availability() for x in r.entries()}\n"
        "print(e['cpu'][0], e['cpu'][1]); print(r.get_device().id)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    first, second = out.stdout.splitlines()
    assert first.startswith("False") and "not built" in first
    assert second == "reference:0"


def test_registered_through_the_entry_point_with_priority() -> None:
    reg = BackendRegistry(allowlist=["cpu", "reference"])
    assert reg.get_device().id == "cpu:0"
    props = reg.get_device("cpu").properties
    assert props["host_visible"] if "host_visible" in props else props["caps"]["host_visible"]


def test_openmp_kernels_load_with_a_short_spin_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    # libgomp reads its wait policy when it loads: the kernels are imported
    # inside settings.openmp_defaults(), which must set the short spin only
    # for that import and never override a user's choice.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with settings.openmp_defaults():
        assert os.environ["GOMP_SPINCOUNT"] == str(settings.SHORT_SPIN)
        assert "OMP_WAIT_POLICY" not in os.environ
    assert "GOMP_SPINCOUNT" not in os.environ
    for name, value in (("OMP_WAIT_POLICY", "passive"), ("GOMP_SPINCOUNT", "50")):
        monkeypatch.setenv(name, value)
        with settings.openmp_defaults():
            # the user's variable alone, as given: neither the other one nor the short spin is added
            other = "GOMP_SPINCOUNT" if name == "OMP_WAIT_POLICY" else "OMP_WAIT_POLICY"
            assert other not in os.environ
            assert os.environ[name] == value
        monkeypatch.delenv(name)


def test_reused_index_buffers_follow_their_new_values() -> None:
    # The backend caches the C pointer of an index buffer's validated host
    # copy; a write, or a zero-copy export that lets the caller write, must
    # make the next call use the new values.
    dev = cpu_device()
    pool_host = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    pool, out = dev.upload(pool_host), dev.alloc((2, 8))
    rows = dev.indices(np.array([0, 1]))
    for want in ([0, 1], [3, 2]):
        if want != [0, 1]:
            dev.write(rows, np.array(want))
        dev.get_rows(pool, rows, out)
        np.testing.assert_array_equal(dev.download(out), pool_host[want])
    np.asarray(rows)[...] = [1, 0]  # zero-copy write through the exported view
    dev.get_rows(pool, rows, out)
    np.testing.assert_array_equal(dev.download(out), pool_host[[1, 0]])
