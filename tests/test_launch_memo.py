"""The launch memo: repeated identical calls skip validation, and only while
that is right (see statecache.launch_memo).  Every backend also runs the
conformance case ``device.repeated_calls``."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from statecache import primitives as P
from statecache.errors import ArgumentError
from statecache.launch_memo import MEMO_LIMIT, LaunchMemo
from statecache.registry import get_device


@pytest.fixture(params=["reference", "cpu"])
def dev(request):  # type: ignore[no-untyped-def]
    return get_device(request.param)


def _scan_args(dev, rng, n_s=2):  # type: ignore[no-untyped-def]
    H, P_, N = 2, 4, 8
    pool = dev.upload(rng.uniform(-1, 1, (4, H * P_ * N)).astype(np.float32))
    x = dev.upload(rng.uniform(-1, 1, (n_s, 1, H, P_)).astype(np.float32))
    dt = dev.upload(rng.uniform(-2, 1, (n_s, 1, H)).astype(np.float32))
    A = dev.upload(-rng.uniform(0.5, 1, (H,)).astype(np.float32))
    B = dev.upload(rng.uniform(-1, 1, (n_s, 1, 1, N)).astype(np.float32))
    C = dev.upload(rng.uniform(-1, 1, (n_s, 1, 1, N)).astype(np.float32))
    y = dev.alloc((n_s, 1, H, P_))
    rows = dev.indices(np.arange(n_s))
    return pool, rows, rows, x, dt, A, B, C, y


def _count_checks(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    calls = [0]
    real = P.check_ssm_scan

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(P, "check_ssm_scan", counting)
    return calls


def test_identical_calls_are_validated_once(dev, rng, monkeypatch) -> None:
    calls = _count_checks(monkeypatch)
    args = _scan_args(dev, rng)
    for _ in range(3):
        dev.ssm_scan(*args)
    assert calls[0] == 1
    dev.ssm_scan(*args, n_snap=1, plane_stride=2)  # another scalar: another call
    assert calls[0] == 2
    dev.write(args[1], [1, 0])  # a rewritten index buffer is validated again
    dev.ssm_scan(*args)
    assert calls[0] == 3


def test_remembered_call_matches_validated_call(dev, rng) -> None:
    args = _scan_args(dev, rng)
    pool0 = dev.download(args[0])
    for _ in range(3):
        dev.ssm_scan(*args)
    remembered = dev.download(args[0]), dev.download(args[-1])
    dev.write(args[0], pool0)
    for _ in range(3):  # fresh x/y views every call: never remembered
        dev.ssm_scan(*args[:3], args[3].view(args[3].shape), *args[4:8], y := dev.alloc(args[-1].shape))
    np.testing.assert_array_equal(dev.download(args[0]), remembered[0])
    np.testing.assert_array_equal(dev.download(y), remembered[1])


def test_memo_does_not_keep_buffers_alive(dev, rng) -> None:
    args = list(_scan_args(dev, rng))
    dev.ssm_scan(*args)
    pool_ref = weakref.ref(args[0])
    del args
    gc.collect()
    assert pool_ref() is None


def test_unhashable_scalar_is_an_argument_error(dev, rng) -> None:
    args = _scan_args(dev, rng)
    with pytest.raises(ArgumentError, match="n_snap"):
        dev.ssm_scan(*args, n_snap=[1])  # type: ignore[arg-type]


def test_refused_after_remembered_success_changes_nothing(dev, rng) -> None:
    args = _scan_args(dev, rng)
    dev.ssm_scan(*args)
    dev.ssm_scan(*args)
    before = dev.download(args[0]), dev.download(args[-1])
    dev.write(args[2], [0, 9])  # start and destination rows share this buffer
    with pytest.raises(ArgumentError, match="out of range"):
        dev.ssm_scan(*args)
    np.testing.assert_array_equal(dev.download(args[0]), before[0])
    np.testing.assert_array_equal(dev.download(args[-1]), before[1])


def test_cpu_index_written_through_an_export_is_validated_again(rng) -> None:
    dev = get_device("cpu")
    args = _scan_args(dev, rng)
    dev.ssm_scan(*args)
    np.asarray(args[1])[1] = 99  # zero-copy view: the validator never saw this
    with pytest.raises(ArgumentError, match="index 99 out of range"):
        dev.ssm_scan(*args)


def test_dead_buffer_with_a_reused_id_does_not_match() -> None:
    class Buf:
        host_indices = None
        is_contiguous = True

    memo = LaunchMemo()
    old = Buf()
    key = ("op", id(old))
    memo.store(key, "caps", (old,), (), "checked", None)
    assert memo.lookup(key, "caps", (old,), ()) is not None
    assert memo.lookup(key, "other caps", (old,), ()) is None
    del old
    newcomer = Buf()  # may or may not get the old id: the key is reused explicitly
    assert memo.lookup(key, "caps", (newcomer,), ()) is None


def test_index_buffer_without_host_shadow_is_never_remembered() -> None:
    class Index:
        host_indices = None
        is_contiguous = True

    memo = LaunchMemo()
    idx = Index()
    memo.store(("op", id(idx)), "caps", (idx,), (idx,), "checked", None)
    assert len(memo) == 0


def test_memo_stays_bounded() -> None:
    class Buf:
        host_indices = None
        is_contiguous = True

    memo = LaunchMemo()
    keep = [Buf() for _ in range(MEMO_LIMIT + 10)]
    for i, buf in enumerate(keep):
        memo.store(("op", i), "caps", (buf,), (), None, None)
    assert len(memo) <= MEMO_LIMIT
    # Full of live entries: the newer half stays (a steady working set is not
    # dropped whole), the older half goes.
    last = MEMO_LIMIT + 9
    assert memo.lookup(("op", last), "caps", (keep[last],), ()) is not None
    assert memo.lookup(("op", 0), "caps", (keep[0],), ()) is None


def test_index_buffer_overwritten_by_copy_buffer_is_validated_with_its_new_values(dev, rng) -> None:
    args = _scan_args(dev, rng)
    dev.ssm_scan(*args)
    dev.copy_buffer(dev.indices([0, 7]), args[1])
    with pytest.raises(ArgumentError, match="index 7 out of range"):
        dev.ssm_scan(*args)


def test_steady_decode_through_the_memory_validates_once(dev, rng, monkeypatch) -> None:
    """What the memo is for: a runtime that keeps its activation buffers and
    decodes step after step through the memory (which reuses its pools and
    index buffers) pays for validation once for the steady call, and the states
    still equal a decode with fresh buffers every step."""
    from statecache.batch import Batch, BatchAllocator
    from statecache.spec import MemorySpec, RecurrentLayerSpec, make_memory

    H, P_, N = 2, 4, 8
    layer = RecurrentLayerSpec.mamba2(d_inner=H * P_, d_state=N, d_conv=4, n_group=1, head_dim=P_)
    A = dev.upload(-rng.uniform(0.5, 1, H).astype(np.float32))
    steps = rng.uniform(-1, 1, (6, 2, 1, H * P_ + 2 * N + H)).astype(np.float32)

    def run(keep_buffers: bool) -> np.ndarray:
        mem = make_memory(MemorySpec.build(1, {0: layer}), dev, n_seq_max=2, n_rs_seq=2)
        kept = dev.alloc((2, 1, H * P_ + 2 * N + H)), dev.alloc((2, 1, H, P_))
        for t, values in enumerate(steps):
            balloc = BatchAllocator(2)
            balloc.init(Batch.for_sequences({0: [t], 1: [t]}), mem)
            ctx = mem.init_batch(balloc, n_ubatch=8)
            assert ctx.apply()
            inp, y = kept if keep_buffers else (dev.alloc(kept[0].shape), dev.alloc(kept[1].shape))
            dev.write(inp, values)
            row = H * P_ + 2 * N + H
            x = inp.view((2, 1, H, P_), (row, row, P_, 1))
            B = inp.view((2, 1, 1, N), (row, row, N, 1), H * P_)
            C = inp.view((2, 1, 1, N), (row, row, N, 1), H * P_ + N)
            dt = inp.view((2, 1, H), (row, row, 1), H * P_ + 2 * N)
            if keep_buffers:  # a runtime keeps its views too
                x, B, C, dt = kept_views.setdefault("v", (x, B, C, dt))
            ctx.step().scan(0, x, dt, A, B, C, y)
            assert not ctx.next()
        return dev.download(mem.pools[0]["s"])

    kept_views: dict[str, tuple] = {}
    fresh = run(keep_buffers=False)
    calls = _count_checks(monkeypatch)
    kept = run(keep_buffers=True)
    # the first step starts both sequences from the zero row (its own start-row
    # buffer); every later step reads the live plane and writes the next one, so a
    # steady decode cycles through n_snap = 3 calls (planes 1 -> 2, 2 -> 0, 0 -> 1)
    # whose index buffers the memory hands back.  Each of the four calls is validated
    # once by the step (before its first write, so a refused call changes nothing)
    # and once by the device (its launch memo); the 2 later steps repeat a validated
    # call and are checked by neither
    assert calls[0] == 2 * (1 + 3), f"{calls[0]} validations for {len(steps)} decode steps"
    np.testing.assert_array_equal(kept, fresh)


def test_write_through_a_view_withdraws_the_parent_host_copy(dev, rng) -> None:
    """An index buffer written through a view of it is validated with its new
    values: out of range refused (pool unchanged), in range used."""
    pool = dev.upload(rng.uniform(-1, 1, (6, 3)).astype(np.float32))
    src = dev.upload(rng.uniform(-1, 1, (4, 3)).astype(np.float32))
    rows = dev.indices([0, 1, 2, 3])
    dev.set_rows(pool, rows, src)  # remembered with the copy [0, 1, 2, 3]
    tail = rows.view((2,), (1,), 2)
    dev.write(tail, [7, 8])
    before = dev.download(pool)
    with pytest.raises(ArgumentError, match="index 7 out of range"):
        dev.set_rows(pool, rows, src)
    np.testing.assert_array_equal(dev.download(pool), before)
    dev.write(tail, [5, 4])
    dev.set_rows(pool, rows, src)
    np.testing.assert_array_equal(dev.download(pool)[[0, 1, 5, 4]], dev.download(src))
    np.testing.assert_array_equal(dev.download(pool)[[2, 3]], before[[2, 3]])
