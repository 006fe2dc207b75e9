"""Primitive validation that only the kit (or another backend's tests)
checked (issue 20, items 9 and 10): refusals are decided in the core, so they
are tested here on the reference device, and a refused call writes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.errors import ArgumentError


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def test_copy_rows_refuses_to_read_and_write_one_row_of_one_buffer(dev):
    pool = dev.upload(np.arange(24, dtype=np.float32).reshape(6, 4))
    before = pool.numpy()
    with pytest.raises(ArgumentError) as err:
        dev.copy_rows(pool, dev.indices([1, 2]), pool, dev.indices([2, 3]))  # row 2 read and written
    assert err.value.argument == "dst_rows" and "row 2" in str(err.value)
    assert np.array_equal(pool.numpy(), before)
    # the same rows of two different buffers, and disjoint rows of one, are fine
    other = dev.upload(np.zeros((6, 4), dtype=np.float32))
    dev.copy_rows(pool, dev.indices([1, 2]), other, dev.indices([1, 2]))
    dev.copy_rows(pool, dev.indices([1, 2]), pool, dev.indices([4, 5]))
    assert np.array_equal(pool.numpy()[4:], before[1:3])
    # a view of the same storage is the same buffer for this rule
    with pytest.raises(ArgumentError, match="both read and written"):
        dev.copy_rows(pool.view((6, 4)), dev.indices([0]), pool, dev.indices([0]))


def _scan_args(dev, n_rows: int, n_t: int):
    H, P, N = 2, 2, 4
    rng = np.random.default_rng(0)
    u = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)  # noqa: E731
    pool = dev.upload(u(n_rows, H * P * N))
    inputs = [dev.upload(a) for a in (u(1, n_t, H, P), u(1, n_t, H), -np.ones(H, np.float32), u(1, n_t, 1, N))]
    x, dt, A, B = inputs
    C = dev.upload(u(1, n_t, 1, N))
    y = dev.alloc((1, n_t, H, P))
    return pool, x, dt, A, B, C, y


@pytest.mark.parametrize("n_t", [1, 2, 6])
def test_the_top_written_plane_may_be_the_last_row_and_no_further(dev, n_t):
    """A call writes planes 0 .. min(n_t, n_snap - 1) of each destination row:
    the top one may be the pool's last row; one row further is refused
    (naming dst_rows) before anything is written.  Planes the call does not
    write (n_t + 1 < n_snap) may lie past the end."""
    n_snap, stride, n_rows = 4, 3, 10
    top = min(n_t, n_snap - 1)
    fits = n_rows - 1 - top * stride  # the top plane lands on the last row
    pool, x, dt, A, B, C, y = _scan_args(dev, n_rows, n_t)
    start = dev.indices([0])
    dev.ssm_scan(pool, start, dev.indices([fits]), x, dt, A, B, C, y, n_snap=n_snap, plane_stride=stride)
    before = pool.numpy()
    with pytest.raises(ArgumentError) as err:
        dev.ssm_scan(pool, start, dev.indices([fits + 1]), x, dt, A, B, C, y, n_snap=n_snap, plane_stride=stride)
    assert err.value.argument == "dst_rows"
    assert np.array_equal(pool.numpy(), before)
