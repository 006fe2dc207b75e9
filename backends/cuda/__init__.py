"""CUDA backend: kernels built by nvcc into a shared library, loaded with cffi
(ABI mode).

This module holds only the hook implementation.  Nothing heavy happens at
import: the library is found or built, and the driver asked for devices,
inside ``CudaBackend.availability()`` / ``devices()``.
"""

from __future__ import annotations

from statecache.hookspecs import hookimpl


@hookimpl
def statecache_register_backends(registry):  # type: ignore[no-untyped-def]
    from statecache.backends.cuda.device import CudaBackend

    registry.add(CudaBackend())
