"""KV cache details that survived mutation of ``core/kv_cells.py`` and
``core/kv_cache.py``: the smallest stream, the argument each refusal names,
removals handing their cells back first so the attention span stays short,
and the words of the errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_behaviours_kv import held, make_cache, run

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, StateError
from statecache.kv_cache import KVCacheISWA, KVLayer
from statecache.kv_cells import KVCells
from statecache.memory import MemoryStatus
from statecache.state_io import pack_sections, unpack_sections


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def test_a_one_cell_stream_works(dev):
    cells = KVCells(1, 1)
    assert cells.size == 1 and cells.used_max_p1() == 0
    cache = make_cache(dev, size=1, n_seq_max=1)
    run(cache, Batch.for_sequences({0: [7]}))
    assert held(cache, 0) == [(0, 7)]


@pytest.mark.parametrize(("size", "n_seq_max", "argument"), [(0, 1, "size"), (-1, 1, "size"), (4, 0, "n_seq_max")])
def test_bad_geometry_names_the_argument(size, n_seq_max, argument):
    with pytest.raises(ArgumentError) as err:
        KVCells(size, n_seq_max)
    assert err.value.argument == argument
    assert str(size if argument == "size" else n_seq_max) in str(err.value)


@pytest.mark.parametrize("unified", [True, False])
def test_freed_cells_are_reused_first_so_the_attention_span_stays_short(dev, unified):
    """Removing the first positions frees the lowest cells; the next tokens
    must go there (the search restarts at the lowest freed cell), not past
    the last used one, or every step reads a longer, padded KV span."""
    cache = make_cache(dev, size=32, unified=unified)  # n_pad 8
    run(cache, Batch.for_sequences({0: list(range(1, 9))}))
    assert cache.n_kv() == 8
    assert cache.seq_rm(0, 0, 4)
    run(cache, Batch.for_sequences({0: [20, 21]}))
    assert cache.n_kv() == 8
    assert [p for p, _ in held(cache, 0)] == [4, 5, 6, 7, 8, 9]
    # the same after a per-sequence removal of everything but the tail
    assert cache.seq_rm(0, 0, 8)
    run(cache, Batch.for_sequences({0: list(range(30, 36))}))
    assert cache.n_kv() == 8


def test_writes_and_failed_plans_say_what_was_wrong(dev):
    cache = make_cache(dev, size=4)
    balloc = BatchAllocator(cache.n_seq_max)
    balloc.init(Batch.for_sequences({0: [1, 2]}), cache)
    ctx = cache.init_batch(balloc, 8)
    assert ctx.apply()
    for copy, what in ((ctx.cpy_k, "k"), (ctx.cpy_v, "v")):
        with pytest.raises(ArgumentError) as err:
            copy(0, np.zeros((3, 4), dtype=np.float32))  # 3 rows for 2 tokens
        assert err.value.argument == what and "expected shape (2, 4), got (3, 4)" in str(err.value)
        with pytest.raises(ArgumentError) as err:
            copy(5, np.zeros((2, 4), dtype=np.float32))
        assert err.value.argument == "il" and f"layer 5 has no {what} buffer" in str(err.value)
    balloc.init(Batch.for_sequences({1: [1, 2, 3, 4, 5]}), cache)
    failed = cache.init_batch(balloc, 8)
    assert failed.status is MemoryStatus.FAILED_PREPARE
    assert "no free slot" in failed.reason and cache.name in failed.reason


def test_a_blob_cell_without_sequences_is_refused_by_field(dev):
    cache = make_cache(dev, size=4)
    run(cache, Batch.for_sequences({0: [1]}))
    flags, sections = unpack_sections(cache.state_write())
    (tag, payload), *_ = sections
    body = bytearray(bytes(payload))
    body[12:16] = (0).to_bytes(4, "little")  # n_seq_id of the first cell
    with pytest.raises(StateError) as err:
        cache.state_read(pack_sections([(tag, bytes(body))], flags))
    assert err.value.field == f"{cache.name}.n_seq_id" and "cell 0 lists 0 sequences" in str(err.value)


def test_iswa_pair_moves_both_caches_and_sums_their_memory(dev):
    mem = KVCacheISWA(
        dev, [KVLayer(0, 4, 4), KVLayer(1, 4, 4)], [1], size=32, n_seq_max=2, n_ubatch=4, n_swa=4, dtype="f32",
        unified=False, n_pad=8,
    )  # fmt: skip
    base, swa = mem.caches
    assert mem.memory_breakdown() == {dev.id: sum(b.nbytes for c in (base, swa) for b in c.buffers())}
    balloc = BatchAllocator(2)
    balloc.init(Batch.for_sequences({0: list(range(8))}), mem)
    ctx = mem.init_batch(balloc, 4)
    while True:
        assert ctx.apply()
        if not ctx.next():
            break
    mem.seq_div(0, 0, -1, 2)  # positions 0..7 -> 0..3 in both caches
    assert base.seq_pos_max(0) == 3 and swa.seq_pos_max(0) == 3
    with pytest.raises(ArgumentError) as err:
        mem.seq_cp(0, 1, 2, -1)  # streams per sequence: only whole copies
    assert err.value.argument == "p0/p1" and "must cover the whole sequence" in str(err.value)
