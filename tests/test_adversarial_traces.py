"""Adversarial traces against the public memory API (hunt for spec disagreements).

Each test here caught a real bug or pins an edge the other stateful tests do not
reach; the fixes are in the core, with a comment saying why.

* A blob of another memory kind is refused, changing nothing: every reader used to
  pick the sections it knows by tag and silently drop the rest (a hybrid blob read
  into a KV cache restored the attention cells without the recurrent state).
* KV ``seq_cp`` within a stream into a sequence already holding some of the copied
  positions left it two cells at one position (its own blob was then unreadable).
* No token may sit at 2**31 - 1, the open end of every range (``seq_rm(s, -1, -1)``
  returned True and left it).
* While a copy between streams waits for the update, planning a batch and restoring
  a sequence into either stream are refused (the update overwrote their rows).
* Properties: the KV book against a model of the spec (positions, sharing, refusals),
  and every kind's book stays sound (no twin positions, parts agree, blobs read back)
  under random operations.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hybrid_toy import ATTN, E, HybridToy, make_hybrid
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import toy_spec
from test_memory_queries import DEV, EXAMPLES, KINDS, build, decode, plan, run_update, view_key
from test_memory_queries import ops as OPS

from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, BatchError, StateError
from statecache.kv_cache import KVCache, KVLayer
from statecache.memory import POS_LAST, POS_MAX, ContextError, Memory, StateFlags
from statecache.recurrent import RecurrentMemory
from statecache.state_io import pack_sections, unpack_sections

BUILDERS: dict[str, Any] = {
    "recurrent": lambda: build("recurrent"),
    "recurrent_n2": lambda: RecurrentMemory(toy_spec(), DEV, n_seq_max=2, n_rs_seq=2),
    "positions_only": lambda: build("positions_only"),
    "kv": lambda: build("kv"),
    "kv_streams": lambda: build("kv_streams"),
    "kv_small": lambda: KVCache(DEV, [KVLayer(ATTN, E, E)], size=12, n_seq_max=3, dtype="f32", n_pad=8),
    "kv_iswa": lambda: build("kv_iswa"),
    "hybrid": lambda: build("hybrid"),
    "hybrid_streams": lambda: build("hybrid_streams"),
    "hybrid_iswa": lambda: build("hybrid_iswa"),
    "hybrid_idx": lambda: build("hybrid_idx"),
    "hybrid_small": lambda: make_hybrid(DEV, "hybrid", size=12, n_rs_seq=2),
}


def fingerprint(mem: Memory) -> tuple[Any, ...]:
    """The whole-memory blob, every sequence's state view and the version."""
    views = tuple(view_key(mem.seq_state(s)) for s in range(min(3, mem.n_seq_max)))
    return mem.version, getattr(mem, "_edits", None), mem.state_write(-1), views


#: the memory kind of each builder (sizes and stream layouts aside)
KIND = {
    "recurrent": "recurrent", "recurrent_n2": "recurrent", "positions_only": "recurrent",
    "kv": "kv", "kv_streams": "kv", "kv_small": "kv", "kv_iswa": "kv_iswa",
    "hybrid": "hybrid", "hybrid_streams": "hybrid", "hybrid_small": "hybrid",
    "hybrid_iswa": "hybrid_iswa", "hybrid_idx": "hybrid_idx",
}  # fmt: skip

# every pair of memories whose kinds differ (the same kind at another size is a separate test)
PAIRS = [(a, b) for a in BUILDERS for b in BUILDERS if KIND[a] != KIND[b]]


@pytest.mark.parametrize("flags", [StateFlags.NONE, StateFlags.PARTIAL_ONLY])
@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_blob_of_another_kind_is_refused(src: str, dst: str, flags: int) -> None:
    """Regression: a reader took the sections it knows by tag and dropped the others,
    so e.g. a hybrid blob read into a KV cache was accepted without its recurrent
    state.  Now every blob of another kind is refused with StateError, changing nothing
    (a PARTIAL_ONLY hybrid blob is only a recurrent section: a recurrent memory may read it)."""
    a, b = BUILDERS[src](), BUILDERS[dst]()
    decode(a, {0: 5, 1: 3})
    decode(b, {0: 2, 1: 6})
    for seq in (-1, 1):
        blob = a.state_write(seq, flags)
        before = fingerprint(b)
        try:
            b.state_read(blob, seq, flags)
        except StateError:
            assert fingerprint(b) == before, (src, dst, seq)
            continue
        # accepted: only where the blob holds exactly what this memory writes
        tags_a = _tags(a, flags)
        assert tags_a == _tags(b, flags), (src, dst, seq, tags_a)


def _tags(mem: Memory, flags: int) -> list[bytes]:
    from statecache.state_io import unpack_sections

    return sorted(t for t, _ in unpack_sections(mem.state_write(-1, flags))[1])


SAME_KIND = [("recurrent", "recurrent_n2"), ("kv", "kv_small"), ("kv", "kv_streams"), ("hybrid", "hybrid_small")]


@pytest.mark.parametrize(("src", "dst"), SAME_KIND)
def test_blob_of_another_size(src: str, dst: str) -> None:
    """A blob of the same kind from a memory of another size: accepted exactly when it
    fits (the positions read back are the source's), else StateError / ArgumentError
    naming what is wrong, changing nothing."""
    a, b = BUILDERS[src](), BUILDERS[dst]()
    decode(a, {0: 9, 1: 3, 2: 7})
    decode(b, {0: 2, 1: 4})
    for seq in (-1, 0, 2):
        blob = a.state_write(seq)
        before = fingerprint(b)
        try:
            b.state_read(blob, seq)
        except (StateError, ArgumentError):
            assert fingerprint(b) == before, (src, dst, seq)
            continue
        for s in range(b.n_seq_max) if seq < 0 else (seq,):
            assert (b.seq_pos_min(s), b.seq_pos_max(s)) == (a.seq_pos_min(s), a.seq_pos_max(s)), (seq, s)


# -- the KV book against a model of the spec ------------------------------------------------


class KVModel:
    """The KV book of docs/memory-semantics.md#kv-sequence-ops as plain cells
    ``[stream, pos, {seqs}, ext]`` (unified: one stream; else stream ``s`` holds ``s``;
    ``ext`` the 2-D extension, the position the token was decoded at, which ``seq_add``
    and ``seq_div`` leave as it is).  Raises ArgumentError where the memory must refuse."""

    def __init__(self, n_seq: int, unified: bool) -> None:
        self.n_seq, self.unified = n_seq, unified
        self.cells: list[list[Any]] = []  # [stream, pos, set(seqs), ext]

    def of(self, s: int) -> list[list[Any]]:
        return [c for c in self.cells if s in c[2]]

    def pos_max(self, s: int) -> int:
        return max((c[1] for c in self.of(s)), default=-1)

    def _gc(self) -> None:
        self.cells = [c for c in self.cells if c[2] and c[1] >= 0]

    def decode(self, s: int, n: int) -> None:
        start = self.pos_max(s) + 1
        self.cells += [[0 if self.unified else s, start + k, {s}, start + k] for k in range(n)]

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        for c in self.cells:
            if p0 <= c[1] < p1:
                c[2].discard(s) if s >= 0 else c[2].clear()
        self._gc()

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if src == dst:
            return
        brought = [c for c in self.of(src) if p0 <= c[1] < p1]
        if not self.unified:
            if (p0, p1) != (0, POS_MAX):
                raise ArgumentError("p0/p1", "between streams: whole sequences only")
            self.cells = [c for c in self.cells if c[0] != dst]
            self.cells += [[dst, c[1], {dst}, c[3]] for c in brought]
            return
        at = {c[1] for c in brought}
        for c in self.of(dst):
            if c[1] in at and src not in c[2]:
                c[2].discard(dst)
        for c in brought:
            c[2].add(dst)
        self._gc()

    def seq_keep(self, s: int) -> None:
        for c in self.cells:
            c[2].intersection_update({s})
        self._gc()

    def move(self, s: int, p0: int, p1: int, f: Any) -> None:
        mine = self.of(s)
        inside = [c for c in mine if p0 <= c[1] < p1]
        if any(len(c[2]) > 1 for c in inside):
            raise ArgumentError("seq", "shared")
        new = [(f(c[1]) if p0 <= c[1] < p1 else c[1], c[3]) for c in mine]
        kept = [q for q in new if q[0] >= 0]
        if len(kept) != len(set(kept)):
            raise ArgumentError("delta", "twins")
        for c in inside:
            c[1] = f(c[1])
        self._gc()

    def positions(self, s: int) -> list[tuple[int, bool]]:
        return sorted((c[1], len(c[2]) > 1) for c in self.of(s))


N = 3
pos = st.integers(-2, 14)
kv_ops = st.one_of(
    st.tuples(st.just("decode"), st.integers(0, N - 1), st.integers(1, 5)),
    st.tuples(st.just("seq_rm"), st.integers(-1, N - 1), pos, pos),
    st.tuples(st.just("seq_cp"), st.integers(0, N - 1), st.integers(0, N - 1), pos, pos),
    st.tuples(st.just("seq_cp"), st.integers(0, N - 1), st.integers(0, N - 1), st.just(-1), st.just(-1)),
    st.tuples(st.just("seq_keep"), st.integers(0, N - 1)),
    st.tuples(st.just("seq_add"), st.integers(0, N - 1), pos, pos, st.integers(-6, 6)),
    st.tuples(st.just("seq_div"), st.integers(0, N - 1), pos, pos, st.integers(1, 3)),
)


def _norm(p0: int, p1: int) -> tuple[int, int]:
    return max(p0, 0), POS_MAX if p1 < 0 else p1


#: cheap (about 15 ms an example): more than the shared bound under ``ci``
KV_EXAMPLES = 100 if settings.default.max_examples <= 40 else settings.default.max_examples


@pytest.mark.parametrize("kind", ["kv", "kv_streams", "kv_iswa"])
@settings(max_examples=KV_EXAMPLES)
@given(program=st.lists(kv_ops, min_size=3, max_size=25))
def test_kv_book_follows_the_model(kind: str, program: list[tuple[Any, ...]]) -> None:
    """Every sequence holds exactly the model's positions (and sharing) after every
    operation; the model refuses exactly where the memory raises, and a refusal changes
    nothing.  Regression: ``seq_cp`` within a stream into a sequence that already held
    some of the copied positions left it two cells at one position (its own blob was
    then refused by its own state_read)."""
    mem = build(kind)
    model = KVModel(N, unified=kind != "kv_streams")
    for op in program:
        name, *args = op
        if name == "decode":
            before = fingerprint(mem)
            ok = _decode(mem, {args[0]: args[1]})
            if ok:
                model.decode(*args)
            else:
                assert fingerprint(mem) == before
            continue
        if name in ("seq_rm", "seq_cp", "seq_add", "seq_div"):
            q = list(args)
            k = 2 if name == "seq_cp" else 1
            q[k], q[k + 1] = _norm(q[k], q[k + 1])
        want_error = None
        try:
            if name == "seq_add" or name == "seq_div":
                s, p0, p1, x = q
                if p0 < p1 and (x != 0 if name == "seq_add" else x != 1):
                    model.move(s, p0, p1, (lambda p, x=x: p + x) if name == "seq_add" else (lambda p, x=x: p // x))
            elif name == "seq_keep":
                model.seq_keep(*args)
            else:
                getattr(model, name)(*q)
        except ArgumentError as exc:
            want_error = exc
        before = fingerprint(mem)
        try:
            assert getattr(mem, name)(*args) in (None, True)
        except ArgumentError:
            assert want_error is not None, op
            assert fingerprint(mem) == before, op
            continue
        assert want_error is None, (op, want_error)
        for s in range(N):
            view, *window = mem.seq_state(s).kv
            got = sorted(zip(view.positions.tolist(), view.shared.tolist(), strict=True))
            assert got == model.positions(s), (op, s)
            assert mem.seq_pos_max(s) == model.pos_max(s)
            for w in window:  # an iSWA pair's window cache: a subset of the base, ending where it ends
                held = w.positions.tolist()
                assert set(held) <= set(view.positions.tolist()), (op, s)
                assert max(held, default=-1) == model.pos_max(s), (op, s)
        # every sequence's blob reads back (no sequence holds a position twice)
        blob = mem.state_write(-1)
        fresh = build(kind)
        fresh.state_read(blob)
        assert fresh.state_write(-1) == blob


def _decode(mem: Memory, tokens: dict[int, int]) -> bool:
    """The decode loop of docs/memory-semantics.md#failed-compute: any pending update first."""
    run_update(mem)
    ctx = plan(mem, tokens, 4)
    if ctx is None:
        return False
    while True:
        assert ctx.apply()
        if not ctx.next():
            return True


@pytest.mark.parametrize("kind", ["kv", "kv_iswa"])
def test_seq_cp_into_a_sequence_holding_the_positions(kind: str) -> None:
    """Regression: ``seq_cp(0, 1, 2, 4)`` with sequence 1 already at positions 0..4 left
    it two cells at positions 2 and 3 (upstream does too); its blob was refused by its
    own ``state_read`` ("duplicate positions").  Now dst holds src's cells there."""
    mem = build(kind, n_rs_seq=0)
    decode(mem, {0: 5, 1: 5})
    mem.seq_cp(0, 1, 2, 4)
    for view in mem.seq_state(1).kv:
        assert view.positions.tolist() == [0, 1, 2, 3, 4]
        assert view.shared.tolist() == [False, False, True, True, False]
    for seq in (-1, 1):
        fresh = build(kind, n_rs_seq=0)
        fresh.state_read(mem.state_write(seq), seq)
        assert fresh.seq_pos_max(1) == 4


# -- the last int32 position ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["recurrent", "positions_only", "kv", "kv_streams", "kv_iswa", "hybrid", "hybrid_idx"])
def test_no_token_at_the_open_end_of_every_range(name: str) -> None:
    """Regression: a token could sit at position 2**31 - 1 (a batch there, or a
    ``seq_add`` onto it), which is where ``p1 = -1`` ends every range, so
    ``seq_rm(s, -1, -1)`` returned True and left it.  Now a batch there, a shift onto it
    and a blob holding it are refused (nothing changed), and a sequence at the last
    position a token may hold is removed by ``seq_rm(s, -1, -1)``."""
    mem = BUILDERS[name]()
    decode(mem, {0: 3, 1: 2})
    before = fingerprint(mem)
    balloc = BatchAllocator.for_memory(mem)
    with pytest.raises(BatchError, match="end of every range"):
        balloc.init(Batch(tokens=np.array([1, 2], np.int32), pos=np.array([POS_MAX - 1, POS_MAX]), seq_ids=[2, 2]), mem)
    with pytest.raises(ArgumentError, match="largest position"):
        mem.seq_add(0, 0, -1, POS_MAX - 2)  # position 2 would land on POS_MAX
    assert fingerprint(mem) == before
    mem.seq_add(1, 0, -1, POS_LAST - 1)  # positions 0, 1 -> POS_LAST - 1, POS_LAST
    assert mem.seq_pos_max(1) == POS_LAST
    blob = mem.state_write(1)
    # the same blob with the position one further: refused by name, nothing changed
    flags, sections = unpack_sections(blob)
    last = struct.pack("<i", POS_LAST)
    patched = [(t, bytes(p).replace(last, struct.pack("<i", POS_MAX))) for t, p in sections]
    assert any(bytes(p) != q for (_, p), (_, q) in zip(sections, patched, strict=True))
    target = BUILDERS[name]()
    decode(target, {0: 2})
    before = fingerprint(target)
    with pytest.raises(StateError, match="pos"):
        target.state_read(pack_sections(patched, flags), 1)
    assert fingerprint(target) == before
    target.state_read(blob, 1)
    assert target.seq_pos_max(1) == POS_LAST
    for m in (mem, target):
        assert m.seq_rm(1, -1, -1)
        assert m.seq_pos_max(1) == -1 and m.seq_pos_min(1) == -1


# -- every kind: what a book must always satisfy, after random operations -------------------


def _check_book(kind: str, mem: Memory, op: Any) -> None:
    """Positions held once per sequence (with their 2-D extension), the parts of a hybrid
    ending at one position, and every blob (whole and per sequence) read back into a fresh
    memory giving the same blob."""
    for s in range(N):
        view = mem.seq_state(s)
        for cells in view.kv:
            pos = cells.positions.tolist()
            if cells.cache != "kv_swa":
                assert max(pos, default=-1) == view.pos_max or view.recurrent is not None, (op, s, cells.cache)
        r = view.recurrent
        if r is not None and view.kv and r.tensors:
            ends = {max(c.positions.tolist(), default=-1) for c in view.kv}
            assert ends == {r.pos}, (op, s, ends, r.pos)
    whole = mem.state_write(-1)
    fresh = build(kind)
    fresh.state_read(whole)
    assert fresh.state_write(-1) == whole, op
    for s in range(N):
        one = mem.state_write(s)
        fresh = build(kind)
        fresh.state_read(one, s)
        assert fresh.state_write(s) == one, (op, s)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=EXAMPLES)
@given(program=st.lists(OPS, min_size=3, max_size=15))
def test_books_stay_sound_under_random_operations(kind: str, program: list[tuple[Any, ...]]) -> None:
    mem = build(kind)
    decode(mem, {0: 6, 1: 4, 2: 5})
    for op in program:
        if op[0] in ("undo", "update"):
            continue  # undo and updates have their own tests (test_memory_queries)
        if op[0] == "decode":
            _decode(mem, op[1])
            _check_book(kind, mem, op)
            continue
        if op[0] == "keep":
            op = ("seq_keep", op[1])
        if op[0] == "rollback":
            s, k = op[1], op[2]
            op = ("seq_rm", s, mem.seq_pos_max(s) + 1 - k, -1)
        try:
            getattr(mem, op[0])(*op[1:])
        except ArgumentError:
            continue
        _check_book(kind, mem, op)
        _decode(mem, {0: 2, 2: 1})
        _check_book(kind, mem, (op, "then decode"))


@pytest.mark.parametrize("kind", ["kv_streams", "hybrid_streams"])
def test_no_plan_while_a_copy_between_streams_waits(kind: str) -> None:
    """Regression: ``seq_cp`` between streams copies the rows at the next update; a batch
    planned and run before it wrote the source stream's rows, and the update then copied
    the new tokens into the destination (sequence 1 silently attended to sequence 0's
    later tokens).  Planning is now refused with ContextError (nothing changed) until
    the update ran, and the destination keeps exactly what was copied."""
    mem = build(kind, n_rs_seq=0)
    toy = HybridToy(DEV, mem) if kind.startswith("hybrid") else None
    if toy is not None:
        toy.decode({0: [1, 2, 3, 4]})
    else:
        decode(mem, {0: 4})
        for buf in mem.buffers():  # distinct rows, so that a wrong copy shows
            mem.device.write(buf, np.arange(np.prod(buf.shape), dtype=np.float32).reshape(buf.shape))
    mem.seq_cp(0, 1)
    copied = mem.state_write(1)  # what sequence 1 holds (a blob accounts for the pending copy)
    assert mem.seq_rm(0, -1, -1)
    before = fingerprint(mem)
    with pytest.raises(ContextError, match="waits for the update"):
        plan(mem, {0: 4}, 8)
    assert fingerprint(mem) == before
    run_update(mem)
    if toy is not None:
        toy.decode({0: [9, 9, 9, 9]})
    else:
        decode(mem, {0: 4})
    assert mem.state_write(1) == copied


@pytest.mark.parametrize("kind", ["kv_streams", "hybrid_streams"])
@pytest.mark.parametrize("target", [0, 1])
def test_no_restore_into_a_stream_a_copy_waits_for(kind: str, target: int) -> None:
    """Regression: a sequence restored (``state_read(blob, seq)``) into the source or the
    destination stream of a copy still waiting for the update had its rows overwritten
    by that copy (or carried into the destination) when the update ran.  The read is now
    refused with StateError, nothing changed; after the update it restores exactly."""
    donor = build(kind, n_rs_seq=0)
    if kind.startswith("hybrid"):
        HybridToy(DEV, donor).decode({target: [5, 6, 7]})
    else:
        decode(donor, {target: 3})
        for buf in donor.buffers():
            donor.device.write(buf, np.full(buf.shape, 5.0, np.float32))
    blob = donor.state_write(target)
    mem = build(kind, n_rs_seq=0)
    if kind.startswith("hybrid"):
        HybridToy(DEV, mem).decode({0: [1, 2, 3, 4]})
    else:
        decode(mem, {0: 4})
        for buf in mem.buffers():
            mem.device.write(buf, np.arange(np.prod(buf.shape), dtype=np.float32).reshape(buf.shape))
    mem.seq_cp(0, 1)
    other = mem.state_write(1 - target)
    before = fingerprint(mem)
    with pytest.raises(StateError, match="waits for the copy"):
        mem.state_read(blob, target)
    assert fingerprint(mem) == before
    run_update(mem)
    mem.state_read(blob, target)
    assert mem.state_write(target) == blob
    assert mem.state_write(1 - target) == other


# -- a window cache that gave up positions cannot be rolled back past them -------------------


@pytest.mark.parametrize("kind", ["kv_iswa", "hybrid_iswa"])
def test_rollback_past_what_the_window_cache_gave_up_is_refused(kind: str) -> None:
    """Regression (found by the stress profile): decoding far past the window evicts the
    window cache's old positions; ``seq_rm(0, 1, -1)`` on a pure iSWA cache then left the
    base cache ending sequence 0 at position 0 and the window cache holding nothing, so
    ``seq_pos_max`` (the window cache's, as upstream) said -1 and the next token's window
    layers read nothing.  Now it is refused (nothing changed), ``rollback_reach`` names the
    lowest accepted position, and a removal there leaves both caches ending together."""
    mem = build(kind)
    decode(mem, {0: 6, 1: 4, 2: 5})
    for _ in range(5):  # every sequence decodes: the window cache must evict old positions
        assert _decode(mem, {0: 2, 1: 1, 2: 1})
    reach = mem.rollback_reach(0)
    assert reach.pos_max == 15 and reach.floor > 1
    gone = min(min(c.positions.tolist()) for c in mem.seq_state(0).kv)
    assert gone == 0  # the base cache holds it all; the window cache does not:
    assert min(mem.seq_state(0).kv[-1].positions.tolist()) > 1 or kind != "kv_iswa"
    before = fingerprint(mem)
    assert not mem.can_seq_rm(0, 1, -1)
    assert mem.seq_rm(0, 1, -1) is False
    assert fingerprint(mem) == before
    assert mem.can_seq_rm(0, reach.floor, -1) and not mem.can_seq_rm(0, reach.floor - 1, -1)
    assert mem.seq_rm(0, reach.floor, -1)
    view = mem.seq_state(0)
    assert view.pos_max == reach.floor - 1
    assert {max(c.positions.tolist()) for c in view.kv} == {reach.floor - 1}
    assert mem.seq_rm(0, 0, -1) and mem.seq_pos_max(0) == -1  # dropping it all is always accepted
