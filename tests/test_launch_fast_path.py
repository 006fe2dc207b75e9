"""The CPU device's remembered-call fast path in C (sc_dlpack.c): the launch
memo's probe, the prepared launches (a builtin running its kernel's block)
and the thread count they read, each against the Python it replaces.

* The compiled probe answers what ``LaunchMemo.probe_python`` answers, entry
  for entry, through every state an entry goes through (hit, other caps,
  index rewritten, buffer dead, matched by geometry, unhashable key).
* A prepared launch gives bitwise what the cffi call it replaces gives (a
  device without the builtins), for every primitive and both token forms,
  with a scale that float32 rounds; its block is made when the call is met
  again (the validated call itself goes through cffi).
* A call differing from a remembered one in any argument (another Buffer
  with the same contents, another scalar) is validated, not launched.
* The thread count is ``settings.num_threads()`` in every case that
  function distinguishes, errors included."""

from __future__ import annotations

import gc
import os
import sys
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_launch_probe import CASES, _upload

from statecache import primitives as P
from statecache import settings as sc_settings
from statecache.backends.cpu.device import CpuDevice, load_kernels
from statecache.errors import ArgumentError
from statecache.launch_memo import LaunchMemo

ffi, lib, why = load_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason=f"the C kernels are not usable here: {why}")


def _devices() -> tuple[CpuDevice, CpuDevice]:
    """(fast, plain): the device as shipped, and one whose memo probes in
    Python and whose launches are cffi calls of the same kernels."""
    fast = CpuDevice(ffi, lib)
    plain = CpuDevice(ffi, lib)
    plain._runner = None
    plain._threads = sc_settings.num_threads
    plain._launches = LaunchMemo()
    assert fast._runner is not None, "this build has no C runner: the fast path is not tested"
    return fast, plain


def test_prepared_launches_are_builtins_for_every_primitive() -> None:
    fast, _ = _devices()
    for arrays, _, _, call in CASES.values():
        call(fast, _upload(fast, arrays))
    launches = [e.launch for e in fast._launches._entries.values()]
    assert launches and all(type(launch).__name__ == "builtin_function_or_method" for launch in launches), launches


def test_a_block_is_made_when_a_call_is_met_again_and_a_call_none_carries_stays_on_cffi() -> None:
    """The validated call runs through cffi (a call validated every time never
    builds a block); the first remembered one makes the block and runs it."""
    fast, plain = _devices()
    arrays, written, _, call = CASES["rwkv_wkv7"]
    bufs = _upload(fast, arrays)
    call(fast, bufs)
    (entry,) = fast._launches._entries.values()
    state = entry.launch.__self__  # [block, threads, keep, kernel, args, build]
    assert state[0] is True  # run once, through cffi
    call(fast, bufs)
    assert isinstance(state[0], bytes)
    # A build that declines (a call no block carries): cffi from then on, the same bits.
    state[0], state[5] = True, lambda: None
    call(fast, bufs)
    assert state[0] is False
    call(fast, bufs)
    pbufs = _upload(plain, arrays)
    for _ in range(4):
        call(plain, pbufs)
    for k in written:
        np.testing.assert_array_equal(fast.download(bufs[k]), plain.download(pbufs[k]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_builtin_launch_equals_the_cffi_call(name: str) -> None:
    fast, plain = _devices()
    arrays, written, _, call = CASES[name]
    outs = []
    for dev in (fast, plain):
        bufs = _upload(dev, arrays)
        for _ in range(3):  # validated, then remembered twice (the state advances each time)
            call(dev, bufs)
        outs.append({k: dev.download(bufs[k]) for k in written})
    for k in written:
        np.testing.assert_array_equal(outs[0][k], outs[1][k], err_msg=f"{name}: {k}")


@pytest.mark.parametrize("op", ["rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn", "gated_delta_net"])
def test_a_scale_float32_rounds_reaches_the_kernel_as_cffi_passes_it(op: str) -> None:
    """Float arguments travel in a block word as float32 bits: 0.1 is not a float32."""
    fast, plain = _devices()
    arrays, written, _, call = CASES[op]
    outs = []
    for dev in (fast, plain):
        bufs = _upload(dev, arrays)
        real = getattr(dev, op)

        def scaled(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            return _real(*args, scale=0.1, **kwargs)

        shim = types.SimpleNamespace(**{op: scaled})
        for _ in range(2):
            call(shim, bufs)
        outs.append({k: dev.download(bufs[k]) for k in written})
    for k in written:
        np.testing.assert_array_equal(outs[0][k], outs[1][k], err_msg=f"{op}: {k}")


def _count_validations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counts = [0]
    for fn in ("check_rows_op", "check_zero_rows", "check_copy_rows", "check_ssm_conv", "check_ssm_scan",
               "check_gated_delta_net", "check_linear_attn"):  # fmt: skip
        real = getattr(P, fn)

        def counting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            counts[0] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(P, fn, counting)
    return counts


class _Recording(dict):  # type: ignore[type-arg]
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, k: str) -> Any:
        self.read.add(k)
        return super().__getitem__(k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_call_differing_in_any_buffer_is_validated(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace each argument in turn by a new Buffer with the same contents: the
    call is new to the memo and validated (once: then it is remembered)."""
    fast, _ = _devices()
    arrays, _, _, call = CASES[name]
    counts = _count_validations(monkeypatch)
    bufs = _upload(fast, arrays)
    call(fast, bufs)
    call(fast, bufs)
    assert counts[0] == 1
    used = _Recording(bufs)
    call(fast, used)  # which arguments the call passes (the case's arrays may hold more)
    assert counts[0] == 1
    for k in sorted(used.read):
        twin = dict(bufs)
        twin[k] = _upload(fast, {k: fast.download(bufs[k])})[k]
        before = counts[0]
        call(fast, twin)
        assert counts[0] == before + 1, f"{name}: a new {k} was not validated"
        call(fast, twin)
        assert counts[0] == before + 1, f"{name}: the call with the new {k} was not remembered"


@pytest.mark.parametrize(
    "change",
    [{"n_snap": 2, "plane_stride": 6}, {"apply_silu": False}, {"bias": None}, {"plane_stride": 3, "n_snap": 2}],
)
def test_a_call_differing_in_a_scalar_is_validated(change: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    fast, _ = _devices()
    arrays, _, _, _ = CASES["ssm_conv"]
    bufs = _upload(fast, arrays)
    counts = _count_validations(monkeypatch)
    args = dict(bias=bufs["bias"], apply_silu=True, n_snap=1, plane_stride=0)

    def call(**kw: Any) -> None:
        fast.ssm_conv(bufs["pool"], bufs["start"], bufs["dst"], bufs["x"], bufs["weight"], bufs["y"], **kw)

    call(**args)
    call(**args)
    assert counts[0] == 1
    try:
        call(**{**args, **change})
    except ArgumentError:
        pass  # refused by validation: also validated
    assert counts[0] == 2, change


def test_a_bad_rewrite_after_remembered_calls_is_refused_and_changes_nothing() -> None:
    fast, _ = _devices()
    arrays, written, _, call = CASES["ssm_conv"]
    bufs = _upload(fast, arrays)
    call(fast, bufs)
    call(fast, bufs)
    fast.write(bufs["dst"], np.array([2, 99], np.int32))
    before = {k: fast.download(bufs[k]) for k in written}
    with pytest.raises(ArgumentError):
        call(fast, bufs)
    for k in written:
        np.testing.assert_array_equal(fast.download(bufs[k]), before[k])


# -- the compiled probe against the Python one ------------------------------------------------

_probe_steps = st.lists(
    st.sampled_from(["call", "rewrite", "export", "drop", "other_caps", "unhashable", "clear"]), max_size=10
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.sampled_from(sorted(CASES)), min_size=1, max_size=3), steps=_probe_steps)
def test_compiled_probe_answers_as_the_python_probe(names: list[str], steps: list[str]) -> None:
    fast, _ = _devices()
    memo = fast._launches
    assert memo.probe != memo.probe_python
    live = []
    for name in names:
        arrays, _, index_names, call = CASES[name]
        live.append((name, _upload(fast, arrays), index_names, call))
    for step in ["call", *steps]:
        if step == "call":
            for _, bufs, _, call in live:
                call(fast, bufs)
        elif step == "rewrite" and live:
            _, bufs, index_names, _ = live[0]
            k = index_names[0]
            fast.write(bufs[k], fast.download(bufs[k]))
        elif step == "export" and live:
            _, bufs, index_names, _ = live[-1]
            np.asarray(bufs[index_names[-1]])
        elif step == "drop" and live:
            live.pop()
            gc.collect()
        elif step == "clear":
            memo.clear()
        keys = list(memo._entries)
        caps = object() if step == "other_caps" else fast.caps
        for key in keys:
            assert memo.probe(key, caps) is memo.probe_python(key, caps), (step, key[0])
        if step == "unhashable":
            bad = ("ssm_conv", [1], 0, True)
            assert memo.probe(bad, caps) is None and memo.probe_python(bad, caps) is None
        assert memo.probe(("no such call",), caps) is None


def test_compiled_probe_follows_a_pruned_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruning keeps the memo's dict (the compiled probe reads that very dict)."""
    import statecache.launch_memo as lm

    fast, _ = _devices()
    monkeypatch.setattr(lm, "MEMO_LIMIT", 8)
    arrays, _, _, call = CASES["get_rows"]
    kept = [_upload(fast, arrays) for _ in range(12)]
    for bufs in kept:
        call(fast, bufs)
    memo = fast._launches
    assert len(memo) <= 8
    for key in memo._entries:
        assert memo.probe(key, fast.caps) is memo.probe_python(key, fast.caps) is memo._entries[key]


# -- the thread count ---------------------------------------------------------------------------


@pytest.fixture
def threads() -> Any:
    fast, _ = _devices()
    return fast._threads


def _same(threads: Any) -> int:
    want = sc_settings.num_threads()
    got = threads()
    assert got == want and type(got) is int
    return got


def test_threads_without_torch_and_with_the_variable(threads: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("STATECACHE_NUM_THREADS", raising=False)
    assert _same(threads) == len(os.sched_getaffinity(0))
    for value, want in (("3", 3), ("1", 1), (" 2 ", 2), ("3", 3)):
        monkeypatch.setenv("STATECACHE_NUM_THREADS", value)
        assert _same(threads) == want
        assert _same(threads) == want  # the second time from the cache
    os.environ["STATECACHE_NUM_THREADS"] = "5"
    assert _same(threads) == 5
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "")  # empty: unset
    _same(threads)
    for bad in ("x", "0", "-2"):
        monkeypatch.setenv("STATECACHE_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="STATECACHE_NUM_THREADS"):
            threads()
        with pytest.raises(ValueError, match="STATECACHE_NUM_THREADS"):
            threads()  # never cached


def test_threads_follow_torch_as_num_threads_does(threads: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATECACHE_NUM_THREADS", raising=False)
    count = {"n": 3}
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: count["n"]))
    assert _same(threads) == 3
    count["n"] = 1
    assert _same(threads) == 1
    for odd in (0, -3, 2.0, "3", True, None):
        count["n"] = odd  # type: ignore[assignment]
        _same(threads)

    def broken() -> int:
        raise RuntimeError("no")

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=broken))
    _same(threads)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())  # still being imported
    _same(threads)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 7))
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "2")
    assert _same(threads) == 2  # the variable overrides torch


def test_threads_with_a_stand_in_environ(threads: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 6))
    monkeypatch.setattr(os, "environ", {"STATECACHE_NUM_THREADS": "4"})
    assert _same(threads) == 4
    os.environ["STATECACHE_NUM_THREADS"] = "2"
    assert _same(threads) == 2
    monkeypatch.undo()
    monkeypatch.delenv("STATECACHE_NUM_THREADS", raising=False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 6))
    assert _same(threads) == 6


def test_a_bad_thread_count_fails_a_remembered_call_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fast, _ = _devices()
    arrays, written, _, call = CASES["ssm_conv"]
    bufs = _upload(fast, arrays)
    call(fast, bufs)
    before = {k: fast.download(bufs[k]) for k in written}
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="STATECACHE_NUM_THREADS"):
        call(fast, bufs)
    for k in written:
        np.testing.assert_array_equal(fast.download(bufs[k]), before[k])
