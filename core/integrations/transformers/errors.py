"""Errors of the transformers integration.

:class:`~statecache.errors.IntegrationError` (the core's) says the integration cannot be used
here at all: torch or transformers is missing or outside the supported versions.
:class:`UnsupportedModelError`, a subclass, says this *model* cannot run: a model type, a
decoder layer's mixer class, a shape, a device or an option the integration does not map,
named in the message.  It is raised while the model is attached, before anything is built,
so nothing runs half-supported.
"""

from __future__ import annotations

from statecache.errors import IntegrationError

#: what every supported model needs, for the ``needed`` field of the core error
_NEEDED = "a model type, layer and device the integration maps (docs/integrations/transformers.md)"


class UnsupportedModelError(IntegrationError, ValueError):
    """A model type, layer class, device or option the transformers integration cannot run."""

    def __init__(self, message: str) -> None:
        ImportError.__init__(self, message)  # the message names what was refused, not a version
        self.runtime = "transformers"
        self.extra = "transformers"
        self.found = None
        self.needed = _NEEDED


__all__ = ["IntegrationError", "UnsupportedModelError"]
