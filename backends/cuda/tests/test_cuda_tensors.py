"""CUDA tensors in, the caller's stream, and CUDA-graph safety, without a GPU.

``emu`` is the real CudaDevice with host memory standing in for device
memory (conftest.py): its tensor import, stream choice and capture refusals
are the code a GPU runs.  Host tensors stand in for CUDA tensors there
(``dlpack_device_type`` is kDLCPU); ``cuda_typed`` is the same device told
that its memory is kDLCUDA, fed by a producer that labels host memory as
CUDA memory, so the device-memory paths (int64 indices read back as int32
words, host tensors refused or copied in) run too.

What only a GPU can show (backends/cuda/tests/test_cuda_gpu.py, run by
gpu_check.sh): that torch's current stream is the one used, that the
kernels read torch's device memory correctly, and that a decode step is
captured into a torch.cuda.CUDAGraph and replays to the eager result.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from statecache.backends.cuda.device import KDL_CUDA, CudaError, _torch_stream_getter, stream_handle_of
from statecache.conformance.tensor_cases import buffers, primitive_calls, results, run
from statecache.dlpack import capsule_tensor
from statecache.errors import ArgumentError

torch = pytest.importorskip("torch", reason="the torch extra is not installed")


def test_tensor_conformance_cases(emu) -> None:  # type: ignore[no-untyped-def]
    from statecache.conformance.catalog import all_cases

    cases = [c for c in all_cases() if c.id.startswith("device.tensors.")]
    assert len(cases) >= 17
    for case in cases:
        case.run(emu)


@pytest.mark.parametrize("op", ["copy_rows", "ssm_conv", "ssm_scan", "gated_delta_net"])
def test_tensors_are_imported_without_a_copy(emu, op) -> None:  # type: ignore[no-untyped-def]
    call = primitive_calls(3)[op]
    want = results(emu, call, run(emu, call, buffers(emu)))
    passed = run(emu, call, lambda name, host: torch.from_numpy(host))
    for name in call.written:
        np.testing.assert_array_equal(passed[name].numpy(), want[name])
    borrowed = [w.buffer for w in emu._wraps._wraps.values() if w.buffer._geometry is not None]
    pointers = {int(t.data_ptr()) for t in passed.values() if t.dtype.is_floating_point}
    assert pointers and pointers <= {b.data_ptr() for b in borrowed}


# -- streams ---------------------------------------------------------------------------


def _decode(dev):  # type: ignore[no-untyped-def]
    call = primitive_calls(4)["ssm_scan"]
    return call, run(dev, call, buffers(dev))


def test_launches_follow_use_stream_then_torch_then_the_own_stream(emu) -> None:  # type: ignore[no-untyped-def]
    _decode(emu)
    assert emu.launched_on[-1] == emu.stream_handle == emu.launch_stream
    emu._torch_stream = lambda index: 0xBEEF  # what torch's current stream would be
    _decode(emu)
    assert emu.launched_on[-1] == 0xBEEF
    with emu.use_stream(0x1234):
        _decode(emu)
        assert emu.launched_on[-1] == 0x1234
        with emu.use_stream(types.SimpleNamespace(cuda_stream=0x5678)):  # torch.cuda.Stream's attribute
            assert emu.launch_stream == 0x5678
        assert emu.launch_stream == 0x1234
    assert emu.launch_stream == 0xBEEF
    emu.follow_torch_stream = False
    assert emu.launch_stream == emu.stream_handle
    assert {0xBEEF, 0x1234} <= set(emu._used_streams)
    emu.synchronize()
    assert emu._used_streams == {}


def test_stream_objects() -> None:
    class Protocol:
        def __cuda_stream__(self):  # type: ignore[no-untyped-def]
            return (0, 77)

    assert stream_handle_of(5) == 5
    assert stream_handle_of(Protocol()) == 77
    assert stream_handle_of(types.SimpleNamespace(ptr=9)) == 9  # CuPy
    with pytest.raises(TypeError, match="not a CUDA stream"):
        stream_handle_of("stream")


def test_torch_stream_is_looked_up_never_imported(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    state = {"initialized": False}
    fake_cuda = types.SimpleNamespace(
        is_initialized=lambda: state["initialized"],
        current_stream=lambda index: types.SimpleNamespace(cuda_stream=100 + index),
    )
    fake = types.SimpleNamespace(cuda=fake_cuda, _C=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert _torch_stream_getter() is None  # torch without CUDA initialised: the device's own stream
    state["initialized"] = True
    assert _torch_stream_getter()(3) == 103  # type: ignore[misc]
    fake._C._cuda_getCurrentRawStream = lambda index: 200 + index
    assert _torch_stream_getter()(1) == 201  # type: ignore[misc]
    monkeypatch.delitem(sys.modules, "torch")
    assert _torch_stream_getter() is None


def test_exchange_stream_numbers_the_legacy_default_stream_1(emu) -> None:  # type: ignore[no-untyped-def]
    assert emu.exchange_stream() is None  # host memory: no stream to name
    emu.dlpack_device_type = KDL_CUDA
    emu._torch_stream = lambda index: 0  # torch's default stream is cudaStreamLegacy's 0
    assert emu.exchange_stream() == 1
    with emu.use_stream(0xABC):
        assert emu.exchange_stream() == 0xABC


# -- CUDA-typed memory: a producer that labels host memory as kDLCUDA --------------------


class ExportedCudaTensor:
    """Host memory exported as kDLCUDA device 0, and nothing else (read by
    exporting it every call); records the ``stream`` each export was asked for."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.streams: list[object] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, 0)

    def __dlpack__(self, *, stream=None, max_version=None):  # type: ignore[no-untyped-def]
        self.streams.append(stream)
        capsule = self.array.__dlpack__(max_version=max_version) if max_version else self.array.__dlpack__()
        capsule_tensor(capsule)[0].device.device_type = KDL_CUDA
        return capsule


class FakeCudaTensor(ExportedCudaTensor):
    """The same with torch's methods: read directly, exported on first sight."""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def device(self) -> str:
        return "cuda:0"

    def data_ptr(self) -> int:
        return int(self.array.__array_interface__["data"][0])

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)


@pytest.fixture
def cuda_typed(emu):  # type: ignore[no-untyped-def]
    emu.dlpack_device_type = KDL_CUDA
    return emu


def test_cuda_tensors_and_int64_indices_in_device_memory(cuda_typed) -> None:  # type: ignore[no-untyped-def]
    dev = cuda_typed
    call = primitive_calls(8)["copy_rows"]
    want = results(dev, call, run(dev, call, buffers(dev)))
    dev._torch_stream = lambda index: 0x77
    passed = run(dev, call, lambda name, host: FakeCudaTensor(host))
    np.testing.assert_array_equal(passed["dst"].array, want["dst"])
    assert passed["src"].streams == [0x77]  # the export synchronised with the launch stream
    rows = passed["src_rows"]
    assert rows.array.dtype == np.int64  # read back as int32 words from "device" memory
    rows.array[:] = [5, 1, 0]
    dst = dev.alloc(call.args["dst"].shape)
    dev.copy_rows(passed["src"], rows, dst, passed["dst_rows"])
    np.testing.assert_array_equal(dev.download(dst)[call.args["dst_rows"]], call.args["src"][[5, 1, 0]])
    rows.array[0] = 6
    with pytest.raises(ArgumentError, match="src_rows: index 6 out of range"):
        dev.copy_rows(passed["src"], rows, dst, passed["dst_rows"])


def test_producers_read_by_export_synchronise_every_call(cuda_typed) -> None:  # type: ignore[no-untyped-def]
    dev = cuda_typed
    src = ExportedCudaTensor(np.arange(12, dtype=np.float32).reshape(4, 3))
    dst, rows = dev.alloc((2, 3)), dev.indices([2, 1])
    with dev.use_stream(0x99):
        dev.get_rows(src, rows, dst)
        dev.get_rows(src, rows, dst)
    dev.get_rows(src, rows, dst)
    assert src.streams == [0x99, 0x99, dev.exchange_stream()]
    np.testing.assert_array_equal(dev.download(dst), src.array[[2, 1]])


def test_host_tensors_on_a_cuda_device_are_copied_in_or_refused(cuda_typed) -> None:  # type: ignore[no-untyped-def]
    dev = cuda_typed
    src = torch.arange(12.0).reshape(4, 3)
    dst = dev.alloc((2, 3))
    dev.get_rows(src, torch.tensor([3, 1]), dst)
    np.testing.assert_array_equal(dev.download(dst), src.numpy()[[3, 1]])
    with pytest.raises(ArgumentError, match="dst: is a host tensor, which cuda-emu:0 cannot write in place"):
        dev.get_rows(dev.upload(src.numpy()), torch.tensor([3, 1]), torch.zeros(2, 3))


# -- CUDA graphs: nothing allocated or copied in a steady decode step ----------------------


def _step_args(dev, step: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(step)
    H, P, N, n_s = 2, 4, 8, 2
    return {
        "x": torch.from_numpy(rng.uniform(-1, 1, (n_s, 1, H, P)).astype(np.float32)),
        "dt": torch.from_numpy(rng.uniform(-2, 1, (n_s, 1, H)).astype(np.float32)),
        "B": torch.from_numpy(rng.uniform(-1, 1, (n_s, 1, 1, N)).astype(np.float32)),
        "C": torch.from_numpy(rng.uniform(-1, 1, (n_s, 1, 1, N)).astype(np.float32)),
        "y": torch.zeros(n_s, 1, H, P),
    }


def test_steady_decode_allocates_and_copies_nothing(emu, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Fresh activation tensors every step, at new addresses (kept alive), with
    index Buffers reused: no device allocation, no host copy."""
    H, P, N = 2, 4, 8
    pool = emu.upload(np.zeros((4, H * P * N), np.float32))
    A = torch.full((H,), -1.0, requires_grad=True)
    rows = emu.indices([2, 0])
    keep = []
    emu.ssm_scan(pool, rows, rows, A=A, **_step_args(emu, 0))  # the first call validates
    counts = {"alloc": 0, "copy_in": 0}
    for what, name in (("alloc", "_alloc_memory"), ("copy_in", "_copy_in")):
        real = getattr(emu, name)

        def counting(*args, real=real, what=what):  # type: ignore[no-untyped-def]
            counts[what] += 1
            return real(*args)

        monkeypatch.setattr(emu, name, counting)
    emu.capturing = True  # and the capture refusals stay silent
    for step in range(1, 5):
        args = _step_args(emu, step)
        emu.ssm_scan(pool, rows, rows, A=A, **args)
        keep.append(args)
    assert counts == {"alloc": 0, "copy_in": 0}
    emu.capturing = False
    assert len({a["x"].data_ptr() for a in keep}) == 4


def test_what_would_break_a_capture_is_refused_clearly(emu) -> None:  # type: ignore[no-untyped-def]
    buf = emu.alloc((2, 3))
    src = emu.upload(np.ones((4, 3), np.float32))
    emu.capturing = True
    for attempt, what in (
        (lambda: emu.alloc((2, 3)), "allocate device memory"),
        (lambda: emu.write(buf, np.ones((2, 3), np.float32)), "copy host data to the device"),
        (lambda: emu.download(buf), "synchronize"),
        (lambda: emu.indices([0, 1]), "allocate device memory"),
    ):
        with pytest.raises(CudaError, match=f"cannot {what} while .*captured into a CUDA graph"):
            attempt()
    # An index tensor at an address never seen needs a device copy: refused, not recorded.
    with pytest.raises(CudaError, match="captured into a CUDA graph"):
        emu.get_rows(src, torch.tensor([0, 1]), buf)
    emu.capturing = False
    emu.get_rows(src, emu.indices([0, 1]), buf)  # outside the capture all of it works
