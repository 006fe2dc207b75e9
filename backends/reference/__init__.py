"""The NumPy reference backend: the definition of truth for the conformance
suite, and a backend that works anywhere without a compiler.

This module holds only the hook implementation; the device lives in
``device.py`` and each primitive family in its own file.
"""

from __future__ import annotations

from statecache.hookspecs import hookimpl


@hookimpl(trylast=True)
def statecache_register_backends(registry):  # type: ignore[no-untyped-def]
    from statecache.backends.reference.device import ReferenceBackend

    registry.add(ReferenceBackend())
