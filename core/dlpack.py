"""The DLPack C structures (dlpack.h, ABI 1.x) as ctypes, shared by the
backends that export or import buffers without copies.

Only the standard layout lives here; what a backend puts in the fields
(device type, who frees the memory) stays in that backend.  ctypes is part of
the standard library, so the core still imports no backend library.
"""

from __future__ import annotations

import ctypes

KDL_CPU = 1
KDL_CUDA = 2

#: DLDataType codes
KDL_INT = 0
KDL_UINT = 1
KDL_FLOAT = 2
KDL_BFLOAT = 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]
