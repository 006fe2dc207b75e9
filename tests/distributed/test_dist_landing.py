"""Rows received straight into the receiver's free rows (a gloo group, host memory).

After the metadata is validated, the receiving memory names the row writes its commit
will make into rows that nothing references (``state_io.rows_landing``); the transfer
receives those messages there instead of into a staging buffer, and the commit then
only updates the book.  Here the bytes travel between two threads over an in-process
stand-in for ``isend``/``irecv`` (``dist_fake``), taking the host branches a gloo
group takes, so the landing really writes the pools.

* a transfer that lands installs exactly what the state format installs;
* one that fails after some rows landed (the sender stops mid-way) leaves every
  observable of the receiver as it was (its state_write bytes, books, positions),
  makes plans and undos made before it stale instead of letting them trust the
  overwritten free rows, and the next transfer and the next batch work.
"""

from __future__ import annotations

import numpy as np
import pytest
from dist_fake import FakeDist, run_sender
from dist_memories import SPECS, build, garbage_memory, place

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import statecache  # noqa: E402
from statecache.batch import Batch, BatchAllocator  # noqa: E402
from statecache.distributed import TransferError, book_fields, recv_sequence, send_sequence, transfer  # noqa: E402
from statecache.hostmem import row_run  # noqa: E402
from statecache.memory import ContextError  # noqa: E402

KINDS = sorted(SPECS)


@pytest.fixture
def fake(monkeypatch):
    """The transfer's torch.distributed routed through threads, on the host (as gloo)."""
    fake = FakeDist("gloo")
    monkeypatch.setattr(transfer, "torch_dist", lambda: (torch, fake))
    monkeypatch.setattr(transfer, "group_device", lambda group=None: torch.device("cpu"))
    return fake


@pytest.fixture
def landings(monkeypatch):
    """Every write a transfer landed (none is staged early, whatever EARLY_BYTES says)."""
    monkeypatch.setattr(transfer, "EARLY_BYTES", 0)
    seen = []
    land = transfer._Arrival.land

    def spy(self, writes):
        got = land(self, writes)
        seen.extend(got)
        return got

    monkeypatch.setattr(transfer._Arrival, "land", spy)
    return seen


def observable(mem):
    """What a failed transfer must leave as it was: every sequence's state (the blob), the
    books, and every sequence's positions."""
    books = {f.name: f.values.copy() for f in book_fields(mem)}
    pos = [(mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in range(mem.n_seq_max)]
    return mem.state_write(), books, pos


def same(a, b):
    return (
        a[0] == b[0]
        and a[2] == b[2]
        and a[1].keys() == b[1].keys()
        and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    )


def receiver(kind, seed=44):
    """A memory holding sequences 1 and 2 (rows of garbage) whose sequence 0 is free."""
    mem = garbage_memory(kind, statecache.get_device("cpu"), seed=seed)
    mem.seq_rm(0, -1, -1)
    return mem


@pytest.mark.parametrize("kind", KINDS)
def test_landed_rows_install_what_the_state_format_installs(fake, landings, kind):
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=41)
    dst, ref = receiver(kind), receiver(kind)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 1, 1, timeout=10))
    recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert not errors and not thread.is_alive()
    assert landings, "no row landed: the test would not show anything"
    ref.state_read(src.state_write(1), 0)
    assert dst.state_write() == ref.state_write()  # every sequence: the others untouched too


def _stop_after(src, seq, n_rows_sent, eager=False):
    """A sender that sends the header, the metadata and the first ``n_rows_sent`` row
    messages of sequence ``seq``, then stops (dies, stalls); ``eager``: without waiting
    for the go (protocol 6's gloo path)."""

    def run():
        ch = transfer._Channel(1, None, 0, 10)
        out = transfer._Outgoing.of(src, seq, 0)
        header = transfer._header(
            len(out.meta) + out.nbytes, src.seq_pos_min(seq), src.seq_pos_max(seq), 0, None, len(out.meta), out.sizes,
            eager=eager,
        )  # fmt: skip
        ch.send(transfer._header_message(ch, header, out.meta), "header and metadata")
        if not eager:
            assert ch.hear("go") == transfer.OK
        for k in range(n_rows_sent):
            ch.send(torch.from_numpy(out.part(k).copy()), "rows")

    return run


@pytest.mark.parametrize("eager", [False, True], ids=["on_go", "eager"])
@pytest.mark.parametrize("held", [False, True], ids=["free_destination", "destination_holds_a_state"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_after_rows_landed_changes_nothing_observable(fake, landings, kind, held, eager):
    """``held``: the destination sequence holds a state, whose rows are no landing space;
    ``eager``: the sender posted its rows right behind the header."""
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=41)
    dst, twin = receiver(kind), receiver(kind)
    if held:
        for mem in (dst, twin):
            place(mem, {0: [7, 7, 7]})
    n_messages = len(transfer._Outgoing.of(src, 1, 0).sizes)
    assert n_messages >= 3
    sent = n_messages - 1  # all but the last: most landed rows hold the sender's bytes now
    before = observable(dst)
    thread, errors = run_sender(fake, _stop_after(src, 1, sent, eager))
    with pytest.raises(TransferError, match="receiving the rows"):
        recv_sequence(dst, 0, 0, timeout=0.3)
    thread.join(10)
    assert not errors
    assert same(observable(dst), before)
    # the rows did land in free rows (what would make the failure observable if the book moved)
    out = transfer._Outgoing.of(src, 1, 0)
    parts = [out.part(k) for k in range(sent)]
    arrived = [w for w in landings if any(np.array_equal(row_run(w.device, w.buf, w.idx).view(np.uint8).ravel(), p)
                                          for p in parts)]  # fmt: skip
    assert arrived or held, "no landed row holds the sender's bytes: nothing landed before the failure"
    # the next transfer into the same free rows works, and so does the next batch
    thread, errors = run_sender(fake, lambda: send_sequence(src, 1, 1, timeout=10, tag=1))
    recv_sequence(dst, 0, 0, timeout=10, tag=1)
    thread.join(10)
    assert not errors
    twin.state_read(src.state_write(1), 0)
    assert dst.state_write() == twin.state_write()
    for mem in (dst, twin):  # the next batch (book only: nothing is computed here)
        place(mem, {0: [1, 2], 2: [3]})
    a, b = observable(dst), observable(twin)
    assert same((b"", a[1], a[2]), (b"", b[1], b[2]))
    assert all(dst.state_write(s) == twin.state_write(s) for s in range(dst.n_seq_max))


def _apply(mem, tokens):
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens), mem)
    ctx = mem.init_batch(balloc, 8)
    assert not ctx.status.is_fail and ctx.apply()
    return ctx


@pytest.mark.parametrize("kind", ["hybrid_iswa", "recurrent"])
def test_a_failure_after_rows_landed_makes_an_earlier_undo_stale(fake, landings, kind):
    """An applied, unconfirmed batch may be undone into cells the landing overwrote; after
    a failure that landed rows its undo is refused (as after any state change), never
    done over other bytes."""
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=41)
    dst = build(SPECS[kind], statecache.get_device("cpu"))
    place(dst, {1: [1, 2, 3]})
    ctx = _apply(dst, {1: [4]})
    thread, _ = run_sender(fake, _stop_after(src, 1, 2))
    with pytest.raises(TransferError):
        recv_sequence(dst, 0, 0, timeout=0.3)
    thread.join(10)
    assert landings
    before = observable(dst)
    with pytest.raises(ContextError, match="changed after"):
        ctx.undo(drop=True)
    assert same(observable(dst), before)


@pytest.mark.parametrize("max_bytes", [None, 64], ids=["refused_state", "refused_header"])
def test_a_refused_eager_payload_changes_nothing_and_says_whether_the_tag_is_spent(fake, max_bytes):
    """Protocol 6: the rows follow the header without a go.  A receiver that refuses the
    state (another layout) drains them, so the next transfer on the same tag installs
    the sequence; one that refuses the header (over ``max_bytes``) cannot know what to
    drain, and both sides say the tag is spent.  Either way the receiver is unchanged."""
    src = garbage_memory("recurrent", statecache.get_device("cpu"), seed=41)
    dst, ref = receiver("hybrid_iswa"), receiver("hybrid_iswa")
    before = observable(dst)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 1, 1, timeout=10))
    expected = ("StateError", "another kind") if max_bytes is None else ("TransferError", "fresh one")
    with pytest.raises(Exception, match=expected[1]) as caught:
        recv_sequence(dst, 0, 0, timeout=10, max_bytes=max_bytes)
    assert type(caught.value).__name__ == expected[0]
    thread.join(10)
    assert same(observable(dst), before)
    assert len(errors) == 1 and "refused" in str(errors[0])
    assert ("fresh tag" in str(errors[0])) == (max_bytes is not None)
    if max_bytes is None:  # drained: the same tag carries the next transfer
        good = garbage_memory("hybrid_iswa", statecache.get_device("cpu"), seed=41)
        thread, errors = run_sender(fake, lambda: send_sequence(good, 1, 1, timeout=10))
        recv_sequence(dst, 0, 0, timeout=10)
        thread.join(10)
        assert not errors
        ref.state_read(good.state_write(1), 0)
        assert dst.state_write() == ref.state_write()
