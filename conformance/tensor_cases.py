"""Tensor cases: DLPack objects wherever a primitive takes a Buffer.

Every primitive accepts any object speaking DLPack in place of a Buffer
(:mod:`statecache.tensor_args`); the core does the bookkeeping, and a
device's part is :meth:`Device._import_memory` (a Buffer over a tensor's
memory, for memory it can address).  These cases hold every device to the
result: host tensors as inputs give exactly the all-Buffer result (imported
in place or copied in); host tensors as outputs are either written exactly
or refused with an ArgumentError naming the argument, with nothing changed;
index tensors may be int32 or int64, are re-read when rewritten in place,
and values outside int32 are refused; an output overlapping an input in
memory is refused even when the two are separate tensors over one array.

The producers are NumPy arrays (no torch needed to run the suite); torch
tensors take the same path, with the tests of the core checking them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from statecache.backend import Buffer, Device
from statecache.conformance.cases import Case, ConformanceFailure, Requirement, assert_exact, rng_for
from statecache.dtypes import DType
from statecache.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class Call:
    """One primitive call as host arrays: ``args`` in the method's order
    (positional names then keyword names), the names it writes, the index
    names, and the keyword-only argument names."""

    op: str
    args: dict[str, np.ndarray]
    written: tuple[str, ...]
    indices: tuple[str, ...]
    keywords: tuple[str, ...] = ()


def _u(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-1, 1, shape).astype(np.float32)


def primitive_calls(seed: int) -> dict[str, Call]:
    """A small valid call of every primitive (decode of two sequences for the
    stateful ones, with the fused epilogues the devices may lack left out)."""
    rng = rng_for(seed)
    rows = np.array([3, 0, 4], dtype=np.int64)
    calls = {
        "get_rows": Call("get_rows", {"src": _u(rng, 6, 8), "rows": rows, "dst": _u(rng, 3, 8)}, ("dst",), ("rows",)),
        "set_rows": Call("set_rows", {"dst": _u(rng, 6, 8), "rows": rows, "src": _u(rng, 3, 8)}, ("dst",), ("rows",)),
        "zero_rows": Call("zero_rows", {"dst": _u(rng, 6, 8), "rows": rows[:2]}, ("dst",), ("rows",)),
        "copy_rows": Call(
            "copy_rows",
            {"src": _u(rng, 6, 8), "src_rows": rows, "dst": _u(rng, 5, 8), "dst_rows": np.array([1, 4, 2])},
            ("dst",),
            ("src_rows", "dst_rows"),
        ),
    }
    seq_rows = np.array([2, 0], dtype=np.int64)
    ch, d_conv = 6, 4
    calls["ssm_conv"] = Call(
        "ssm_conv",
        {
            "pool": _u(rng, 4, ch * (d_conv - 1)),
            "start_rows": seq_rows,
            "dst_rows": seq_rows,
            "x": _u(rng, 2, 1, ch),
            "weight": _u(rng, ch, d_conv),
            "y": _u(rng, 2, 1, ch),
            "bias": _u(rng, ch),
        },
        ("pool", "y"),
        ("start_rows", "dst_rows"),
        ("bias",),
    )
    H, P, N = 2, 4, 8
    calls["ssm_scan"] = Call(
        "ssm_scan",
        {
            "pool": _u(rng, 4, H * P * N),
            "start_rows": seq_rows,
            "dst_rows": seq_rows,
            "x": _u(rng, 2, 1, H, P),
            "dt": rng.uniform(-2, 1, (2, 1, H)).astype(np.float32),
            "A": -rng.uniform(0.5, 1.5, H).astype(np.float32),
            "B": _u(rng, 2, 1, 1, N),
            "C": _u(rng, 2, 1, 1, N),
            "y": _u(rng, 2, 1, H, P),
        },
        ("pool", "y"),
        ("start_rows", "dst_rows"),
    )
    Hv, S = 2, 4
    calls["gated_delta_net"] = Call(
        "gated_delta_net",
        {
            "pool": _u(rng, 4, Hv * S * S),
            "start_rows": seq_rows,
            "dst_rows": seq_rows,
            "q": _u(rng, 2, 1, Hv, S),
            "k": _u(rng, 2, 1, Hv, S) / 2,
            "v": _u(rng, 2, 1, Hv, S),
            "g": -rng.uniform(0.1, 0.5, (2, 1, Hv)).astype(np.float32),
            "beta": rng.uniform(0.2, 0.8, (2, 1, Hv)).astype(np.float32),
            "o": _u(rng, 2, 1, Hv, S),
        },
        ("pool", "o"),
        ("start_rows", "dst_rows"),
    )
    # the linear-attention primitives: per-token inputs [n_s, n_t, H, S], w / g log-decays
    decay = -rng.uniform(0.1, 0.5, (2, 1, Hv, S)).astype(np.float32)
    linear = {
        "rwkv_wkv6": {"r": _u(rng, 2, 1, Hv, S), "k": _u(rng, 2, 1, Hv, S), "v": _u(rng, 2, 1, Hv, S), "w": decay,
                      "u": _u(rng, Hv, S)},
        "rwkv_wkv7": {"r": _u(rng, 2, 1, Hv, S), "w": decay, "k": _u(rng, 2, 1, Hv, S), "v": _u(rng, 2, 1, Hv, S),
                      "a": _u(rng, 2, 1, Hv, S) / 4, "b": _u(rng, 2, 1, Hv, S) / 4},
        "gated_linear_attn": {"q": _u(rng, 2, 1, Hv, S), "k": _u(rng, 2, 1, Hv, S), "v": _u(rng, 2, 1, Hv, S),
                              "g": decay},
    }  # fmt: skip
    for op, inputs in linear.items():
        args = {"pool": _u(rng, 4, Hv * S * S), "start_rows": seq_rows, "dst_rows": seq_rows, **inputs}
        args["o"] = _u(rng, 2, 1, Hv, S)
        calls[op] = Call(op, args, ("pool", "o"), ("start_rows", "dst_rows"))
    return calls


def requirement(op: str) -> list[Requirement]:
    extra = {"ssm_conv": {"d_conv": 4}}.get(op, {})
    return [Requirement(op, {"dtype": "f32", **extra})]


Converter = Callable[[str, np.ndarray], Any]


def buffers(dev: Device) -> Converter:
    """Every argument as a Buffer of ``dev``."""

    def convert(name: str, host: np.ndarray) -> Any:
        if host.dtype.kind in "iu":
            return dev.indices(host)
        return dev.upload(host, DType.F32)

    return convert


def run(dev: Device, call: Call, convert: Converter) -> dict[str, Any]:
    """Run ``call`` with each argument made by ``convert(name, host copy)``;
    returns the arguments passed (outputs read back by :func:`results`)."""
    passed = {name: convert(name, host.copy()) for name, host in call.args.items()}
    positional = [passed[n] for n in call.args if n not in call.keywords]
    keywords = {n: passed[n] for n in call.keywords}
    getattr(dev, call.op)(*positional, **keywords)
    return passed


def results(dev: Device, call: Call, passed: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name in call.written:
        value = passed[name]
        out[name] = dev.download(value) if isinstance(value, Buffer) else np.array(value, copy=True)
    return out


def _expected(dev: Device, call: Call) -> dict[str, np.ndarray]:
    return results(dev, call, run(dev, call, buffers(dev)))


def _host_inputs(dev: Device, op: str, seed: int) -> None:
    """Read-only arguments as host arrays (int64 indices), outputs as Buffers."""
    call = primitive_calls(seed)[op]
    want = _expected(dev, call)
    as_buffer = buffers(dev)

    def convert(name: str, host: np.ndarray) -> Any:
        return as_buffer(name, host) if name in call.written else host

    got = results(dev, call, run(dev, call, convert))
    for name in call.written:
        assert_exact(f"{op} {name} with host-array inputs", got[name], want[name])


def _host_outputs(dev: Device, op: str, seed: int) -> None:
    """Every argument a host array: written exactly, or refused naming a
    written argument with nothing changed."""
    call = primitive_calls(seed)[op]
    want = _expected(dev, call)
    passed = {name: host.copy() for name, host in call.args.items()}
    try:
        run(dev, call, lambda name, host: passed[name])
    except ArgumentError as exc:
        if exc.argument not in call.written:
            raise ConformanceFailure(f"{op} with host-array outputs refused naming {exc.argument!r}: {exc}") from None
        for name in call.written:
            assert_exact(f"{op} {name} after a refused call", passed[name], call.args[name])
        return
    for name in call.written:
        assert_exact(f"{op} {name} written into a host array", passed[name], want[name])


def _index_dtypes(dev: Device, seed: int) -> None:
    """int32 and int64 index arrays give the Buffer result; values outside
    int32 and non-integer index types are refused naming the argument."""
    call = primitive_calls(seed)["get_rows"]
    want = _expected(dev, call)
    as_buffer = buffers(dev)
    for dtype in (np.int32, np.int64):
        passed = run(
            dev, call, lambda name, host, dtype=dtype: host.astype(dtype) if name == "rows" else as_buffer(name, host)
        )
        assert_exact(f"get_rows with {np.dtype(dtype)} rows", results(dev, call, passed)["dst"], want["dst"])
    src = dev.upload(call.args["src"])
    dst = dev.upload(call.args["dst"])
    for what, rows in (
        ("an int64 row past int32", np.array([0, 2**31 + 1, 1], dtype=np.int64)),
        ("uint8 rows", np.array([0, 1, 2], dtype=np.uint8)),
        ("float rows", np.array([0.0, 1.0, 2.0], dtype=np.float32)),
    ):
        try:
            dev.get_rows(src, rows, dst)
        except ArgumentError as exc:
            if exc.argument != "rows":
                raise ConformanceFailure(f"get_rows with {what}: refused naming {exc.argument!r}, not 'rows'") from None
        else:
            raise ConformanceFailure(f"get_rows with {what}: no ArgumentError")
        assert_exact(f"dst after get_rows with {what}", dev.download(dst), call.args["dst"])


def _rewritten_index(dev: Device, seed: int) -> None:
    """One index array object, rewritten in place between calls: each call
    uses its current values (a device remembering validated calls must not
    trust the old ones), and a rewrite into a duplicate destination is refused."""
    call = primitive_calls(seed)["set_rows"]
    src = dev.upload(call.args["src"])
    dst = dev.upload(call.args["dst"])
    rows = np.array([3, 0, 4], dtype=np.int64)
    expect = call.args["dst"].copy()
    for values in ([3, 0, 4], [3, 0, 4], [5, 1, 2]):
        rows[:] = values
        dev.set_rows(dst, rows, src)
        expect[values] = call.args["src"]
        assert_exact(f"set_rows into rows {values} given by a rewritten array", dev.download(dst), expect)
    rows[:] = [1, 1, 2]
    try:
        dev.set_rows(dst, rows, src)
    except ArgumentError as exc:
        if exc.argument != "rows":
            raise ConformanceFailure(f"duplicate rows refused naming {exc.argument!r}") from None
    else:
        raise ConformanceFailure("set_rows with an index array rewritten to a duplicate: no ArgumentError")
    assert_exact("dst after the refused set_rows", dev.download(dst), expect)


def _overlap(dev: Device, seed: int) -> None:
    """An output over the same memory as an input is refused, also when the
    two are separate arrays (views) over one allocation."""
    rng = rng_for(seed)
    whole = _u(rng, 8, 8)
    before = whole.copy()
    src, dst = whole[0:6], whole[3:6]  # dst lies inside src's memory
    try:
        dev.get_rows(src, np.array([0, 1, 2]), dst)
    except ArgumentError as exc:
        if exc.argument not in ("src", "dst"):
            raise ConformanceFailure(f"overlapping get_rows refused naming {exc.argument!r}") from None
    else:
        raise ConformanceFailure("get_rows writing dst over src's memory (two views of one array): no ArgumentError")
    assert_exact("array after the refused get_rows", whole, before)
    call = primitive_calls(seed)["ssm_conv"]
    pool = dev.upload(call.args["pool"])
    act = _u(rng, 16)
    act_before = act.copy()
    x, y = act[0:12].reshape(2, 1, 6), act[3:15].reshape(2, 1, 6)  # y starts inside x
    try:
        dev.ssm_conv(pool, call.args["start_rows"], call.args["dst_rows"], x, call.args["weight"], y)
    except ArgumentError as exc:
        if exc.argument not in ("x", "y"):
            raise ConformanceFailure(f"ssm_conv with y over x refused naming {exc.argument!r}") from None
    else:
        raise ConformanceFailure("ssm_conv writing y over x's memory (two views of one array): no ArgumentError")
    assert_exact("activations after the refused ssm_conv", act, act_before)
    assert_exact("pool after the refused ssm_conv", dev.download(pool), call.args["pool"])


def all_cases() -> list[Case]:
    cases: list[Case] = []
    holder: dict[str, Case] = {}

    def add(case_id: str, fn: Callable[[Device, int], None], ops: tuple[str, ...], reqs: list[Requirement]) -> None:
        def run_case(device: Device) -> None:
            fn(device, holder[case_id].seed)

        case = Case(case_id, "device", ops, run_case, tuple(reqs))
        holder[case_id] = case
        cases.append(case)

    for op in primitive_calls(0):  # every primitive of the contract
        add(
            f"device.tensors.host_inputs[{op}]",
            lambda dev, seed, op=op: _host_inputs(dev, op, seed),
            (op,),
            requirement(op),
        )
        add(
            f"device.tensors.host_outputs[{op}]",
            lambda dev, seed, op=op: _host_outputs(dev, op, seed),
            (op,),
            requirement(op),
        )
    add("device.tensors.index_dtypes[get_rows]", _index_dtypes, ("get_rows",), requirement("get_rows"))
    add("device.tensors.rewritten_index[set_rows]", _rewritten_index, ("set_rows",), requirement("set_rows"))
    add(
        "device.tensors.overlap_refused[f32]",
        _overlap,
        ("get_rows", "ssm_conv"),
        requirement("get_rows") + requirement("ssm_conv"),
    )
    return cases
