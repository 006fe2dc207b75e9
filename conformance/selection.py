"""Which devices a conformance run covers, and which failures are expected.

Shared by the pytest plugin and the ``statecache conformance`` command so both
select and report identically.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import os
from collections.abc import Iterable, Sequence

from statecache.backend import Backend, Device
from statecache.errors import SelectionError
from statecache.registry import BackendRegistry

#: Name of the expected-failures file a backend package may ship next to its
#: ``__init__.py``: one case id (or fnmatch pattern) per line, ``#`` comments.
XFAIL_FILENAME = "conformance_xfails.txt"


@dataclasses.dataclass
class Selection:
    registry: BackendRegistry
    devices: list[Device]
    #: backend name -> why it contributes no device (unavailable, no devices)
    missing: dict[str, str]
    #: backends named explicitly by the user
    named: list[str]

    def backend_of(self, device: Device) -> Backend:
        return self.registry.get_backend(device.backend_name)


def load_plugins(modules: Iterable[str]) -> list[object]:
    """Import statecache plugin modules named on the command line."""
    plugins = []
    for name in modules:
        try:
            plugins.append(importlib.import_module(name))
        except ImportError as exc:
            raise SelectionError(f"cannot import statecache plugin module {name!r}: {exc}") from exc
    return plugins


def select(
    backends: Sequence[str] | None,
    device_spec: str | None,
    plugin_modules: Sequence[str] = (),
    registry: BackendRegistry | None = None,
) -> Selection:
    """Resolve ``--backend`` (names; none = every available backend) and
    ``--device`` (``all``, an index valid for each backend such as ``0``, or
    comma-separated ids such as ``cpu:0,opencl:1``)."""
    if registry is None:
        registry = BackendRegistry(plugins=load_plugins(plugin_modules))
    names = [n.strip() for spec in backends or () for n in spec.split(",") if n.strip()]
    known = registry.names()
    for name in names:
        if name not in known:
            raise SelectionError(f"no backend named {name!r}; installed: {', '.join(known) or 'none'}")
    spec = (device_spec or "all").strip()
    ids = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        # Backends named through device ids count as named; otherwise every one.
        names_from_ids = [i.partition(":")[0] for i in ids if ":" in i]
        for name in names_from_ids:
            if name not in known:
                raise SelectionError(f"device {spec!r} names unknown backend {name!r}; installed: {', '.join(known)}")
        chosen = list(dict.fromkeys(names_from_ids)) or known
        named = list(dict.fromkeys(names_from_ids))
    else:
        chosen = names
        named = names
        # A device id of a backend that is not being tested would be dropped
        # without a word (``--backend cpu --device cpu:0,opencl:0``): refuse it.
        stray = [i for i in ids if ":" in i and i.partition(":")[0] not in names]
        if stray:
            raise SelectionError(
                f"--device {', '.join(stray)} names a backend not given to --backend ({', '.join(names)})"
            )
    devices: list[Device] = []
    missing: dict[str, str] = {}
    for name in chosen:
        entry = next(e for e in registry.entries() if e.name == name)
        ok, reason = entry.availability()
        if not ok or entry.backend is None:
            missing[name] = f"unavailable: {reason}"
            continue
        try:
            devs = list(entry.backend.devices())
        except Exception as exc:  # a broken backend must be reported, not crash the run
            missing[name] = f"listing devices raised {type(exc).__name__}: {exc}"
            continue
        picked = _pick(name, devs, ids)
        if not picked:
            missing[name] = "no device matches --device " + spec if devs else "no devices"
        devices.extend(picked)
    return Selection(registry, devices, missing, named)


def _pick(name: str, devices: list[Device], ids: list[str]) -> list[Device]:
    if not ids or ids == ["all"]:
        return devices
    out = []
    for want in ids:
        if want.isdigit():
            out += [d for d in devices if d.id == f"{name}:{want}"]
        elif want.partition(":")[0] == name:
            match = [d for d in devices if d.id == want]
            if not match and not want.endswith(":"):
                raise SelectionError(f"no device {want!r}; {name} has: {', '.join(d.id for d in devices) or 'none'}")
            out += match
        elif ":" not in want and want != "all":
            raise SelectionError(f"--device takes 'all', an index or ids such as 'cpu:0', got {want!r}")
    return list(dict.fromkeys(out))


# -- expected failures ------------------------------------------------------------


@dataclasses.dataclass
class Expectations:
    """Expected failures per backend, with where each entry came from."""

    #: backend -> list of (pattern, source)
    entries: dict[str, list[tuple[str, str]]]

    def matches(self, backend: str, case_id: str) -> str | None:
        for pattern, source in self.entries.get(backend, ()):
            if case_id == pattern or fnmatch.fnmatchcase(case_id, pattern):
                return source
        return None

    def stale(self, case_ids: Iterable[str]) -> list[tuple[str, str, str]]:
        """(backend, pattern, source) of entries that match no case at all."""
        ids = list(case_ids)
        out = []
        for backend, entries in self.entries.items():
            for pattern, source in entries:
                if not any(i == pattern or fnmatch.fnmatchcase(i, pattern) for i in ids):
                    out.append((backend, pattern, source))
        return out


def read_xfail_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        lines = [line.split("#", 1)[0].strip() for line in fh]
    return [line for line in lines if line]


def expectations(selection: Selection, files: Sequence[str] = ()) -> Expectations:
    """Merge the hook's lists, each backend package's ``conformance_xfails.txt``
    and ``--xfails-file [BACKEND=]PATH`` files (no BACKEND: every backend)."""
    entries: dict[str, list[tuple[str, str]]] = {}
    backends = {d.backend_name for d in selection.devices}
    for name in sorted(backends):
        got = entries.setdefault(name, [])
        for case in selection.registry.expected_failures(name):
            got.append((case, "statecache_conformance_expected_failures hook"))
        backend = selection.registry.get_backend(name)
        module = importlib.import_module(type(backend).__module__)
        package_dir = os.path.dirname(module.__file__ or "")
        shipped = os.path.join(package_dir, XFAIL_FILENAME)
        if os.path.isfile(shipped):
            got += [(case, shipped) for case in read_xfail_file(shipped)]
    for spec in files:
        target, sep, path = spec.partition("=")
        if not sep:
            target, path = "", spec
        if not os.path.isfile(path):
            raise SelectionError(f"--xfails-file {path!r} does not exist")
        for name in [target] if target else sorted(backends):
            entries.setdefault(name, []).extend((case, path) for case in read_xfail_file(path))
    return Expectations(entries)
