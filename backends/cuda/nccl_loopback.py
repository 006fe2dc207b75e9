"""A sequence transfer over NCCL on this machine's GPUs (run by gpu_check.sh).

    python backends/cuda/nccl_loopback.py [--device cuda] [--timeout 120]

With two or more GPUs: two processes (rank r on ``cuda:r``) join an NCCL group on
127.0.0.1.  Rank 0 holds a hybrid memory (GDN + Mamba-2 + attention, rollback
planes) of the statecache device ``--device`` with garbage rows and a sequence
of several writes; it sends the sequence with ``send_sequence`` three ways (rows
apart, rows apart with a CRC-32, the state-format blob); rank 1 receives each into
a memory of another size.  Every tensor on the wire is a CUDA tensor (the group is
NCCL).  Checked on rank 0, after gathering rank 1's blobs over the same NCCL group:
rank 1 holds exactly rank 0's sequence, and after rolling both back into the last
write (the planes travelled with the rows), still exactly the same state.

With one GPU, NCCL refuses two ranks on one device, so the transfer cannot run;
the script then runs the NCCL collectives statecache uses (``check_books``,
``gather_memory`` / ``scatter_memory``) in a group of one and says that the
point-to-point transfer was not run.  Exit status: 0 when every check that ran
passed, 1 otherwise (no GPU, no NCCL, a mismatch, a timeout).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import sys
import traceback
from typing import Any


def _memory(device: str, n_seq_max: int, seed: int) -> tuple[Any, Any]:
    import statecache
    from statecache.factory import make_memory
    from statecache.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec

    spec = ModelSpec.build(
        3,
        recurrent={0: RecurrentLayerSpec.gdn(n_head=4, head_dim=16, d_conv=4),
                   2: RecurrentLayerSpec.mamba2(d_inner=64, d_state=16, d_conv=4, n_group=2, head_dim=16)},
        attention={1: AttentionLayerSpec(4, 32)},
        kv_dtype="f16",
    )  # fmt: skip
    mem = make_memory(spec, statecache.get_device(device), n_seq_max, 3, n_ctx=64, n_ubatch=16)
    mem.fill_garbage(seed)
    return spec, mem


def _place(mem: Any, tokens_by_seq: dict[int, list[int]]) -> None:
    from statecache.batch import Batch, BatchAllocator

    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens_by_seq), mem)
    ctx = mem.init_batch(balloc, 16)
    assert not ctx.status.is_fail, ctx.status
    while True:
        assert ctx.apply()
        if not ctx.next():
            break


def _transfer(rank: int, port: int, device: str, backend: str, out: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        from statecache.distributed import recv_sequence, send_sequence
        from statecache.distributed.wire import gather_bytes, group_device

        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        want = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        assert group_device(None) == want, f"tensors would go to {group_device(None)}, not {want}"
        if rank == 0:
            _, mem = _memory(device, 2, seed=1)
            _place(mem, {0: list(range(5)), 1: [9]})
            _place(mem, {0: list(range(5, 9))})  # the last write: three planes to roll back into
            for how in ({}, {"checksum": True}, {"rows": False}):
                send_sequence(mem, 0, 1, timeout=60, **how)
        else:
            received = []
            for _ in range(3):
                _, mem = _memory(device, 3, seed=2)
                _place(mem, {2: [7, 7]})
                recv_sequence(mem, 0, 0, timeout=60)
                received.append(mem)
        memories = [mem] if rank == 0 else received
        blobs = [m.state_write(0) for m in memories]
        rolled_ok = [m.seq_rm(0, 7, -1) for m in memories]  # into the last write; the format holds no planes
        assert rolled_ok == ([True] if rank == 0 else [True, True, False]), rolled_ok
        rolled = [m.state_write(0) for m in memories]
        got = gather_bytes(b"".join(len(b).to_bytes(8, "little") + b for b in blobs + rolled), 0)
        if rank == 0:
            assert got is not None
            mine = blobs[0], rolled[0]
            theirs, raw, off = [], got[1], 0
            while off < len(raw):
                n = int.from_bytes(raw[off : off + 8], "little")
                theirs.append(raw[off + 8 : off + 8 + n])
                off += 8 + n
            after, rolled_back = theirs[:3], theirs[3:]
            for k, what in enumerate(("rows", "rows + CRC-32", "state format")):
                assert after[k] == mine[0], f"{what}: rank 1's sequence differs from rank 0's"
                if what != "state format":  # the format holds no planes: no rollback after it
                    assert rolled_back[k] == mine[1], f"{what}: rank 1 rolled back to another state"
            out.put((rank, f"ok: 3 transfers over {backend}, received states and rollbacks equal the sender's"))
        else:
            out.put((rank, "ok"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out.put((rank, "FAILED\n" + traceback.format_exc()))


def _collectives(port: int, device: str, backend: str = "nccl") -> str:
    import torch
    import torch.distributed as dist

    from statecache.distributed import BookCheck, check_books, gather_memory, scatter_memory

    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    spec, mem = _memory(device, 2, seed=3)
    _place(mem, {0: [1, 2, 3], 1: [4]})
    check_books(mem, None)
    assert isinstance(BookCheck(mem, None), BookCheck)
    blob = gather_memory(mem, spec, None)
    _, other = _memory(device, 2, seed=4)
    scatter_memory(other, spec, blob, None)
    assert other.state_write() == mem.state_write(), "scatter_memory over NCCL restored another state"
    dist.destroy_process_group()
    return f"ok: check_books, gather_memory, scatter_memory over {backend} (a group of one)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="statecache device of the memories (cuda, cpu, ...)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--group",
        choices=("nccl", "gloo"),
        default="nccl",
        help="gloo: the same two-process checks with host tensors (the script's own test, no GPU)",
    )
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.group == "gloo":
        n_gpu = 2  # nothing of a GPU is used
    elif not n_gpu or not dist.is_available() or not dist.is_nccl_available():
        print(
            f"nccl_loopback: FAILED: {n_gpu} GPUs, NCCL available: {dist.is_available() and dist.is_nccl_available()}"
        )
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if n_gpu == 1:
        print("nccl_loopback: one GPU: NCCL refuses two ranks on one device, so the point-to-point")
        print("  transfer (send_sequence / recv_sequence over NCCL) was NOT run; the collectives were:")
        print("  " + _collectives(port, args.device))
        return 0
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_transfer, args=(r, port, args.device, args.group, out)) for r in range(2)]
    for p in procs:
        p.start()
    status = 0
    try:
        for _ in procs:
            rank, message = out.get(timeout=args.timeout)
            print(f"nccl_loopback rank {rank}: {message}")
            status |= not message.startswith("ok")
    except Exception as exc:  # queue.Empty: a rank hung
        print(f"nccl_loopback: FAILED: no answer within {args.timeout:g} s ({type(exc).__name__})")
        status = 1
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
