"""Fixtures of the CUDA backend tests.

The library is compiled once per test session into a temporary cache (about
half a minute for sm_80 + sm_90 + PTX on two cores).  ``emu`` is a
:class:`HostEmulationDevice`: the real ``CudaDevice`` marshalling (views,
strides, offsets, argument structs) driving the same kernel bodies compiled
for the host, so GPU-less machines test the indexing the GPU runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from statecache.backends.cuda import build
from statecache.backends.cuda.device import KDL_CPU, CudaBuffer, CudaDevice, Runtime, load_library
from statecache.dlpack import host_flat
from statecache.dtypes import DType
from statecache.hostmem import aligned_empty


@pytest.fixture(scope="session")
def cuda_cache(tmp_path_factory):
    """A fresh cache root for this session (the ``cuda`` folder of a cache dir)."""
    return tmp_path_factory.mktemp("statecache-cache") / "cuda"


@pytest.fixture(scope="session")
def built(cuda_cache):
    """The library built from scratch into the session cache."""
    tc = build.toolchain()
    if tc is None:
        pytest.skip("nvcc is not installed: the CUDA library cannot be built on this machine")
    result = build.ensure_built(cuda_cache, tc)
    assert result.built, "a fresh cache must build"
    print(f"\nCUDA library built in {result.seconds:.1f} s: {result.path}")
    return result


@pytest.fixture(scope="session")
def runtime(built) -> Runtime:
    return load_library(built.path)


class HostAllocation:
    """Host memory standing in for a cudaMalloc block."""

    __slots__ = ("__weakref__", "array", "ptr")

    def __init__(self, n_elements: int, dtype: DType) -> None:
        self.array = aligned_empty(n_elements, dtype)
        self.ptr = int(self.array.ctypes.data)


class HostBorrowed:
    """Host memory of a tensor standing in for a CUDA tensor's device memory
    (imported without a copy, never owned)."""

    __slots__ = ("__weakref__", "array", "ptr")

    def __init__(self, memory, dtype: DType) -> None:  # type: ignore[no-untyped-def]
        self.array = host_flat(memory, dtype.numpy)
        self.ptr = int(memory.address)


class HostEmulationDevice(CudaDevice):
    """CudaDevice whose memory is host memory and whose launches call the
    ``statecache_cuda_host_*`` twins of the kernels.

    Host tensors stand in for CUDA tensors (``dlpack_device_type`` is
    kDLCPU), so the real import, stream and capture bookkeeping of
    CudaDevice runs; ``launched_on`` records the stream handle each launch
    would have been queued on, and ``capturing`` pretends the launch stream
    is being captured into a CUDA graph."""

    dlpack_device_type = KDL_CPU

    def __init__(self, runtime: Runtime) -> None:  # no driver calls
        self.runtime = runtime
        self.index = 0
        self.id = "cuda-emu:0"
        self.backend_name = "cuda-emu"
        from statecache.backend import DeviceKind

        self.kind = DeviceKind.CPU
        self.name = "CUDA kernels emulated on the host"
        self.memory_bytes = None
        self.compute_capability = (0, 0)
        self.multiprocessors = 0
        self._stream = runtime.ffi.NULL
        self.stream_handle = 0
        self._init_streams()
        self.caps = self._caps()
        self._pending_host = []
        self._pending_bytes = 0
        self.launched_on: list[int] = []
        self.capturing = False

    def _activate(self) -> None:
        pass

    def _capturing(self, stream) -> bool:  # type: ignore[no-untyped-def]
        return self.capturing

    def _launch(self, op: str, *args) -> None:  # type: ignore[no-untyped-def]
        handle, stream = self._stream_now()
        self._used_streams[handle] = stream
        del self.launched_on[:-64]
        self.launched_on.append(handle)
        status = getattr(self.runtime.lib, f"statecache_cuda_host_{op}")(*args)
        self.runtime.check(status, op)

    def _borrowed_storage(self, memory, dtype):  # type: ignore[no-untyped-def]
        return HostBorrowed(memory, dtype)

    def _alloc_memory(self, shape, dtype):  # type: ignore[no-untyped-def]
        return CudaBuffer(self, HostAllocation(int(np.prod(shape, dtype=np.int64)), dtype), dtype, shape)

    def _flat(self, buf) -> np.ndarray:  # type: ignore[no-untyped-def]
        return buf.storage.array

    def _copy_in(self, buffer, host) -> None:  # type: ignore[no-untyped-def]
        self._flat(buffer)[buffer.offset : buffer.offset + buffer.size] = host.reshape(-1)

    def _copy_out(self, buffer):  # type: ignore[no-untyped-def]
        flat = self._flat(buffer)
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[buffer.offset :], shape=buffer.shape, strides=tuple(s * item for s in buffer.strides)
        )
        return np.array(view, copy=True)

    def synchronize(self) -> None:
        # Launches ran when queued: nothing to wait for, but what was kept
        # until the stream is past it is released here as on a GPU.
        if self.capturing:
            from statecache.backends.cuda.device import CudaError

            raise CudaError(f"{self.id}: cannot synchronize while the stream is being captured into a CUDA graph")
        self._used_streams.clear()
        self._pending_host.clear()
        self._pending_bytes = 0

    def copy_buffer(self, src, dst) -> None:  # type: ignore[no-untyped-def]
        raise NotImplementedError("the emulation has no device-to-device copy")


@pytest.fixture
def emu(runtime) -> HostEmulationDevice:
    return HostEmulationDevice(runtime)


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


@pytest.fixture(scope="session")
def gpu_backend(cuda_cache, built):
    from statecache.backends.cuda.device import CudaBackend

    return CudaBackend(cache_root=cuda_cache)


@pytest.fixture
def gpu(gpu_backend):
    """The first CUDA device; skips (with the CUDA runtime's reason) only when
    the machine has none.  Any other problem fails."""
    ok, reason = gpu_backend.availability()
    if not ok:
        pytest.skip(f"no usable CUDA device: {reason}")
    return gpu_backend.devices()[0]


@pytest.fixture(params=[pytest.param("emu"), pytest.param("gpu", marks=pytest.mark.cuda)])
def dut(request):
    """Device under test: the host emulation, and the GPU where there is one."""
    return request.getfixturevalue(request.param)
