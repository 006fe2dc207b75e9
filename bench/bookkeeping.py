"""Host-side cost of one decode step of the recurrent memory.

A step = batch validation + split + plan (prepare, a dry run) + apply (commit)
+ building the graph inputs (index rows uploaded to the device).  No kernel
runs, so this is the pure bookkeeping overhead a runtime pays per step.

    python bench/bookkeeping.py [--steps N] [--rounds R]

Target: at most 1 ms per step at 256 sequences.  Both process CPU time
(time.process_time: what this process spent, less inflated by other load on
a shared machine) and wall time (time.perf_counter) are reported, each the
median over R rounds of N steps.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.recurrent import RecurrentMemory
from statecache.recurrent_step import RecurrentStep
from statecache.spec import MemorySpec, RecurrentLayerSpec


def bench(n_seq: int, n_rs_seq: int, steps: int, rounds: int = 5) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per decode step, medians over ``rounds``."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{'n_seq':>6} {'n_rs_seq':>8} {'cpu ms/step':>12} {'wall ms/step':>13} {'cpu us/seq':>11}")
    for n_rs_seq in (0, 3):
        for n_seq in (1, 16, 64, 256):
            cpu, wall = bench(n_seq, n_rs_seq, args.steps, args.rounds)
            print(f"{n_seq:>6} {n_rs_seq:>8} {cpu * 1e3:>12.3f} {wall * 1e3:>13.3f} {cpu * 1e6 / n_seq:>11.2f}")


if __name__ == "__main__":
    main()
