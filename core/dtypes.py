"""Storage and index dtypes that cross the backend boundary.

States are always *computed* in float32; they may be *stored* as f32, f16 or
bf16.  bf16 comes from ml_dtypes so NumPy can hold it without a hand-rolled
conversion.  Index arrays are always int32.

ml_dtypes is imported the first time bf16's NumPy dtype is asked for, not
with statecache: its extension takes about half a second of CPU to import,
which every process (the CLI, each rank of a distributed test) would pay
whether or not it ever holds a bf16 value.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class _LazyNumpy:
    """``DType.numpy`` of a member whose NumPy dtype needs an import: found on
    first use, then stored on the member, so later reads are a plain attribute
    (an instance attribute wins over this non-data descriptor)."""

    def __get__(self, member: Any, owner: type | None = None) -> np.dtype:
        if member is None:
            raise AttributeError("numpy")
        npd = _load_numpy(member)
        object.__setattr__(member, "numpy", npd)
        return npd


class DType(enum.Enum):
    """A dtype a buffer may hold.  ``value`` is the short name used in caps."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I32 = "i32"

    # numpy / itemsize are looked up on every primitive call: they are plain
    # attributes set once below the class, not properties hashing the enum.
    numpy: np.dtype
    itemsize: int

    @property
    def is_float(self) -> bool:
        return self is not DType.I32

    @classmethod
    def parse(cls, value: DType | str | np.dtype | type) -> DType:
        """Accept a DType, its short name ('f16') or a NumPy dtype."""
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        try:
            npd = np.dtype(value)
        except TypeError:
            npd = None
        if npd is not None:
            for member, candidate in _NUMPY.items():
                if candidate == npd:
                    return member
            # A bf16 dtype exists only once ml_dtypes is imported, so this
            # compare imports nothing that was not already loaded.
            if npd.name == "bfloat16" and npd == DType.BF16.numpy:
                return DType.BF16
        names = ", ".join(m.value for m in cls)
        if npd is not None and not isinstance(value, str):
            # Most often a NumPy default (float64, int64) reaching upload(): say how to get
            # a stored dtype instead of only listing them.
            raise ValueError(
                f"NumPy dtype {npd.name} is not a statecache dtype (expected one of {names}); "
                "convert the array first (e.g. array.astype(np.float32)) or name the storage "
                "dtype (device.upload(array, 'f32'))"
            )
        raise ValueError(f"unknown dtype {value!r}; expected one of {names}")

    def __str__(self) -> str:
        return str(self.value)


#: The NumPy dtypes known without importing anything; bf16's is added by
#: :func:`_load_numpy` when first asked for.
_NUMPY: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.I32: np.dtype(np.int32),
}


def _load_numpy(member: DType) -> np.dtype:
    if member is DType.BF16:
        import ml_dtypes

        npd: np.dtype = np.dtype(ml_dtypes.bfloat16)
        _NUMPY[member] = npd
        return npd
    return _NUMPY[member]


# Set on the class after it is made: in the class body a descriptor would
# read as a member to the type checker.
type.__setattr__(DType, "numpy", _LazyNumpy())
for _member, _np_dtype in _NUMPY.items():
    # Enum members accept instance attributes; these never change.
    object.__setattr__(_member, "numpy", _np_dtype)
for _member, _size in ((DType.F32, 4), (DType.F16, 2), (DType.BF16, 2), (DType.I32, 4)):
    object.__setattr__(_member, "itemsize", _size)

#: Dtypes a state pool, K/V buffer or primitive output may be stored in.
STORAGE_DTYPES: frozenset[DType] = frozenset({DType.F32, DType.F16, DType.BF16})
