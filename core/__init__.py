"""statecache: the memory subsystem for recurrent and hybrid LLMs.

The core is backend-neutral (it never imports torch, cffi or pyopencl);
devices come from backends found through the ``statecache.backends``
entry-point group.  Select one with :func:`get_device`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from statecache.backend import Backend, Buffer, Caps, Device, DeviceKind, Support
from statecache.dtypes import DType
from statecache.errors import (
    ArgumentError,
    BackendNotFoundError,
    BackendUnavailableError,
    BatchError,
    CapabilityError,
    StatecacheError,
    StateError,
)
from statecache.registry import BackendRegistry, default_registry, get_device

__all__ = [
    "ArgumentError",
    "Backend",
    "BackendNotFoundError",
    "BackendRegistry",
    "BackendUnavailableError",
    "BatchError",
    "Buffer",
    "Caps",
    "CapabilityError",
    "DType",
    "Device",
    "DeviceKind",
    "StateError",
    "StatecacheError",
    "Support",
    "__version__",
    "default_registry",
    "get_device",
]
