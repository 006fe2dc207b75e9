"""Storage and index dtypes that cross the backend boundary.

States are always *computed* in float32; they may be *stored* as f32, f16 or
bf16.  bf16 comes from ml_dtypes so NumPy can hold it without a hand-rolled
conversion.  Index arrays are always int32.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


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
        names = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown dtype {value!r}; expected one of {names}")

    def __str__(self) -> str:
        return str(self.value)


_NUMPY: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.I32: np.dtype(np.int32),
}

for _member, _np_dtype in _NUMPY.items():
    # Enum members accept instance attributes; these never change.
    object.__setattr__(_member, "numpy", _np_dtype)
    object.__setattr__(_member, "itemsize", int(_np_dtype.itemsize))

#: Dtypes a state pool, K/V buffer or primitive output may be stored in.
STORAGE_DTYPES: frozenset[DType] = frozenset({DType.F32, DType.F16, DType.BF16})
