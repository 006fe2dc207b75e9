"""Every exception statecache raises on purpose.

Errors name what was wrong (the argument, field, token or sequence) so that
a caller can act on them without reading our source.
"""

from __future__ import annotations


class StatecacheError(Exception):
    """Base class of every statecache error."""


class ArgumentError(StatecacheError, ValueError):
    """A primitive or API argument is invalid.  Raised before anything runs."""

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}")


class CapabilityError(StatecacheError):
    """The device cannot do what was asked (op, dtype, shape limit)."""


class BackendNotFoundError(StatecacheError, LookupError):
    """No backend or device of that name is installed or usable."""


class BackendUnavailableError(StatecacheError):
    """The backend is installed but cannot be used here (reason in message)."""


class BatchError(StatecacheError, ValueError):
    """A batch breaks a rule; the message names token, sequence and rule."""

    def __init__(self, message: str, *, token: int | None = None, seq: int | None = None, rule: str = "") -> None:
        self.token = token
        self.seq = seq
        self.rule = rule
        super().__init__(message)


class StateError(StatecacheError, ValueError):
    """A state blob is corrupt or does not match this memory (field named)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"state blob field {field!r}: {message}")


class MemoryPlanError(StatecacheError):
    """A memory could not plan a batch (no slot, too many sequences ...)."""
