"""The remembered-call fast path of every primitive (LaunchMemo.probe): a call
with the very Buffers of an earlier validated one goes straight to its launch,
and only while that is right.

Property: whatever sequence of repeated calls, index rewrites (valid or not),
dropped and replaced buffers a decode loop goes through, each call of every
primitive gives bitwise what the same call with brand-new Buffers (always
validated) gives, and a bad rewrite is refused with nothing written."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statecache import primitives as P
from statecache.errors import ArgumentError
from statecache.registry import get_device

R = 6  # pool rows
N_S = 2  # sequences

F = np.float32


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(F)


# Each case: host arrays by name (int32 arrays are index buffers), the names the
# call writes, the index names a rewrite changes, whether a rewrite must be
# duplicate-free, and the call itself on a dict of Buffers.
Case = tuple[dict[str, np.ndarray], tuple[str, ...], tuple[str, ...], Callable[[Any, dict[str, Any]], None]]


def _state_arrays(rng: np.random.Generator, row: int, tokens: dict[str, tuple[tuple[int, ...], float, float]],
                  varlen: bool) -> dict[str, np.ndarray]:  # fmt: skip
    arrays = {"pool": _u(rng, (R, row)), "start": np.array([0, 1], np.int32), "dst": np.array([2, 3], np.int32)}
    for name, (shape, lo, hi) in tokens.items():
        arrays[name] = _u(rng, (N_S, *shape) if varlen else (N_S, 1, *shape), lo, hi)
    if varlen:
        arrays["cu"] = np.array([0, 1, 2], np.int32)
    return arrays


def _cases() -> dict[str, Case]:
    rng = np.random.default_rng(7)
    E, ch, d_conv, H, Pd, N, S = 5, 8, 4, 2, 4, 8, 4
    state = ("pool",)
    rows = ("start", "dst")
    cases: dict[str, Case] = {
        "get_rows": (
            {"src": _u(rng, (R, E)), "rows": np.array([4, 1], np.int32), "out": np.zeros((2, E), F)},
            ("out",),
            ("rows",),
            lambda d, b: d.get_rows(b["src"], b["rows"], b["out"]),
        ),
        "set_rows": (
            {"pool": _u(rng, (R, E)), "rows": np.array([4, 1], np.int32), "src": _u(rng, (2, E))},
            state,
            ("rows",),
            lambda d, b: d.set_rows(b["pool"], b["rows"], b["src"]),
        ),
        "zero_rows": (
            {"pool": _u(rng, (R, E)), "rows": np.array([4, 1], np.int32)},
            state,
            ("rows",),
            lambda d, b: d.zero_rows(b["pool"], b["rows"]),
        ),
        "copy_rows": (
            {
                "src": _u(rng, (R, E)),
                "srows": np.array([0, 5], np.int32),
                "pool": _u(rng, (R, E)),
                "rows": np.array([4, 1], np.int32),
            },
            state,
            ("srows", "rows"),
            lambda d, b: d.copy_rows(b["src"], b["srows"], b["pool"], b["rows"]),
        ),
    }
    for varlen in (False, True):
        plus = "+cu" if varlen else ""

        def cu(b: dict[str, Any]) -> dict[str, Any]:
            return {"cu_seqlens": b["cu"]} if "cu" in b else {}

        conv = _state_arrays(rng, ch * (d_conv - 1), {"x": ((ch,), -1, 1), "y": ((ch,), 0, 0)}, varlen)
        conv.update(weight=_u(rng, (ch, d_conv)), bias=_u(rng, (ch,)))
        cases["ssm_conv" + plus] = (
            conv,
            ("pool", "y"),
            rows,
            lambda d, b: d.ssm_conv(
                b["pool"], b["start"], b["dst"], b["x"], b["weight"], b["y"], bias=b["bias"], apply_silu=True, **cu(b)
            ),
        )
        scan = _state_arrays(rng, H * Pd * N, {"x": ((H, Pd), -1, 1), "dt": ((H,), -2, 1), "B": ((1, N), -1, 1),
                                               "C": ((1, N), -1, 1), "z": ((H, Pd), -1, 1), "y": ((H, Pd), 0, 0)},
                             varlen)  # fmt: skip
        scan.update(A=-_u(rng, (H,), 0.5, 1), D=_u(rng, (H,)), dt_bias=_u(rng, (H,)))
        cases["ssm_scan" + plus] = (
            scan,
            ("pool", "y"),
            rows,
            lambda d, b: d.ssm_scan(
                b["pool"], b["start"], b["dst"], b["x"], b["dt"], b["A"], b["B"], b["C"], b["y"], **cu(b)
            ),
        )
        if not varlen:  # the epilogues: the other key of ssm_scan
            cases["ssm_scan+epilogues"] = (scan, ("pool", "y"), rows, lambda d, b: d.ssm_scan(
                b["pool"], b["start"], b["dst"], b["x"], b["dt"], b["A"], b["B"], b["C"], b["y"], D=b["D"], z=b["z"],
                dt_bias=b["dt_bias"], dt_limit=(0.0, 6.0)))  # fmt: skip
        vec = ((H, S), -1, 1)
        gdn = _state_arrays(rng, H * S * S, {"q": vec, "k": vec, "v": vec, "g": ((H,), -1, -0.1),
                                             "beta": ((H,), 0, 1), "o": ((H, S), 0, 0)}, varlen)  # fmt: skip
        cases["gated_delta_net" + plus] = (
            gdn,
            ("pool", "o"),
            rows,
            lambda d, b: d.gated_delta_net(
                b["pool"], b["start"], b["dst"], b["q"], b["k"], b["v"], b["g"], b["beta"], b["o"], **cu(b)
            ),
        )
        decay = ((H, S), -1, -0.1)
        out = ((H, S), 0, 0)
        wkv6 = _state_arrays(rng, H * S * S, {"r": vec, "k": vec, "v": vec, "w": decay, "o": out}, varlen)
        wkv6["u"] = _u(rng, (H, S))
        cases["rwkv_wkv6" + plus] = (
            wkv6,
            ("pool", "o"),
            rows,
            lambda d, b: d.rwkv_wkv6(
                b["pool"], b["start"], b["dst"], b["r"], b["k"], b["v"], b["w"], b["u"], b["o"], **cu(b)
            ),
        )
        small = ((H, S), -0.5, 0.5)
        wkv7 = _state_arrays(rng, H * S * S, {"r": vec, "w": decay, "k": vec, "v": vec, "a": small, "b": small,
                                              "o": out}, varlen)  # fmt: skip
        cases["rwkv_wkv7" + plus] = (
            wkv7,
            ("pool", "o"),
            rows,
            lambda d, b: d.rwkv_wkv7(
                b["pool"], b["start"], b["dst"], b["r"], b["w"], b["k"], b["v"], b["a"], b["b"], b["o"], **cu(b)
            ),
        )
        gla = _state_arrays(rng, H * S * S, {"q": vec, "k": vec, "v": vec, "g": decay, "o": out}, varlen)
        cases["gated_linear_attn" + plus] = (
            gla,
            ("pool", "o"),
            rows,
            lambda d, b: d.gated_linear_attn(
                b["pool"], b["start"], b["dst"], b["q"], b["k"], b["v"], b["g"], b["o"], **cu(b)
            ),
        )
    return cases


CASES = _cases()


def _upload(dev: Any, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: dev.indices(v) if v.dtype == np.int32 else dev.upload(v) for k, v in arrays.items()}


def _fresh(dev: Any, case: Case, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The call with brand-new Buffers (never remembered) from ``host``: what it writes."""
    _, written, _, call = case
    bufs = _upload(dev, host)
    call(dev, bufs)
    return {k: dev.download(bufs[k]) for k in written}


# Steps: repeat the call; rewrite the index buffers with a valid choice of rows
# (distinct, away from the start rows of other sequences) or an invalid one; replace
# an output with a new Buffer (the old one dropped, its id free for reuse).
_step = st.one_of(
    st.just(("call",)),
    st.tuples(st.just("rows"), st.permutations(range(R))),
    st.tuples(st.just("bad"), st.sampled_from([R, -2, R + 7])),
    st.just(("new_out",)),
)


@pytest.mark.parametrize("device_id", ["cpu", "reference", "opencl"])
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_step, min_size=1, max_size=8))
def test_remembered_calls_equal_fresh_calls(device_id: str, name: str, steps: list[tuple[Any, ...]]) -> None:
    try:
        dev = get_device(device_id)
    except Exception as exc:  # the opencl backend or its device is missing here
        pytest.skip(f"no {device_id} device: {exc}")
    case = CASES[name]
    arrays, written, index_names, call = case
    host = {k: v.copy() for k, v in arrays.items()}
    bufs = _upload(dev, host)
    call(dev, bufs)  # validated and remembered
    for k in written:
        host[k] = dev.download(bufs[k])
    for step in steps:
        if step[0] == "rows":
            perm = np.array(step[1], np.int32)
            if "dst" in index_names:  # in place: start == dst, a valid call whatever the rows
                new = {"dst": perm[:N_S], "start": perm[:N_S]}
            elif "srows" in index_names:
                new = {"srows": perm[:2], "rows": perm[2:4]}
            else:
                new = {"rows": perm[:2]}
            for k, values in new.items():
                host[k] = values.copy()
                dev.write(bufs[k], values)
            continue
        if step[0] == "bad":
            idx = index_names[-1]
            values = host[idx].copy()
            values[-1] = step[1]
            dev.write(bufs[idx], values)
            before = {k: dev.download(bufs[k]) for k in written}
            with pytest.raises(ArgumentError):
                call(dev, bufs)
            for k in written:
                np.testing.assert_array_equal(dev.download(bufs[k]), before[k], err_msg=f"{k} after a refused call")
            dev.write(bufs[idx], host[idx])  # back to the good rows
            continue
        if step[0] == "new_out":
            out = written[-1]
            del bufs[out]
            gc.collect()
            bufs[out] = dev.upload(host[out])
            continue
        want = _fresh(dev, case, host)
        call(dev, bufs)
        for k in written:
            got = dev.download(bufs[k])
            np.testing.assert_array_equal(got, want[k], err_msg=f"{name}: {k} of a repeated call")
            host[k] = got


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


@pytest.mark.parametrize("name", sorted(CASES))
def test_repeated_call_is_validated_once_and_again_after_a_rewrite(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = get_device("cpu")
    arrays, _, index_names, call = CASES[name]
    counts = _count_validations(monkeypatch)
    bufs = _upload(dev, arrays)
    for _ in range(3):
        call(dev, bufs)
    assert counts[0] == 1
    idx = index_names[-1]
    dev.write(bufs[idx], arrays[idx])  # the same values, written again: checked again
    call(dev, bufs)
    assert counts[0] == 2
    np.asarray(bufs[idx])  # handed out: only the device knows its contents now
    call(dev, bufs)
    call(dev, bufs)
    assert counts[0] == 4


def test_probe_refuses_a_dead_buffer_with_a_reused_id(rng: np.random.Generator) -> None:
    dev = get_device("cpu")
    arrays, _, _, call = CASES["get_rows"]
    bufs = _upload(dev, arrays)
    call(dev, bufs)
    memo = dev._launches
    key = ("get_rows", id(bufs["src"]), id(bufs["rows"]), id(bufs["out"]))
    assert memo.probe(key, dev.caps) is not None
    assert memo.probe(key, object()) is None  # other capabilities
    del bufs["out"]
    gc.collect()
    assert memo.probe(key, dev.caps) is None  # the key's ids alone prove nothing once a buffer is gone


def test_probe_refuses_a_buffer_freed_as_cyclic_garbage() -> None:
    """The liveness flag is cleared by weakref callbacks: also when the garbage
    collector frees a buffer caught in a reference cycle."""
    dev = get_device("cpu")
    arrays, _, _, call = CASES["ssm_conv"]
    bufs = _upload(dev, arrays)
    call(dev, bufs)
    y = bufs["y"]
    key = ("ssm_conv", 1, 0, True, *(id(bufs[k]) for k in ("pool", "start", "dst", "x", "weight", "bias")), id(y))
    assert dev._launches.probe(key, dev.caps) is not None
    y._derived = {"cycle": y}
    del bufs["y"], y
    gc.collect()
    assert dev._launches.probe(key, dev.caps) is None
