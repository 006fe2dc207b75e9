"""Tensors changed in place between remembered calls on the cpu device.

The launch memo and the relaunch by geometry recognise a call by its
arguments' identity or geometry; a torch tensor can keep its identity while
its memory, shape or strides change (``set_``, ``resize_``, ``as_strided_``)
and an index tensor can be rewritten in place.  Every call must then still
equal a fresh call (new Buffers, never remembered) bitwise, and a call made
invalid by the change must be refused with nothing written."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_launch_probe import CASES, R, _fresh

from statecache.backends.cpu.device import CpuDevice, load_kernels
from statecache.errors import ArgumentError

torch = pytest.importorskip("torch")
ffi, lib, why = load_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason=f"the C kernels are not usable here: {why}")

_step = st.one_of(
    st.just(("call",)),
    st.tuples(st.just("set_"), st.integers(0, 2**31)),  # an input to new memory, same geometry, new values
    st.tuples(st.just("copy_"), st.integers(0, 2**31)),  # an input rewritten in place
    st.tuples(st.just("strided"), st.integers(0, 2**31)),  # an input re-strided over a bigger storage
    st.tuples(st.just("offset"), st.integers(0, 2**31)),  # an input moved to an offset in a bigger storage
    st.just(("out_set_",)),  # an output moved to new memory: results must land there
    st.tuples(st.just("rows"), st.permutations(range(R))),  # an index tensor rewritten in place
    st.tuples(st.just("resize"), st.integers(0, 1)),  # an input of another size: refused, nothing written
)


def _as_tensor(v: np.ndarray) -> Any:
    t = torch.from_numpy(v.copy()).clone()  # resizable storage
    return t.to(torch.int64) if v.dtype == np.int32 else t


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_step, min_size=1, max_size=8))
def test_tensors_changed_in_place_between_calls_equal_fresh_calls(name: str, steps: list[tuple[Any, ...]]) -> None:
    case = CASES[name]
    arrays, written, index_names, call = case
    dev, oracle = CpuDevice(ffi, lib), CpuDevice(ffi, lib)
    state = [k for k in written if k == "pool"]
    inputs = [k for k, v in arrays.items() if v.dtype != np.int32 and k not in written and v.ndim >= 2]
    # The pool stays a device Buffer (a tensor pool is validated every call); everything else is a tensor.
    args: dict[str, Any] = {k: (dev.upload(v) if k in state else _as_tensor(v)) for k, v in arrays.items()}

    def host() -> dict[str, np.ndarray]:
        out = {}
        for k, v in args.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.numpy().astype(np.int32) if v.dtype == torch.int64 else v.numpy().copy()
            else:
                out[k] = dev.download(v)
        return out

    def current(k: str) -> np.ndarray:
        v = args[k]
        return v.numpy().copy() if isinstance(v, torch.Tensor) else dev.download(v)

    call(dev, args)
    for step in [*steps, ("call",)]:
        kind = step[0]
        if kind == "call":
            want = _fresh(oracle, case, host())
            before = {w: current(w) for w in written}
            try:
                call(dev, args)
            except ArgumentError as exc:  # only a strided input where the primitive wants contiguity
                assert "contiguous" in str(exc) and any(
                    isinstance(v, torch.Tensor) and not v.is_contiguous() for v in args.values()
                ), exc
                for w in written:
                    np.testing.assert_array_equal(current(w), before[w], err_msg=f"{name}: {w} after a refused call")
                continue
            for k in written:
                np.testing.assert_array_equal(current(k), want[k], err_msg=f"{name}: {k} after {steps}")
        elif kind in ("set_", "copy_", "strided") and inputs:
            rng = np.random.default_rng(step[1])
            k = inputs[step[1] % len(inputs)]
            t = args[k]
            new = torch.from_numpy(rng.uniform(-1, 1, t.shape).astype(np.float32))
            if kind == "set_":
                t.set_(new.clone())
            elif kind == "copy_":
                t.copy_(new)
            else:  # the same shape and values, every other element of a bigger storage, from an offset
                offset = step[1] % 3
                big = torch.zeros(2 * t.numel() + offset)
                big[offset::2][: t.numel()] = new.reshape(-1)
                t.set_(big.untyped_storage(), offset, tuple(t.shape), tuple(2 * s for s in new.stride()))
        elif kind == "offset" and inputs:  # contiguous again, at an offset into a bigger storage
            k = inputs[step[1] % len(inputs)]
            t = args[k]
            offset = 1 + step[1] % 5
            big = torch.zeros(t.numel() + offset)
            big[offset:] = t.reshape(-1)
            t.set_(big.untyped_storage(), offset, tuple(t.shape), tuple(t.contiguous().stride()))
        elif kind == "out_set_":
            k = [w for w in written if w not in state]
            if k:
                out = args[k[0]]  # new memory, at an offset into its storage
                big = torch.full((out.numel() + 3,), 7.0)
                out.set_(big.untyped_storage(), 3, tuple(out.shape), tuple(out.contiguous().stride()))
        elif kind == "rows":
            perm = np.array(step[1], np.int64)
            if "dst" in index_names:
                new_rows = {"dst": perm[:2], "start": perm[:2]}
            elif "srows" in index_names:
                new_rows = {"srows": perm[:2], "rows": perm[2:4]}
            else:
                new_rows = {"rows": perm[:2]}
            for k, values in new_rows.items():
                args[k].copy_(torch.from_numpy(values))
        elif kind == "resize" and inputs:
            k = inputs[step[1] % len(inputs)]
            t = args[k]
            shape = tuple(t.shape)
            before = {w: current(w) for w in written}
            bigger = (shape[0], shape[1] + 1, *shape[2:]) if len(shape) > 1 else (shape[0] + 1,)
            try:
                t.resize_(bigger)
            except RuntimeError:  # torch keeps an exported storage from being resized: new memory, that shape
                t.set_(torch.zeros(bigger))
            with pytest.raises(ArgumentError):
                call(dev, args)
            for w in written:
                np.testing.assert_array_equal(current(w), before[w], err_msg=f"{name}: {w} after a refused call")
            t.set_(t.clone()[:, : shape[1]].contiguous() if len(shape) > 1 else t.clone()[: shape[0]].contiguous())


@pytest.mark.parametrize("strided", ["weight", "bias", "both"])
@pytest.mark.parametrize("calls", [1, 3])
def test_ssm_conv_with_a_strided_weight_or_bias_equals_the_dense_call(strided: str, calls: int) -> None:
    """A conv weight sliced out of a wider one (``w[:, ::2]``, ``bias[::2]``)
    is a valid argument (weights may be strided, as A, D, dt_bias are): the
    kernel must read it by its strides, first call and remembered ones alike."""
    arrays, written, _, call = CASES["ssm_conv"]
    dev, oracle = CpuDevice(ffi, lib), CpuDevice(ffi, lib)
    want = {k: v.copy() for k, v in arrays.items()}
    for _ in range(calls):
        want = _fresh(oracle, CASES["ssm_conv"], want | {k: v for k, v in arrays.items() if k not in written})
    args: dict[str, Any] = {k: (dev.upload(v) if k == "pool" else _as_tensor(v)) for k, v in arrays.items()}
    for k in ("weight", "bias") if strided == "both" else (strided,):
        wide = torch.zeros(*args[k].shape[:-1], 2 * args[k].shape[-1])
        wide[..., ::2] = args[k]
        args[k] = wide[..., ::2]
        assert not args[k].is_contiguous()
    for _ in range(calls):
        call(dev, args)
    np.testing.assert_array_equal(args["y"].numpy(), want["y"])
    np.testing.assert_array_equal(dev.download(args["pool"]), want["pool"])
