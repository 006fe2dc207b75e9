"""Backend discovery and device selection.

A :class:`BackendRegistry` owns its own pluggy PluginManager (there is no
global one at import time); :func:`default_registry` builds one lazily from
the ``statecache.backends`` entry points.  Embedding runtimes and tests make
their own registries, with or without entry points.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import pluggy

from statecache import hookspecs, settings
from statecache.backend import Backend, Device
from statecache.errors import (
    BackendDiscoveryWarning,
    BackendNotFoundError,
    BackendUnavailableError,
    DuplicateBackendWarning,
    SettingsWarning,
)

ENTRY_POINT_GROUP = "statecache.backends"

#: Where a backend that is not installed comes from (for error messages).
KNOWN_PROVIDERS: dict[str, str] = {
    "reference": "the statecache distribution itself",
    "cpu": "the statecache distribution, built with a C compiler (pip install statecache)",
    "opencl": "the 'opencl' extra (pip install 'statecache[opencl]') and an OpenCL platform "
    "(apt-get install pocl-opencl-icd)",
    "cuda": "the statecache distribution, with nvcc and a CUDA driver on the machine",
}


@dataclasses.dataclass
class BackendEntry:
    """What the registry knows about one backend name."""

    name: str
    backend: Backend | None
    distribution: str
    dist_version: str
    load_error: str = ""

    def availability(self) -> tuple[bool, str]:
        if self.backend is None:
            return False, self.load_error
        try:
            return self.backend.availability()
        except Exception as exc:  # a broken backend must never break discovery
            return False, f"availability check raised {type(exc).__name__}: {exc}"


class BackendRegistry:
    """Backends by name, and device selection.

    :param load_entry_points: load plugins from the ``statecache.backends``
        entry-point group (the built-ins are there).
    :param allowlist: only these backend names are loaded; ``None`` reads
        ``STATECACHE_BACKENDS`` (unset = all).
    :param plugins: extra plugin objects (modules or instances with
        ``@hookimpl`` methods) to register before the hook is called.
    """

    def __init__(
        self,
        *,
        load_entry_points: bool = True,
        allowlist: Iterable[str] | None = None,
        plugins: Iterable[Any] = (),
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        if settings.trace_plugins():
            self.pm.trace.root.setwriter(print)
            self.pm.enable_tracing()
        self.allowlist = frozenset(allowlist) if allowlist is not None else settings.backend_allowlist()
        self._entries: dict[str, BackendEntry] = {}
        #: every backend name some plugin offered, loaded or filtered out by the allowlist
        self._offered: set[str] = set()
        self._plugin_dist: dict[int, tuple[str, str]] = {}
        self._current_dist: tuple[str, str] | None = None
        if load_entry_points:
            self._load_entry_points()
        for plugin in plugins:
            self.pm.register(plugin)
        # Historic: plugins registered later through register_plugin are called too.
        self.pm.hook.statecache_register_backends.call_historic(kwargs={"registry": self})
        self.pm.check_pending()
        if allowlist is None and self.allowlist:
            # A typo in STATECACHE_BACKENDS would otherwise just hide a backend.
            unknown = sorted(self.allowlist - self._offered)
            if unknown:
                warnings.warn(
                    f"STATECACHE_BACKENDS names {', '.join(map(repr, unknown))}, which no installed plugin "
                    f"provides (installed: {', '.join(sorted(self._offered)) or 'none'}); ignored",
                    SettingsWarning,
                    stacklevel=2,
                )

    # -- plugins ----------------------------------------------------------------
    def _load_entry_points(self) -> None:
        claims: dict[str, list[tuple[importlib.metadata.EntryPoint, str, str]]] = {}
        seen: set[tuple[str, str, str]] = set()
        for dist in importlib.metadata.distributions():
            dist_name = dist.metadata["Name"] or "?"
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP:
                    continue
                key = (ep.name, ep.value, dist_name)
                if key in seen:  # the same dist-info seen twice (lib64 -> lib symlink)
                    continue
                seen.add(key)
                claims.setdefault(ep.name, []).append((ep, dist_name, dist.version))
        self._offered.update(claims)
        for name, claimants in sorted(claims.items()):
            if len(claimants) > 1:
                who = ", ".join(f"{d} {v} ({ep.value})" for ep, d, v in claimants)
                warnings.warn(
                    f"backend {name!r} is claimed by several distributions: {who}; using the first",
                    DuplicateBackendWarning,
                    stacklevel=3,
                )
            if self.allowlist is not None and name not in self.allowlist:
                continue
            ep, dist_name, dist_version = claimants[0]
            try:
                plugin = ep.load()
            except Exception as exc:  # never crash discovery
                self._entries[name] = BackendEntry(
                    name, None, dist_name, dist_version, f"plugin {ep.value} failed to import: {exc}"
                )
                continue
            self.pm.register(plugin, name=f"{ENTRY_POINT_GROUP}:{name}")
            self._plugin_dist[id(plugin)] = (dist_name, dist_version)

    def register_plugin(self, plugin: Any, *, distribution: str = "", version: str = "") -> None:
        """Register a plugin object late; its backends are added at once."""
        self._plugin_dist[id(plugin)] = (distribution or getattr(plugin, "__name__", "?"), version)
        self.pm.register(plugin)
        self.pm.check_pending()

    # -- what plugins call ------------------------------------------------------
    def add(self, backend: Backend) -> None:
        """Add a backend.  A second backend of an existing name is refused with
        a warning naming both providers (the first one stays)."""
        if not isinstance(backend, Backend):
            raise TypeError(f"registry.add() takes a Backend, got {type(backend).__name__}")
        name = backend.name
        self._offered.add(name)
        if self.allowlist is not None and name not in self.allowlist:
            return
        dist, version = self._dist_of(backend)
        existing = self._entries.get(name)
        if existing is not None:
            warnings.warn(
                f"backend {name!r} registered twice: by {existing.distribution} and by {dist}; "
                f"keeping {existing.distribution}",
                DuplicateBackendWarning,
                stacklevel=2,
            )
            return
        self._entries[name] = BackendEntry(name, backend, dist, version)

    def _dist_of(self, backend: Backend) -> tuple[str, str]:
        module = type(backend).__module__
        for plugin in self.pm.get_plugins():
            pname = getattr(plugin, "__name__", "")
            if pname and module.startswith(pname) and id(plugin) in self._plugin_dist:
                return self._plugin_dist[id(plugin)]
        return backend.provided_by, backend.version

    # -- queries ----------------------------------------------------------------
    def entries(self) -> list[BackendEntry]:
        """Every known backend, usable or not, by descending priority."""
        return sorted(
            self._entries.values(),
            key=lambda e: (-(e.backend.priority if e.backend else -1), e.name),
        )

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def why_empty(self) -> str:
        """Why no backend is known ("" when some is): an empty or mistyped
        ``STATECACHE_BACKENDS``, or no plugin installed at all."""
        if self._entries:
            return ""
        if self.allowlist is not None and not self.allowlist:
            return (
                "STATECACHE_BACKENDS is set but empty, so no backend is loaded; "
                "unset it to load every installed backend, or name some (e.g. STATECACHE_BACKENDS=cpu,reference)"
            )
        if self.allowlist is not None:
            return (
                f"STATECACHE_BACKENDS allows only {', '.join(sorted(self.allowlist))}, and no installed plugin "
                f"provides those (installed: {', '.join(sorted(self._offered)) or 'none'})"
            )
        return f"no statecache backend is installed (entry-point group {ENTRY_POINT_GROUP!r} is empty)"

    def get_backend(self, name: str) -> Backend:
        entry = self._entries.get(name)
        if entry is None:
            raise BackendNotFoundError(self._not_found_message(name))
        ok, reason = entry.availability()
        if not ok or entry.backend is None:
            raise BackendUnavailableError(f"backend {name!r} is installed but unavailable: {reason}")
        return entry.backend

    def available_devices(self) -> list[Device]:
        out: list[Device] = []
        for entry in self.entries():
            ok, _ = entry.availability()
            if ok and entry.backend is not None:
                try:
                    out.extend(entry.backend.devices())
                except Exception as exc:  # pragma: no cover - defensive
                    warnings.warn(
                        f"backend {entry.name!r} failed to list devices: {exc}", BackendDiscoveryWarning, stacklevel=2
                    )
        return out

    def get_device(self, name: str | None = None) -> Device:
        """Select a device: ``"cpu"``, ``"cpu:0"``, ``"opencl:1"``, ``"reference"``.

        With no name: ``STATECACHE_DEVICE``, else the first device of the
        available backend with the highest priority.
        """
        if name is None:
            from_env = settings.device()
            if from_env is not None:
                try:
                    return self.get_device(from_env)
                except (BackendNotFoundError, BackendUnavailableError) as exc:
                    # Name the variable: the caller named no device, so a bare
                    # "no backend named 'nosuch'" would not say where it came from.
                    raise type(exc)(f"STATECACHE_DEVICE={from_env!r}: {exc}") from None
        if name is None:
            for entry in self.entries():
                ok, _ = entry.availability()
                if ok and entry.backend is not None and entry.backend.devices():
                    return entry.backend.devices()[0]
            why = self.why_empty()  # an empty or mistyped STATECACHE_BACKENDS says so here too
            raise BackendNotFoundError(
                f"no usable device; backends known: {self._listing()}" + (f" ({why})" if why else "")
            )
        backend_name, _, index_text = name.strip().partition(":")
        backend = self.get_backend(backend_name)
        devices = list(backend.devices())
        if not index_text:
            if not devices:
                raise BackendUnavailableError(f"backend {backend_name!r} has no devices")
            return devices[0]
        try:
            index = int(index_text)
        except ValueError:
            raise BackendNotFoundError(f"device index {index_text!r} in {name!r} is not an integer") from None
        if not 0 <= index < len(devices):
            ids = ", ".join(d.id for d in devices) or "none"
            raise BackendNotFoundError(f"no device {name!r}; {backend_name} has: {ids}")
        return devices[index]

    def expected_failures(self, backend_name: str) -> list[str]:
        lists = self.pm.hook.statecache_conformance_expected_failures(backend_name=backend_name)
        return sorted({case for lst in lists if lst for case in lst})

    def _listing(self) -> str:
        parts = []
        for entry in self.entries():
            ok, reason = entry.availability()
            parts.append(entry.name if ok else f"{entry.name} (unavailable: {reason})")
        return ", ".join(parts) or "none"

    def _not_found_message(self, name: str) -> str:
        msg = f"no backend named {name!r}; installed: {self._listing()}"
        if self.allowlist is not None and name not in self.allowlist:
            msg += f"; STATECACHE_BACKENDS restricts loading to {sorted(self.allowlist)}"
        if name in KNOWN_PROVIDERS:
            msg += f"; {name!r} is provided by {KNOWN_PROVIDERS[name]}"
        else:
            msg += "; is the plugin package installed?"
        return msg


_default: BackendRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> BackendRegistry:
    """The process-wide registry, built on first use from entry points."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BackendRegistry()
        return _default


def reset_default_registry() -> None:
    """Forget the default registry (tests, or after changing the environment)."""
    global _default
    with _default_lock:
        _default = None


def get_device(name: str | None = None) -> Device:
    """Select a device from the default registry (see BackendRegistry.get_device)."""
    return default_registry().get_device(name)
