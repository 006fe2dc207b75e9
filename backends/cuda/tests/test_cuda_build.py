"""Build, load and ABI checks of the CUDA library; availability reasons.

These run on any machine with nvcc, GPU or not: loading the library and
asking it questions never calls into a kernel.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from statecache.backends.cuda import build
from statecache.backends.cuda import device as cuda_device
from statecache.backends.cuda.device import (
    ABI_VERSION,
    STRUCTS,
    AbiMismatchError,
    CudaBackend,
    declared_functions,
    header_cdef,
    load_library,
)


def test_cache_hit_and_key_layout(built, cuda_cache):
    again = build.ensure_built(cuda_cache)
    assert not again.built and again.path == built.path
    assert built.path.parent.parent == cuda_cache
    assert built.path.name == build.LIBRARY_NAME
    # Nothing half-written is left next to the library.
    assert sorted(p.name for p in built.path.parent.iterdir()) == [build.LIBRARY_NAME]


def test_cache_key_covers_every_input(monkeypatch):
    tc = build.Toolchain("/x/nvcc", "Cuda compilation tools, release 13.0, V13.0.88")
    base = build.cache_key(tc)
    assert build.cache_key(tc) == base
    assert build.cache_key(build.Toolchain(tc.nvcc, tc.version_text + "-other")) != base
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-lineinfo"))
    with_flag = build.cache_key(tc)
    assert with_flag != base
    monkeypatch.setattr(build, "GENCODE", build.GENCODE[:1])
    assert build.cache_key(tc) not in (base, with_flag)
    monkeypatch.undo()
    monkeypatch.setattr(build, "__version__", "99.0")
    assert build.cache_key(tc) != base


def test_cache_key_covers_sources(tmp_path, monkeypatch):
    tc = build.Toolchain("/x/nvcc", "v")
    base = build.cache_key(tc)
    for name in build.SOURCES + build.HEADERS:
        shutil.copy(build.PACKAGE_DIR / name, tmp_path / name)
    monkeypatch.setattr(build, "PACKAGE_DIR", tmp_path)
    assert build.cache_key(tc) == base
    for name in (build.SOURCES[-1], "common.cuh"):
        (tmp_path / name).write_text((tmp_path / name).read_text() + "\n// changed\n")
        changed = build.cache_key(tc)
        assert changed != base
        base = changed


def test_abi_version_agrees_everywhere(runtime):
    assert build.abi_version() == ABI_VERSION
    assert int(runtime.lib.statecache_cuda_abi_version()) == ABI_VERSION


def test_every_declared_function_is_exported_and_nothing_else(built, runtime):
    declared = declared_functions(header_cdef())
    assert len(declared) >= 25
    for name in declared:
        getattr(runtime.lib, name)  # AttributeError if the symbol is missing
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils nm is not installed: cannot list the library's exports")
    out = subprocess.run([nm, "-D", "--defined-only", str(built.path)], capture_output=True, text=True, check=True)
    exported = sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip())
    # Only our entry points: the statically linked cudart stays hidden, so it
    # cannot clash with a torch- or CuPy-loaded libcudart in the same process.
    assert exported == declared


def test_struct_layouts_match_the_compiled_library(runtime):
    ffi, lib = runtime.ffi, runtime.lib
    checked = 0
    for struct in STRUCTS:
        assert lib.statecache_cuda_layout(struct.encode()) == ffi.sizeof(struct), struct
        for field, _ in ffi.typeof(struct).fields:
            got = lib.statecache_cuda_layout(f"{struct}.{field}".encode())
            assert got == ffi.offsetof(struct, field), f"{struct}.{field}"
            checked += 1
    # Every field of the library's table was compared: none is missing from the cdef.
    assert checked == (build.PACKAGE_DIR / "runtime.cu").read_text().count("SC_FIELD(statecache_")
    assert lib.statecache_cuda_layout(b"no_such_struct") == -1


def test_status_text(runtime):
    assert runtime.error_text(0) == "no error"
    assert "ABI" in runtime.error_text(-1)
    with pytest.raises(cuda_device.CudaError, match="ABI mismatch"):
        runtime.check(-1, "launch")


def test_wrong_struct_size_is_refused(runtime):
    ffi, lib = runtime.ffi, runtime.lib
    args = ffi.new("statecache_cuda_scan_args *")
    args.struct_size = ffi.sizeof("statecache_cuda_scan_args") - 8
    assert lib.statecache_cuda_host_ssm_scan(args) == -1


def test_library_with_another_abi_is_refused(tmp_path):
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler to build the fake library")
    src = tmp_path / "fake.cpp"
    src.write_text(f'extern "C" int statecache_cuda_abi_version(void) {{ return {ABI_VERSION + 1}; }}\n')
    lib = tmp_path / "libfake.so"
    subprocess.run([gxx, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(AbiMismatchError, match=f"ABI version {ABI_VERSION + 1}"):
        load_library(lib)


def test_unavailable_with_the_cuda_error_text(built, runtime, cuda_cache):
    count, status = runtime.device_count()
    ok, reason = CudaBackend(cache_root=cuda_cache).availability()
    if cuda_device.driver_problem() is not None:
        # No driver: said so, whatever the build cache holds (this machine).
        assert (ok, reason) == (False, cuda_device.driver_problem())
    elif status:
        # No driver or no GPU (this machine): cudart's own words.
        assert not ok
        assert runtime.error_text(status) in reason
        assert CudaBackend(cache_root=cuda_cache).devices() == []
    else:
        assert ok == (count > 0)


def test_unavailable_without_nvcc(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_device, "driver_problem", lambda: None)
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    ok, reason = CudaBackend(cache_root=tmp_path).availability()
    assert not ok and "nvcc not found" in reason
    assert list(tmp_path.iterdir()) == []


def test_no_build_during_discovery_without_a_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_device, "driver_problem", lambda: "no CUDA driver: test")
    ok, reason = CudaBackend(cache_root=tmp_path).availability()
    assert (ok, reason) == (False, "no CUDA driver: test")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cache", ["empty", "holds a library", "no nvcc"])
def test_no_driver_is_the_reason_whatever_the_build_cache_holds(tmp_path, monkeypatch, cache):
    """The reason must not depend on what an earlier build left in the cache:
    a library found there used to turn "no driver" into a load or runtime error."""
    monkeypatch.setattr(cuda_device, "driver_problem", lambda: "no CUDA driver: test")
    if cache == "holds a library":
        monkeypatch.setattr(build, "cached_library", lambda *a, **k: tmp_path / "libstatecache_cuda.so")
        monkeypatch.setattr(build, "toolchain", lambda: build.Toolchain("nvcc", "fake"))
    elif cache == "no nvcc":
        monkeypatch.setattr(build, "find_nvcc", lambda: None)
    assert CudaBackend(cache_root=tmp_path).availability() == (False, "no CUDA driver: test")


def test_real_driver_probe_names_libcuda():
    problem = cuda_device.driver_problem()
    if problem is not None:
        assert "libcuda.so.1" in problem


def test_build_error_surfaces_nvcc_output(tmp_path, monkeypatch):
    if build.toolchain() is None:
        pytest.skip("nvcc is not installed")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name in build.SOURCES + build.HEADERS:
        shutil.copy(build.PACKAGE_DIR / name, pkg / name)
    (pkg / "runtime.cu").write_text("int broken( {\n")
    monkeypatch.setattr(build, "PACKAGE_DIR", pkg)
    with pytest.raises(build.BuildError, match=r"nvcc failed[\s\S]*runtime\.cu"):
        build.ensure_built(tmp_path / "cache")
    # The failed build left no library behind.
    assert not list((tmp_path / "cache").rglob(build.LIBRARY_NAME))


def test_registry_discovery_never_crashes(cuda_cache, built, monkeypatch):
    from statecache.registry import BackendRegistry

    monkeypatch.setenv("STATECACHE_CACHE_DIR", str(cuda_cache.parent))
    registry = BackendRegistry(allowlist=["cuda"])
    (entry,) = registry.entries()
    ok, reason = entry.availability()
    assert ok or reason
    if not ok:
        from statecache.errors import BackendUnavailableError

        with pytest.raises(BackendUnavailableError, match="cuda"):
            registry.get_device("cuda")


def test_build_command_line(cuda_cache, built):
    out = subprocess.run(
        [sys.executable, "-m", "statecache.backends.cuda", "--cache-dir", str(cuda_cache), "build"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "found in the cache" in out.stdout and str(built.path) in out.stdout
    assert f"ABI version {ABI_VERSION}" in out.stdout
