"""Questions before actions (issue 15, item 8): every query of the
:class:`~statecache.memory.Memory` contract answers exactly what its action
would do, on every memory kind.

The property: over random sequences of decodes, updates and sequence
operations (good and bad arguments), ``*_refusal`` says refused iff the action
raises or returns False, and a refused action changes nothing (the whole-memory
blob, every sequence's state view, the version and the edit count of a hybrid).
``rollback_reach`` agrees with ``seq_rm(seq, p, -1)`` at every position.  The
``ci`` profile runs a bounded number of examples; ``HYPOTHESIS_PROFILE=stress``
runs many more (tests/conftest.py).

Undo: after a batch whose steps wrote without kept rows, ``undo_loses`` names
exactly what ``undo(drop=True)`` drops, and ``undo()`` refuses (nothing changed)
exactly when that is not empty.

Regressions: a context shift on a forked sequence changes nothing when refused
(upstream, and the two-call form, apply the removal first); ``state_write``
with a pending update (K shift, copy between streams) writes what it writes
after the update was run by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hybrid_toy import ATTN, E, make_hybrid
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import Tables, run_layers, toy_spec

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, BatchError, StateError
from statecache.hybrid import HybridMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.memory import POS_MAX, ContextError, Memory, MemoryStatus, SeqState
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec

N_SEQ = 3
DEV = statecache.get_device("reference")
KINDS = [
    "recurrent",
    "positions_only",
    "kv",
    "kv_streams",
    "kv_iswa",
    "hybrid",
    "hybrid_streams",
    "hybrid_iswa",
    "hybrid_idx",
    "hybrid_idx_order",
]


def toy_k_shift(cache: KVCache, il: int, buf: Any, rows: np.ndarray, shifts: np.ndarray) -> None:
    """A stand-in for RoPE: any function of (row, shift) applied in place to the rows given
    (what a runtime's hook does), so that a rotated copy and a rotated cache can be compared."""
    if not rows.size:
        return
    dev = cache.device
    k = dev.download(buf)[rows].astype(np.float64)
    k = k * np.cos(shifts[:, None] * 0.1) + np.sin(shifts[:, None] * 0.1)
    dev.set_rows(buf, dev.indices(rows), dev.upload(k.astype(np.float32)))


def build(kind: str, n_rs_seq: int = 2) -> Memory:
    common: dict[str, Any] = dict(n_seq_max=N_SEQ, dtype="f32", n_pad=8)
    mem: Any
    if kind == "recurrent":
        mem = RecurrentMemory(toy_spec(), DEV, n_seq_max=N_SEQ, n_rs_seq=n_rs_seq)
    elif kind == "positions_only":
        mem = RecurrentMemory(MemorySpec.build(2, {}), DEV, n_seq_max=N_SEQ)
    elif kind in ("kv", "kv_streams"):
        mem = KVCache(DEV, [KVLayer(ATTN, E, E)], size=48, unified=kind == "kv", k_shift=toy_k_shift, **common)
    elif kind == "kv_iswa":
        mem = KVCacheISWA(
            DEV, [KVLayer(ATTN, E, E), KVLayer(2, E, E)], [ATTN], size=48, n_ubatch=8, n_swa=3,
            k_shift=toy_k_shift, **common,
        )  # fmt: skip
    else:
        base = kind.split("_")[1] if "_" in kind else "hybrid"
        geom: dict[str, Any] = dict(n_seq_max=N_SEQ, size=48, n_rs_seq=n_rs_seq, seed=3)
        if base == "streams":
            base, geom["unified"] = "hybrid", False
        if base == "iswa":
            geom["n_swa"] = 3
        mem = make_hybrid(DEV, base, by_order=kind.endswith("order"), **geom)
        for cache in mem.kv_caches:
            cache.k_shift = toy_k_shift
    if hasattr(mem, "fill_garbage"):
        mem.fill_garbage(7)
    return mem


def plan(mem: Memory, tokens: dict[int, int], n_ubatch: int) -> Any:
    """The context of a batch of ``tokens[s]`` tokens per sequence, or None where the
    batch is empty or refused (a refusal is what the queries are tested against elsewhere)."""
    balloc = BatchAllocator.for_memory(mem)
    batch = {s: [1 + (s + k) % 5 for k in range(n)] for s, n in tokens.items() if n}
    if not batch:
        return None
    try:
        balloc.init(Batch.for_sequences(batch, output_all=True), mem)
    except BatchError:
        return None
    ctx = mem.init_batch(balloc, n_ubatch)
    return None if ctx.status.is_fail else ctx


def plan_as_runtime(mem: Memory, tokens: dict[int, int], n_ubatch: int) -> Any:
    """:func:`plan` as a runtime plans: a copy between streams waits for the update,
    and planning is refused (changing nothing) until it runs, so run it first, as the
    refusal says (upstream's decode always runs the update first)."""
    try:
        return plan(mem, tokens, n_ubatch)
    except ContextError:
        run_update(mem)
        return plan(mem, tokens, n_ubatch)


def decode(mem: Memory, tokens: dict[int, int], n_ubatch: int = 8) -> None:
    """Plan and apply a batch (book only: the queries are about the book; rows keep
    whatever they hold, which the fingerprints compare anyway)."""
    ctx = plan_as_runtime(mem, tokens, n_ubatch)
    if ctx is None:
        return
    while True:
        assert ctx.apply()
        if not ctx.next():
            break


TABLES = Tables()


def decode_then_undo(mem: Memory, tokens: dict[int, int]) -> None:
    """A batch whose compute "fails" after every ubatch ran (the recurrent steps write,
    without kept rows): ``undo_loses`` names exactly the sequences ``undo(drop=True)``
    drops, and a plain ``undo()`` is refused, changing nothing, exactly when it is lossy."""
    if not isinstance(mem, RecurrentMemory | HybridMemory):
        return  # a KV cache alone offers no undo
    ctx: Any = plan_as_runtime(mem, tokens, 4)
    if ctx is None:
        return
    recr = mem if isinstance(mem, RecurrentMemory) else mem.recr
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        if recr.has_layers:
            step = ctx.step() if isinstance(mem, RecurrentMemory) else ctx.recr.step()
            run_layers(DEV, step, TABLES, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
        if not ctx.next():
            break
    before = fingerprint(mem)
    lost = ctx.undo_loses()
    if lost:
        with pytest.raises(ContextError, match="cannot be exact"):
            ctx.undo()
        assert fingerprint(mem) == before
    assert ctx.undo(drop=True) == lost


def run_update(mem: Memory) -> None:
    ctx = mem.init_update()
    if ctx.status is MemoryStatus.SUCCESS:
        assert ctx.apply()


def view_key(v: SeqState) -> tuple[Any, ...]:
    """A comparable form of a state view (its arrays as lists, without the readers)."""
    kv = tuple(
        (c.cache, c.stream, c.positions.tolist(), c.cells.tolist(), c.shared.tolist(), c.pending_shift.tolist())
        for c in v.kv
    )
    r = v.recurrent
    rec = None if r is None else (r.cell, r.pos, r.row, r.planes, r.pending_rollback, r.sharers)
    return v.seq, v.pos_min, v.pos_max, rec, kv, v.rollback


def fingerprint(mem: Memory) -> tuple[Any, ...]:
    """Everything a refused action must leave as it was."""
    try:
        blob: Any = mem.state_write(-1)
    except StateError as exc:
        blob = repr(exc)
    views = tuple(view_key(mem.seq_state(s)) for s in range(N_SEQ))
    return mem.version, getattr(mem, "_edits", None), blob, views


def fingerprint_without_blob(mem: Memory) -> tuple[Any, ...]:
    return mem.version, tuple(view_key(mem.seq_state(s)) for s in range(N_SEQ))


def check_reach(mem: Memory) -> None:
    """rollback_reach agrees with the seq_rm query at every position (the query with the
    action is what the operations below prove)."""
    for s in range(N_SEQ):
        reach = mem.rollback_reach(s)
        assert reach.pos_max == mem.seq_pos_max(s)
        P = reach.pos_max  # positions may sit near int32's end after a large shift: look around both ends
        if P == POS_MAX:
            continue  # seq_rm(s, p, -1) never reaches the last int32 position (RollbackReach says so)
        for p in sorted(set(range(-1, min(P, 12) + 3)) | set(range(max(P - 12, -1), P + 3))):
            assert reach.accepts(p) == mem.can_seq_rm(s, p, -1), (s, p, reach)


def act(mem: Memory, op: tuple[Any, ...]) -> tuple[str | None, bool]:
    """(the query's answer, whether the action was refused) for one operation."""
    name, *args = op
    query = getattr(mem, f"{name}_refusal")(*args)
    try:
        ok = getattr(mem, name)(*args)
    except ArgumentError:
        return query, True
    return query, ok is False


pos = st.integers(-2, 30)
seqs = st.integers(-1, N_SEQ)  # -1 (only seq_rm takes it) and one past the end are bad ids on purpose
ops = st.one_of(
    st.tuples(st.just("seq_rm"), seqs, pos, pos),
    st.tuples(st.just("seq_cp"), seqs, seqs, pos, pos),
    st.tuples(st.just("seq_cp"), seqs, seqs, st.just(-1), st.just(-1)),
    st.tuples(st.just("seq_add"), seqs, pos, pos, st.one_of(st.integers(-8, 8), st.just(POS_MAX - 3))),
    st.tuples(st.just("seq_div"), seqs, pos, pos, st.integers(0, 3)),
    st.tuples(st.just("context_shift"), seqs, pos, pos),
    st.tuples(st.just("rollback"), st.integers(0, N_SEQ - 1), st.integers(1, 4)),
    st.tuples(st.just("decode"), st.dictionaries(st.integers(0, N_SEQ - 1), st.integers(1, 6), max_size=N_SEQ)),
    st.tuples(st.just("undo"), st.dictionaries(st.integers(0, N_SEQ - 1), st.integers(1, 6), max_size=N_SEQ)),
    st.tuples(st.just("keep"), st.integers(0, N_SEQ - 1)),
    st.tuples(st.just("update")),
)


#: bounded under the ``ci`` profile (about 2 s per kind on a quiet core); other profiles set their own
EXAMPLES = 15 if settings.default.max_examples <= 40 else settings.default.max_examples


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=EXAMPLES)
@given(program=st.lists(ops, min_size=4, max_size=20))
def test_queries_agree_with_actions(kind: str, program: list[tuple[Any, ...]]) -> None:
    mem = build(kind)
    decode(mem, {0: 6, 1: 4, 2: 5})
    refused = 0
    for op in program:
        if op[0] == "decode":
            decode(mem, op[1])
        elif op[0] == "undo":
            decode_then_undo(mem, op[1])
        elif op[0] == "update":
            run_update(mem)
        elif op[0] == "keep":
            mem.seq_keep(op[1])
        else:
            if op[0] == "rollback":  # a speculative rollback: what rollback_reach promises
                s, k = op[1], op[2]
                op = ("seq_rm", s, mem.seq_pos_max(s) + 1 - k, -1)
                assert mem.rollback_reach(s).accepts(op[2]) == mem.can_seq_rm(*op[1:])
            before = fingerprint(mem)
            query, was_refused = act(mem, op)
            assert (query is not None) == was_refused, (op, query)
            if was_refused:
                refused += 1
                assert fingerprint(mem) == before, op
        check_reach(mem)


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_iswa", "hybrid_idx", "kv", "kv_iswa", "recurrent"])
def test_context_shift_of_a_forked_sequence_changes_nothing(kind: str) -> None:
    """Regression (issue 15 item 8): on a forked sequence the move half is refused (its
    cells or state are shared), and the shift as one operation changes nothing, where
    seq_rm + seq_add applied the removal before the refusal."""
    mem = build(kind)
    decode(mem, {0: 8})
    mem.seq_cp(0, 1)  # fork: sequence 1 shares sequence 0's cells / state
    before = fingerprint(mem)
    reason = mem.context_shift_refusal(0, 2, 4)
    assert reason is not None and ("shares" in reason or "shared" in reason), reason
    with pytest.raises(ArgumentError):
        mem.context_shift(0, 2, 4)
    assert fingerprint(mem) == before
    # the two-call form: the removal goes through (attention cells dropped), then the move is refused
    assert mem.seq_rm(0, 2, 4)
    with pytest.raises(ArgumentError):
        mem.seq_add(0, 4, -1, -2)
    if kind != "recurrent":
        assert fingerprint(mem) != before


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_iswa", "hybrid_idx", "kv", "recurrent"])
def test_context_shift_equals_the_two_calls(kind: str) -> None:
    """Accepted, the one operation leaves exactly what seq_rm + seq_add leave."""
    one, two = build(kind, n_rs_seq=0), build(kind, n_rs_seq=0)
    for mem in (one, two):
        decode(mem, {0: 8, 1: 5})
    assert one.can_context_shift(0, 2, 5)
    one.context_shift(0, 2, 5)
    assert two.seq_rm(0, 2, 5)
    two.seq_add(0, 5, -1, -3)
    assert fingerprint(one)[2:] == fingerprint(two)[2:]
    assert one.seq_pos_max(0) == 4  # 8 tokens, 3 shifted out


PENDING_KINDS = ["kv", "kv_streams", "kv_iswa", "hybrid", "hybrid_streams", "hybrid_iswa", "hybrid_idx"]


def _with_pending_update(kind: str) -> Memory:
    mem = build(kind, n_rs_seq=0)
    decode(mem, {0: 7, 2: 6})
    run_update(mem)
    mem.seq_cp(0, 1)  # between streams: the row copy waits for the update
    mem.context_shift(2, 1, 3)  # a K shift waits for the update
    return mem


@pytest.mark.parametrize("kind", PENDING_KINDS)
def test_state_write_accounts_for_a_pending_update(kind: str) -> None:
    """state_write needs no manual update first: with a K shift and a copy between streams
    pending, every blob equals the blob written after running the update by hand, and
    writing changes nothing (the update is still pending, the version unmoved)."""
    mem, ref = _with_pending_update(kind), _with_pending_update(kind)
    assert mem.init_update().status is MemoryStatus.SUCCESS
    version = mem.version
    pending = {s: mem.state_write(s) for s in (-1, 0, 1, 2)}
    assert mem.version == version and mem.init_update().status is MemoryStatus.SUCCESS
    run_update(ref)
    for s, blob in pending.items():
        assert blob == ref.state_write(s), s


def test_state_write_without_a_hook_refuses_only_shifted_rows() -> None:
    """A cache whose runtime rotates K itself (no hook) cannot write rows a shift waits for:
    a StateError naming the cache, nothing changed; sequences without a pending shift write."""
    mem = build("kv", n_rs_seq=0)
    assert isinstance(mem, KVCache)
    mem.k_shift = None
    decode(mem, {0: 6, 1: 6})
    mem.context_shift(1, 0, 2)
    before = fingerprint_without_blob(mem)
    with pytest.raises(StateError, match="k_shift"):
        mem.state_write(1)
    assert fingerprint_without_blob(mem) == before
    assert mem.state_write(0)  # sequence 0's rows wait for nothing


@pytest.mark.parametrize("kind", KINDS)
def test_seq_state_names_the_rows(kind: str) -> None:
    """The state view names exactly the rows the state lives in: its readers return the
    same bytes as the sequence's blob (recurrent rows; K/V rows per layer), and refuse
    once the memory changed."""
    mem = build(kind, n_rs_seq=2)
    decode(mem, {0: 5, 1: 3})
    decode(mem, {0: 1})  # a decode: planes behind the state
    view = mem.seq_state(0)
    assert view.pos_max == 5 and view.seq == 0
    r = view.recurrent
    if r is not None and r.tensors:
        assert r.pos == 5 and len(r.planes) == 1  # one token since the last write: one plane back
        blob = mem.state_write(0)
        for layer, name in r.tensors:
            rows = r.read(layer, name)
            assert rows.shape[0] == 1 + len(r.planes)
            assert rows[0].tobytes() in blob  # the logical state is what state_write writes
    for cells in view.kv:
        assert cells.positions.tolist() == list(range(cells.positions[0], 6))
        assert not cells.positions.flags.writeable
        blob = mem.state_write(0)
        for il in cells.layers:
            for v in (False,) if cells.key_only else (False, True):
                rows = cells.read(il, v)
                assert rows.shape[0] == cells.rows.size
                assert all(row.tobytes() in blob for row in rows)  # each is a row the blob holds
    decode(mem, {1: 1})
    for cells in view.kv:
        if not cells.layers:
            continue
        with pytest.raises(ContextError):
            cells.read(cells.layers[0])
    if r is not None and r.tensors:
        with pytest.raises(ContextError):
            r.read(*r.tensors[0])


def test_allocator_sized_by_the_memory() -> None:
    mem = build("hybrid")
    balloc = mem.batch_allocator()
    assert balloc.n_seq_max == mem.n_seq_max == BatchAllocator.for_memory(mem).n_seq_max
    balloc.init(Batch.for_sequences({N_SEQ - 1: [1, 2]}), mem)
    assert mem.init_batch(balloc, 8).status is MemoryStatus.SUCCESS


def test_iswa_reach_after_a_head_removal_matches_seq_rm() -> None:
    """Found by the stress profile of the property above: after ``seq_rm(0, 0, 1)`` the
    sequence starts at 1, so ``seq_rm(0, 1, -1)`` takes all of it (accepted) while a
    rollback to 2 needs position 1, which the window cache gave up.  The reach said
    floor 0 (every p accepted); it must accept p <= 1 and refuse 2."""
    mem = build("kv_iswa")
    decode(mem, {0: 6, 1: 4, 2: 5})
    assert mem.seq_rm(0, 0, 1)
    decode(mem, {0: 3})
    decode(mem, {0: 1, 1: 1, 2: 6})
    check_reach(mem)
    reach = mem.rollback_reach(0)
    for p in range(-1, reach.pos_max + 2):
        assert reach.accepts(p) == mem.can_seq_rm(0, p, -1), (p, reach)
    assert reach.accepts(1) and not reach.accepts(2)
