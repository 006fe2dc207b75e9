"""What each process of the distributed tests runs (see dist_launch.run); results go back
to the test, which asserts.  Kept importable by name so spawned processes find them."""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np
from dist_tp_model import decode, make_memory, shard_weights

import statecache
from statecache.conformance import model as M
from statecache.distributed import (
    BookCheck,
    BookDivergenceError,
    TransferError,
    book_fields,
    check_books,
    gather_memory,
    recv_sequence,
    scatter_memory,
    send_sequence,
)

SEED = 7
PROMPTS = {0: [3, 1, 4, 1, 5, 9, 2], 1: [6, 5, 3, 5]}
STEPS = [{0: [t], 1: [u]} for t, u in ((2, 7), (8, 1), (2, 8), (1, 8), (2, 8))]
MORE = [{0: [4], 1: [5]}, {0: [9], 1: [0]}]


def allreduce(a: np.ndarray, group: Any = None) -> np.ndarray:
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).copy())
    dist.all_reduce(t, group=group)
    return t.numpy()


def books(mem: Any) -> dict[str, np.ndarray]:
    return {f.name: f.values.copy() for f in book_fields(mem)}


def tensor_parallel(rank: int, world: int, device: str) -> dict[str, Any]:
    """Prefill and decode the tiny hybrid model with heads split over the ranks, the books
    checked after every step; rank 0 also runs the unsharded model on the same batches."""
    import torch.distributed as dist

    dev = statecache.get_device(device)
    spec = M.model_spec("f32")
    w = M.Weights.random(SEED, M.HYBRID_LAYERS)
    mem = make_memory(dev, spec.shard(rank, world))
    sw = shard_weights(w, rank, world, allreduce)
    check = BookCheck(mem)  # debug mode: the books are compared after every apply
    tp = [decode(mem, sw, PROMPTS, world, check)]
    for step in STEPS:
        tp.append(decode(mem, sw, step, world, check))
    out: dict[str, Any] = {"tp": tp, "books": books(mem), "checks": check.steps}
    blob = gather_memory(mem, spec)  # the unsharded checkpoint, on rank 0
    # scatter it into fresh shard memories: they continue exactly like the originals
    fresh = make_memory(dev, spec.shard(rank, world))
    scatter_memory(fresh, spec, blob)
    out["after_scatter"] = [(decode(fresh, sw, s, world), decode(mem, sw, s, world)) for s in MORE]
    if rank == 0:
        single = make_memory(dev, spec)
        out["single"] = [decode(single, w, PROMPTS)] + [decode(single, w, s) for s in STEPS]
        restored = make_memory(dev, spec)
        restored.state_read(blob)
        out["restored_vs_single"] = [(decode(restored, w, s), decode(single, w, s)) for s in MORE]
    # a rank that skips an edit the others make: the next check names it
    if rank == world - 1:
        mem.seq_rm(1, -1, -1)
    try:
        check_books(mem)
    except BookDivergenceError as exc:
        out["divergence"] = (exc.field, exc.ranks, exc.index, exc.seqs, str(exc))
    dist.barrier()
    return out


# -- sequence transfer: rank 0 prefills, rank 1 decodes ------------------------------------

PROMPT = [5, 3, 9, 1, 1, 7, 2, 6]
DECODE = [{0: [4]}, {0: [8]}, {0: [1]}]
BIG = 64 << 20


def _snapshot(mem: Any) -> tuple[dict[str, np.ndarray], bytes]:
    """Everything a receiver must keep when a transfer fails: its book and its state."""
    return books(mem), mem.state_write()


def _same(a: tuple[dict[str, np.ndarray], bytes], b: tuple[dict[str, np.ndarray], bytes]) -> bool:
    return a[0].keys() == b[0].keys() and all(np.array_equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1]


def _forge(
    header: list[int],
    dst: int,
    tag: int,
    payload: bytes | None = None,
    answers: int = 1,
    group: Any = None,
    inline: bytes = b"",
) -> list[int]:
    """Send a hand-made header (with ``inline`` metadata behind it in its message, and a
    payload after the answer); return the receiver's answer codes."""
    import torch
    import torch.distributed as dist

    first = np.asarray(header, dtype="<i8").tobytes() + inline
    dist.send(torch.frombuffer(bytearray(first), dtype=torch.uint8), dst, group=group, tag=tag)
    codes = []
    for k in range(answers):
        ans = torch.zeros(2, dtype=torch.int64)
        dist.recv(ans, dst, group=group, tag=tag)
        codes.append(int(ans[1]))
        if k == 0 and payload is not None and codes[0] == 0:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group=group, tag=tag)
    return codes


def _expect_failure(mem: Any, fn: Any) -> tuple[str, str, bool]:
    """Run a receive that must fail: (error type, message, memory unchanged)."""
    before = _snapshot(mem)
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), _same(before, _snapshot(mem))
    return "no error", "", _same(before, _snapshot(mem))


ROLLBACK = 3


def _rollback_and_decode(mem: Any, seq: int, w: Any) -> list[Any]:
    """Per depth ROLLBACK + 1 .. 1: whether ``seq_rm`` rolled the sequence back that far,
    and the logits of decoding on from there.  Replaying the removed tokens afterwards
    leaves planes for every smaller depth, hence the descending order."""
    out = []
    end = len(PROMPT)
    for depth in range(ROLLBACK + 1, 0, -1):
        ok = mem.seq_rm(seq, end - depth, -1)
        logits = decode(mem, w, {seq: DECODE[0][0]})[seq] if ok else None
        out.append((ok, logits))
        if ok:  # back to the prompt's end: roll back the decoded token, replay the removed ones
            assert mem.seq_rm(seq, end - depth, -1)
            decode(mem, w, {seq: PROMPT[end - depth :]})
    return out


def transfer(rank: int, world: int) -> Any:
    import torch.distributed as dist

    from statecache.distributed import transfer as T

    side = dist.new_group([0, 1])
    rows_side = dist.new_group([0, 1])  # for the metadata whose rows never come (a timeout closes its pair)
    w = M.Weights.random(SEED, M.HYBRID_LAYERS)
    spec = M.model_spec("f32")
    cpu, ref = statecache.get_device("cpu"), statecache.get_device("reference")
    out: dict[str, Any] = {}
    if rank == 0:
        mem = make_memory(cpu, spec, n_seq_max=3)
        decode(mem, w, {2: PROMPT})
        sent = send_sequence(mem, 2, 1, tag=1)  # to a cpu memory of another size, into sequence 0
        send_sequence(mem, 2, 1, tag=2, rows=False)  # the state format, to a reference-backend memory
        # the tiny model's row blocks all travel in the coalesced message; again with none coalesced
        out["coalesced"] = all(T._coalesced(T._Outgoing.of(mem, 2, 0).sizes, T.SMALL_BLOCK, T.SMALL_TOTAL))
        keep, T.SMALL_BLOCK = T.SMALL_BLOCK, 0
        try:
            send_sequence(mem, 2, 1, tag=14)
        finally:
            T.SMALL_BLOCK = keep
        # with rollback planes: the receiver rolls back like the sender
        deep = make_memory(cpu, spec, n_seq_max=1, n_rs_seq=ROLLBACK)
        decode(deep, w, {0: PROMPT})
        send_sequence(deep, 0, 1, tag=12)
        out["rolled"] = _rollback_and_decode(deep, 0, w)
        out["sent"] = (sent.nbytes, sent.pos_min, sent.pos_max)
        out["blob"] = mem.state_write(2)
        out["logits"] = [decode(mem, w, {2: s[0]})[2] for s in DECODE]
        # corrupt headers: wrong magic; a field changed after hashing; too large to hold
        good = T._header(1000, 0, 7, 0, None)
        out["bad_magic"] = _forge([0x1234, *good[1:]], 1, tag=3)
        out["bad_hash"] = _forge([*good[:2], 999, *good[3:]], 1, tag=4)
        out["too_large"] = _forge(T._header(1 << 40, 0, 7, 0, None), 1, tag=5)
        # a payload that does not match its CRC-32
        blob = bytearray(out["blob"])
        blob[-3] ^= 0xFF
        out["bad_crc"] = _forge(T._header(len(blob), 0, 10, 0, zlib.crc32(bytes(out["blob"]))), 1, 6, bytes(blob), 2)
        # positions in the header that the payload does not have
        out["bad_pos"] = _forge(T._header(len(out["blob"]), 0, 99, 0, None), 1, 7, out["blob"], 2)
        # a layout the receiver refuses (f16 states), through the public API
        other = make_memory(cpu, M.model_spec("f16"), n_seq_max=1)
        decode(other, w, {0: PROMPT[:3]})
        try:
            send_sequence(other, 0, 1, tag=8)
        except TransferError as exc:
            out["refused"] = str(exc)
        # its rows followed the header at once (protocol 6) and the receiver drained them:
        # the same tag carries the next transfer
        out["blob_again"] = mem.state_write(2)
        send_sequence(mem, 2, 1, tag=8)
        # refused on the header (over the receiver's max_bytes): nothing told the receiver
        # what to drain, so the rows stay posted on that tag, and both sides say so
        try:
            send_sequence(mem, 2, 1, tag=15)
        except TransferError as exc:
            out["too_large_eager"] = str(exc)
        # the sender cannot write the sequence (unknown id): the receiver is told at once
        try:
            send_sequence(mem, 9, 1, tag=9)
        except Exception as exc:
            out["abort"] = type(exc).__name__
        # valid metadata whose rows never come: the receiver validates it (and saves the
        # state it holds) while waiting for them, then times out with nothing written
        data, meta_bytes, sizes = T._rows_payload(mem, 2, 0)
        header = T._header(len(data), mem.seq_pos_min(2), mem.seq_pos_max(2), 0, None, meta_bytes, sizes)
        out["lost_rows"] = _forge(header, 1, tag=13, group=rows_side, inline=data[:meta_bytes].tobytes())
        # a sender that stalls past the receiver's timeout, in a group of its own (a gloo
        # timeout closes the connection it happened on)
        _forge(T._header(len(out["blob"]), 0, 7, 0, None), 1, tag=11, group=side)
        time.sleep(3)
        # finally: die while the payload is on its way (a large one, so that it is mid-way)
        import torch
        import torch.distributed as dist

        _forge(T._header(BIG, 0, 7, 0, None), 1, tag=10)
        dist.isend(torch.ones(BIG, dtype=torch.uint8), 1, tag=10)
        return ("exit", 17, out)
    mem = make_memory(cpu, spec, n_seq_max=2, n_ctx=64)
    decode(mem, w, {1: [2, 2, 2]})  # another sequence, which no transfer may touch
    other_before = mem.state_write(1)
    got = recv_sequence(mem, 0, 0, tag=1)
    out["got"] = (got.nbytes, got.pos_min, got.pos_max)
    mem_ref = make_memory(ref, spec, n_seq_max=1, n_ctx=32)
    recv_sequence(mem_ref, 0, 0, tag=2)
    out["ref_blob"] = mem_ref.state_write(0)
    per_block = make_memory(cpu, spec, n_seq_max=1, n_ctx=32)
    recv_sequence(per_block, 0, 0, tag=14)
    deep = make_memory(cpu, spec, n_seq_max=2, n_ctx=64, n_rs_seq=ROLLBACK)
    decode(deep, w, {0: [2, 2, 2]})  # the receiving sequence is another one, with a state of its own
    recv_sequence(deep, 1, 0, tag=12)
    out["rolled"] = _rollback_and_decode(deep, 1, w)
    out["logits"] = [decode(mem, w, s)[0] for s in DECODE]
    out["ref_logits"] = [decode(mem_ref, w, s)[0] for s in DECODE]
    out["per_block_logits"] = [decode(per_block, w, s)[0] for s in DECODE]
    out["other_untouched"] = mem.state_write(1) == other_before
    for name, tag in (("bad_magic", 3), ("bad_hash", 4), ("too_large", 5), ("bad_crc", 6), ("bad_pos", 7)):
        out[name] = _expect_failure(mem, lambda tag=tag: recv_sequence(mem, 0, 0, tag=tag))
    out["refused"] = _expect_failure(mem, lambda: recv_sequence(mem, 0, 0, tag=8))
    again = make_memory(cpu, spec, n_seq_max=1, n_ctx=32)
    recv_sequence(again, 0, 0, tag=8)
    out["blob_again"] = again.state_write(0)
    out["too_large_eager"] = _expect_failure(mem, lambda: recv_sequence(mem, 0, 0, tag=15, max_bytes=1000))
    out["abort"] = _expect_failure(mem, lambda: recv_sequence(mem, 0, 0, tag=9))
    assert mem.seq_pos_max(0) >= 0  # the destination holds a state a write would change
    out["lost_rows"] = _expect_failure(mem, lambda: recv_sequence(mem, 0, 0, rows_side, tag=13, timeout=1.0))
    out["timeout"] = _expect_failure(mem, lambda: recv_sequence(mem, 0, 0, side, tag=11, timeout=1.0))
    out["died"] = _expect_failure(mem, lambda: recv_sequence(mem, 0, 0, tag=10, timeout=3.0, max_bytes=BIG))
    out["after_all"] = [decode(mem, w, s)[0] for s in ({0: [3]},)]
    return ("skip_destroy", out)


def everything(rank: int, world: int) -> Any:
    """Both scenarios in one pair of processes (starting processes that import torch is
    most of the cost): tensor parallelism first, then transfers, whose last step kills rank 0."""
    t0 = time.perf_counter()
    tp = tensor_parallel(rank, world, "cpu")
    t1 = time.perf_counter()
    tr = transfer(rank, world)
    t2 = time.perf_counter()
    result = {"tp": tp, "seconds": (t1 - t0, t2 - t1)}
    if isinstance(tr, tuple):
        result["transfer"] = tr[-1]
        return (*tr[:-1], result)
    result["transfer"] = tr
    return result


def disaggregated(rank: int, world: int) -> list[np.ndarray]:
    """Ranks 0, 1: a prefill instance, tensor-parallel over two ranks; ranks 2, 3: a decode
    instance of the same degree with memories of another size.  Each prefill rank sends
    its shard of the sequence to its decode peer; both instances then decode on."""
    import functools

    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    prefill, tp_rank = rank < 2, rank % 2
    group = groups[0 if prefill else 1]
    spec = M.model_spec("f32").shard(tp_rank, 2)
    sw = shard_weights(M.Weights.random(SEED, M.HYBRID_LAYERS), tp_rank, 2, functools.partial(allreduce, group=group))
    dev = statecache.get_device("cpu")
    if prefill:
        mem = make_memory(dev, spec, n_seq_max=2)
        decode(mem, sw, {1: PROMPT}, 2)
        send_sequence(mem, 1, rank + 2)
        seq = 1
    else:
        mem = make_memory(dev, spec, n_seq_max=1, n_ctx=32)
        recv_sequence(mem, 0, rank - 2)
        seq = 0
    check_books(mem, group)
    logits = [decode(mem, sw, {seq: s[0]}, 2)[seq] for s in DECODE]
    check_books(mem, group)
    dist.barrier()
    return logits
