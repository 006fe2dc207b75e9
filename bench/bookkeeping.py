"""Host-side cost of one decode step of the recurrent memory.

A step = batch validation + split + plan (prepare, a dry run) + apply (commit)
+ building the graph inputs (index rows uploaded to the device).  No kernel
runs, so this is the pure bookkeeping overhead a runtime pays per step.

    python bench/bookkeeping.py [--steps N]

Target: at most 1 ms per step at 256 sequences.  Times are process CPU time
(time.process_time), so other load on a shared machine inflates them less.
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


def bench(n_seq: int, n_rs_seq: int, steps: int) -> float:
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
    t0 = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"{'n_seq':>6} {'n_rs_seq':>8} {'ms/step':>9} {'us/seq':>8}")
    for n_rs_seq in (0, 3):
        for n_seq in (1, 16, 64, 256):
            t = bench(n_seq, n_rs_seq, args.steps)
            print(f"{n_seq:>6} {n_rs_seq:>8} {t * 1e3:>9.3f} {t * 1e6 / n_seq:>8.2f}")


if __name__ == "__main__":
    main()
