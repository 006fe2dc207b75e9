"""Discovery, device selection and the build of the OpenCL backend."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from statecache import DType
from statecache.backends.opencl import build
from statecache.backends.opencl.device import OpenCLBackend, OpenCLDevice
from statecache.registry import BackendRegistry

pytestmark = pytest.mark.opencl


def test_registered_through_the_entry_point(cl_platform):
    registry = BackendRegistry(allowlist=["opencl"])
    assert registry.names() == ["opencl"]
    ok, reason = registry.entries()[0].availability()
    assert ok, reason
    device = registry.get_device("opencl:0")
    assert isinstance(device, OpenCLDevice)
    assert device.id == "opencl:0"


def test_every_device_of_every_platform_in_loader_order(cl_platform, pyopencl):
    cl = pyopencl

    expected = [(p.name, d.name) for p in cl.get_platforms() for d in p.get_devices()]
    devices = OpenCLBackend().devices()
    assert [(d.cl_platform.name, d.cl_device.name) for d in devices] == expected
    assert [d.id for d in devices] == [f"opencl:{i}" for i in range(len(expected))]
    # A second backend object lists the same devices under the same ids.
    assert [d.name for d in OpenCLBackend().devices()] == [d.name for d in devices]


def test_pyopencl_ctx_restricts_the_devices(cl_platform, pyopencl, monkeypatch):
    cl = pyopencl

    first_platform = cl.get_platforms()[0]
    monkeypatch.setenv("PYOPENCL_CTX", "0:0")
    devices = OpenCLBackend().devices()
    assert len(devices) == 1 and devices[0].cl_device == first_platform.get_devices()[0]
    monkeypatch.setenv("PYOPENCL_CTX", first_platform.name[:6].upper())  # name substring, any case
    assert len(OpenCLBackend().devices()) == len(first_platform.get_devices())
    monkeypatch.setenv("PYOPENCL_CTX", "no-such-platform")
    backend = OpenCLBackend()
    ok, reason = backend.availability()
    assert not ok and "PYOPENCL_CTX='no-such-platform' selects no OpenCL device" in reason
    assert backend.devices() == []


def test_missing_pyopencl_is_unavailable_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # makes `import pyopencl` fail
    ok, reason = OpenCLBackend().availability()
    assert not ok
    assert "pyopencl is not installed" in reason and "statecache[opencl]" in reason


@pytest.mark.parametrize("failure", ["empty", "raises"])
def test_no_platform_is_unavailable_with_the_install_hint(pyopencl, monkeypatch, failure):
    cl = pyopencl

    def get_platforms():
        if failure == "raises":
            raise RuntimeError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
        return []

    monkeypatch.setattr(cl, "get_platforms", get_platforms)
    backend = OpenCLBackend()
    ok, reason = backend.availability()
    assert not ok
    assert "apt-get install pocl-opencl-icd" in reason
    assert backend.devices() == []
    # The registry lists it as unavailable rather than failing.
    registry = BackendRegistry(load_entry_points=False)
    registry.add(backend)
    assert registry.entries()[0].availability() == (False, reason)


def test_build_failure_carries_the_compiler_log(cl_device):
    source = "__kernel void broken(__global float *a) { a[0] = undeclared_identifier_xyz; }"
    with pytest.raises(build.KernelBuildError) as info:
        build.build_program(cl_device.context, cl_device.cl_device, source, [], "broken.cl")
    message = str(info.value)
    assert "broken.cl" in message
    assert "undeclared_identifier_xyz" in message  # from the compiler's log


def test_kernels_are_built_once_and_kept(cl_device):
    first = cl_device.kernel("rows", "copy_rows_u32")
    assert cl_device.kernel("rows", "copy_rows_u32") is first
    f16 = cl_device.kernel("ssm_scan", "ssm_scan", DType.F16)
    assert cl_device.kernel("ssm_scan", "ssm_scan", DType.F16) is f16
    assert cl_device.kernel("ssm_scan", "ssm_scan", DType.F32) is not f16  # a separate specialisation


def test_launches_are_queued_and_synchronize_finishes(cl_device):
    assert cl_device.caps.async_launch and not cl_device.caps.host_visible
    host = np.arange(64, dtype=np.float32).reshape(4, 16)
    src = cl_device.upload(host)
    dst = cl_device.alloc((4, 16))
    cl_device.get_rows(src, cl_device.indices([3, 2, 1, 0]), dst)
    cl_device.synchronize()
    assert np.array_equal(dst.numpy(), host[::-1])


def test_supports_reports_kernel_limits(cl_device):
    assert cl_device.supports("ssm_conv", d_conv=4)
    assert not cl_device.supports("ssm_conv", d_conv=build.MAX_WINDOW + 2)
    assert cl_device.supports("gated_delta_net", head_size=128)
    assert not cl_device.supports("gated_delta_net", head_size=build.MAX_HEAD_SIZE + 1)
    assert cl_device.supports("ssm_scan", dtype="bf16")


def test_launches_from_several_threads_match_serial_results(cl_device):
    """Kernel arguments live on shared cl.Kernel objects and the prep kernels
    share one scratch buffer: concurrent callers must not mix their launches."""
    import threading

    import numpy as np

    dev = cl_device
    rng = np.random.default_rng(5)
    H, P, N = 4, 8, 16

    def job(seed: int) -> np.ndarray:
        r = np.random.default_rng(seed)
        pool = dev.upload(r.standard_normal((2, H * P * N)).astype(np.float32))
        args = [
            dev.upload(r.standard_normal(shape).astype(np.float32))
            for shape in ((1, 3, H, P), (1, 3, H), (H,), (1, 3, 1, N), (1, 3, 1, N))
        ]
        y = dev.alloc((1, 3, H, P))
        idx = dev.indices([0])
        for _ in range(20):
            dev.ssm_scan(pool, idx, idx, *args, y)
        return np.concatenate([y.numpy().ravel(), pool.numpy().ravel()])

    seeds = [int(s) for s in rng.integers(0, 1 << 30, 6)]
    serial = [job(s) for s in seeds]
    results: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda i=i, s=s: results.__setitem__(i, job(s))) for i, s in enumerate(seeds)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two Python steps of a launch
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    for i in range(len(seeds)):
        np.testing.assert_array_equal(results[i], serial[i])
