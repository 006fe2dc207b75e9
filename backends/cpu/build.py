"""cffi builder (API mode) of the CPU kernels: ``statecache.backends.cpu._kernels``.

setup.py names ``backends/cpu/build.py:ffibuilder`` in ``cffi_modules``, so the
kernels are compiled at install; ``python setup.py build_ext --inplace``
rebuilds them in place for quick iterations.

Instruction set: the package is built on the machine that runs it (pip
install from source), so we compile for the best *portable* x86-64 level the
build host supports: ``x86-64-v3`` (AVX2, FMA, F16C) when present, else
``x86-64-v2``; never ``-march=native``, which would tie the binary to one CPU
model.  The library records the level (``sc_cpu_isa``) and checks the running
CPU at load (``sc_cpu_isa_supported``), so a binary copied to an older CPU is
refused with a clear reason instead of dying on an illegal instruction.
Threads come from OpenMP (``-fopenmp``).

Staleness: the library also records a digest of the kernel sources it was
compiled from (``sc_cpu_source_digest``).  An editable install compiles once,
at install, so after a ``git pull`` or an edit of a ``.c`` file the old
binary would otherwise keep running while the sources say something else;
the device compares the digest with the sources beside it at load and
refuses a stale build by name (``load_kernels``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = "statecache_cpu.h"
SOURCES = ("rows.c", "ssm_conv.c", "ssm_scan.c", "delta_net.c", "linear_attn.c", "sc_dlpack.c")
MODULE = "statecache.backends.cpu._kernels"
#: Every file whose bytes the compiled library depends on.
KERNEL_FILES = (HEADER, "sc_internal.h", "sc_gemm.h", "sc_dlpack.h", *SOURCES)

_V3_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
_V2_FLAGS = {"sse4_1", "sse4_2", "ssse3", "popcnt"}


def cdef_source() -> str:
    """The declarations between the cdef markers of the public header."""
    with open(os.path.join(HERE, HEADER), encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.S)
    if match is None:
        raise RuntimeError(f"{HEADER} lacks the cdef-begin/cdef-end markers")
    return match.group(1)


def host_isa() -> str | None:
    """The x86-64 micro-architecture level to compile for, or None elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags: set[str] = set()
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return None
    if _V3_FLAGS <= flags:
        return "x86-64-v3"
    if _V2_FLAGS <= flags:
        return "x86-64-v2"
    return None


def compile_args(isa: str | None) -> list[str]:
    args = ["-O3", "-std=gnu11", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
    if isa is not None:
        args.append(f"-march={isa}")
        args.append(f'-DSC_BUILD_ISA="{isa}"')
    return args


def source_digest(folder: str = HERE) -> str | None:
    """A short sha256 over :data:`KERNEL_FILES` in ``folder`` (names and
    bytes), or None when one of them is absent (an installation that ships
    no sources cannot be stale against them)."""
    h = hashlib.sha256()
    for name in KERNEL_FILES:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
        except OSError:
            return None
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def _rel(name: str) -> str:
    # distutils wants source paths relative to the current directory.
    return os.path.relpath(os.path.join(HERE, name))


ISA = host_isa()

ffibuilder = FFI()
ffibuilder.cdef(cdef_source())
# Not in the public header: the digest is a fact of this build, not of the ABI.
ffibuilder.cdef("const char *sc_cpu_source_digest(void);")
# Nor the DLPack geometry readers (sc_dlpack.h): Python builtins, which cffi only finds
# (ffi.addressof) for ctypes to call once, the GIL held.
ffibuilder.cdef("void *sc_dlpack_functions(void);")
ffibuilder.set_source(
    MODULE,
    f'#include "{HEADER}"\n#include "sc_dlpack.h"\n'
    f'static const char *sc_cpu_source_digest(void) {{ return "{source_digest() or "unknown"}"; }}\n',
    sources=[_rel(name) for name in SOURCES],
    include_dirs=[_rel(".")],
    depends=[_rel(HEADER), _rel("sc_internal.h"), _rel("sc_gemm.h"), _rel("sc_dlpack.h")],
    extra_compile_args=compile_args(ISA),
    extra_link_args=["-fopenmp"],
    libraries=["m"],
)
