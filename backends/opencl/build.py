"""Building the OpenCL kernel families, once per device.

Each family (``rows``, ``ssm_conv``, ``ssm_scan``, ``delta_net``, ``linear_attn``) is one
``.cl`` file; ``common.cl`` (dtype conversions, softplus) is prepended to it.
The stateful families are specialised by a build option, the pool's storage
dtype (``-DPOOL_DTYPE=n``), so their inner loops carry no dtype switch; a
variant is built the first time a call needs it.  ``rows`` converts at run
time, so one build serves every dtype pair.

Programs go through pyopencl's on-disk binary cache (keyed by source, build
options and device), so a second process reuses the binaries; in-process,
the built ``cl.Kernel`` objects are kept here, because fetching
``program.name`` again creates a new kernel object on every call.
"""

from __future__ import annotations

import importlib.resources
import threading
import warnings
from typing import Any

from statecache.dtypes import DType
from statecache.errors import BuildError

#: Codes the kernels use for storage dtypes (see common.cl).
DTYPE_CODES: dict[DType, int] = {DType.F32: 0, DType.F16: 1, DType.BF16: 2}

#: Compile-time limits of the kernels (private arrays); Device.supports checks them.
MAX_WINDOW = 32  # ssm_conv: d_conv - 1
MAX_HEAD_SIZE = 256  # gated_delta_net and the linear-attention primitives: S
# ssm_scan: d_state elements kept in private memory at a time.  One chunk for
# every real d_state (<= 256): on PoCL a second chunk (a second pass over y
# and the per-token softplus) cost 3x at d_state 128 with chunks of 64.
SCAN_KCHUNK = 256

#: The kernels of each family, by file name.
FAMILIES: dict[str, tuple[str, ...]] = {
    "rows": (
        "copy_rows_u32",
        "copy_rows_u16",
        "copy_rows_v16",
        "copy_rows_convert",
        "zero_rows_u32",
        "zero_rows_u16",
        "zero_rows_v16",
        "widen_act",
        "narrow_act",
    ),
    "ssm_conv": ("ssm_conv",),
    "ssm_scan": ("ssm_scan_prep", "ssm_scan", "ssm_scan_vec8"),
    "delta_net": ("gated_delta_net_gate", "gated_delta_net_l2norm", "gated_delta_net", "gated_delta_net_vec8"),
    "linear_attn": ("linear_attn_prep", "linear_attn_kv", "linear_attn_kv_vec8", "rwkv_wkv7", "rwkv_wkv7_vec8"),
}

_FAMILY_DEFINES: dict[str, tuple[str, ...]] = {
    "rows": (),
    "ssm_conv": (f"-DMAX_WINDOW={MAX_WINDOW}",),
    "ssm_scan": (f"-DKCHUNK={SCAN_KCHUNK}",),
    "delta_net": (f"-DMAX_S={MAX_HEAD_SIZE}",),
    "linear_attn": (f"-DMAX_S={MAX_HEAD_SIZE}",),
}


class KernelBuildError(BuildError):
    """An OpenCL program failed to build; the message carries the compiler log."""


def family_source(family: str) -> str:
    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    files = importlib.resources.files("statecache.backends.opencl")
    common = files.joinpath("common.cl").read_text(encoding="utf-8")
    body = files.joinpath(f"{family}.cl").read_text(encoding="utf-8")
    return f"{common}\n#line 1\n{body}"


def build_options(family: str, pool_dtype: DType | None) -> list[str]:
    # Argument info lets typed_kernel() declare the scalar argument types.
    options = ["-cl-kernel-arg-info", *_FAMILY_DEFINES[family]]
    if pool_dtype is not None:
        options.append(f"-DPOOL_DTYPE={DTYPE_CODES[pool_dtype]}")
    return options


def build_program(context: Any, device: Any, source: str, options: list[str], what: str) -> Any:
    """Build ``source`` for one device; failures raise with the compiler log."""
    import pyopencl as cl

    program = cl.Program(context, source)
    with warnings.catch_warnings():
        # pyopencl turns any non-empty build log into a CompilerWarning; PoCL
        # logs harmless notes, and the test suite runs with warnings as errors.
        warnings.simplefilter("ignore", cl.CompilerWarning)
        try:
            program.build(options=options, devices=[device])
        except cl.Error as exc:
            log = _build_log(program, device) or str(exc)
            raise KernelBuildError(
                f"OpenCL build of {what} failed on {device.name!r} (options {' '.join(options)}):\n{log}"
            ) from exc
    return program


def _build_log(program: Any, device: Any) -> str:
    import pyopencl as cl

    try:
        return str(program.get_build_info(device, cl.program_build_info.LOG)).strip()
    except Exception:  # the program object may be unusable after a failed build
        return ""


_SCALAR_TYPES: dict[str, Any] = {}


def typed_kernel(program: Any, name: str) -> Any:
    """``cl.Kernel(program, name)`` with its scalar argument types declared.

    Without declared types pyopencl inspects every scalar argument on every
    call: about 14 us per argument, half a millisecond for a scan's 40, which
    is more than a decode step's work.  Declared, a call takes ~15 us and
    accepts plain Python ints and floats."""
    import numpy as np
    import pyopencl as cl

    if not _SCALAR_TYPES:
        _SCALAR_TYPES.update(
            {"long": np.int64, "int": np.int32, "float": np.float32, "uint": np.uint32, "ulong": np.uint64}
        )
    kernel = cl.Kernel(program, name)
    dtypes = []
    for i in range(kernel.num_args):
        type_name = str(kernel.get_arg_info(i, cl.kernel_arg_info.TYPE_NAME)).strip().rstrip("\x00")
        address = kernel.get_arg_info(i, cl.kernel_arg_info.ADDRESS_QUALIFIER)
        if type_name.endswith("*") or address != cl.kernel_arg_address_qualifier.PRIVATE:
            dtypes.append(None)  # a buffer
        elif type_name in _SCALAR_TYPES:
            dtypes.append(_SCALAR_TYPES[type_name])
        else:
            raise KernelBuildError(f"kernel {name}: argument {i} has unsupported scalar type {type_name!r}")
    kernel.set_scalar_arg_dtypes(dtypes)
    return kernel


class KernelCache:
    """The built kernels of one device: ``kernel(family, name, pool_dtype)``."""

    def __init__(self, context: Any, device: Any) -> None:
        self._context = context
        self._device = device
        self._kernels: dict[tuple[str, DType | None], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def kernel(self, family: str, name: str, pool_dtype: DType | None = None) -> Any:
        key = (family, pool_dtype)
        kernels = self._kernels.get(key)
        if kernels is None:
            with self._lock:
                kernels = self._kernels.get(key)
                if kernels is None:
                    kernels = self._build(family, pool_dtype)
                    self._kernels[key] = kernels
        return kernels[name]

    def _build(self, family: str, pool_dtype: DType | None) -> dict[str, Any]:
        what = f"{family}.cl" + (f" (pool {pool_dtype})" if pool_dtype is not None else "")
        program = build_program(
            self._context, self._device, family_source(family), build_options(family, pool_dtype), what
        )
        return {name: typed_kernel(program, name) for name in FAMILIES[family]}
