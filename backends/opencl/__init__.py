"""The OpenCL backend: OpenCL C kernels run through pyopencl.

This module holds only the hook implementation; the device lives in
``device.py``, the build in ``build.py`` and each primitive family in its own
``.cl`` file.  Nothing here imports pyopencl, so the backend is listed (as
unavailable, with the reason) even where the ``opencl`` extra is missing.
"""

from __future__ import annotations

from statecache.hookspecs import hookimpl


@hookimpl
def statecache_register_backends(registry):  # type: ignore[no-untyped-def]
    from statecache.backends.opencl.device import OpenCLBackend

    registry.add(OpenCLBackend())
