"""Device cases: buffers, transfers, views, and refusal of bad arguments.

These need no reference: they check the Device protocol that every primitive
case relies on (a device whose upload or download is wrong would make every
other comparison meaningless).  Every transfer (``write``, ``download``,
``copy_buffer``, ``fill_bytes``) and every index argument of the primitives
is also exercised through views with offsets (and strides where the method
takes them): a backend that ignores ``buffer.offset`` in its ``_write`` or
reads an index view from the start of its storage passes every case on
whole buffers.
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


# -- transfers through views ------------------------------------------------------------

#: Views of a [6, 7] buffer as (shape, strides, offset): a row, two rows, a run
#: that starts and ends inside rows, one element at the end.  All contiguous,
#: as write() and copy_buffer() require; offsets are what a backend must honour.
_ROWS, _COLS = 6, 7
_CONTIGUOUS_VIEWS = (
    ((1, _COLS), (_COLS, 1), 2 * _COLS),
    ((2, _COLS), None, 3 * _COLS),
    ((9,), None, 11),
    ((1,), None, 41),
)


def _host_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    if dtype is DType.I32:
        return rng.integers(-1000, 1000, shape).astype(np.int32)
    return rng.uniform(-5, 5, shape).astype(np.float32).astype(dtype.numpy)


def _write_views(dev: Device, dtype: DType, seed: int) -> None:
    """write() through a view changes exactly the elements the view addresses."""
    rng = rng_for(seed)
    want = _host_values(rng, (_ROWS, _COLS), dtype)
    buf = dev.upload(want, dtype)
    flat = want.reshape(-1)
    for shape, strides, offset in _CONTIGUOUS_VIEWS:
        data = _host_values(rng, shape, dtype)
        dev.write(buf.view(shape, strides, offset), data)
        flat[offset : offset + data.size] = data.ravel()
        assert_exact(f"{dtype} buffer after write() through view({shape}, offset={offset})", dev.download(buf), want)
    # A view of a view: the offsets add up.
    inner = buf.view((3, _COLS), None, _COLS).view((4,), None, _COLS + 2)
    data = _host_values(rng, (4,), dtype)
    dev.write(inner, data)
    flat[2 * _COLS + 2 : 2 * _COLS + 6] = data
    assert_exact(f"{dtype} buffer after write() through a view of a view", dev.download(buf), want)


def _read_views(dev: Device, dtype: DType, seed: int) -> None:
    """download() of a view returns what NumPy's view of the same elements holds."""
    rng = rng_for(seed)
    host = _host_values(rng, (_ROWS, _COLS), dtype)
    buf = dev.upload(host, dtype)
    flat = host.reshape(-1)
    strided = (((3, 2), (2 * _COLS, 3), 1), ((4,), (_COLS + 1,), 5), ((2, 2, 3), (3 * _COLS, _COLS, 2), _COLS - 1))
    for shape, strides, offset in _CONTIGUOUS_VIEWS + strided:
        view = buf.view(shape, strides, offset)
        want = np.lib.stride_tricks.as_strided(
            flat[offset:], shape, tuple(s * flat.itemsize for s in view.strides), writeable=False
        )
        assert_exact(f"download of {dtype} view({shape}, {view.strides}, offset={offset})", dev.download(view), want)
    nested = buf.view((4, _COLS), None, _COLS).view((2, 3), (2 * _COLS, 2), _COLS + 1)
    assert_exact(f"download of a {dtype} view of a view", dev.download(nested), host[2:5:2, 1:7:2])


def _copy_buffer_views(dev: Device, dtype: DType, seed: int) -> None:
    """copy_buffer() between views reads from the source view's offset and writes
    only the destination view's elements."""
    rng = rng_for(seed)
    src_host = _host_values(rng, (_ROWS, _COLS), dtype)
    dst_host = _host_values(rng, (_ROWS, _COLS), dtype)
    src, dst = dev.upload(src_host, dtype), dev.upload(dst_host, dtype)
    want = dst_host.copy().reshape(-1)
    pairs = ((((2, _COLS), None, _COLS), ((2, _COLS), None, 3 * _COLS)), (((9,), None, 11), ((9,), None, 30)))
    for (s_shape, s_strides, s_off), (d_shape, d_strides, d_off) in pairs:
        dev.copy_buffer(src.view(s_shape, s_strides, s_off), dst.view(d_shape, d_strides, d_off))
        n = int(np.prod(d_shape))
        want[d_off : d_off + n] = src_host.reshape(-1)[s_off : s_off + n]
        what = f"{dtype} copy_buffer(offset {s_off} -> offset {d_off})"
        assert_exact(what, dev.download(dst), want.reshape(_ROWS, _COLS))
        assert_exact(f"source of {what}", dev.download(src), src_host)


def _fill_bytes_view(dev: Device, seed: int) -> None:
    """fill_bytes() through a view fills that view and nothing around it."""
    rng = rng_for(seed)
    host = _host_values(rng, (_ROWS, _COLS), DType.F32)
    buf = dev.upload(host)
    view = buf.view((2, _COLS), None, 2 * _COLS)
    dev.fill_bytes(view, 99)
    got = dev.download(buf)
    assert_exact(
        "rows around a view filled by fill_bytes()", np.delete(got, [2, 3], axis=0), np.delete(host, [2, 3], 0)
    )
    if np.array_equal(got[2:4], host[2:4]):
        raise ConformanceFailure("fill_bytes() through a view left the view's rows as they were")


def _index_views(dev: Device, seed: int) -> None:
    """Row primitives read their indices from views into larger index buffers
    (offset, strided, and one written through a view) exactly as from whole ones."""
    rng = rng_for(seed)
    n_rows, row = 9, 19
    pool_host = rng.uniform(-1, 1, (n_rows, row)).astype(np.float32)
    src_host = rng.uniform(-1, 1, (3, row)).astype(np.float32)
    perm = rng.permutation(n_rows).astype(np.int32)
    big = dev.indices(perm)
    views = {
        "offset": big.view((3,), None, 4),
        "strided": big.view((3,), (2,), 1),
    }
    written = dev.indices(np.zeros(8, np.int32))
    dev.write(written.view((3,), None, 5), perm[:3])  # write() through a view, then read by the kernels
    views["written through a view"] = written.view((3,), None, 5)
    for label, rows in views.items():
        values = dev.download(rows).astype(np.int64)
        pool = dev.upload(pool_host)
        out = dev.alloc((3, row))
        dev.get_rows(pool, rows, out)
        assert_exact(f"get_rows with {label} index view", dev.download(out), pool_host[values])
        dev.set_rows(pool, rows, dev.upload(src_host))
        want = pool_host.copy()
        want[values] = src_host
        assert_exact(f"set_rows with {label} index view", dev.download(pool), want)
        dev.zero_rows(pool, rows)
        want[values] = 0
        assert_exact(f"zero_rows with {label} index view", dev.download(pool), want)
        target = dev.upload(pool_host)
        dev.copy_rows(dev.upload(want), rows, target, rows)
        expect = pool_host.copy()
        expect[values] = want[values]
        assert_exact(f"copy_rows with {label} index views", dev.download(target), expect)


def _state_index_views(dev: Device, seed: int) -> None:
    """ssm_conv reads start_rows / dst_rows views as it reads whole index buffers
    (the stateful primitives share one index convention; conv stands for them)."""
    rng = rng_for(seed)
    n_rows, ch, d_conv = 6, 8, 4
    init = rng.uniform(-1, 1, (n_rows, ch * (d_conv - 1))).astype(np.float32)
    x = rng.uniform(-1, 1, (2, 3, ch)).astype(np.float32)
    w = rng.uniform(-1, 1, (ch, d_conv)).astype(np.float32)
    big = dev.indices([5, 0, 3, 2, 4, 1])
    start, dst = big.view((2,), None, 2), big.view((2,), (3,), 1)  # rows [3, 2] and [0, 4]
    pool, y = dev.upload(init), dev.alloc((2, 3, ch))
    dev.ssm_conv(pool, start, dst, dev.upload(x), dev.upload(w), y, apply_silu=True)
    fresh_pool, fresh_y = dev.upload(init), dev.alloc((2, 3, ch))
    dev.ssm_conv(
        fresh_pool, dev.indices([3, 2]), dev.indices([0, 4]), dev.upload(x), dev.upload(w), fresh_y, apply_silu=True
    )
    assert_exact("ssm_conv y with index views", dev.download(y), dev.download(fresh_y))
    assert_exact("ssm_conv pool with index views", dev.download(pool), dev.download(fresh_pool))


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
    for dt in (DType.F32, DType.F16, DType.BF16, DType.I32):
        caps = {} if dt is DType.I32 else {"storage_dtypes": {dt.value}}  # i32: every device stores indices
        add(f"device.write_views[{dt.value}]", lambda dev, seed, dt=dt: _write_views(dev, dt, seed), caps=caps)
        add(f"device.read_views[{dt.value}]", lambda dev, seed, dt=dt: _read_views(dev, dt, seed), caps=caps)
        add(
            f"device.copy_buffer_views[{dt.value}]",
            lambda dev, seed, dt=dt: _copy_buffer_views(dev, dt, seed),
            caps=caps,
        )
    add("device.fill_bytes_view[f32]", _fill_bytes_view)
    rows_ops = ("get_rows", "set_rows", "zero_rows", "copy_rows")
    add(
        "device.index_views[f32]",
        _index_views,
        ops=rows_ops,
        reqs=[Requirement(op, {"dtype": "f32"}) for op in rows_ops],
    )
    add(
        "device.state_index_views[f32]",
        _state_index_views,
        ops=("ssm_conv",),
        reqs=[Requirement("ssm_conv", {"dtype": "f32", "d_conv": 4})],
    )
    refusing_ops = ("set_rows", "zero_rows", "copy_rows")
    add(
        "device.refuses_bad_arguments[f32]",
        _refuses,
        ops=refusing_ops,
        reqs=[Requirement(op, {"dtype": "f32"}) for op in refusing_ops],
    )
    add(
        "device.repeated_calls[f32]",
        _repeated_calls,
        ops=("ssm_conv", "set_rows"),
        reqs=[Requirement("ssm_conv", {"dtype": "f32", "d_conv": 4}), Requirement("set_rows", {"dtype": "f32"})],
    )
    return cases
