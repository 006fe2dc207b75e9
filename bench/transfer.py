"""Sequence transfer between two local processes against a plain tensor send of the same bytes.

    python bench/transfer.py                               # 64, 256 and 4096 tokens, gloo on 127.0.0.1
    python bench/transfer.py --tokens 256,4096 --rounds 9 --checksum
    python bench/transfer.py --rounds 61 --tokens 64,256 --kinds "sequence;seq, protocol 5"

Two processes join a gloo group on 127.0.0.1.  Rank 0 holds a hybrid memory
(Qwen3-Next-like proportions: 12 gated-delta-net layers of 16 heads of 128 in
f32 and 4 attention layers of 4 K/V heads of 128 in f16) with one sequence of
``--tokens`` tokens; rank 1 holds an empty memory of the same spec.  For each
size, each round times, on the receiver, from a barrier to the end of the
receive (the kinds in a rotating order, so that every kind meets the same load;
the first ``--warmup`` rounds are not counted):

* ``plain``: one ``dist.send`` / ``dist.recv`` of a ``uint8`` tensor of exactly
  the sequence transfer's payload bytes (metadata + rows; the target is >= 0.8 of
  its GB/s);
* ``plain, N msgs``: the same bytes as the N messages a sequence transfer sends
  (its header and metadata, the small row blocks coalesced into one, then one per
  other row block), all posted at once: what the wire alone costs when split like a
  transfer (gloo moves a large payload faster in pieces);
* ``sequence``: ``send_sequence`` / ``recv_sequence`` until the state is installed
  in the receiver's memory;
* ``seq, per block``: the same with no block coalesced (every row block its own
  message, as protocol 4 sent them): what coalescing changes, in the same run;
* ``seq, protocol 5``: the same with the sender waiting for the receiver's *go*
  before it posts the rows (``transfer.EAGER = False``): what posting them right
  behind the header (protocol 6) changes, in the same run;
* ``state format``: the same with ``rows=False`` (``state_write`` blob,
  ``state_read``: the fallback between memories that cannot exchange rows).

Prints each kind's GB/s of the sequence's payload (``--stat``: median or min
over the rounds), the ratio to ``plain`` of that statistic and the median of the
per-round ratios (a round's kinds ran back to back), the median CPU time of both
processes together (every thread) and its ratio to ``plain``'s (on a loaded host
the wall time follows it), then where a transfer's
fixed cost goes, timed in one process: the sender's metadata, the receiver's
checks, validation + book commit with every row landed, and the state format's
``state_write`` / ``state_read``.  A transfer is a wall-clock matter between two
processes: there is no CPU clock to use; on a loaded machine repeat the run and
compare ratios from one run.  The rows hold garbage (nothing is computed).

``--trace`` also times, for the ``sequence`` kind, each side's steps (the spans
between stamps taken where the transfer's internal functions start and end;
``SENDER_STEPS``, ``RECEIVER_STEPS``) as wall / CPU of the transfer's thread, and
the hand-overs between the processes (``perf_counter`` is one clock for both): a
step whose wall time is far above its CPU time waited, for the peer or, on a
loaded host, for a core.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

#: What each kind does on one side: ``fn(rank, mem, ctx)`` with ``ctx`` the size's buffers.
KINDS: dict[str, Callable[[int, Any, dict[str, Any]], None]] = {}


def kind(name: str) -> Callable[[Callable[[int, Any, dict[str, Any]], None]], Any]:
    def add(fn: Callable[[int, Any, dict[str, Any]], None]) -> Any:
        KINDS[name] = fn
        return fn

    return add


@kind("plain")
def _plain(rank: int, mem: Any, ctx: dict[str, Any]) -> None:
    import torch.distributed as dist

    (dist.send if rank == 0 else dist.recv)(ctx["plain"], 1 - rank)


@kind("plain, N msgs")
def _plain_split(rank: int, mem: Any, ctx: dict[str, Any]) -> None:
    import torch.distributed as dist

    post = dist.isend if rank == 0 else dist.irecv
    for work in [post(part, 1 - rank) for part in ctx["parts"]]:
        work.wait()


@kind("sequence")
def _sequence(rank: int, mem: Any, ctx: dict[str, Any]) -> None:
    from statecache.distributed import recv_sequence, send_sequence

    if rank == 0:
        send_sequence(mem, 0, 1, checksum=ctx["checksum"], timeout=300)
    else:
        recv_sequence(mem, 0, 0, timeout=300)
        assert mem.seq_pos_max(0) == ctx["tokens"] - 1


@kind("seq, per block")
def _sequence_per_block(rank: int, mem: Any, ctx: dict[str, Any]) -> None:
    """The transfer without coalescing: every row block its own message (protocol 4's
    shape; the sender decides, the receiver follows the header)."""
    from statecache.distributed import transfer as T

    keep = T.SMALL_BLOCK
    T.SMALL_BLOCK = 0
    try:
        _sequence(rank, mem, ctx)
    finally:
        T.SMALL_BLOCK = keep


@kind("seq, protocol 5")
def _sequence_go(rank: int, mem: Any, ctx: dict[str, Any]) -> None:
    """The transfer with the sender waiting for the receiver's *go* before it posts the
    rows (protocol 5's shape; the sender decides, the receiver follows the header)."""
    from statecache.distributed import transfer as T

    T.EAGER = False
    try:
        _sequence(rank, mem, ctx)
    finally:
        T.EAGER = True


@kind("state format")
def _state_format(rank: int, mem: Any, ctx: dict[str, Any]) -> None:
    from statecache.distributed import recv_sequence, send_sequence

    if rank == 0:
        send_sequence(mem, 0, 1, checksum=ctx["checksum"], timeout=300, rows=False)
    else:
        recv_sequence(mem, 0, 0, timeout=300)
        assert mem.seq_pos_max(0) == ctx["tokens"] - 1


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


def message_sizes(mem: Any) -> list[int]:
    """The messages a sequence transfer of sequence 0 sends over gloo, in bytes: the
    header with the metadata inline, the small row blocks coalesced into one (when
    there are any), then one per other row block."""
    from statecache.distributed import transfer as T

    out = T._Outgoing.of(mem, 0, 0)
    picked = T._coalesced(out.sizes, T.SMALL_BLOCK, T.SMALL_TOTAL)
    small = sum(n for n, p in zip(out.sizes, picked, strict=True) if p)
    big = [n for n, p in zip(out.sizes, picked, strict=True) if not p]
    return [8 * T._HEADER_WORDS + len(out.meta), *([small] if small else []), *big]


def breakdown(mem: Any, other: Any, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Where a transfer's fixed cost goes, in this process (no wire): the sender's
    metadata; the receiver's checks of it; its ``state_read`` with every row block
    landed (validation and the book: what is left of the install when the wire wrote
    the rows); the state format's ``state_write`` and ``state_read``."""
    from statecache.distributed import transfer as T
    from statecache.state_io import RowSource, rows_apart

    data, meta_bytes, _ = T._rows_payload(mem, 0, 0)
    meta, rows = data[:meta_bytes], data[meta_bytes:]
    blob = mem.state_write(0)
    times: dict[str, list[float]] = {}
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        T._Outgoing.of(mem, 0, 0)
        t1 = time.perf_counter()
        T._check_positions(meta, tokens - 1, rows)
        t2 = time.perf_counter()
        with rows_apart(RowSource(rows, wait=lambda: None, land=list)):
            other.state_read(meta, 0, 0)
        t3 = time.perf_counter()
        other.seq_rm(0, -1, -1)
        t4 = time.perf_counter()
        mem.state_write(0)
        t5 = time.perf_counter()
        other.state_read(blob, 0)
        t6 = time.perf_counter()
        other.seq_rm(0, -1, -1)
        if r:
            for k, t in (("metadata", t1 - t0), ("checks", t2 - t1), ("install", t3 - t2), ("state_write", t5 - t4),
                         ("state_read", t6 - t5)):  # fmt: skip
                times.setdefault(k, []).append(t)
    return times


#: ``--trace``: each side's steps of a ``sequence`` transfer, as spans between stamps taken where
#: the transfer's internal functions start and end (the bench wraps them; the library is unchanged).
#: A step is (name, first stamp, last stamp); ``#2`` is a label's second occurrence in a transfer.
SENDER_STEPS = [
    ("setup", "start", "of>"),
    ("metadata", "of>", "of<"),
    ("header", "of<", "send:sending the header<"),
    ("reads", "send:sending the header<", "_post_payload>"),
    ("post sends", "_post_payload>", "_post_payload<"),
    ("wait verdict", "_post_payload<", "hear<"),
    ("finish", "hear<", "end"),
]
RECEIVER_STEPS = [
    ("wait header", "start", "wait:receiving the header<"),
    ("header", "wait:receiving the header<", "_check_positions>"),
    ("checks", "_check_positions>", "cut<"),
    ("validate", "cut<", "land>"),
    ("land", "land>", "arrive>"),
    ("small rows", "arrive>", "wait:receiving the rows>"),
    ("rows", "wait:receiving the rows>", "arrive<"),
    ("commit", "arrive<", "_read<"),
    ("answer", "_read<", "end"),
]
#: Hand-overs between the processes (one shared clock: perf_counter is CLOCK_MONOTONIC):
#: (name, sender's stamp, receiver's stamp, +1 when the sender's comes first, else -1).
HANDOVERS = [
    ("header posted -> received", "send:sending the header<", "wait:receiving the header<", 1),
    ("sends posted -> landing receives posted", "_post_payload<", "land<", 1),
]


def install_trace(stamp: Callable[[str], None], patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Wrap the transfer's steps (with ``patch``: ``setattr``, or a test's monkeypatch) so that
    each start and end calls ``stamp(label + ">")`` / ``stamp(label + "<")``."""
    from statecache.distributed import transfer as T

    def wrap(owner: Any, name: str, label: Callable[..., str]) -> None:
        fn = getattr(owner, name)

        def traced(*a: Any, **k: Any) -> Any:
            tag = label(*a, **k)
            stamp(tag + ">")
            try:
                return fn(*a, **k)
            finally:
                stamp(tag + "<")

        patch(owner, name, traced)

    wrap(T._Outgoing, "of", lambda *a, **k: "of")
    wrap(T, "_post_payload", lambda *a, **k: "_post_payload")
    wrap(T, "_check_positions", lambda *a, **k: "_check_positions")
    wrap(T, "_read", lambda *a, **k: "_read")
    for name in ("cut", "land", "arrive"):
        wrap(T._Arrival, name, lambda *a, _n=name, **k: _n)
    for name in ("hear", "tell"):
        wrap(T._Channel, name, lambda *a, _n=name, **k: _n)
    wrap(T._Channel, "send", lambda ch, t, what: f"send:{what}")
    wrap(T, "wait", lambda work, timeout, peer, what: f"wait:{what}")


def trace_steps(log: list[tuple[str, float, float]]) -> dict[str, tuple[float, float]]:
    """Each label's stamp (the first of its n-th occurrence named ``label#n``): (wall, CPU)."""
    seen: dict[str, int] = {}
    at: dict[str, tuple[float, float]] = {}
    for label, wall, cpu in log:
        seen[label] = seen.get(label, 0) + 1
        at[label if seen[label] == 1 else f"{label}#{seen[label]}"] = (wall, cpu)
    return at


def spans(at: dict[str, tuple[float, float]], steps: list[tuple[str, str, str]]) -> dict[str, tuple[float, float]]:
    """Each step's (wall, CPU) seconds, for the steps whose two stamps are there."""
    return {name: (at[b][0] - at[a][0], at[b][1] - at[a][1]) for name, a, b in steps if a in at and b in at}


def worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    sizes = args.tokens
    _, mem = spec_and_memory(args.device, max(sizes))
    other = spec_and_memory(args.device, max(sizes))[1] if rank == 0 else None
    kinds = [k for k in KINDS if k == "plain" or not args.kinds or k in args.kinds.split(";")]
    results = {}
    log: list[tuple[str, float, float]] = []
    if args.trace:
        install_trace(lambda label: log.append((label, time.perf_counter(), time.thread_time())))
    for tokens in sizes:
        if rank == 0:
            mem.seq_rm(0, -1, -1)
            fill(mem, tokens)
        count = torch.zeros(1, dtype=torch.int64)
        msgs = message_sizes(mem) if rank == 0 else []
        count[0] = len(msgs)
        dist.broadcast(count, 0)
        lengths = torch.tensor(msgs, dtype=torch.int64) if rank == 0 else torch.zeros(int(count), dtype=torch.int64)
        dist.broadcast(lengths, 0)
        msgs = [int(n) for n in lengths.tolist()]
        n = sum(msgs)
        plain = torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8)
        ctx = {"plain": plain, "parts": list(torch.split(plain, msgs)), "checksum": args.checksum, "tokens": tokens}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}  # this process's CPU (every thread)
        traces: list[dict[str, tuple[float, float]]] = []
        for r in range(args.warmup + args.rounds):
            for k in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                if rank == 1:
                    mem.seq_rm(0, -1, -1)  # a decode instance receives into a free sequence
                dist.barrier()
                log.clear()
                c0, t0 = time.process_time(), time.perf_counter()
                log.append(("start", t0, time.thread_time()))
                KINDS[k](rank, mem, ctx)
                log.append(("end", time.perf_counter(), time.thread_time()))
                if r >= args.warmup:
                    times[k].append(log[-1][1] - t0)
                    cpu[k].append(time.process_time() - c0)
                    if args.trace and k == "sequence":
                        traces.append(trace_steps(log))
        if rank == 0:
            results[tokens] = {"local": breakdown(mem, other, tokens, args.rounds), "trace": traces, "cpu": cpu}
        else:
            results[tokens] = {"wire": times, "n": n, "msgs": len(msgs), "trace": traces, "cpu": cpu}
    out.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def print_trace(sender: list[dict[str, tuple[float, float]]], receiver: list[dict[str, tuple[float, float]]]) -> None:
    """The medians over the rounds of each side's steps (wall / CPU of the transfer's
    thread, ms) and of the hand-overs (how long the other side took to see a message)."""
    for side, steps, rounds in (("sender", SENDER_STEPS, sender), ("receiver", RECEIVER_STEPS, receiver)):
        per = [spans(at, steps) for at in rounds]
        cells = []
        for name, _, _ in steps:
            got = [p[name] for p in per if name in p]
            if got:
                wall = statistics.median(w for w, _ in got)
                cpu = statistics.median(c for _, c in got)
                cells.append(f"{name} {wall * 1e3:.2f}/{cpu * 1e3:.2f}")
        total = [(at["end"][0] - at["start"][0], at["end"][1] - at["start"][1]) for at in rounds]
        wall, cpu = (statistics.median(x[i] for x in total) for i in (0, 1))
        print(f"  trace {side:8s} (ms, wall/CPU): total {wall * 1e3:.2f}/{cpu * 1e3:.2f}: " + ", ".join(cells))
    cells = []
    for name, s_label, r_label, sign in HANDOVERS:
        got = [sign * (r[r_label][0] - s[s_label][0]) for s, r in zip(sender, receiver, strict=True)
               if s_label in s and r_label in r]  # fmt: skip
        if got:
            cells.append(f"{name} {statistics.median(got) * 1e3:.2f}")
    print("  trace hand-overs (ms, median): " + ", ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,256,4096", help="tokens of the sequence (K/V cells), comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="rounds run first and not counted")
    ap.add_argument("--device", default="cpu", help="statecache device of both memories")
    ap.add_argument("--checksum", action="store_true", help="send a CRC-32 of the payload (checked on receipt)")
    ap.add_argument("--trace", action="store_true",
                    help="time each side's steps of the sequence transfer and the hand-overs between them")  # fmt: skip
    ap.add_argument("--kinds", default="",
                    help="kinds to run besides plain, separated by semicolons (default: every kind)")  # fmt: skip
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: each kind's fastest round (less sensitive to a loaded machine's stalls)")  # fmt: skip
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    while len(got) < 2:  # a worker that dies says so instead of leaving this waiting
        try:
            rank, results = out.get(timeout=5)
            got[rank] = results
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a worker failed (exit codes {[p.exitcode for p in procs]})") from None
    for p in procs:
        p.join(timeout=60)
    pick = statistics.median if args.stat == "median" else min
    summary = []
    for tokens in args.tokens:
        wire, local = got[1][tokens], got[0][tokens]["local"]
        n, times = wire["n"], wire["wire"]
        stat = {k: pick(v) for k, v in times.items()}
        print(f"{tokens} tokens: payload {n} bytes ({n / 2**20:.2f} MiB) in {wire['msgs']} messages; device "
              f"{args.device}, checksum {'on' if args.checksum else 'off'}; {args.stat} of {args.rounds} rounds "
              f"after {args.warmup} warm-up")  # fmt: skip
        cpu = {k: statistics.median(map(sum, zip(got[0][tokens]["cpu"][k], c, strict=True)))
               for k, c in wire["cpu"].items()}  # fmt: skip
        for k, t in stat.items():
            per_round = statistics.median(a / b for a, b in zip(times["plain"], times[k], strict=True))
            print(f"  {k:16s}{n / t / 1e9:7.2f} GB/s  ({t * 1e3:8.2f} ms)  ratio {stat['plain'] / t:5.2f}"
                  f"  (per round: median {per_round:5.2f})"
                  f"  CPU {cpu[k] * 1e3:6.2f} ms ({cpu[k] / cpu['plain']:4.2f}x)")  # fmt: skip
        print("  fixed costs, one process:  " + "  ".join(f"{k} {pick(v) * 1e3:.2f} ms" for k, v in local.items()))
        if args.trace:
            print_trace(got[0][tokens]["trace"], wire["trace"])
        seq = stat["plain"] / stat["sequence"]
        per_round = statistics.median(a / b for a, b in zip(times["plain"], times["sequence"], strict=True))
        summary.append((tokens, n, stat["plain"], stat["sequence"], seq, per_round))
    print("summary (target: sequence >= 0.8 of plain)")
    print(f"  {'tokens':>7s} {'MiB':>7s} {'plain ms':>9s} {'seq ms':>8s} {'ratio':>6s} {'per-round':>9s}")
    for tokens, n, p, s, ratio, per_round in summary:
        print(f"  {tokens:7d} {n / 2**20:7.2f} {p * 1e3:9.2f} {s * 1e3:8.2f} {ratio:6.2f} {per_round:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
