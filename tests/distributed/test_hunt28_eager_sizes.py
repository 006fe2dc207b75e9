"""Protocol 6 (eager rows over gloo) between memories of different sizes (hunt28).

The sender posts every row message behind the header.  A receiver whose memory is
smaller (no room for the sequence) or larger than the sender's, or whose checksum check
fails, must either install exactly what ``state_read`` of the same blob installs, or
refuse with the memory unchanged and the refused rows drained, so that the next transfer
on the same tag installs its sequence.  In-process (dist_fake): no processes spawned."""

from __future__ import annotations

import pytest
from dist_fake import FakeDist, run_sender
from dist_memories import SPECS, garbage_memory, place
from test_dist_landing import observable, same

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import statecache  # noqa: E402
from statecache.distributed import recv_sequence, send_sequence, transfer  # noqa: E402
from statecache.errors import StateError  # noqa: E402
from statecache.factory import make_memory  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    fake = FakeDist("gloo")
    monkeypatch.setattr(transfer, "torch_dist", lambda: (torch, fake))
    monkeypatch.setattr(transfer, "group_device", lambda group=None: torch.device("cpu"))
    return fake


def _receiver(kind: str, n_ctx: int, n_seq_max: int, full: bool = False):
    dev = statecache.get_device("cpu")
    spec = SPECS[kind]
    if kind == "recurrent":
        mem = make_memory(spec, dev, n_seq_max)
    else:
        mem = make_memory(spec, dev, n_seq_max, n_ctx=n_ctx, n_ubatch=8, n_pad=8)
    if full and kind != "recurrent":  # fewer cells left than the six the sequence needs
        cells = mem.kv_caches[0].size if hasattr(mem, "kv_caches") else 0
        place(mem, {1: list(range(1, cells // 2 + 1)), 2: list(range(1, cells - cells // 2 - 2))})
    else:
        place(mem, {1: [3, 4, 5], 2: [6, 7]})  # sequence 0 free
    return mem


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize(("n_ctx", "full"), [(8, False), (16, True), (40, False)])
@pytest.mark.parametrize("n_seq_max", [3, 5])
def test_an_eager_transfer_between_memories_of_other_sizes_installs_or_changes_nothing(
    fake, kind, n_ctx, full, n_seq_max
):
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=51)  # sequence 0: six positions
    dst, ref = _receiver(kind, n_ctx, n_seq_max, full), _receiver(kind, n_ctx, n_seq_max, full)
    before = observable(dst)
    try:
        ref.state_read(src.state_write(0), 0)
        fits = True
    except StateError:
        fits = False
    assert fits == (kind == "recurrent" or not full)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 0, 1, timeout=10, checksum=True))
    if fits:
        recv_sequence(dst, 0, 0, timeout=10)
        thread.join(10)
        assert not errors, errors
        assert dst.state_write() == ref.state_write()
        return
    with pytest.raises(StateError):
        recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert same(observable(dst), before)
    assert len(errors) == 1 and "refused" in str(errors[0]) and "fresh tag" not in str(errors[0])
    # drained: the same tag carries the next transfer (a sequence of two positions, room made for it)
    for mem in (dst, ref):
        mem.seq_rm(1, -1, -1)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 2, 1, timeout=10))
    recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert not errors, errors
    ref.state_read(src.state_write(2), 0)
    assert dst.state_write() == ref.state_write()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_corrupt_eager_row_fails_the_checksum_changes_nothing_and_the_tag_carries_on(fake, kind, monkeypatch):
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=52)
    dst, ref = _receiver(kind, 40, 3), _receiver(kind, 40, 3)
    before = observable(dst)
    sent = transfer._Channel.send

    def damaging(self, tensor, what):  # flip a byte of every row message on its way
        if "rows" in what and tensor.numel():
            tensor = tensor.clone()
            tensor.view(torch.uint8).view(-1)[0] ^= 0x5A
        return sent(self, tensor, what)

    monkeypatch.setattr(transfer._Channel, "send", damaging)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 0, 1, timeout=10, checksum=True))
    with pytest.raises(transfer.TransferError, match="CRC"):
        recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert same(observable(dst), before)
    assert len(errors) == 1
    monkeypatch.setattr(transfer._Channel, "send", sent)
    thread, errors = run_sender(fake, lambda: send_sequence(src, 0, 1, timeout=10))
    recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert not errors, errors
    ref.state_read(src.state_write(0), 0)
    assert dst.state_write() == ref.state_write()
