"""The NCCL code path without a GPU, in one process.

Two things decide what a transfer does over NCCL, and both are checked here:

* the device: :func:`wire.group_device` puts every tensor of an NCCL group on
  ``cuda:<current device>`` (torch's own functions are monkeypatched to report an
  NCCL group and a current device);
* the branch taken for a device that is not host memory (:func:`wire.on_host`
  false): the sender uploads each message only once its rows are gathered, the
  receiver copies the rows to a host staging array once they all arrived, and the
  CRC is taken over that copy.  Here those branches run on CPU tensors standing in
  for CUDA ones (``on_host`` monkeypatched to false), between two threads over an
  in-process stand-in for ``torch.distributed``'s ``isend``/``irecv``, so the bytes
  really travel and the receiver's state is compared with the sender's.

What this cannot show: NCCL itself, CUDA streams, device memory.
``backends/cuda/gpu_check.sh`` runs a real NCCL loopback where a GPU exists.
"""

from __future__ import annotations

import pytest
from dist_fake import FakeDist, run_sender
from dist_memories import SPECS, build, garbage_memory, place

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import statecache  # noqa: E402
from statecache.distributed import TransferError, recv_sequence, send_sequence, transfer, wire  # noqa: E402


def test_an_nccl_group_puts_its_tensors_on_the_current_cuda_device(monkeypatch):
    import torch.distributed as dist

    cuda3, cpu = torch.device("cuda", 3), torch.device("cpu")
    for backend, device in (("nccl", cuda3), ("NCCL", cuda3), ("gloo", cpu), ("cpu:gloo,cuda:nccl", cuda3)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        assert wire.group_device(None) == device, backend
        assert wire.on_host(wire.group_device(None)) == (device.type == "cpu")


def _pair(monkeypatch, fake):
    """Route the transfer's torch.distributed through ``fake``, on a stand-in device
    that takes the branches of a device that is not host memory."""
    monkeypatch.setattr(transfer, "torch_dist", lambda: (torch, fake))
    monkeypatch.setattr(transfer, "group_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(transfer, "on_host", lambda device: False)
    monkeypatch.setattr(wire, "on_host", lambda device: False)


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("kind", ["hybrid_iswa", "recurrent"])
def test_the_device_branch_moves_the_sequence_intact(monkeypatch, kind, checksum):
    fake = FakeDist()
    _pair(monkeypatch, fake)
    dev = statecache.get_device("cpu")
    src = garbage_memory(kind, dev, seed=41)
    dst = build(SPECS[kind], dev, n_seq_max=4)
    place(dst, {2: [3, 3]})
    thread, errors = run_sender(fake, lambda: send_sequence(src, 1, 1, timeout=10, checksum=checksum))
    got = recv_sequence(dst, 0, 0, timeout=10)
    thread.join(10)
    assert not errors and not thread.is_alive()
    assert got.pos_max == src.seq_pos_max(1)
    ref = build(SPECS[kind], dev, n_seq_max=4)
    ref.state_read(src.state_write(1), 0)
    assert dst.state_write(0) == ref.state_write(0)
    assert len(fake.devices) > 6  # header, answers, metadata and several row messages


def test_the_device_branch_with_rows_that_never_come_changes_nothing(monkeypatch):
    fake = FakeDist()
    _pair(monkeypatch, fake)
    dev = statecache.get_device("cpu")
    src = garbage_memory("hybrid_iswa", dev, seed=43)
    dst = garbage_memory("hybrid_iswa", dev, seed=44)
    before = dst.state_write()

    def sender():  # the header and the metadata, then nothing
        ch = transfer._Channel(1, None, 0, 10)
        data, meta_bytes, sizes = transfer._rows_payload(src, 1, 0)
        header = transfer._header(len(data), 0, src.seq_pos_max(1), 0, None, meta_bytes, sizes)
        ch.send(ch.ints(header), "header")
        assert ch.hear("go") == transfer.OK
        ch.send(torch.from_numpy(data[:meta_bytes].copy()), "metadata")

    thread, errors = run_sender(fake, sender)
    with pytest.raises(TransferError, match="receiving the rows"):
        recv_sequence(dst, 0, 0, timeout=0.5)
    thread.join(10)
    assert not errors
    assert dst.state_write() == before
