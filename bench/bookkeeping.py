"""Host-side cost of one decode step, for every memory kind and context length.

A step = batch validation + split + plan (``init_batch``, a dry run) + apply
(commit) + the graph inputs every step needs (the recurrent index rows
uploaded to the device, the K/V write rows and ``n_kv``), for one token per
sequence.  No kernel runs, so this is the pure bookkeeping a runtime pays per
decode step.  Two modes:

    python bench/bookkeeping.py                 # the recurrent memory (n_rs_seq 0 and 3)
    python bench/bookkeeping.py --sweep         # every memory kind x sequences x context

``--sweep`` runs memory kind (recurrent, kv, hybrid, hybrid-iswa, hybrid-idx)
x sequences (1, 8, 64, 256) x context per sequence (16 .. 32768 tokens, rows
whose cells would pass ``--max-cells`` = 256k are skipped), with one stream
shared by every sequence (``--layout unified``, the default) or one stream per
sequence (``split``).  The context is built through the public API, in
prefill batches of about ``--prefill-tokens`` tokens; the decode steps after
it are timed.  Printed per row: ms per decode step (``step``), its ratio to
the same memory and sequence count at context 16 (``x16``), and, apart from
the step (inputs whose size is the context itself, so they cannot stay
flat): the attention mask of the ubatch (``mask``: dense ``[n_tokens, n_kv]``,
built once per ubatch; ``-`` where it would pass 32M entries) and for
hybrid-idx the k-pool graph inputs (``kpool``).

Targets (issue 13): the step at 32k context within 1.5x of context 16 for
every kind and sequence count; at 256 sequences at most 1 ms for the
recurrent memory and 2 ms for the hybrids.

Timing: process CPU time (``time.process_time``: what this process spent,
less inflated by other load on a shared machine).  The rows of one memory kind
and sequence count are built first and their decode steps then taken in turn,
one step of each context per round, so that load on a shared machine falls on
every context alike and the ``x16`` ratio compares like with like; a round
stops coming once the rows have spent ``--row-seconds`` of CPU time each (at
least 3 steps).  Printed: the median (``step``) and the 10th percentile
(``p10``: the step with the least interference), ``x16`` of each.  Wall
time (median) is printed too.  For the issue's table:

    python bench/bookkeeping.py --sweep --seqs 256 --ctx 16,1024,4096,32768
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.factory import make_model_memory
from statecache.memory import Memory, MemoryContext
from statecache.recurrent import RecurrentMemory
from statecache.recurrent_step import RecurrentStep
from statecache.spec import AttentionLayerSpec, IndexerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec

KINDS = ("recurrent", "kv", "hybrid", "hybrid-iswa", "hybrid-idx")
#: the window of the sliding-window layer of the hybrid-iSWA rows
N_SWA = 128


def bench(n_seq: int, n_rs_seq: int, steps: int, rounds: int = 5) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per decode step of the recurrent memory, medians over ``rounds``."""
    dev = statecache.get_device("reference")
    layer = RecurrentLayerSpec.gdn(n_head=1, head_dim=4, d_conv=2)  # tiny rows: bookkeeping only
    mem = RecurrentMemory(MemorySpec.build(1, {0: layer}), dev, n_seq_max=n_seq, n_rs_seq=n_rs_seq)
    balloc = BatchAllocator(n_seq)
    seqs = np.arange(n_seq, dtype=np.int32)
    tokens = np.ones(n_seq, dtype=np.int32)
    out = np.ones(n_seq, dtype=bool)

    def step() -> None:
        balloc.init(Batch(tokens=tokens, seq_ids=seqs, output=out), mem)
        ctx = mem.init_batch(balloc, max(n_seq, n_rs_seq + 2))
        assert not ctx.status.is_fail
        while True:
            assert ctx.apply()
            RecurrentStep(mem, ctx.inputs)  # uploads the index rows
            if not ctx.next():
                break

    for _ in range(5):
        step()
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            step()
        cpu.append((time.process_time() - c0) / steps)
        wall.append((time.perf_counter() - w0) / steps)
    return float(np.median(cpu)), float(np.median(wall))


# -- the sweep ------------------------------------------------------------------------
def model_spec(kind: str) -> ModelSpec:
    """One GDN layer and one attention layer (two for iSWA: full + window) with tiny rows."""
    gdn = RecurrentLayerSpec.gdn(n_head=1, head_dim=4, d_conv=2)
    att = AttentionLayerSpec(n_head_kv=1, head_dim_k=4)
    if kind == "kv":
        return ModelSpec.build(1, attention={0: att}, kv_dtype="f32")
    if kind == "hybrid":
        return ModelSpec.build(2, recurrent={0: gdn}, attention={1: att}, kv_dtype="f32")
    if kind == "hybrid-iswa":
        swa = AttentionLayerSpec(n_head_kv=1, head_dim_k=4, swa=True)
        return ModelSpec.build(3, recurrent={0: gdn}, attention={1: att, 2: swa}, kv_dtype="f32", n_swa=N_SWA)
    if kind == "hybrid-idx":
        return ModelSpec.build(
            2, recurrent={0: gdn}, attention={1: att}, kv_dtype="f32", indexer=IndexerSpec(layers=(1,), head_size=4)
        )
    return ModelSpec.build(1, recurrent={0: gdn})


def _leaves(ctx: Any) -> list[Any]:
    """The KV contexts inside a (composite) context."""
    from statecache.kv_cache import CompositeContext, KVCacheContext

    if isinstance(ctx, KVCacheContext):
        return [ctx]
    if isinstance(ctx, CompositeContext):
        return [leaf for p in ctx.parts for leaf in _leaves(p)]
    return []


def _recurrent_ctx(ctx: Any) -> Any:
    return getattr(ctx, "recr", ctx)


class Row:
    """One memory, filled to a context, ready to time decode steps."""

    def __init__(self, kind: str, n_seq: int, n_ctx: int, unified: bool, prefill_tokens: int, headroom: int) -> None:
        self.kind, self.n_seq, self.n_ctx = kind, n_seq, n_ctx
        dev = statecache.get_device("reference")
        spec = model_spec(kind)
        chunk = max(1, min(n_ctx, prefill_tokens // n_seq))
        self.n_ubatch = chunk * n_seq
        if kind == "recurrent":
            self.mem: Memory = RecurrentMemory(spec.recurrent, dev, n_seq_max=n_seq)
        else:
            self.mem = make_model_memory(
                spec, dev, n_seq, n_ctx=n_ctx + headroom, unified=unified, n_ubatch=max(self.n_ubatch, n_seq)
            )
        self.balloc = BatchAllocator(n_seq)
        seqs = np.arange(n_seq, dtype=np.int32)
        done = 0
        t0 = time.perf_counter()
        while done < n_ctx:
            c = min(chunk, n_ctx - done)
            ids = np.repeat(seqs, c)
            self._run(Batch(tokens=np.ones(ids.size, dtype=np.int32), seq_ids=ids), self.n_ubatch, inputs=False)
            done += c
        self.prefill_s = time.perf_counter() - t0
        assert all(self.mem.seq_pos_max(s) == n_ctx - 1 for s in range(n_seq))
        self.decode = Batch(tokens=np.ones(n_seq, dtype=np.int32), seq_ids=seqs, output=np.ones(n_seq, dtype=bool))

    def _run(self, batch: Batch, n_ubatch: int, inputs: bool, on_ubatch: Callable[[Any], None] | None = None) -> None:
        self.balloc.init(batch, self.mem)
        ctx: MemoryContext = self.mem.init_batch(self.balloc, n_ubatch)
        assert not ctx.status.is_fail, getattr(ctx, "reason", ctx.status)
        while True:
            assert ctx.apply()
            if inputs:
                rctx = _recurrent_ctx(ctx)
                if getattr(rctx, "inputs", None) is not None:
                    RecurrentStep(rctx.memory, rctx.inputs)  # uploads the index rows
                for leaf in _leaves(ctx):
                    leaf.k_idxs()
                    leaf.n_kv()
                if on_ubatch is not None:
                    on_ubatch(ctx)
            if not ctx.next():
                break

    def time_step(self) -> tuple[float, float]:
        """(CPU, wall) seconds of one decode step."""
        c0, w0 = time.process_time(), time.perf_counter()
        self._run(self.decode, self.n_seq, inputs=True)
        return time.process_time() - c0, time.perf_counter() - w0

    def time_steps(self, max_steps: int, budget_s: float) -> tuple[float, float]:
        """Median (CPU, wall) seconds per decode step."""
        cpu, wall = time_rows([self], max_steps, budget_s)[0]
        return float(np.median(cpu)), float(np.median(wall))

    def time_inputs(self, max_steps: int, budget_s: float, max_mask: int) -> tuple[float | None, float | None]:
        """Median CPU seconds of the mask (every KV leaf, once per ubatch) and of the k-pool inputs."""
        if self.kind == "recurrent":
            return None, None
        masks: list[float] = []
        kpools: list[float] = []

        def on_ubatch(ctx: Any) -> None:
            leaves = _leaves(ctx)
            if all(leaf.get_ubatch().n_tokens * leaf.n_kv() <= max_mask for leaf in leaves):
                c0 = time.process_time()
                for leaf in leaves:
                    leaf.mask()
                masks.append(time.process_time() - c0)
            if hasattr(ctx, "kpool_inputs"):
                c0 = time.process_time()
                ctx.kpool_inputs()
                kpools.append(time.process_time() - c0)

        spent = 0.0
        for k in range(max_steps):
            c0 = time.process_time()
            self._run(self.decode, self.n_seq, inputs=True, on_ubatch=on_ubatch)
            spent += time.process_time() - c0
            if k >= 2 and spent > budget_s:
                break
        return (
            float(np.median(masks)) if masks else None,
            float(np.median(kpools)) if kpools else None,
        )


def time_rows(rows: list[Row], max_steps: int, budget_s: float) -> list[tuple[list[float], list[float]]]:
    """(CPU, wall) seconds of each decode step of every row, the rows taking one step each
    in turn (load on the machine then falls on all of them alike)."""
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in rows]
    rounds = 0
    while rounds < max_steps and (rounds < 3 or min(sum(cpu) for cpu, _ in out) < budget_s):
        for row, (cpu, wall) in zip(rows, out, strict=True):
            c, w = row.time_step()
            cpu.append(c)
            wall.append(w)
        rounds += 1
    return out


def sweep(args: argparse.Namespace) -> None:
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"unknown kind {k!r}; expected some of {', '.join(KINDS)}")
    layouts = ["unified", "split"] if args.layout == "both" else [args.layout]
    seqs = [int(x) for x in args.seqs.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    print(
        f"{'kind':<12} {'layout':<8} {'seqs':>5} {'context':>8} {'cells':>8} {'step ms':>9} {'x16':>6} "
        f"{'p10 ms':>9} {'x16':>6} {'wall ms':>9} {'mask ms':>9} {'kpool ms':>9} {'prefill s':>9}",
        flush=True,
    )

    def fmt(x: float | None) -> str:
        return f"{x * 1e3:>9.3f}" if x is not None else f"{'-':>9}"

    worst: dict[str, float] = {}
    for kind in kinds:
        for layout in layouts if kind != "recurrent" else ["-"]:
            for n_seq in seqs:
                rows = [
                    Row(kind, n_seq, n_ctx, layout != "split", args.prefill_tokens, args.headroom)
                    for n_ctx in ctxs
                    if n_seq * n_ctx <= args.max_cells
                ]
                for row in rows:  # warm up: first-call costs (growth of the per-sequence arrays) stay out
                    row.time_step()
                times = time_rows(rows, args.steps, args.row_seconds)
                base = base10 = None
                for row, (cpu_all, wall_all) in zip(rows, times, strict=True):
                    cpu, p10, wall = np.median(cpu_all), np.percentile(cpu_all, 10), np.median(wall_all)
                    mask, kpool = row.time_inputs(args.input_steps, args.row_seconds / 2, args.max_mask)
                    if base is None or base10 is None:
                        base, base10 = cpu, p10
                    ratio = cpu / base
                    if row.n_ctx > 16:
                        worst[kind] = max(worst.get(kind, 0.0), ratio)
                    print(
                        f"{kind:<12} {layout:<8} {n_seq:>5} {row.n_ctx:>8} {n_seq * row.n_ctx:>8} {cpu * 1e3:>9.3f} "
                        f"{ratio:>6.2f} {p10 * 1e3:>9.3f} {p10 / base10:>6.2f} {wall * 1e3:>9.3f} {fmt(mask)} "
                        f"{fmt(kpool)} {row.prefill_s:>9.1f}",
                        flush=True,
                    )
    print("worst ratio (median) to the first context per kind: " + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per round (200) / per row (--sweep: 30)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="every memory kind x sequences x context")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seqs", default="1,8,64,256")
    ap.add_argument("--ctx", default="16,256,1024,4096,32768")
    ap.add_argument("--layout", choices=("unified", "split", "both"), default="unified")
    ap.add_argument("--max-cells", type=int, default=256 * 1024, help="skip rows holding more cells")
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="tokens per prefill batch")
    ap.add_argument("--headroom", type=int, default=256, help="cells per sequence beyond the context")
    ap.add_argument("--row-seconds", type=float, default=10.0, help="CPU seconds a row's timing may take")
    ap.add_argument("--input-steps", type=int, default=5, help="steps timed for the mask / k-pool inputs")
    ap.add_argument("--max-mask", type=int, default=32 << 20, help="skip masks with more entries")
    args = ap.parse_args()
    if args.sweep:
        args.steps = args.steps or 30
        sweep(args)
        return
    args.steps = args.steps or 200
    print(f"{'n_seq':>6} {'n_rs_seq':>8} {'cpu ms/step':>12} {'wall ms/step':>13} {'cpu us/seq':>11}")
    for n_rs_seq in (0, 3):
        for n_seq in (1, 16, 64, 256):
            cpu, wall = bench(n_seq, n_rs_seq, args.steps, args.rounds)
            print(f"{n_seq:>6} {n_rs_seq:>8} {cpu * 1e3:>12.3f} {wall * 1e3:>13.3f} {cpu * 1e6 / n_seq:>11.2f}")


if __name__ == "__main__":
    main()
