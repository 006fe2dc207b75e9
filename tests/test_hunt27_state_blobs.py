"""Hunt 27: per-sequence and whole-memory blobs under corruption, on every memory kind.

For a recurrent, KV, KV-iSWA, hybrid, hybrid-iSWA and hybrid-idx memory (the
``test_memory_step`` models, garbage-filled, driven by its one decode loop), a
blob of one sequence or of the whole memory is read into another memory of the
same kind where other sequences live (some sharing a cell after ``seq_cp``, one with a
pending rollback), after one bit of its metadata was flipped
and the section checksum rebuilt (so the memory's own checks, not the CRC, must
catch it):

* refused (``StateError`` / ``ArgumentError``): the destination's full
  fingerprint (whole-memory blob, every sequence's state view, version, edit
  count, and the raw bytes of every state and K/V buffer) is unchanged;
* accepted: the sequences the blob does not name are untouched, the memory's
  book stays sound (its whole blob reads back into a fresh memory) and it keeps
  decoding; an unflipped blob continues exactly as the source memory does.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from recurrent_toy import Tables
from test_memory_queries import view_key
from test_memory_step import KINDS, decode_loop, make_memory
from test_recurrent_families import _nmse

import statecache
from statecache.errors import ArgumentError, StateError
from statecache.memory import Memory, StateFlags
from statecache.recurrent import RecurrentMemory

# HUNT27_DEVICE=cpu runs it on the cpu device (opencl: the decode loop passes host outputs, which it refuses)
DEV = statecache.get_device(__import__("os").environ.get("HUNT27_DEVICE", "reference"))
TABLES = Tables()
N_SEQ = 3
HEADER = struct.Struct("<4sHHI")
SECTION = struct.Struct("<4sQI")


def _buffers(mem: Any) -> list[Any]:
    out = []
    recr = mem if isinstance(mem, RecurrentMemory) else getattr(mem, "recr", None)
    if recr is not None:
        out += [b for pools in recr.pools.values() for b in pools.values()]
    caches = list(getattr(mem, "kv_caches", []))
    if not caches and hasattr(mem, "k"):
        caches = [mem]
    if not caches and hasattr(mem, "base"):
        caches = [mem.base, mem.swa]
    if hasattr(mem, "idx"):
        caches.append(mem.idx)
    for c in caches:
        out += list(c.k.values()) + list(c.v.values())
    assert out
    return out


def fingerprint(mem: Memory) -> tuple[Any, ...]:
    views = tuple(repr(view_key(mem.seq_state(s))) for s in range(N_SEQ))
    raw = tuple(DEV.download(b).tobytes() for b in _buffers(mem))
    return mem.version, getattr(mem, "_edits", None), mem.state_write(-1), views, raw


def sections(blob: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every section payload."""
    _, _, _, count = HEADER.unpack_from(blob, 0)
    off, out = HEADER.size, []
    for _ in range(count):
        _, length, _ = SECTION.unpack_from(blob, off)
        off += SECTION.size
        out.append((off, length))
        off += length
    return out


def flip(blob: bytes, section: int, offset: int, bit: int) -> bytes:
    """One bit of a section payload flipped, its CRC rebuilt."""
    secs = sections(blob)
    start, length = secs[section % len(secs)]
    out = bytearray(blob)
    out[start + offset % length] ^= 1 << bit
    struct.pack_into("<I", out, start - 4, zlib.crc32(out[start : start + length]))
    return bytes(out)


def feed(mem: Memory, rng: np.random.Generator, lens: dict[int, int]) -> dict[tuple[int, int], np.ndarray] | None:
    return run(mem, {s: [int(t) for t in rng.integers(0, 8, n)] for s, n in lens.items() if n})


def run(mem: Memory, batch: dict[int, list[int]]) -> dict[tuple[int, int], np.ndarray] | None:
    if not batch:
        return {}
    try:
        return decode_loop(mem, TABLES, batch)
    except AssertionError:  # no room (status fail) in a full cache: not what this test is about
        return None


trace = st.lists(st.dictionaries(st.integers(0, N_SEQ - 1), st.integers(1, 5), min_size=1), min_size=1, max_size=3)


@given(
    kind=st.sampled_from(KINDS),
    seq=st.sampled_from([-1, 0, 1, 2]),
    src=trace,
    dst=trace,
    rollback=st.booleans(),
    fork=st.sampled_from([None, (0, 2), (1, 0), (2, 1)]),
    planes=st.booleans(),
    damage=st.none() | st.tuples(st.integers(0, 3), st.integers(0, 159), st.integers(0, 7)),
    seed=st.integers(0, 2**16),
)
def test_flipped_metadata_is_refused_atomically_or_read_soundly(
    kind: str,
    seq: int,
    src: list[dict[int, int]],
    dst: list[dict[int, int]],
    rollback: bool,
    fork: tuple[int, int] | None,
    planes: bool,
    damage: Any,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    a, b = make_memory(DEV, kind), make_memory(DEV, kind)
    for lens in src:
        feed(a, rng, lens)
    if rollback:
        for s in range(N_SEQ):
            if a.seq_pos_max(s) >= 2:
                a.seq_rm(s, a.seq_pos_max(s), -1)  # a pending rollback where the memory has one
                break
    if fork is not None:  # shared cells (a whole-memory blob lists several sequences per cell)
        a.seq_cp(*fork)
    for lens in dst:
        feed(b, rng, lens)
    if fork is not None and b.seq_pos_max(fork[0]) >= 0:
        b.seq_cp(*fork)
    blob = a.state_write(seq, StateFlags.WITH_PLANES if planes else StateFlags.NONE)
    if damage is not None:
        blob = flip(blob, *damage)
    before = fingerprint(b)
    # the logical state of every other sequence (sharing a cell with the destination may end)
    others = {s: b.state_write(s) for s in range(N_SEQ) if seq >= 0 and s != seq}
    try:
        b.state_read(blob, seq)
    except (StateError, ArgumentError):
        event(f"refused ({'damaged' if damage is not None else 'no room'})")
        assert fingerprint(b) == before, "a refused blob changed the memory"
        return
    event(f"accepted ({'damaged' if damage is not None else 'clean'})")
    for s, v in others.items():
        assert b.state_write(s) == v, f"restoring sequence {seq} changed sequence {s}"
    fresh = make_memory(DEV, kind)
    fresh.state_read(b.state_write(-1))  # the book is sound: its own blob reads back
    cont = {s: [int(t) for t in rng.integers(0, 8, 2)] for s in range(N_SEQ) if (seq < 0 or s == seq)}
    cont = {s: t for s, t in cont.items() if b.seq_pos_max(s) >= 0 or damage is not None}
    if planes and damage is None:  # the snapshot planes came along: a rollback is as exact as the source's
        for s in cont:
            p = a.seq_pos_max(s)
            if p >= 1 and a.seq_rm(s, p, -1):  # (a reader may offer more: no pending rollback is read back)
                assert b.seq_rm(s, p, -1), (s, kind)
    if not cont:
        return
    with np.errstate(all="ignore"):  # a flipped bit of a row is a valid blob of another value
        got = run(b, cont)
    if damage is None and got is not None:  # the source continues identically
        want = run(a, cont) or {}  # None: the source has no room left (the destination may)
        assert not want or got.keys() == want.keys()
        for k in want:
            assert _nmse(got[k], want[k]) < 1e-12, (k, kind, seq)


def _iswa(kind: str, n_swa: int, swa_full: bool = False) -> Memory:
    from test_memory_step import N_RS_SEQ, E, spec4

    from statecache.hybrid import HybridISWAMemory
    from statecache.kv_cache import KVCacheISWA, KVLayer

    attn = KVCacheISWA(
        DEV, [KVLayer(1, E, E), KVLayer(3, E, E)], [3], size=64, n_ubatch=8, n_swa=n_swa, swa_full=swa_full,
        rollback_depth=N_RS_SEQ, n_seq_max=N_SEQ, unified=True, dtype="f32", n_pad=8,
    )  # fmt: skip
    mem: Any = attn
    if kind == "hybrid-iswa":
        mem = HybridISWAMemory(attn, RecurrentMemory(spec4(), DEV, n_seq_max=N_SEQ, n_rs_seq=N_RS_SEQ))
    mem.fill_garbage(3)
    return mem


@pytest.mark.parametrize("kind", ["kv-iswa", "hybrid-iswa"])
@pytest.mark.parametrize(
    ("n_src", "n_dst", "dst_full"), [(3, 30, False), (3, 40, False), (3, 12, True), (30, 3, False)]
)
def test_a_window_cache_blob_of_a_narrower_window(kind: str, n_src: int, n_dst: int, dst_full: bool) -> None:
    """Regression: the window cache of a blob written with a narrow window holds only the
    positions that window reads; a memory with a wider window read it without a word and
    its next token's window layers attended over fewer positions than the model reads
    (silently other outputs).  Such a blob is refused now, naming the window section and
    changing nothing; where it is accepted, the continuation equals a recompute of the
    whole history in the destination memory."""
    rng = np.random.default_rng(5)
    hist = [int(t) for t in rng.integers(0, 8, 40)]
    src = _iswa(kind, n_src)
    for t in hist:  # token by token: the source's window cache gives up what its window left
        decode_loop(src, TABLES, {0: [t]})
    decode_loop(src, TABLES, {1: [1, 2]})
    dst = _iswa(kind, n_dst, dst_full)
    decode_loop(dst, TABLES, {1: [3, 4, 5], 2: [6]})
    before = fingerprint(dst)
    try:
        dst.state_read(src.state_write(0), 0)
    except StateError as exc:
        assert "kv_swa" in exc.field, exc
        assert fingerprint(dst) == before
        return
    ref = _iswa(kind, n_dst, dst_full)
    for t in hist:
        decode_loop(ref, TABLES, {0: [t]})
    got, want = decode_loop(dst, TABLES, {0: [7, 1]}), decode_loop(ref, TABLES, {0: [7, 1]})
    for k in want:
        assert _nmse(got[k], want[k]) < 1e-12, (k, kind, n_src, n_dst)


@pytest.mark.parametrize("kind", ["recurrent", "kv", "hybrid", "hybrid-iswa", "hybrid-idx"])
@pytest.mark.parametrize("seq", [-1, 1])
def test_every_bit_of_the_blob_and_section_headers(kind: str, seq: int) -> None:
    """Every single bit of the file header (magic, version, flags, count) and of every
    section header (tag, length, checksum) flipped: the blob is refused naming a field,
    changing nothing, or (a flag bit that does not change what this memory reads)
    accepted with the same result as the unflipped blob."""

    def filled(lens: dict[int, int], seed: int) -> Memory:
        mem = make_memory(DEV, kind)
        feed(mem, np.random.default_rng(seed), lens)
        return mem

    blob = filled({0: 3, 1: 4, 2: 1}, 1).state_write(seq)
    b = filled({1: 2, 2: 5}, 2)
    before = fingerprint(b)
    _, _, _, count = HEADER.unpack_from(blob, 0)
    offsets = list(range(HEADER.size))
    for start, _ in sections(blob):
        offsets += range(start - SECTION.size, start)
    assert len(offsets) == HEADER.size + count * SECTION.size
    clean = filled({1: 2, 2: 5}, 2)
    clean.state_read(blob, seq)
    for off in offsets:
        for bit in range(8):
            bad = bytearray(blob)
            bad[off] ^= 1 << bit
            try:
                b.state_read(bytes(bad), seq)
            except StateError as exc:
                assert exc.field, exc
                assert fingerprint(b) == before, (off, bit)
                continue
            assert 6 <= off < 8, f"byte {off} bit {bit} flipped was accepted"  # the flags field only
            assert b.state_write(-1) == clean.state_write(-1), (off, bit)
            b = filled({1: 2, 2: 5}, 2)
            before = fingerprint(b)
