"""The error the transformers integration raises on purpose."""

from __future__ import annotations

from statecache.errors import StatecacheError


class IntegrationError(StatecacheError, ValueError):
    """A model, layer type, device or option the integration cannot run.

    The message names what was refused (the model type, the layer's class
    and index, the device) so that nothing runs half-supported.
    """
