"""Adversarial traces against the public memory API (hunt for spec disagreements).

Each test here caught a real bug or pins an edge the other stateful tests do not
reach; the fixes are in the core, with a comment saying why.

* A blob of another memory kind is refused, changing nothing: every reader used to
  pick the sections it knows by tag and silently drop the rest (a hybrid blob read
  into a KV cache restored the attention cells without the recurrent state).
"""

from __future__ import annotations

from typing import Any

import pytest
from hybrid_toy import ATTN, E, make_hybrid
from recurrent_toy import toy_spec
from test_memory_queries import DEV, build, decode, view_key

from statecache.errors import ArgumentError, StateError
from statecache.kv_cache import KVCache, KVLayer
from statecache.memory import Memory, StateFlags
from statecache.recurrent import RecurrentMemory

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
