"""Which devices a conformance run covers, and which failures are expected.

Shared by the pytest plugin and the ``statecache conformance`` command so both
select and report identically.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence

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
    """Import statecache plugin modules named on the command line.

    A module that is not on the import path is looked for in the current
    directory too (the ``statecache`` script's own folder, not the one it is
    run from, heads ``sys.path``), and otherwise the error says how to point
    Python at it."""
    return [_import_plugin(name) for name in modules]


def _import_plugin(name: str) -> object:
    cwd = os.getcwd()
    for where in ("import path", "current directory"):
        if where == "current directory":
            if cwd in [os.path.abspath(p or ".") for p in sys.path]:
                break
            # Kept on sys.path when the import works: plugins import their own
            # submodules lazily (in the hook, in devices()).
            sys.path.insert(0, cwd)
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if where == "current directory":
                sys.path.remove(cwd)
            if not _is_the_module_itself(exc, name):
                raise _import_failed(name, exc) from exc
        except Exception as exc:  # a plugin that fails on import: its error in one line, not our traceback
            raise _import_failed(name, exc) from exc
    raise SelectionError(
        f"cannot import statecache plugin module {name!r}: it is neither on the import path nor in the current "
        f"directory ({cwd}); set PYTHONPATH to the folder that holds it, e.g. "
        f"PYTHONPATH=path/to/folder statecache conformance --plugin {name}"
    )


def _import_failed(name: str, exc: Exception) -> SelectionError:
    return SelectionError(f"statecache plugin module {name!r} failed to import: {type(exc).__name__}: {exc}")


def _is_the_module_itself(exc: ModuleNotFoundError, name: str) -> bool:
    """Whether ``exc`` says the plugin (or a parent package of it) is missing,
    rather than something the plugin imports."""
    parts = name.split(".")
    return exc.name in {".".join(parts[: i + 1]) for i in range(len(parts))}


def keyword_matcher(expression: str) -> Callable[[str], bool]:
    """A predicate for ``-k EXPRESSION`` over names (case ids, benchmark shapes).

    The grammar is pytest's (``and``, ``or``, ``not``, parentheses); a word
    matches when it is a case-insensitive substring of the name, as pytest
    matches it against a test's id.  A malformed expression is a
    :class:`SelectionError`."""
    # pytest's own parser, so -k means the same here as in the suite's run;
    # its error class changed name across pytest versions (ParseError, SyntaxError).
    from _pytest.mark.expression import Expression

    try:
        compiled = Expression.compile(expression)
    except Exception as exc:
        raise SelectionError(f"-k {expression!r} is not a valid expression: {exc}") from None

    def matches(name: str) -> bool:
        lowered = name.lower()
        return compiled.evaluate(lambda word, /, **_: word.lower() in lowered)

    return matches


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
    listed: list[Device] = []
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
        listed += devs
        picked = _pick(name, devs, ids)
        if not picked:
            missing[name] = "no device matches --device " + spec if devs else "no devices"
        devices.extend(picked)
    # An index no backend has (``--device 99``) is a mistake like ``--device cpu:3``,
    # not "no usable device" (which --require-device would turn into a failed check).
    for want in ids:
        if want.isdigit() and listed and not any(d.id.partition(":")[2] == want for d in listed):
            raise SelectionError(
                f"--device {want}: no selected backend has a device with index {want}; "
                f"devices: {', '.join(d.id for d in listed)}"
            )
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
