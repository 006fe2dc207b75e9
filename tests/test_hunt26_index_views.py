"""Index buffers written through ``statecache.hostmem.as_array`` (hunt26).

``as_array`` is the documented way to see a host buffer's memory as NumPy
(docs/embedding.md).  Index validation trusts the host copy statecache keeps
of what it wrote into an index buffer (``Buffer.host_indices``); a buffer
handed out writable (``np.asarray``, DLPack) is marked exported so that
validation reads it back.  ``as_array`` once handed out a writable view
without that mark: rows rewritten through it were validated against the old
copy, so a call used rows nobody validated (an out-of-range row reached the
kernel) and the derived snapshot tables kept the old rows.
"""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.errors import ArgumentError
from statecache.hostmem import as_array

CH, D_CONV, ROWS = 4, 3, 6


def _conv(dev, start, dst, n_snap=1, plane_stride=0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    pool = dev.upload(rng.uniform(-1, 1, (ROWS, CH * (D_CONV - 1))).astype(np.float32))
    x = dev.upload(rng.uniform(-1, 1, (2, 2, CH)).astype(np.float32))
    w = dev.upload(rng.uniform(-1, 1, (CH, D_CONV)).astype(np.float32))
    y = dev.alloc((2, 2, CH))
    dev.ssm_conv(pool, start, dst, x, w, y, n_snap=n_snap, plane_stride=plane_stride)
    return dev.download(pool), dev.download(y)


@pytest.mark.parametrize("name", ["reference", "cpu"])
@pytest.mark.parametrize("n_snap", [1, 2])
def test_rows_rewritten_through_as_array_are_the_rows_used(name: str, n_snap: int) -> None:
    dev = statecache.get_device(name)
    stride = 3 if n_snap > 1 else 0
    rows = dev.indices([0, 1])
    _conv(dev, rows, rows, n_snap, stride)  # validated and remembered with rows 0, 1
    as_array(rows)[:] = [2, 1]
    got = _conv(dev, rows, rows, n_snap, stride)
    want = _conv(dev, dev.indices([2, 1]), dev.indices([2, 1]), n_snap, stride)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_an_out_of_range_row_written_through_as_array_is_refused(name: str) -> None:
    dev = statecache.get_device(name)
    rows = dev.indices([0, 1])
    _conv(dev, rows, rows)
    as_array(rows)[:] = [0, 10_000]
    with pytest.raises(ArgumentError, match=r"start_rows|dst_rows"):
        _conv(dev, rows, rows)
