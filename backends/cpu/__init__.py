"""C CPU backend: every primitive in C, compiled with cffi (API mode) at install.

This module holds only the hook implementation; the device lives in
``device.py``, the cffi builder in ``build.py`` and each primitive family in
its own C file (``rows.c``, ``ssm_conv.c``, ``ssm_scan.c``, ``delta_net.c``).
"""

from __future__ import annotations

from statecache.hookspecs import hookimpl


@hookimpl
def statecache_register_backends(registry):  # type: ignore[no-untyped-def]
    # device.py imports the compiled module lazily: a build without a
    # compiler still registers the backend, reported unavailable with the reason.
    from statecache.backends.cpu.device import CpuBackend

    registry.add(CpuBackend())
