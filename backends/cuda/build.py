"""Build libstatecache_cuda.so with nvcc, cached by a hash of every input.

The library is built on first use (or by ``python -m statecache.backends.cuda
build``) into ``<cache_dir>/cuda/<key>/``, where the key hashes the kernel
sources and headers, ``nvcc --version``, the flags, the arch list, the
package version and the ABI version: anything that changes the binary
changes the key, so a stale library is never loaded.  The build runs in a
temporary directory next to the target and is moved into place with
``os.replace`` under a file lock, so concurrent processes never see a
half-written file and build it only once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from statecache import __version__, settings
from statecache.errors import BuildError

PACKAGE_DIR = Path(__file__).resolve().parent
HEADER = "statecache_cuda.h"
HEADERS = (HEADER, "common.cuh")
SOURCES = ("runtime.cu", "rows.cu", "ssm_conv.cu", "ssm_scan.cu", "delta_net.cu", "linear_attn.cu")
LIBRARY_NAME = "libstatecache_cuda.so"

#: Real code for Ampere (sm_80) and Hopper (sm_90), plus sm_90 PTX that the
#: driver JIT-compiles for newer GPUs.
GENCODE = (
    "arch=compute_80,code=sm_80",
    "arch=compute_90,code=sm_90",
    "arch=compute_90,code=compute_90",
)
#: No --use_fast_math: the scans must meet NMSE 1e-7 against float64.
FLAGS = (
    "-shared",
    "-Xcompiler",
    "-fPIC",
    "-O3",
    "-std=c++17",
    "-cudart",
    "static",  # the .so then needs only the driver (libcuda) at run time
    "--threads",
    "2",  # nvcc compiles the gencode targets of a file in parallel
)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    nvcc: str
    version_text: str


def abi_version() -> int:
    """STATECACHE_CUDA_ABI_VERSION as written in the header."""
    for line in (PACKAGE_DIR / HEADER).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[:2] == ["#define", "STATECACHE_CUDA_ABI_VERSION"]:
            return int(parts[2])
    raise RuntimeError(f"{HEADER} defines no STATECACHE_CUDA_ABI_VERSION")


def find_nvcc() -> str | None:
    """nvcc from PATH, else from CUDA_HOME / CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidate = Path(root) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def toolchain() -> Toolchain | None:
    """The nvcc to build with, or None when there is none."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return Toolchain(nvcc, out.stdout.strip())


def cache_key(tc: Toolchain) -> str:
    """sha256 of everything that determines the binary."""
    h = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    for name in sorted(HEADERS + SOURCES):
        part(f"file:{name}", (PACKAGE_DIR / name).read_bytes())
    part("nvcc", tc.version_text.encode())
    part("flags", "\0".join(FLAGS).encode())
    part("gencode", "\0".join(GENCODE).encode())
    part("package", __version__.encode())
    part("abi", str(abi_version()).encode())
    return h.hexdigest()


def cache_root(root: str | os.PathLike[str] | None = None) -> Path:
    return Path(root) if root is not None else Path(settings.cache_dir()) / "cuda"


def library_path(tc: Toolchain, root: str | os.PathLike[str] | None = None) -> Path:
    """Where the library for this toolchain and these sources lives."""
    return cache_root(root) / cache_key(tc)[:24] / LIBRARY_NAME


def command(tc: Toolchain, output: Path) -> list[str]:
    cmd = [tc.nvcc, *FLAGS]
    for gencode in GENCODE:
        cmd += ["-gencode", gencode]
    cmd += ["-o", str(output)]
    cmd += [str(PACKAGE_DIR / name) for name in SOURCES]
    return cmd


@dataclasses.dataclass(frozen=True)
class BuildResult:
    path: Path
    built: bool  # False: found in the cache
    seconds: float


def ensure_built(root: str | os.PathLike[str] | None = None, tc: Toolchain | None = None) -> BuildResult:
    """The library path, building it first if the cache has none for this key.

    Raises :class:`BuildError` with nvcc's output when compilation fails, and
    RuntimeError when there is no nvcc.
    """
    from filelock import FileLock

    tc = tc or toolchain()
    if tc is None:
        raise RuntimeError("nvcc not found (looked on PATH and in CUDA_HOME, CUDA_PATH, /usr/local/cuda)")
    target = library_path(tc, root)
    if target.is_file():
        return BuildResult(target, False, 0.0)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent) + ".lock"):
        if target.is_file():  # another process built it while we waited
            return BuildResult(target, False, 0.0)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="build-", dir=target.parent) as tmp:
            staged = Path(tmp) / LIBRARY_NAME
            cmd = command(tc, staged)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
            if proc.returncode != 0 or not staged.is_file():
                output = (proc.stdout + proc.stderr).strip()
                raise BuildError(f"nvcc failed (exit {proc.returncode}): {' '.join(cmd)}\n{output}")
            os.replace(staged, target)
        return BuildResult(target, True, time.perf_counter() - start)


def cached_library(root: str | os.PathLike[str] | None = None, tc: Toolchain | None = None) -> Path | None:
    """The library if it is already built for this key (never builds)."""
    tc = tc or toolchain()
    if tc is None:
        return None
    target = library_path(tc, root)
    return target if target.is_file() else None
