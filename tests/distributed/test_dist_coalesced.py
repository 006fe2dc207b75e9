"""The coalesced message of protocol 5: a sequence's small row blocks in one message.

The sender copies the row blocks of at most ``SMALL_BLOCK`` bytes (up to
``SMALL_TOTAL`` of them, in order) back to back into one message, posted first on
the receiver's *go*; the receiver receives it while its memory validates the
metadata and copies each block to where the commit would write it (straight into
free rows, or into the staging buffer).  Here the bytes travel between two threads
over an in-process stand-in for ``isend``/``irecv`` (``dist_fake``), on the host
branches a gloo group takes:

* a coalesced transfer, alone or mixed with blocks in their own messages, installs
  exactly what the state format installs, and the receiver decodes bit for bit like
  the state format's reader (every memory kind, with and without a CRC-32);
* a corrupt coalesced message (bytes changed, longer than announced, never sent,
  announced with other sizes than the metadata's) is refused with every observable
  of the receiver as it was;
* the header's fields for it are checked before anything is allocated.
"""

from __future__ import annotations

import numpy as np
import pytest
from dist_fake import FakeDist, run_sender
from dist_memories import SPECS, garbage_memory, place
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import statecache  # noqa: E402
from statecache.distributed import TransferError, book_fields, recv_sequence, send_sequence  # noqa: E402
from statecache.distributed import transfer as T  # noqa: E402
from statecache.errors import StateError  # noqa: E402

KINDS = sorted(SPECS)


@pytest.fixture
def fake(monkeypatch):
    """The transfer's torch.distributed routed through threads, on the host (as gloo)."""
    fake = FakeDist("gloo")
    monkeypatch.setattr(T, "torch_dist", lambda: (torch, fake))
    monkeypatch.setattr(T, "group_device", lambda group=None: torch.device("cpu"))
    return fake


def observable(mem):
    books = {f.name: f.values.copy() for f in book_fields(mem)}
    pos = [(mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in range(mem.n_seq_max)]
    return mem.state_write(), books, pos


def same(a, b):
    books = a[1].keys() == b[1].keys() and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    return a[0] == b[0] and a[2] == b[2] and books


def receiver(kind, held, seed=44):
    """A memory holding sequences 1 and 2 whose sequence 0 is free, or (``held``) holds a state."""
    mem = garbage_memory(kind, statecache.get_device("cpu"), seed=seed)
    mem.seq_rm(0, -1, -1)
    if held:
        place(mem, {0: [7, 7, 7]})
    return mem


def _picked(src, seq=1):
    return T._coalesced(T._Outgoing.of(src, seq, 0).sizes, T.SMALL_BLOCK, T.SMALL_TOTAL)


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("mix", ["all_coalesced", "mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_coalesced_transfer_installs_what_the_state_format_installs(fake, monkeypatch, kind, mix, checksum):
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=41)
    sizes = T._Outgoing.of(src, 1, 0).sizes
    if mix == "mixed":  # about half the rows coalesced, the others in messages of their own, interleaved
        monkeypatch.setattr(T, "SMALL_TOTAL", sum(sizes) // 2)
    picked = _picked(src)
    assert any(picked) and (all(picked) if mix == "all_coalesced" else not all(picked))
    dst, ref = receiver(kind, False), receiver(kind, False)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 1, 1, timeout=10, checksum=checksum))
    recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert not errors and not thread.is_alive()
    ref.state_read(src.state_write(1), 0)
    assert dst.state_write() == ref.state_write()  # every sequence: the others untouched too


def _sender(src, seq, *, corrupt=None, small_bytes=None, stop_after_go=False, extra=0):
    """A protocol-5 sender of sequence ``seq`` by hand: ``corrupt`` flips a byte of the
    coalesced message after its CRC was taken; ``small_bytes`` announces another size
    for it (the header hash made to match); ``stop_after_go`` sends nothing after the
    go; ``extra`` sends that many bytes more than announced."""

    def run():
        ch = T._Channel(1, None, 0, 10)
        out = T._Outgoing.of(src, seq, 0)
        picked = T._coalesced(out.sizes, T.SMALL_BLOCK, T.SMALL_TOTAL)
        parts = [out.part(k).copy() for k in range(len(out.sizes))]
        crc = T.zlib.crc32(out.meta)
        for p in parts:
            crc = T.zlib.crc32(p.data, crc)
        small = np.concatenate([p for p, keep in zip(parts, picked, strict=True) if keep])
        if corrupt is not None:
            small[corrupt % small.size] ^= 0xFF
        nbytes = len(out.meta) + out.nbytes
        words = T._header(nbytes, src.seq_pos_min(seq), src.seq_pos_max(seq), 0, crc, len(out.meta), out.sizes,
                          (T.SMALL_BLOCK, T.SMALL_TOTAL))  # fmt: skip
        if small_bytes is not None:
            words[12] = small_bytes
            words[-1] = T._header_hash(words)
            small = np.resize(small, small_bytes)
        if extra:
            small = np.concatenate([small, np.zeros(extra, np.uint8)])
        ch.send(T._header_message(ch, words, out.meta), "header and metadata")
        assert ch.hear("go") == T.OK
        if stop_after_go:
            return
        ch.send(torch.from_numpy(small), "small rows")
        for p, keep in zip(parts, picked, strict=True):
            if not keep:
                ch.send(torch.from_numpy(p), "rows")
        ch.hear("verdict")

    return run


@pytest.mark.parametrize("held", [False, True], ids=["free_destination", "destination_holds_a_state"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_coalesced_message_is_refused_and_changes_nothing(fake, kind, held):
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=41)
    assert all(_picked(src))
    dst = receiver(kind, held)
    before = observable(dst)
    thread, errors = run_sender(fake, _sender(src, 1, corrupt=5))
    with pytest.raises(TransferError, match="CRC-32"):
        recv_sequence(dst, 0, 0, timeout=2)
    thread.join(10)
    assert not errors
    assert same(observable(dst), before)
    # the pair is still in step: the next transfer on the same tag works
    twin = receiver(kind, held)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 1, 1, timeout=10))
    recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert not errors
    twin.state_read(src.state_write(1), 0)
    assert dst.state_write() == twin.state_write()


@pytest.mark.parametrize(
    ("how", "error", "words"),
    [
        ({"extra": 3}, TransferError, "receiving the small rows"),  # longer than its receive
        ({"stop_after_go": True}, TransferError, "receiving the small rows"),  # never sent
        ({"small_bytes": 8}, StateError, "coalesced"),  # announced with sizes the metadata does not have
    ],
    ids=["longer", "never_sent", "other_size"],
)
@pytest.mark.parametrize("held", [False, True], ids=["free_destination", "destination_holds_a_state"])
def test_a_coalesced_message_that_is_not_the_announced_one_changes_nothing(fake, held, how, error, words):
    src = garbage_memory("hybrid_iswa", statecache.get_device("cpu"), seed=41)
    dst = receiver("hybrid_iswa", held)
    before = observable(dst)
    thread, _ = run_sender(fake, _sender(src, 1, **how))  # its own failure (no verdict) is not the point
    with pytest.raises(error, match=words):
        recv_sequence(dst, 0, 0, timeout=0.5)
    thread.join(10)
    assert same(observable(dst), before)


def test_the_header_refuses_impossible_coalesced_fields():
    good = T._header(1000, 0, 7, 0, None, 100, [300, 600], (1024, 4096))
    assert T._check_header(good) is None and good[12] == 900 and good[8] == 0

    def forged(index, value, base=good):
        words = list(base)
        words[index] = value
        words[-1] = T._header_hash(words)
        return T._check_header(words)

    assert "coalesced" in forged(12, 901)  # more than the rows
    assert "coalesced" in forged(12, 5000)  # more than its own total limit
    assert "coalesced" in forged(10, -1)  # a negative block limit
    big = T._header(1 << 40, 0, 7, 0, None, 100, [1 << 39], (1 << 40, 1 << 40))
    assert "coalesced" in T._check_header(big)  # over what any receiver posts a receive for
    blob = T._header(1000, 0, 7, 0, None)  # a whole blob: no rows apart, so nothing to coalesce
    blob[10:13] = [16, 16, 10]
    assert "without rows apart" in forged(12, 10, blob)


@given(
    st.lists(st.integers(0, 1 << 12), max_size=40),
    st.integers(0, 1 << 12),
    st.integers(0, 1 << 14),
)
def test_coalesced_picks_small_blocks_in_order_within_the_total(sizes, block, total):
    picked = T._coalesced(sizes, block, total)
    assert len(picked) == len(sizes)
    run = 0
    for n, p in zip(sizes, picked, strict=True):
        if p:
            assert 0 < n <= block
            run += n
        else:  # left out only when empty, too large, or when it would pass the total
            assert n == 0 or n > block or run + n > total
    assert run <= total
