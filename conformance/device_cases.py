"""Device cases: buffers, transfers, views, and refusal of bad arguments.

These need no reference: they check the Device protocol that every primitive
case relies on (a device whose upload or download is wrong would make every
other comparison meaningless).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from statecache.backend import Buffer, Device
from statecache.conformance.cases import Case, ConformanceFailure, Requirement, assert_exact, rng_for
from statecache.conformance.primitive_cases import EDGE_VALUES
from statecache.dtypes import DType
from statecache.errors import ArgumentError


def _alloc_zero(dev: Device, dtype: DType) -> None:
    buf = dev.alloc((5, 67), dtype)
    got = dev.download(buf).astype(np.float32)
    if np.any(got != 0):
        raise ConformanceFailure(f"alloc({dtype}) is not zero-filled: first non-zero {got[got != 0][0]!r}")


def _roundtrip(dev: Device, dtype: DType, seed: int) -> None:
    rng = rng_for(seed)
    host = rng.uniform(-5, 5, (9, 33)).astype(np.float32)
    host.reshape(-1)[: EDGE_VALUES.size] = EDGE_VALUES
    want = host.astype(dtype.numpy)
    buf = dev.upload(host, dtype)
    assert_exact(f"upload then download ({dtype})", dev.download(buf), want)
    # A strided view reads the same elements NumPy's view does.
    view = buf.view((4, 5), (66, 3), 2)
    expect = np.lib.stride_tricks.as_strided(want.reshape(-1)[2:], (4, 5), (66 * want.itemsize, 3 * want.itemsize))
    assert_exact("download of a strided view", dev.download(view), expect)


def _indices(dev: Device) -> None:
    values = np.array([0, 5, -3, 2**31 - 1, -(2**31)], dtype=np.int64)
    buf = dev.indices(values)
    got = dev.download(buf)
    if got.dtype != np.int32 or not np.array_equal(got, values.astype(np.int32)):
        raise ConformanceFailure(f"indices round trip: got {got!r}")


def _copy_buffer(dev: Device, seed: int) -> None:
    rng = rng_for(seed)
    host = rng.uniform(-1, 1, 4099).astype(np.float32)
    src = dev.upload(host)
    dst = dev.alloc(4099)
    dev.copy_buffer(src, dst)
    assert_exact("copy_buffer", dev.download(dst), host)


def _fill_bytes(dev: Device) -> None:
    buf = dev.alloc((16, 64))
    dev.fill_bytes(buf, 1234)
    got = dev.download(buf)
    if not np.all(np.isfinite(got)) or np.count_nonzero(got) < got.size // 2:
        raise ConformanceFailure("fill_bytes must leave finite, mostly non-zero garbage in float buffers")


def _refuses(dev: Device, seed: int) -> None:
    """Bad arguments raise ArgumentError before anything is written."""
    rng = rng_for(seed)
    host = rng.uniform(-1, 1, (8, 16)).astype(np.float32)
    pool = dev.upload(host)
    src = dev.upload(rng.uniform(-1, 1, (2, 16)).astype(np.float32))
    attempts = {
        "duplicate scatter destination": lambda: dev.set_rows(pool, dev.indices([3, 3]), src),
        "row out of range": lambda: dev.set_rows(pool, dev.indices([1, 8]), src),
        "negative row": lambda: dev.zero_rows(pool, dev.indices([-1])),
        "copy reading a row it writes": lambda: dev.copy_rows(pool, dev.indices([1, 2]), pool, dev.indices([2, 4])),
    }
    for what, attempt in attempts.items():
        _expect_refusal(dev, what, attempt, pool, host)


def _expect_refusal(dev: Device, what: str, attempt: Callable[[], None], pool: Buffer, unchanged: np.ndarray) -> None:
    """``attempt`` raises ArgumentError and ``pool`` still holds ``unchanged``."""
    try:
        attempt()
    except ArgumentError:
        pass
    else:
        raise ConformanceFailure(f"{what}: no ArgumentError raised")
    assert_exact(f"pool after a refused call ({what})", dev.download(pool), unchanged)


def _repeated_calls(dev: Device, seed: int) -> None:
    """A decode loop passes the same buffer objects call after call (devices
    may remember such calls instead of validating them again): the results
    must be those of fresh calls, a rewritten index buffer must take effect,
    and bad rows written into a buffer that worked before must still be
    refused before anything is written."""
    rng = rng_for(seed)
    n_rows, ch, d_conv = 6, 8, 4
    init = rng.uniform(-1, 1, (n_rows, ch * (d_conv - 1))).astype(np.float32)
    weights = rng.uniform(-1, 1, (ch, d_conv)).astype(np.float32)
    xs = rng.uniform(-1, 1, (3, 2, 1, ch)).astype(np.float32)
    rows = ([0, 1], [0, 1], [4, 2])  # the third step rewrites the index buffers

    pool, weight = dev.upload(init), dev.upload(weights)
    x, y = dev.alloc((2, 1, ch)), dev.alloc((2, 1, ch))
    start, dst = dev.indices(rows[0]), dev.indices(rows[0])
    fresh_pool = dev.upload(init)
    for step, step_rows in enumerate(rows):
        dev.write(x, xs[step])
        if step_rows != rows[step - 1]:
            dev.write(start, step_rows)
            dev.write(dst, step_rows)
        dev.ssm_conv(pool, start, dst, x, weight, y, apply_silu=True)
        fresh_y = dev.alloc((2, 1, ch))
        dev.ssm_conv(
            fresh_pool, dev.indices(step_rows), dev.indices(step_rows), dev.upload(xs[step]), dev.upload(weights),
            fresh_y, apply_silu=True,
        )  # fmt: skip
        assert_exact(f"y of repeated call {step}", dev.download(y), dev.download(fresh_y))
        assert_exact(f"pool after repeated call {step}", dev.download(pool), dev.download(fresh_pool))

    # A new output buffer in place of one that is gone receives the result.
    del y
    y2 = dev.alloc((2, 1, ch))
    dev.ssm_conv(pool, start, dst, x, weight, y2, apply_silu=True)
    dev.ssm_conv(fresh_pool, start, dst, x, weight, fresh_y, apply_silu=True)
    assert_exact("y in a new buffer after the old one was dropped", dev.download(y2), dev.download(fresh_y))

    src = dev.upload(rng.uniform(-1, 1, (2, ch * (d_conv - 1))).astype(np.float32))
    scatter = dev.indices([5, 3])
    dev.set_rows(pool, scatter, src)
    dev.set_rows(pool, scatter, src)
    before = dev.download(pool)
    attempts = {
        "ssm_conv destination rewritten out of range": (
            dst,
            [4, n_rows],
            lambda: dev.ssm_conv(pool, start, dst, x, weight, y2, apply_silu=True),
        ),
        "set_rows destinations rewritten to a duplicate": (scatter, [3, 3], lambda: dev.set_rows(pool, scatter, src)),
    }
    for what, (index, values, attempt) in attempts.items():
        dev.write(index, values)
        _expect_refusal(dev, what, attempt, pool, before)


def all_cases() -> list[Case]:
    cases: list[Case] = []
    holder: dict[str, Case] = {}

    def add(case_id: str, fn, ops=(), caps=None, reqs=()):  # type: ignore[no-untyped-def]
        def run(device: Device) -> None:
            fn(device, holder[case_id].seed)

        case = Case(case_id, "device", tuple(ops), run, tuple(reqs), caps or {})
        holder[case_id] = case
        cases.append(case)

    for dt in (DType.F32, DType.F16, DType.BF16):
        caps = {"storage_dtypes": {dt.value}}
        add(f"device.alloc_zero[{dt.value}]", lambda dev, seed, dt=dt: _alloc_zero(dev, dt), caps=caps)
        add(f"device.upload_download[{dt.value}]", lambda dev, seed, dt=dt: _roundtrip(dev, dt, seed), caps=caps)
    add("device.indices[i32]", lambda dev, seed: _indices(dev))
    add("device.copy_buffer[f32]", _copy_buffer)
    add("device.fill_bytes[f32]", lambda dev, seed: _fill_bytes(dev))
    rows_ops = ("set_rows", "zero_rows", "copy_rows")
    add(
        "device.refuses_bad_arguments[f32]",
        _refuses,
        ops=rows_ops,
        reqs=[Requirement(op, {"dtype": "f32"}) for op in rows_ops],
    )
    add(
        "device.repeated_calls[f32]",
        _repeated_calls,
        ops=("ssm_conv", "set_rows"),
        reqs=[Requirement("ssm_conv", {"dtype": "f32", "d_conv": 4}), Requirement("set_rows", {"dtype": "f32"})],
    )
    return cases
