"""Sequence transfer between two local processes against a plain tensor send of the same bytes.

    python bench/transfer.py                       # gloo on 127.0.0.1, cpu backend
    python bench/transfer.py --tokens 8192 --rounds 7 --checksum

Two processes join a gloo group on 127.0.0.1.  Rank 0 holds a hybrid memory
(Qwen3-Next-like proportions: gated-delta-net layers of 16 heads of 128 and
attention layers of 4 K/V heads of 128 in f16) with one sequence of
``--tokens`` tokens; rank 1 holds an empty memory of the same spec.  Each
round, interleaved so both see the same machine load:

* ``plain``: ``dist.send`` of a ``uint8`` tensor as large as the sequence's
  payload, timed on the receiver from a barrier to the end of ``dist.recv``;
* ``sequence``: ``send_sequence`` / ``recv_sequence``, timed on the receiver
  from the same barrier until the state is installed in its memory: the
  sender gathers the sequence's rows (and snapshot planes) into one host
  buffer behind their metadata and sends the metadata first, then the rows;
  the receiver validates the metadata while the rows travel, then copies
  them into its memory;
* ``state format``: the same with ``rows=False``: the sender's ``state_write``
  blob, the receiver's ``state_read`` (the fallback, with the format's CRC-32
  of every section on both sides);
* ``protocol``: the messages and checks around a blob written before the
  clock starts and not read into the memory.

Prints the median GB/s of each and the ratios (target: >= 0.8), then where a
transfer's time goes besides the wire, measured in one process: the sender's
gather, the receiver's checks and install, and ``state_write`` / ``state_read``.
The rows hold garbage (nothing is computed): only bytes and bookkeeping matter.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any


def spec_and_memory(device: str, tokens: int) -> tuple[Any, Any]:
    import statecache
    from statecache.factory import make_memory
    from statecache.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec

    gdn = RecurrentLayerSpec.gdn(n_head=16, head_dim=128, d_conv=4)
    spec = ModelSpec.build(
        16,
        recurrent={i: gdn for i in range(16) if i % 4 != 3},
        attention={i: AttentionLayerSpec(4, 128) for i in range(16) if i % 4 == 3},
        kv_dtype="f16",
    )
    mem = make_memory(spec, statecache.get_device(device), 1, n_ctx=tokens, n_ubatch=512)
    return spec, mem


def fill(mem: Any, tokens: int) -> None:
    """One sequence of ``tokens`` tokens in the book (rows left as allocated)."""
    import numpy as np

    from statecache.batch import Batch, BatchAllocator

    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: np.ones(tokens, dtype=np.int64).tolist()}), mem)
    ctx = mem.init_batch(balloc, 512)
    assert not ctx.status.is_fail, ctx.status
    while True:
        assert ctx.apply()
        if not ctx.next():
            break


def worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    from statecache.distributed import recv_sequence, send_sequence
    from statecache.distributed import transfer as T

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    _, mem = spec_and_memory(args.device, args.tokens)
    if rank == 0:
        fill(mem, args.tokens)
    nbytes = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        nbytes[0] = len(mem.state_write(0))
    dist.broadcast(nbytes, 0)
    n = int(nbytes.item())
    plain = torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8)
    blob = mem.state_write(0) if rank == 0 else b""
    times: dict[str, list[float]] = {"plain": [], "protocol": [], "sequence": [], "state format": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for kind in times:
            if rank == 1:
                mem.seq_rm(0, -1, -1)  # a decode instance receives into a free sequence
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "plain":
                (dist.send if rank == 0 else dist.recv)(plain, 1 - rank)
            elif kind == "protocol":  # the transfer's messages and checks around an already written blob
                ch = T._Channel(1 - rank, None, 0, 300.0)
                if rank == 0:
                    T._offer(ch, blob, 0, args.tokens - 1, 0, args.checksum, "the blob")
                else:
                    got = T._take(ch, 1 << 40)
                    T._check_positions(got.meta, args.tokens - 1)
                    ch.answer(T.OK)
            elif rank == 0:
                send_sequence(mem, 0, 1, checksum=args.checksum, timeout=300, rows=kind == "sequence")
            else:
                recv_sequence(mem, 0, 0, timeout=300)
            if r:
                times[kind].append(time.perf_counter() - t0)
    if rank == 0:  # where the time goes besides the wire, in this process
        blob = mem.state_write(0)
        other = spec_and_memory(args.device, args.tokens)[1]
        for _ in range(args.rounds + 1):
            t0 = time.perf_counter()
            outgoing = T._Outgoing.of(mem, 0, 0)
            t1 = time.perf_counter()
            data, meta_bytes, _ = T._rows_payload(mem, 0, 0)
            t2 = time.perf_counter()
            T._check_positions(data[:meta_bytes], args.tokens - 1, data[meta_bytes:])
            t3 = time.perf_counter()
            T._read(other, data[:meta_bytes], data[meta_bytes:], 0, 0)
            t4 = time.perf_counter()
            other.seq_rm(0, -1, -1)
            t5 = time.perf_counter()
            mem.state_write(0)
            t6 = time.perf_counter()
            other.state_read(blob, 0)
            t7 = time.perf_counter()
            other.seq_rm(0, -1, -1)
            assert outgoing.nbytes + len(outgoing.meta) == len(data)
            for k, t in (("metadata", t1 - t0), ("gather", t2 - t1), ("checks", t3 - t2), ("install", t4 - t3),
                         ("state_write", t6 - t5), ("state_read", t7 - t6)):  # fmt: skip
                times.setdefault(k, []).append(t)
        local = ("metadata", "gather", "checks", "install", "state_write", "state_read")
        out.put(("serialisation", {k: v[1:] for k, v in times.items() if k in local}))
    if rank == 1:
        assert mem.seq_pos_max(0) == args.tokens - 1
        out.put(("wire", (n, times)))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the sequence (K/V cells)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="statecache device of both memories")
    ap.add_argument("--checksum", action="store_true", help="send a CRC-32 of the payload (checked on receipt)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: each kind's fastest round (less sensitive to a loaded machine's stalls)")  # fmt: skip
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=900) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    n, times = got["wire"]
    times.update(got["serialisation"])
    pick = statistics.median if args.stat == "median" else min
    med = {k: pick(v) for k, v in times.items()}
    gbps = {k: n / t / 1e9 for k, t in med.items()}
    print(f"payload {n / 2**20:.1f} MiB ({args.tokens} tokens, device {args.device}, "
          f"checksum {'on' if args.checksum else 'off'}), {args.stat} of {args.rounds} rounds")  # fmt: skip
    print(f"  plain tensor send   {gbps['plain']:7.2f} GB/s  ({med['plain'] * 1e3:8.1f} ms)")
    print(f"  sequence transfer   {gbps['sequence']:7.2f} GB/s  ({med['sequence'] * 1e3:8.1f} ms)")
    ratio = gbps["sequence"] / gbps["plain"]
    print(f"  ratio               {ratio:7.2f}   (target >= 0.8)")
    for k, what in (
        ("state format", "rows=False: state_write, state_read"),
        ("protocol", "a state-format blob written beforehand, its CRCs checked"),
    ):
        print(f"  {k:20s}{gbps[k]:7.2f} GB/s  ({med[k] * 1e3:8.1f} ms)  ratio {gbps[k] / gbps['plain']:.2f}: {what}")
    print("where a transfer's time goes besides the wire (one process):")
    for k, what in (
        ("metadata", "sender: state_write of the metadata (the rows are sent from the pool)"),
        ("gather", "metadata + every row into one buffer (what the sender no longer does)"),
        ("checks", "receiver: the header's positions and the row messages, from the metadata"),
        ("install", "receiver: state_read of metadata + staged rows (validation, then one copy)"),
        ("state_write", "sender, state format"),
        ("state_read", "receiver, state format"),
    ):
        print(f"  {k:20s}{gbps[k]:7.2f} GB/s  ({med[k] * 1e3:8.1f} ms)  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
