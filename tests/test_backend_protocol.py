"""The backend protocol version: a backend written against other primitive
signatures is listed unavailable with the reason, never called."""

from __future__ import annotations

import types

import pytest

import statecache
from statecache.backend import PROTOCOL_VERSION, Backend, Caps
from statecache.backends.reference.device import ReferenceDevice
from statecache.errors import BackendUnavailableError
from statecache.hookspecs import hookimpl
from statecache.registry import BackendRegistry


class OldBackend(Backend):
    """Written before protocol 2: it declares no protocol and overrides both methods."""

    name = "oldie"

    def availability(self):  # type: ignore[no-untyped-def]
        return True, ""

    def devices(self):  # type: ignore[no-untyped-def]
        return [ReferenceDevice()]


class NewBackend(OldBackend):
    name = "newbie"
    protocol = PROTOCOL_VERSION


def _registry(*backends: Backend) -> BackendRegistry:
    mod = types.ModuleType("protocol_plugin")

    @hookimpl
    def statecache_register_backends(registry):  # type: ignore[no-untyped-def]
        for b in backends:
            registry.add(b)

    mod.statecache_register_backends = statecache_register_backends  # type: ignore[attr-defined]
    return BackendRegistry(load_entry_points=False, plugins=[mod])


def test_a_backend_of_another_protocol_is_unavailable_with_the_reason() -> None:
    old = OldBackend()
    ok, reason = old.availability()
    assert not ok
    assert reason.startswith(f"backend 'oldie' implements protocol 1, statecache {statecache.__version__} needs 2")
    assert old.devices() == []  # never handed out, even when asked directly
    assert old.info()["protocol"] == 1
    reg = _registry(old, NewBackend())
    with pytest.raises(BackendUnavailableError, match="implements protocol 1"):
        reg.get_backend("oldie")
    assert reg.get_device("newbie").id == "reference:0"
    assert [d.id for d in reg.available_devices()] == ["reference:0"]


def test_builtin_backends_speak_this_protocol() -> None:
    from statecache.backends.cpu.device import CpuBackend
    from statecache.backends.cuda.device import CudaBackend
    from statecache.backends.opencl.device import OpenCLBackend
    from statecache.backends.reference.device import ReferenceBackend

    for cls in (ReferenceBackend, CpuBackend, OpenCLBackend, CudaBackend):
        assert cls.protocol == PROTOCOL_VERSION, cls


def test_caps_refuse_unknown_epilogues_and_activation_dtypes() -> None:
    with pytest.raises(ValueError, match="unknown epilogues"):
        Caps(ops=frozenset(), storage_dtypes=frozenset(), epilogues=frozenset({"softcap"}))
    with pytest.raises(ValueError, match="activation_dtypes"):
        Caps(ops=frozenset(), storage_dtypes=frozenset(), activation_dtypes=frozenset())
