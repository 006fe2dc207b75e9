"""Memory cases: the tiny model of ``model.py`` decoding through a
:class:`~statecache.recurrent.RecurrentMemory` on the device under test.

Every output of every incremental decode is compared with a full recompute of
that sequence's accepted tokens from a zero state (NMSE per position block),
across: continuous batching of sequences with different lengths, ``seq_cp``
forks that diverge, speculative decoding (draft k, accept j: rollback through
the snapshot planes), rollback refusals, ``seq_keep``, save/restore of one
sequence into a fresh memory and into a dirty one, chunked prefill across
several ubatches.  Every pool starts garbage-filled (``device.fill_bytes``),
so nothing may rely on zeroed memory.

Hybrid scenarios (attention + context shift) join when the hybrid memory is
part of the core; see the report's case list for what ran.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from statecache.backend import Device
from statecache.conformance.cases import Case, ConformanceFailure, Requirement, assert_close
from statecache.conformance.model import VOCAB, Weights, forward, memory_spec, recompute

#: Logits of an incremental decode vs the one-call recompute (float32 states;
#: the two differ only by the order of float32 operations across calls).
LOGITS_NMSE = 1e-6


class Runner:
    """A garbage-filled RecurrentMemory plus a decode driver that checks every output."""

    def __init__(self, dev: Device, n_seq_max: int, n_rs_seq: int, seed: int, size: int | None = None) -> None:
        from statecache.recurrent import RecurrentMemory

        self.dev = dev
        self.weights = Weights.random(1234)
        self.mem = RecurrentMemory(memory_spec(), dev, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq, size=size)
        for L, pools in self.mem.pools.items():
            for k, name in enumerate(sorted(pools)):
                dev.fill_bytes(pools[name], seed * 100 + L * 10 + k)
        self.history: dict[int, list[int]] = {}
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, VOCAB, n)]

    def decode(self, tokens_by_seq: dict[int, list[int]], n_ubatch: int = 512, label: str = "") -> None:
        from statecache.batch import Batch, BatchAllocator

        balloc = BatchAllocator(self.mem.n_seq_max)
        balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), self.mem)
        ctx = self.mem.init_batch(balloc, n_ubatch)
        if ctx.status.is_fail:
            raise ConformanceFailure(f"{label}: the memory could not plan the batch ({ctx.status.value})")
        got: dict[tuple[int, int], np.ndarray] = {}
        while True:
            ub = ctx.get_ubatch()
            if not ctx.apply():
                raise ConformanceFailure(f"{label}: apply() failed")
            step = ctx.step()
            toks = ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
            logits = forward(self.dev, step, self.weights, toks)
            for s in range(ub.n_seqs):
                for t in range(ub.n_seq_tokens):
                    i = s * ub.n_seq_tokens + t
                    for q in ub.seq_id[i]:
                        got[(q, int(ub.pos[i]))] = logits[s, t]
            if not ctx.next():
                break
        for seq, toks_in in tokens_by_seq.items():
            self.history.setdefault(seq, []).extend(toks_in)
        self.check(got, label)

    def check(self, got: dict[tuple[int, int], np.ndarray], label: str) -> None:
        for seq in sorted({q for q, _ in got}):
            positions = sorted(p for q, p in got if q == seq)
            want = recompute(self.dev, self.weights, self.history[seq])
            mine = np.stack([got[(seq, p)] for p in positions])
            assert_close(
                f"{label}: logits of sequence {seq} at positions {positions[0]}..{positions[-1]} "
                f"vs a full recompute of its {len(self.history[seq])} tokens",
                mine,
                want[positions],
                LOGITS_NMSE,
            )

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        ok = self.mem.seq_rm(seq, p0, p1)
        if ok and seq in self.history:
            end = len(self.history[seq]) if p1 < 0 else p1
            if p0 <= 0 and end >= len(self.history[seq]):
                self.history[seq] = []
            elif end >= len(self.history[seq]):
                self.history[seq] = self.history[seq][:p0]
        return ok

    def seq_cp(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        self.history[dst] = list(self.history.get(src, []))

    def seq_keep(self, seq: int) -> None:
        self.mem.seq_keep(seq)
        self.history = {seq: self.history.get(seq, [])}

    def expect_pos(self, seq: int, label: str) -> None:
        want = len(self.history.get(seq, [])) - 1
        got = self.mem.seq_pos_max(seq)
        if got != want:
            raise ConformanceFailure(f"{label}: seq_pos_max({seq}) is {got}, expected {want}")


# -- scenarios -------------------------------------------------------------------


def continuous_batching(dev: Device, seed: int) -> None:
    r = Runner(dev, n_seq_max=4, n_rs_seq=0, seed=seed)
    r.decode({0: r.tokens(7), 1: r.tokens(3), 2: r.tokens(5)}, n_ubatch=4, label="prompts of 7, 3, 5 tokens")
    for step in range(3):
        r.decode({0: r.tokens(1), 1: r.tokens(1), 2: r.tokens(1)}, label=f"decode step {step}")
    r.decode({3: r.tokens(4), 1: r.tokens(1)}, label="a new sequence joins while 1 decodes")
    r.decode({0: r.tokens(1), 2: r.tokens(2), 3: r.tokens(1)}, label="uneven continuation")
    r.seq_rm(1, 0, -1)
    r.decode({1: r.tokens(3), 0: r.tokens(1)}, label="sequence 1 removed and restarted from zero")


def fork(dev: Device, seed: int) -> None:
    r = Runner(dev, n_seq_max=4, n_rs_seq=2, seed=seed)
    r.decode({0: r.tokens(6)}, label="prompt")
    r.seq_cp(0, 1)
    r.seq_cp(0, 2)
    r.decode({1: r.tokens(1), 2: r.tokens(1)}, label="two forks diverge")
    r.decode({0: r.tokens(2), 1: r.tokens(1), 2: r.tokens(3)}, label="origin and forks continue")
    for q in (0, 1, 2):
        r.expect_pos(q, "after the forks")


def speculative(dev: Device, seed: int) -> None:
    k_draft = 4
    r = Runner(dev, n_seq_max=2, n_rs_seq=k_draft, seed=seed)
    r.decode({0: r.tokens(5), 1: r.tokens(4)}, label="prompts")
    for accept in (2, 0, 4, 1):
        n0 = len(r.history[0])
        r.decode({0: r.tokens(k_draft), 1: r.tokens(1)}, label=f"draft {k_draft} tokens")
        keep = n0 + accept  # accept == 0 undoes the whole ubatch (the input-state plane)
        if keep < len(r.history[0]) and not r.seq_rm(0, keep, -1):
            raise ConformanceFailure(f"rollback of {len(r.history[0]) - keep} tokens after a draft was refused")
        r.expect_pos(0, f"after accepting {accept}")
        r.decode({0: r.tokens(1)}, label=f"decode after accepting {accept} of {k_draft}")


def refusals(dev: Device, seed: int) -> None:
    r = Runner(dev, n_seq_max=2, n_rs_seq=2, seed=seed)
    r.decode({0: r.tokens(6)}, label="prompt")
    end = len(r.history[0])
    if r.mem.seq_rm(0, end - 3, -1):
        raise ConformanceFailure("a rollback deeper than n_rs_seq was accepted")
    r.decode({0: r.tokens(1)}, label="decode after a refused rollback")
    r.decode({0: r.tokens(1)}, label="second single-token step")
    # Two single-token steps since the last multi-token write: rolling back two
    # would need a plane that no longer describes this history (exact or refuse).
    end = len(r.history[0])
    if r.seq_rm(0, end - 2, -1):
        r.decode({0: r.tokens(1)}, label="decode after a rollback across single-token steps")
    else:
        r.decode({0: r.tokens(1)}, label="decode after a refused rollback across single-token steps")
    r.decode({0: r.tokens(3)}, label="three tokens")
    if not r.seq_rm(0, len(r.history[0]) - 1, -1):
        raise ConformanceFailure("rollback of one token after a three-token write was refused")
    if r.mem.seq_rm(0, len(r.history[0]) - 1, -1):
        raise ConformanceFailure("a second rollback while one is pending was accepted")
    r.decode({0: r.tokens(2)}, label="decode after one rollback")


def keep(dev: Device, seed: int) -> None:
    r = Runner(dev, n_seq_max=3, n_rs_seq=0, seed=seed)
    r.decode({0: r.tokens(3), 1: r.tokens(4), 2: r.tokens(2)}, label="prompts")
    r.seq_cp(1, 2)
    r.seq_keep(1)
    for q in (0, 2):
        if r.mem.seq_pos_max(q) != -1:
            raise ConformanceFailure(f"seq_keep(1) left sequence {q}")
    r.decode({1: r.tokens(2), 0: r.tokens(3)}, label="kept sequence continues, a removed one restarts from zero")


def save_restore(dev: Device, seed: int) -> None:
    src = Runner(dev, n_seq_max=3, n_rs_seq=2, seed=seed)
    src.decode({0: src.tokens(5), 1: src.tokens(3)}, label="prompts")
    src.decode({1: src.tokens(3)}, label="multi-token write")
    if not src.seq_rm(1, len(src.history[1]) - 1, -1):
        raise ConformanceFailure("rollback before save was refused")
    blob = src.mem.state_write(1)
    cont = src.tokens(2)
    for label, dst in (
        ("fresh memory", Runner(dev, n_seq_max=3, n_rs_seq=2, seed=seed + 1)),
        ("dirty memory", Runner(dev, n_seq_max=3, n_rs_seq=2, seed=seed + 2)),
    ):
        if label == "dirty memory":
            dst.decode({0: dst.tokens(4), 1: dst.tokens(6), 2: dst.tokens(2)}, label="dirty: other content")
            dst.decode({1: dst.tokens(3)}, label="dirty: pending planes")
        dst.mem.state_read(blob, 1)
        dst.history[1] = list(src.history[1])
        dst.expect_pos(1, f"restored into a {label}")
        dst.decode({1: list(cont)}, label=f"continue after restoring into a {label}")
        if label == "dirty memory":
            dst.decode({0: dst.tokens(1), 2: dst.tokens(1)}, label="other sequences of the dirty memory")
    src.decode({1: list(cont)}, label="the source continues identically")


def chunked_prefill(dev: Device, seed: int) -> None:
    # n_ubatch must exceed n_rs_seq + 1 (the rollback tail stays in one ubatch).
    r = Runner(dev, n_seq_max=2, n_rs_seq=1, seed=seed)
    r.decode({0: r.tokens(11), 1: r.tokens(9)}, n_ubatch=3, label="prefill in ubatches of 3 tokens")
    r.decode({0: r.tokens(7)}, n_ubatch=3, label="second chunked prefill")
    r.decode({0: r.tokens(1), 1: r.tokens(1)}, label="decode")


SCENARIOS: dict[str, tuple[Callable[[Device, int], None], int]] = {
    # name: (scenario, n_snap it needs)
    "continuous_batching": (continuous_batching, 1),
    "fork": (fork, 3),
    "speculative": (speculative, 5),
    "rollback_refusals": (refusals, 3),
    "seq_keep": (keep, 1),
    "save_restore": (save_restore, 3),
    "chunked_prefill": (chunked_prefill, 2),
}

_OPS = ("get_rows", "set_rows", "zero_rows", "copy_rows", "ssm_conv", "ssm_scan", "gated_delta_net")


def _core_has_recurrent_memory() -> bool:
    import importlib.util

    names = ("statecache.batch", "statecache.recurrent", "statecache.recurrent_step")
    return all(importlib.util.find_spec(name) is not None for name in names)


def all_cases() -> list[Case]:
    if not _core_has_recurrent_memory():
        return []
    cases = []
    for name, (fn, n_snap) in SCENARIOS.items():
        reqs = [Requirement(op, {"dtype": "f32"}) for op in _OPS[:4]]
        reqs += [Requirement(op, {"dtype": "f32", "n_snap": n_snap}) for op in _OPS[4:]]
        holder: dict[str, Case] = {}

        def run(device: Device, fn=fn, holder=holder) -> None:  # type: ignore[no-untyped-def]
            fn(device, holder["case"].seed)

        case = Case(
            f"memory.recurrent[{name}-f32]",
            "memory",
            _OPS,
            run,
            tuple(reqs),
            {"storage_dtypes": {"f32"}, "max_snapshots": n_snap},
        )
        holder["case"] = case
        cases.append(case)
    return cases
