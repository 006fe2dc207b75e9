"""A third-party backend package, as a backend author would write it.

It registers ``toy`` (a correct backend: the NumPy reference kernels under
another name), ``toy_oob`` (a broken one: its scatter writes one element past
the last row it addresses), and ``toy_nodev`` (available, but with no
devices).  Installed packages register through the ``statecache.backends``
entry point; the tests load this one with ``--statecache-plugin statecache_toy``.
"""

from __future__ import annotations

from statecache.hookspecs import hookimpl


@hookimpl
def statecache_register_backends(registry):  # type: ignore[no-untyped-def]
    from statecache_toy.backend import NoDeviceBackend, ToyBackend

    registry.add(ToyBackend("toy", broken=False))
    registry.add(ToyBackend("toy_oob", broken=True))
    registry.add(NoDeviceBackend())


@hookimpl
def statecache_conformance_expected_failures(backend_name):  # type: ignore[no-untyped-def]
    if backend_name == "toy_oob":
        # One known failure, and one entry that matches no case (stale).
        return ["set_rows[r16-e33-n5-f32]", "set_rows[no-such-case]"]
    return None
