"""Shared helpers of the CPU backend tests: the same call on the C device and
on the NumPy reference, from identical garbage-filled storage with guard
bands, and comparisons that say what differs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from statecache.backends.cpu.device import load_kernels
from statecache.backends.reference.device import ReferenceDevice
from statecache.dtypes import DType
from statecache.registry import BackendRegistry

GUARD = 97  # odd, so guard bands never line up with a vector width
NMSE_MAX = {DType.F32: 1e-7, DType.F16: 1e-6, DType.BF16: 5e-5}


def cpu_device():  # type: ignore[no-untyped-def]
    _, lib, reason = load_kernels()
    if lib is None:  # a broken build is a failure here, never a skip
        pytest.fail(f"the C kernels did not load: {reason}")
    return BackendRegistry(load_entry_points=True, allowlist=["cpu"]).get_device("cpu")


REF = ReferenceDevice()


@dataclasses.dataclass
class Arg:
    """One argument: its logical contents, storage dtype, and (for strided
    inputs) a view ``(shape, strides, offset)`` into the named base instead."""

    data: np.ndarray | None = None
    dtype: DType = DType.F32
    base: str | None = None
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None


def place(dev, args: dict[str, Arg], seed: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    """Upload each own-storage argument between two guard bands of garbage
    (the same bytes on every device); views are made over their base."""
    rng = np.random.default_rng(seed)
    bufs: dict[str, Any] = {}
    storages: dict[str, Any] = {}
    initial: dict[str, np.ndarray] = {}
    for name, a in args.items():
        if a.base is not None:
            continue
        body = np.asarray(a.data)
        if a.dtype is DType.I32:
            bufs[name] = dev.indices(body)
            continue
        guard = rng.uniform(-1e3, 1e3, 2 * GUARD).astype(np.float32)
        full = np.concatenate([guard[:GUARD], body.astype(np.float32).ravel(), guard[GUARD:]])
        storage = dev.upload(full, a.dtype)
        storages[name] = storage
        initial[name] = dev.download(storage)
        bufs[name] = storage.view(body.shape, offset=GUARD)
    for name, a in args.items():
        if a.base is not None:
            assert a.view is not None
            shape, strides, offset = a.view
            bufs[name] = bufs[a.base].view(shape, strides, offset)
    return bufs, storages, initial


def run(dev, args: dict[str, Arg], call: Callable[..., None], seed: int = 0) -> tuple[dict[str, np.ndarray], dict]:  # type: ignore[no-untyped-def]
    bufs, storages, initial = place(dev, args, seed)
    call(dev, **bufs)
    return {name: dev.download(s) for name, s in storages.items()}, initial


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


def assert_bitwise(what: str, got: np.ndarray, want: np.ndarray) -> None:
    diff = bits(np.ascontiguousarray(got)) != bits(np.ascontiguousarray(want))
    if diff.any():
        at = np.argwhere(diff)[0]
        raise AssertionError(
            f"{what}: {int(diff.sum())} elements differ, first at {tuple(at)}: "
            f"{got[tuple(at)]!r} != {want[tuple(at)]!r}"
        )


def assert_packed_call_thread_invariant(
    monkeypatch: pytest.MonkeyPatch, op: Any, lengths: tuple[int, ...], n_cols: int = 4, seed: int = 11
) -> None:
    """The packed (varlen) call of ``op`` (a ``varlen_cases.Op``) over sequences of
    ``lengths`` with a sparse snapshot table of ``n_cols`` columns gives the same
    bits for 1, 2 and 3 threads."""
    from statecache.conformance import varlen_cases as V
    from statecache.conformance.cases import run_on

    dev = cpu_device()
    params = V.VarlenParams(op, lengths, n_cols, "sparse")
    tensors, rows, _ = V.varlen_tensors(params, seed=seed)
    call = V.varlen_call(params, rows)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("STATECACHE_NUM_THREADS", threads)
        got = run_on(dev, tensors, seed, call)
        results.append({name: full for name, (_, full) in got.items() if tensors[name].output})
    for other in results[1:]:
        for name in results[0]:
            assert_bitwise(f"{op.label} {name}", other[name], results[0][name])


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    assert np.isfinite(g).all(), "non-finite values in the result"
    den = float(np.sum(w * w))
    return float(np.sum((g - w) ** 2)) / (den if den > 0 else 1.0)


def compare(
    got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
    initial: dict[str, np.ndarray],
    args: dict[str, Arg],
    outputs: dict[str, np.ndarray | None],
    *,
    exact: bool = False,
) -> None:
    """Inputs bitwise unchanged; outputs: guard bands and rows not in
    ``outputs[name]`` (None = all rows written) bitwise unchanged, written
    rows equal to the reference (bitwise, or within the dtype's NMSE)."""
    for name, full in got.items():
        a = args[name]
        shape = np.asarray(a.data).shape
        n = int(np.prod(shape))
        if name not in outputs:
            assert_bitwise(f"input {name} (with guards)", full, initial[name])
            continue
        assert_bitwise(f"{name}: guard before", full[:GUARD], initial[name][:GUARD])
        assert_bitwise(f"{name}: guard after", full[GUARD + n :], initial[name][GUARD + n :])
        body, ref_body, init_body = (x[GUARD : GUARD + n].reshape(shape) for x in (full, want[name], initial[name]))
        rows = outputs[name]
        if rows is not None:
            untouched = np.setdiff1d(np.arange(shape[0]), rows)
            assert_bitwise(f"{name}: rows not written", body[untouched], init_body[untouched])
            body, ref_body = body[rows], ref_body[rows]
        if exact:
            assert_bitwise(name, body, ref_body)
        else:
            err = nmse(body, ref_body)
            assert err <= NMSE_MAX[a.dtype], f"{name}: NMSE {err:.3e} > {NMSE_MAX[a.dtype]:.0e}"


def against_reference(
    args: dict[str, Arg],
    call: Callable[..., None],
    outputs: dict[str, np.ndarray | None],
    *,
    exact: bool = False,
    seed: int = 0,
    device=None,  # type: ignore[no-untyped-def]
) -> dict[str, np.ndarray]:
    dev = device if device is not None else cpu_device()
    got, initial = run(dev, args, call, seed)
    want, initial_ref = run(REF, args, call, seed)
    for name in initial:
        assert_bitwise(f"{name}: identical starting storage", initial[name], initial_ref[name])
    compare(got, want, initial, args, outputs, exact=exact)
    return got


def written_rows(dst: np.ndarray, n_t: int, n_snap: int, plane_stride: int) -> np.ndarray:
    n_written = min(n_t + 1, n_snap)
    return (dst[:, None] + plane_stride * np.arange(n_written)[None, :]).ravel()
