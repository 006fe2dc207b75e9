"""The plugin contract: every hook statecache calls, in one module.

Plugins implement hooks with :data:`hookimpl` and are found through the
``statecache.backends`` entry-point group (the built-in backends use that
group too).  Every hook name starts with ``statecache_``; an implementation
whose name starts with that prefix but matches no spec is rejected when the
registry loads (``check_pending``), so a misspelled hook fails loudly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from statecache.registry import BackendRegistry

PROJECT = "statecache"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- registration -----------------------------------------------------------


@hookspec(historic=True)
def statecache_register_backends(registry: BackendRegistry) -> None:
    """Register backends with ``registry.add(backend)``.

    :param registry: the :class:`statecache.registry.BackendRegistry` being
        populated.  ``add`` takes a :class:`statecache.backend.Backend`.
    :return: nothing; results are ignored.

    Historic: a plugin registered after the registry was populated (for
    example by an embedding runtime calling ``registry.register_plugin``) is
    still called.  Keep the implementation cheap: import heavy modules
    (pyopencl, the compiled library) inside ``Backend.availability`` or
    ``Backend.devices``, never at plugin import time.
    """


# -- conformance ------------------------------------------------------------


@hookspec
def statecache_conformance_expected_failures(backend_name: str) -> list[str] | None:
    """Case ids the named backend is known to fail (its xfail list).

    :param backend_name: the backend under test.
    :return: a list of conformance case ids (exact ids, as printed by the
        suite), or ``None`` when this plugin has nothing to say.  The lists of
        every plugin are merged; ids that match no case produce a warning so
        stale entries are noticed.

    Not firstresult: every plugin may contribute.
    """


def all_hook_names() -> list[str]:
    """Names of every hook spec in this module (used by meta-tests)."""
    return sorted(name for name, obj in globals().items() if name.startswith("statecache_") and callable(obj))
