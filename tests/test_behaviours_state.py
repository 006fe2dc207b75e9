"""A state blob with bytes after its last section, or after the last field of
a section, is refused with StateError and changes nothing (issue 20, item 8),
for every memory kind."""

from __future__ import annotations

import struct

import pytest
from hybrid_toy import HybridToy, make_hybrid
from recurrent_toy import Toy
from test_behaviours_kv import run

import statecache
from statecache.batch import Batch
from statecache.errors import StateError
from statecache.kv_cache import KVCache, KVLayer
from statecache.state_io import pack_sections, unpack_sections


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def filled(dev, kind):  # type: ignore[no-untyped-def]
    """A memory of ``kind`` holding two sequences."""
    if kind == "recurrent":
        toy = Toy(dev, 2)
        toy.decode({0: [1, 2, 3], 1: [4, 5]})
        return toy.mem
    if kind == "kv":
        cache = KVCache(dev, [KVLayer(0, 4, 4)], size=8, n_seq_max=2, dtype="f32", n_pad=8)
        run(cache, Batch.for_sequences({0: [1, 2, 3], 1: [4, 5]}))
        return cache
    toy = HybridToy(dev, make_hybrid(dev, kind))
    toy.decode({0: [1, 2, 3], 1: [4, 5]})
    return toy.mem


def trailing_after_last_section(blob: bytes) -> bytes:
    return blob + b"\0"


def trailing_inside_last_section(blob: bytes) -> bytes:
    flags, sections = unpack_sections(blob)
    *head, (tag, payload) = sections
    return pack_sections([*((t, bytes(p)) for t, p in head), (tag, bytes(payload) + struct.pack("<I", 0))], flags)


KINDS = ["recurrent", "kv", "hybrid", "iswa", "idx"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", [trailing_after_last_section, trailing_inside_last_section])
@pytest.mark.parametrize("seq", [-1, 1])
def test_bytes_past_the_end_are_refused_and_change_nothing(dev, kind, damage, seq):
    mem = filled(dev, kind)
    blob = mem.state_write(seq)
    other = filled(dev, kind)
    other.seq_rm(1, -1, -1)
    before = other.state_write()
    with pytest.raises(StateError) as err:
        other.state_read(damage(blob), seq)
    assert "trailing" in str(err.value)
    assert other.state_write() == before
    other.state_read(blob, seq)  # the undamaged blob restores
    assert other.seq_pos_max(1) == mem.seq_pos_max(1)
