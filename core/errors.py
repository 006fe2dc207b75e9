"""Every exception and warning statecache raises on purpose, in one hierarchy.

Errors name what was wrong (the argument, field, token or sequence) so that
a caller can act on them without reading our source.  Every error derives
from :class:`StatecacheError` and every warning from
:class:`StatecacheWarning`, so ``except StatecacheError`` (or a warnings
filter on ``StatecacheWarning``) covers the whole package.  Classes that used
to live next to their first user (``ContextError`` in
:mod:`statecache.memory`, ``PosError`` in :mod:`statecache.batch`,
``BuildError`` in the CUDA backend's build module, ``SelectionError`` in the
conformance selection) are defined here and still importable from there.
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


class PosError(BatchError, ArgumentError):
    """``Batch.pos`` has a shape or type the allocator cannot use.

    Both an :class:`ArgumentError` naming ``pos`` and a :class:`BatchError`
    with rule ``"pos"`` (what a bad 1-D ``pos`` always raised)."""

    def __init__(self, message: str) -> None:
        self.argument = "pos"
        self.token = None
        self.seq = None
        self.rule = "pos"
        Exception.__init__(self, f"pos: {message}")


class StateError(StatecacheError, ValueError):
    """A state blob is corrupt or does not match this memory (field named)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"state blob field {field!r}: {message}")


class MemoryPlanError(StatecacheError):
    """A memory could not plan a batch (no slot, too many sequences ...)."""


class ContextError(StatecacheError):
    """A context was used out of order (ubatch of a failed plan, apply past the end),
    or its plan is stale: the memory changed after the plan was made."""


class InvariantError(StatecacheError, AssertionError):
    """An internal consistency check failed: a bug in statecache, not in the caller.

    ``invariant`` names the rule (``"I1"``, ``"kv-used"`` ... as cited in
    ``docs/memory-semantics.md``).  Raised explicitly, so the checks survive
    ``python -O``; an :class:`AssertionError` too, so test helpers that
    expected the old ``assert`` keep working."""

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"invariant {invariant} broken: {message}")


class BuildError(StatecacheError, RuntimeError):
    """Compiling kernels failed; the message holds the command and the compiler's output."""


class IntegrationError(StatecacheError, ImportError):
    """An integration with an outside runtime cannot be used: its package is
    missing or outside the supported versions.  Names the extra to install and
    the versions found and needed."""

    def __init__(self, runtime: str, *, extra: str, found: str | None, needed: str) -> None:
        self.runtime = runtime
        self.extra = extra
        self.found = found
        self.needed = needed
        have = f"found {runtime} {found}" if found is not None else f"{runtime} is not installed"
        super().__init__(f"{have}; statecache needs {runtime} {needed} (pip install 'statecache[{extra}]')")


class SettingsError(StatecacheError, ValueError):
    """An environment variable holds a value statecache cannot use (the
    message names the variable and the value)."""


class SelectionError(StatecacheError):
    """The user asked for a backend, device, plugin or file that does not exist
    (a usage error of the conformance kit)."""


# -- warnings --------------------------------------------------------------------------


class StatecacheWarning(UserWarning):
    """Base class of every warning statecache issues."""


class DuplicateBackendWarning(StatecacheWarning):
    """Two plugins or distributions claim the same backend name."""


class BackendDiscoveryWarning(StatecacheWarning):
    """A backend that says it is available failed to list its devices."""


class SettingsWarning(StatecacheWarning):
    """An environment variable names something that does not exist (it is ignored)."""
