"""The machinery every conformance case shares: the case record, capability
gating, guarded buffers and the comparisons.

A case is data: an id, the primitive it exercises, the capabilities it needs
and a ``run(device)`` callable that raises :class:`ConformanceFailure` with a
message naming the tensor, the element and the numbers when the device is
wrong.  The pytest plugin only parametrises and reports; everything a case
checks lives here and in the ``*_cases`` modules, so a case can also be run
from a script.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from statecache.backend import PRIMITIVES, Buffer, Caps, Device
from statecache.dtypes import DType

#: Elements of poison placed before and after every tensor's storage.  Odd on
#: purpose, so a kernel that writes a whole row too many is caught as well as
#: one that writes a single element too many.
GUARD = 37

#: NMSE thresholds per storage dtype of the compared tensor.  f32 is ggml's
#: default.  f16/bf16 states are rounded once per call: a device computing in
#: float32 and the float64 reference land on different sides of a rounding
#: boundary for a small fraction of elements, one ulp apart (2**-11 relative
#: for f16, 2**-8 for bf16), so the bounds are a few times that error spread
#: over every element, and chained calls (metamorphic cases) stay inside them.
NMSE: dict[DType, float] = {DType.F32: 1e-7, DType.F16: 1e-5, DType.BF16: 1e-4}


class ConformanceFailure(AssertionError):
    """The device under test disagrees with the contract."""


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One ``device.supports(op, **params)`` query a case needs answered yes."""

    op: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.op not in PRIMITIVES:
            raise ValueError(f"requirement names unknown primitive {self.op!r}; known: {', '.join(PRIMITIVES)}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case.

    ``id``: stable, device-independent (``ssm_scan[mamba2-d128-...-f32]``),
    the string expected-failure lists use.  ``family``: ``primitive``,
    ``oracle``, ``metamorphic``, ``device`` or ``memory``.  ``ops``: primitives the case
    exercises (the meta-test checks every primitive has cases).
    ``requires``: supports() queries; ``caps``: capability name -> needed
    value (names must be :attr:`Caps.NAMES`; a set value means "contains").
    """

    id: str
    family: str
    ops: tuple[str, ...]
    run: Callable[[Device], None]
    requires: tuple[Requirement, ...] = ()
    caps: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.caps) - set(Caps.NAMES)
        if unknown:
            raise ValueError(f"case {self.id}: unknown capability names {sorted(unknown)}; known: {Caps.NAMES}")
        bad_ops = set(self.ops) - set(PRIMITIVES)
        if bad_ops:
            raise ValueError(f"case {self.id}: unknown primitives {sorted(bad_ops)}")

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    def support(self, device: Device) -> tuple[bool, str]:
        """``(True, "")`` or ``(False, reason)``; unknown names raise."""
        return check_support(device, self.caps, self.requires)


def check_support(device: Device, caps: Mapping[str, Any], requires: Sequence[Requirement]) -> tuple[bool, str]:
    have = device.caps
    # The missing primitive is the reason a reader needs first: a device that
    # lacks the op is not "missing f16 activations" for it.
    lacking = sorted({*caps.get("ops", ()), *(req.op for req in requires)} - set(have.ops))
    if lacking:
        return False, f"{device.id} does not implement {', '.join(lacking)}"
    for name, need in caps.items():
        if name not in Caps.NAMES:
            raise ValueError(f"unknown capability name {name!r}; known: {', '.join(Caps.NAMES)}")
        value = getattr(have, name)
        if name == "ops":
            missing = set(need) - set(value)
            if missing:
                return False, f"{device.id} does not implement {', '.join(sorted(missing))}"
        elif name == "storage_dtypes":
            missing = {DType.parse(d) for d in need} - set(value)
            if missing:
                return False, f"{device.id} cannot store {', '.join(sorted(d.value for d in missing))}"
        elif name == "activation_dtypes":
            missing = {DType.parse(d) for d in need} - set(value)
            if missing:
                return False, f"{device.id} takes no {', '.join(sorted(d.value for d in missing))} activations"
        elif name == "epilogues":
            missing_names = set(need) - set(value)
            if missing_names:
                return False, f"{device.id} does not fuse {', '.join(sorted(missing_names))}"
        elif name == "max_snapshots":
            if value < int(need):
                return False, f"{device.id} emits at most {value} snapshots, case needs {need}"
        elif bool(value) != bool(need):
            return False, f"{device.id} has {name}={value}, case needs {need}"
    for req in requires:
        answer = device.supports(req.op, **dict(req.params))
        if not answer:
            return False, answer.reason or f"{device.id} does not support {req.op} {dict(req.params)}"
    return True, ""


# -- the reference device ------------------------------------------------------

_REFERENCE: Device | None = None


def reference_device() -> Device:
    """The NumPy reference device: the oracle every primitive case compares to."""
    global _REFERENCE
    if _REFERENCE is None:
        from statecache.backends.reference.device import ReferenceDevice

        _REFERENCE = ReferenceDevice()
    return _REFERENCE


# -- tensors with guard bands --------------------------------------------------


@dataclasses.dataclass
class Tensor:
    """A host description of one argument, materialised identically on every device.

    ``data``: logical contents (stored as ``dtype``).  ``view``: for strided
    inputs, ``(base_name, shape, strides, offset)`` of a view into another
    tensor instead of own storage.  ``written``: for outputs, the rows (first
    axis) the call may change, ``None`` for "all of it"; rows outside must be
    bitwise unchanged, like the guard bands.  ``exact``: written elements
    must match the reference bitwise (NaN matches NaN).
    """

    data: np.ndarray | None
    dtype: DType = DType.F32
    output: bool = False
    written: np.ndarray | None = None
    exact: bool = False
    view: tuple[str, tuple[int, ...], tuple[int, ...], int] | None = None


@dataclasses.dataclass
class Placed:
    """A tensor placed on a device: the storage with its guards, and the view."""

    storage: Buffer
    buffer: Buffer
    initial: np.ndarray  # full storage contents as uploaded (dtype storage)
    offset: int
    shape: tuple[int, ...]


def _poison(rng: np.random.Generator, n: int, dtype: DType) -> np.ndarray:
    return rng.uniform(-1e3, 1e3, n).astype(np.float32).astype(dtype.numpy)


def place(device: Device, tensors: Mapping[str, Tensor], seed: int) -> dict[str, Placed]:
    """Upload every tensor inside a poisoned margin (same bytes on every device)."""
    rng = np.random.default_rng(seed ^ 0x5EED)
    placed: dict[str, Placed] = {}
    for name, t in tensors.items():
        if t.view is not None:
            continue
        assert t.data is not None
        body = np.asarray(t.data).astype(np.float32).astype(t.dtype.numpy).ravel()
        full = np.concatenate([_poison(rng, GUARD, t.dtype), body, _poison(rng, GUARD, t.dtype)])
        storage = device.upload(full, t.dtype)
        view = storage.view(t.data.shape, offset=GUARD)
        placed[name] = Placed(storage, view, full, GUARD, tuple(t.data.shape))
    for name, t in tensors.items():
        if t.view is None:
            continue
        base_name, shape, strides, offset = t.view
        base = placed[base_name]
        view = base.buffer.view(shape, strides, offset)
        placed[name] = Placed(base.storage, view, base.initial, -1, tuple(shape))
    return placed


# -- comparisons ---------------------------------------------------------------


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def where_differs_bitwise(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Mask of elements whose bits differ (two NaNs count as equal)."""
    diff = _bits(got) != _bits(want)
    if got.dtype.kind == "f" or got.dtype.name == "bfloat16":
        both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
        diff &= ~both_nan
    return diff


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def assert_exact(what: str, got: np.ndarray, want: np.ndarray) -> None:
    diff = where_differs_bitwise(got, want)
    if diff.any():
        at = _first(diff)
        raise ConformanceFailure(
            f"{what}: {int(diff.sum())} of {diff.size} elements differ bitwise; first at {at}: "
            f"got {got[at]!r}, expected {want[at]!r}"
        )


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    denom = float(np.sum(w * w))
    num = float(np.sum((g - w) ** 2))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


def assert_close(what: str, got: np.ndarray, want: np.ndarray, threshold: float) -> None:
    """NaN/Inf parity (ggml: no NaN on one side only, infinities equal in sign),
    then NMSE over the finite elements."""
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    if (nan_g != nan_w).any():
        at = _first(nan_g != nan_w)
        raise ConformanceFailure(f"{what}: NaN parity broken at {at}: got {g[at]!r}, expected {w[at]!r}")
    inf_g, inf_w = np.isinf(g), np.isinf(w)
    if (inf_g != inf_w).any() or (np.sign(g[inf_g]) != np.sign(w[inf_w])).any():
        at = _first((inf_g != inf_w) | (inf_g & inf_w & (np.sign(g) != np.sign(w))))
        raise ConformanceFailure(f"{what}: Inf parity broken at {at}: got {g[at]!r}, expected {w[at]!r}")
    finite = ~(nan_w | inf_w)
    err = nmse(g[finite], w[finite])
    if not err <= threshold:
        worst = np.zeros_like(g)
        worst[finite] = np.abs(g[finite] - w[finite])
        at = _first(worst == worst.max())
        raise ConformanceFailure(
            f"{what}: NMSE {err:.3e} > {threshold:.1e}; worst element {at}: got {g[at]!r}, expected {w[at]!r}"
        )


def threshold_for(dtype: DType) -> float:
    return NMSE[dtype]


def check_tensor(
    name: str, t: Tensor, p: Placed, got_full: np.ndarray, want_full: np.ndarray | None, tol: float | None = None
) -> None:
    """Compare one tensor's whole storage after a call.

    Inputs: every element (guards included) bitwise unchanged.  Outputs:
    guards and unwritten rows bitwise unchanged, written rows equal to the
    reference (bitwise or within NMSE).
    """
    if t.view is not None:
        return  # checked through its base storage
    if not t.output:
        assert_exact(f"input {name} (must not be written)", got_full, p.initial)
        return
    n = int(np.prod(p.shape))
    assert_exact(f"{name}: guard band before the tensor", got_full[: p.offset], p.initial[: p.offset])
    assert_exact(f"{name}: guard band after the tensor", got_full[p.offset + n :], p.initial[p.offset + n :])
    body = got_full[p.offset : p.offset + n].reshape(p.shape)
    init = p.initial[p.offset : p.offset + n].reshape(p.shape)
    written = np.zeros(p.shape[0], dtype=bool)
    if t.written is None:
        written[:] = True
    else:
        written[np.asarray(t.written, dtype=np.int64)] = True
    if (~written).any():
        assert_exact(f"{name}: rows the call must not touch", body[~written], init[~written])
    if want_full is None:
        return
    want = want_full[p.offset : p.offset + n].reshape(p.shape)
    rows = np.flatnonzero(written)
    for r in rows if t.exact else ():
        assert_exact(f"{name} row {int(r)}", body[r], want[r])
    if not t.exact and rows.size:
        assert_close(f"{name} (written rows)", body[rows], want[rows], tol if tol is not None else NMSE[t.dtype])


def run_on(device: Device, tensors: Mapping[str, Tensor], seed: int, call: Callable[..., None]) -> dict[str, Any]:
    """Place ``tensors`` on ``device``, call ``call(device, buffers)``, download
    every storage.  Floating-point warnings are silenced: NaN/Inf cases make
    them on purpose, and pytest turns warnings into errors."""
    placed = place(device, tensors, seed)
    buffers = {name: p.buffer for name, p in placed.items()}
    with np.errstate(all="ignore"):
        call(device, buffers)
        device.synchronize()
    return {name: (p, device.download(p.storage)) for name, p in placed.items()}


def compare_with_reference(
    device: Device,
    tensors: Mapping[str, Tensor],
    seed: int,
    call: Callable[..., None],
    tolerance: Mapping[str, float] | None = None,
) -> None:
    """Run ``call`` on the device and on the reference with identical bytes and
    check every tensor (see :func:`check_tensor`)."""
    ref = run_on(reference_device(), tensors, seed, call)
    got = run_on(device, tensors, seed, call)
    for name, t in tensors.items():
        p, got_full = got[name]
        _, want_full = ref[name]
        check_tensor(name, t, p, got_full, want_full, (tolerance or {}).get(name))


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)
