"""Validation of the primitive calls, pinned where mutation of
``core/primitives.py`` found it loose: every refusal names the argument that
is wrong and says what it expected, index arrays longer than the small-array
fast path are checked too, and accepted calls with start rows above every
written row run."""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.backends.reference.device import ReferenceDevice
from statecache.errors import ArgumentError


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def f32(dev, *shape, value: float = 0.5):  # type: ignore[no-untyped-def]
    return dev.upload(np.full(shape, value, dtype=np.float32))


def refused(call, argument: str, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArgumentError) as err:
        call()
    assert err.value.argument == argument, str(err.value)
    assert words in str(err.value), str(err.value)


def test_row_primitives_name_the_wrong_argument(dev):
    src, dst = f32(dev, 8, 4), f32(dev, 8, 4)
    idx = dev.indices
    refused(lambda: dev.get_rows(src, dev.upload(np.zeros(2, np.float32)), f32(dev, 2, 4)), "rows", "must be i32")
    refused(lambda: dev.get_rows(src, idx([0, 1, 2]), f32(dev, 2, 4)), "rows", "length 3 does not match expected 2")
    refused(lambda: dev.set_rows(dst, idx([0, 9]), f32(dev, 2, 4)), "rows", "index 9 out of range [0, 8)")
    refused(lambda: dev.zero_rows(dst, idx([8])), "rows", "index 8 out of range [0, 8)")
    refused(lambda: dev.copy_rows(src, idx([0]), dst, idx([8])), "dst_rows", "index 8 out of range [0, 8)")
    refused(lambda: dev.copy_rows(src.view((32,)), idx([0]), dst, idx([1])), "src", "must be 2-D")
    refused(lambda: dev.set_rows(dst, idx([3, 5, 3]), f32(dev, 3, 4)), "rows", "duplicate destination row 3")


def test_index_arrays_longer_than_32_are_validated_too(dev):
    n = 40
    dst = f32(dev, n + 5, 3)
    src = dev.upload(np.arange(n * 3, dtype=np.float32).reshape(n, 3))
    rows = np.arange(n)[::-1].copy()
    dev.set_rows(dst, dev.indices(rows), src)
    assert np.array_equal(dst.numpy()[rows], src.numpy())
    dup = rows.copy()
    dup[-1] = dup[0]
    refused(lambda: dev.set_rows(dst, dev.indices(dup), src), "rows", f"duplicate destination row {dup[0]}")
    bad = rows.copy()
    bad[7] = n + 5
    refused(lambda: dev.get_rows(dst, dev.indices(bad), f32(dev, n, 3)), "rows", f"index {n + 5} out of range")


def _scan(dev, n_s=1, n_t=2, H=4, P=2, N=4, G=2, rows=12):  # type: ignore[no-untyped-def]
    return dict(
        pool=f32(dev, rows, H * P * N),
        x=f32(dev, n_s, n_t, H, P),
        dt=f32(dev, n_s, n_t, H),
        A=f32(dev, H, value=-1.0),
        B=f32(dev, n_s, n_t, G, N),
        C=f32(dev, n_s, n_t, G, N),
        y=f32(dev, n_s, n_t, H, P),
    )


def test_stateful_primitives_name_the_wrong_argument(dev):
    a = _scan(dev)
    i = dev.indices

    def scan(**kw):  # type: ignore[no-untyped-def]
        args = {**a, **kw}
        n_snap = args.pop("n_snap", 1)
        stride = args.pop("plane_stride", 0)
        dev.ssm_scan(args["pool"], i([0]), i([1]), args["x"], args["dt"], args["A"], args["B"], args["C"], args["y"],
                     n_snap=n_snap, plane_stride=stride)  # fmt: skip

    refused(lambda: scan(x=f32(dev, 1, 2, 8)), "x", "must be 4-D [n_seqs, n_tokens, n_head, head_dim]")
    refused(lambda: scan(B=f32(dev, 1, 2, 3, 4), C=f32(dev, 1, 2, 3, 4)), "B", "n_group 3 must divide n_head 4")
    refused(lambda: scan(n_snap=0), "n_snap", "must be an integer >= 1, got 0")
    refused(lambda: scan(n_snap=2, plane_stride=0), "plane_stride", "must be > 0 when n_snap > 1")
    refused(lambda: scan(y=f32(dev, 1, 2, 4, 3)), "y", "shape (1, 2, 4, 3) does not match expected (1, 2, 4, 2)")

    ch, W = 4, 3
    conv = dict(pool=f32(dev, 6, ch * W), x=f32(dev, 1, 2, ch), w=f32(dev, ch, W + 1), y=f32(dev, 1, 2, ch))
    refused(lambda: dev.ssm_conv(conv["pool"], i([0]), i([1]), f32(dev, 2, ch), conv["w"], conv["y"]), "x", "3-D")
    refused(
        lambda: dev.ssm_conv(f32(dev, 6, 0), i([0]), i([1]), conv["x"], f32(dev, ch, 1), conv["y"]),
        "weight",
        "d_conv 1 must be >= 2",
    )

    S, Hv = 2, 3
    q = f32(dev, 1, 1, 2, S)
    v = f32(dev, 1, 1, Hv, S)
    g, beta, o = f32(dev, 1, 1, Hv), f32(dev, 1, 1, Hv), f32(dev, 1, 1, Hv, S)
    pool = f32(dev, 4, Hv * S * S)
    refused(lambda: dev.gated_delta_net(pool, i([0]), i([1]), q, q, v, g, beta, o), "q", "H_k 2 must divide H_v 3")
    q1 = f32(dev, 1, 1, 1, S)
    refused(
        lambda: dev.gated_delta_net(f32(dev, 4, 5), i([0]), i([1]), q1, q1, v, g, beta, o),
        "pool",
        f"must be H_v * S * S = {Hv * S * S}",
    )
    both = f32(dev, 2, 1, 1, Hv, S)  # o and v as views of one storage
    vo, oo = both.view((1, 1, Hv, S)), both.view((1, 1, Hv, S), offset=Hv * S)
    refused(lambda: dev.gated_delta_net(pool, i([0]), i([1]), q1, q1, vo, g, beta, oo), "o", "shares storage with v")


def test_start_rows_above_every_written_row_are_accepted(dev):
    """Two planes written per sequence, start rows in a source region above
    all of them (the slow path of the overlap check)."""
    a = _scan(dev, n_s=2, rows=12)
    i = dev.indices
    before = a["pool"].numpy()
    dev.ssm_scan(a["pool"], i([10, 11]), i([0, 1]), a["x"], a["dt"], a["A"], a["B"], a["C"], a["y"],
                 n_snap=2, plane_stride=2)  # fmt: skip
    after = a["pool"].numpy()
    assert not np.array_equal(after[[0, 1, 2, 3]], before[[0, 1, 2, 3]])
    assert np.array_equal(after[4:], before[4:])


def test_foreign_buffers_and_delta_outputs_name_the_argument(dev):
    other = ReferenceDevice()  # another device: its buffers are not this one's
    src = other.upload(np.zeros((4, 2), np.float32))
    refused(lambda: dev.get_rows(src, dev.indices([0]), f32(dev, 1, 2)), "src", f"buffer lives on {other.id}")
    S, Hv = 2, 2
    q = f32(dev, 1, 1, 1, S)
    v, g, beta = f32(dev, 1, 1, Hv, S), f32(dev, 1, 1, Hv), f32(dev, 1, 1, Hv)
    pool = f32(dev, 4, Hv * S * S)
    i = dev.indices
    refused(lambda: dev.gated_delta_net(pool, i([0]), i([1]), q, q, v, g, beta, f32(dev, 1, 1, Hv, 3)), "o", "shape")
    o_in_pool = pool.view((1, 1, Hv, S), offset=3 * Hv * S * S)
    refused(
        lambda: dev.gated_delta_net(pool, i([0]), i([1]), q, q, v, g, beta, o_in_pool), "o", "shares storage with pool"
    )
