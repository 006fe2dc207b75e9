"""The backend protocol version: a backend written against other primitive
signatures is listed unavailable with the reason, never called."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import statecache
from statecache.backend import PROTOCOL_VERSION, Backend, Caps
from statecache.backends.reference.device import ReferenceDevice
from statecache.dtypes import DType
from statecache.errors import BackendUnavailableError, CapabilityError
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


class PlainDevice(ReferenceDevice):
    """A third-party device without fused epilogues and without the packed form."""

    def __init__(self) -> None:
        super().__init__()
        self.caps = dataclasses.replace(self.caps, epilogues=frozenset(), varlen=False)


def test_a_missing_epilogue_is_not_supported_and_writes_nothing() -> None:
    dev = PlainDevice()
    rng = np.random.default_rng(0)
    H, P_, N = 2, 4, 8
    pool_host = rng.uniform(-1, 1, (2, H * P_ * N)).astype(np.float32)
    pool = dev.upload(pool_host)
    y = dev.alloc((1, 1, H, P_))
    f = lambda *shape: dev.upload(rng.uniform(-1, 1, shape).astype(np.float32))  # noqa: E731
    args = (pool, dev.indices([0]), dev.indices([1]), f(1, 1, H, P_), f(1, 1, H), f(H), f(1, 1, 1, N), f(1, 1, 1, N), y)
    with pytest.raises(CapabilityError, match="does not fuse D into ssm_scan"):
        dev.ssm_scan(*args, D=f(H))
    with pytest.raises(CapabilityError, match="packed"):
        dev.ssm_scan(pool, dev.indices([0]), dev.indices([1]), f(1, H, P_), f(1, H), f(H), f(1, 1, N), f(1, 1, N),
                     dev.alloc((1, H, P_)), cu_seqlens=dev.indices([0, 1]))  # fmt: skip
    np.testing.assert_array_equal(dev.download(pool), pool_host)
    dev.ssm_scan(*args)  # the plain call runs
    # and the suite reports the fused cases as not supported, never as failed
    from statecache.conformance import epilogue_cases

    case = next(c for c in epilogue_cases.all_cases() if c.id.startswith("ssm_scan.epilogue["))
    ok, reason = case.support(dev)
    assert not ok and "varlen=False" in reason, reason
    dev.caps = dataclasses.replace(dev.caps, varlen=True)
    ok, reason = case.support(dev)
    assert not ok and "does not fuse dt_bias into ssm_scan" in reason, reason


def test_a_protocol_2_device_without_the_linear_attention_primitives_refuses_them_cleanly() -> None:
    """A device written before rwkv_wkv6/rwkv_wkv7/gated_linear_attn existed (only the
    abstract methods, ops without them) is constructible and usable; a call of a missing
    one is a CapabilityError naming it, before anything is written."""
    from statecache.backend import LINEAR_ATTN_PRIMITIVES, Device

    class Older(ReferenceDevice):
        def __init__(self) -> None:
            super().__init__()
            self.caps = dataclasses.replace(self.caps, ops=self.caps.ops - LINEAR_ATTN_PRIMITIVES)

    for name in ("_rwkv_wkv6", "_rwkv_wkv7", "_gated_linear_attn"):
        assert name not in Device.__abstractmethods__  # not required of any backend
    dev = Older()
    rng = np.random.default_rng(1)
    H, S = 2, 4
    pool_host = rng.uniform(-1, 1, (2, H * S * S)).astype(np.float32)
    pool = dev.upload(pool_host)
    t = [dev.upload(rng.uniform(-1, 1, (1, 1, H, S)).astype(np.float32)) for _ in range(6)]
    o = dev.alloc((1, 1, H, S))
    rows = (pool, dev.indices([0]), dev.indices([1]))
    with pytest.raises(CapabilityError, match="does not implement rwkv_wkv6"):
        dev.rwkv_wkv6(*rows, *t[:4], dev.upload(np.zeros((H, S), np.float32)), o)
    with pytest.raises(CapabilityError, match="does not implement rwkv_wkv7"):
        dev.rwkv_wkv7(*rows, *t, o)
    with pytest.raises(CapabilityError, match="does not implement gated_linear_attn"):
        dev.gated_linear_attn(*rows, *t[:4], o)
    np.testing.assert_array_equal(dev.download(pool), pool_host)
    np.testing.assert_array_equal(dev.download(o), 0.0)
    assert not dev.supports("rwkv_wkv7") and "does not implement rwkv_wkv7" in dev.supports("rwkv_wkv7").reason
    # the refusal says what the device does do, so a newcomer knows what to ask for instead
    assert "it implements copy_rows, gated_delta_net, get_rows" in dev.supports("rwkv_wkv7").reason


def test_a_dtype_the_device_cannot_store_is_refused_naming_those_it_can() -> None:
    class F32Only(ReferenceDevice):
        def __init__(self) -> None:
            super().__init__()
            self.caps = dataclasses.replace(self.caps, storage_dtypes=frozenset({DType.F32}))

    dev = F32Only()
    with pytest.raises(CapabilityError, match=r"cannot store bf16 \(it stores f32\)"):
        dev.alloc((2, 2), "bf16")
    assert "cannot store f16 (it stores f32)" in dev.supports("get_rows", dtype="f16").reason


def test_fractional_index_values_are_refused_not_truncated() -> None:
    dev = ReferenceDevice()
    assert dev.indices([1.0, 2.0]).numpy().tolist() == [1, 2]  # whole floats are fine
    for bad in ([1.0, 1.5], [float("nan")], [float("inf")]):
        with pytest.raises(statecache.errors.ArgumentError, match="indices: values must be whole numbers"):
            dev.indices(bad)
