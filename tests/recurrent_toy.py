"""A tiny recurrent "model" to drive RecurrentMemory in tests, and its recompute oracle.

Three model layers: layer 0 is Mamba-2-like (conv window ``r`` + selective
scan ``s``), layer 1 has no recurrent state (attention in a real hybrid),
layer 2 is GDN-like (conv ``r`` + gated delta net ``s``).  Every primitive
input is a fixed function of the token id (embedding tables), so the oracle
recomputes a sequence's outputs and states from its plain token list, from a
zero state, with the reference primitives in a single call.
"""

from __future__ import annotations

import numpy as np

from statecache.batch import Batch, BatchAllocator
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec, RecurrentLayerSpec, StateTensor

VOCAB = 32
CH, D_CONV = 6, 3  # conv channels, kernel
H, P, N, G = 2, 2, 3, 1  # mamba-2 heads, head_dim, d_state, groups
HV, S = 2, 3  # gdn heads, head size
W = D_CONV - 1


def toy_spec() -> MemorySpec:
    mamba = RecurrentLayerSpec("mamba2", (StateTensor("r", CH * W), StateTensor("s", H * P * N)))
    gdn = RecurrentLayerSpec("gdn", (StateTensor("r", CH * W), StateTensor("s", HV * S * S)))
    return MemorySpec.build(3, {0: mamba, 2: gdn})


class Tables:
    def __init__(self, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)
        f = np.float32
        self.conv_x = {L: rng.normal(0, 0.5, (VOCAB, CH)).astype(f) for L in (0, 2)}
        self.conv_w = {L: rng.normal(0, 0.5, (CH, D_CONV)).astype(f) for L in (0, 2)}
        self.x = rng.normal(0, 0.5, (VOCAB, H, P)).astype(f)
        self.dt = rng.normal(-1.0, 0.5, (VOCAB, H)).astype(f)
        self.A = -np.abs(rng.normal(1.0, 0.3, (H,))).astype(f)
        self.B = rng.normal(0, 0.5, (VOCAB, G, N)).astype(f)
        self.C = rng.normal(0, 0.5, (VOCAB, G, N)).astype(f)
        kk = rng.normal(0, 1, (VOCAB, HV, S))
        self.k = (kk / np.linalg.norm(kk, axis=-1, keepdims=True)).astype(f)
        qq = rng.normal(0, 1, (VOCAB, HV, S))
        self.q = (qq / np.linalg.norm(qq, axis=-1, keepdims=True)).astype(f)
        self.v = rng.normal(0, 0.5, (VOCAB, HV, S)).astype(f)
        self.g = -np.abs(rng.normal(0.3, 0.1, (VOCAB, HV))).astype(f)
        self.beta = rng.uniform(0.2, 0.8, (VOCAB, HV)).astype(f)


def run_layers(dev, step_or_pools, tables: Tables, toks: np.ndarray):  # type: ignore[no-untyped-def]
    """Run all layers for tokens ``toks`` [n_s, n_t] (or [n_tokens] of a varlen ubatch:
    the packed form); returns outputs [n_s, n_t, K] (or [n_tokens, K]).

    ``step_or_pools`` is a RecurrentStep, or ``(pools, start, dst)`` for the oracle."""
    lead = toks.shape
    outs = []
    for L in (0, 2):
        xc = dev.upload(tables.conv_x[L][toks])
        wc = dev.upload(tables.conv_w[L])
        yc = dev.alloc((*lead, CH))
        if L == 0:
            args = [dev.upload(a) for a in (tables.x[toks], tables.dt[toks], tables.A, tables.B[toks], tables.C[toks])]
            ys = dev.alloc((*lead, H, P))
        else:
            args = [dev.upload(a) for a in (tables.q[toks], tables.k[toks], tables.v[toks], tables.g[toks])]
            args.append(dev.upload(tables.beta[toks]))
            ys = dev.alloc((*lead, HV, S))
        if isinstance(step_or_pools, tuple):
            pools, start, dst = step_or_pools
            dev.ssm_conv(pools[L]["r"], start, dst, xc, wc, yc)
            if L == 0:
                dev.ssm_scan(pools[L]["s"], start, dst, *args, ys)
            else:
                dev.gated_delta_net(pools[L]["s"], start, dst, *args, ys)
        else:
            step_or_pools.conv(L, xc, wc, yc)
            if L == 0:
                step_or_pools.scan(L, *args, ys)
            else:
                step_or_pools.delta(L, *args, ys)
        outs += [yc.numpy().reshape(*lead, -1), ys.numpy().reshape(*lead, -1)]
    return np.concatenate(outs, axis=-1)


def oracle(dev, tables: Tables, tokens: list[int]):  # type: ignore[no-untyped-def]
    """(outputs [len, K], {layer: {tensor: final state row}}) from a zero state."""
    spec = toy_spec()
    pools = {L: {t.name: dev.alloc((1, t.row_size)) for t in spec.layers[L].tensors} for L in (0, 2)}
    if not tokens:
        return np.zeros((0, 0)), {L: {n: b.numpy()[0] for n, b in p.items()} for L, p in pools.items()}
    zero = dev.indices([0])
    out = run_layers(dev, (pools, zero, zero), tables, np.asarray([tokens]))
    return out[0], {L: {n: b.numpy()[0] for n, b in p.items()} for L, p in pools.items()}


class Toy:
    """A RecurrentMemory (pools garbage-filled) plus a decode driver."""

    def __init__(self, dev, n_seq_max: int, n_rs_seq: int = 0, seed: int = 0, size: int | None = None) -> None:  # type: ignore[no-untyped-def]
        self.dev = dev
        self.mem = RecurrentMemory(toy_spec(), dev, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq, size=size)
        for L, pools in self.mem.pools.items():
            for k, (_, buf) in enumerate(sorted(pools.items())):
                dev.fill_bytes(buf, seed * 100 + L * 10 + k)
        self.tables = Tables()
        self.staged_steps = 0
        self.forwards = 0  # ubatches run (one forward of the model each)

    def decode(  # type: ignore[no-untyped-def]
        self, tokens_by_seq: dict[int, list[int]], n_ubatch: int = 512, *, varlen: bool = False, undo: bool = False
    ):
        """Decode one batch; returns {(seq, pos): output} or None when the plan failed.
        ``varlen``: plan it with ``init_batch(varlen=True)`` (packed ubatches);
        ``undo``: run every ubatch, then take the whole batch back (a failed compute)."""
        balloc = BatchAllocator(self.mem.n_seq_max)
        balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), self.mem)
        ctx = self.mem.init_batch(balloc, n_ubatch, varlen=varlen)
        if ctx.status.is_fail:
            return None
        if undo:
            ctx.keep_undo_rows = True
        out = {}
        while True:
            ub = ctx.get_ubatch()
            assert ctx.apply()
            step = ctx.step()
            self.staged_steps += int(step.inputs.staged)
            self.forwards += 1
            toks = ub.token if ub.is_varlen else ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
            y = self.run_step(step, toks).reshape(ub.n_tokens, -1)  # set-major in both forms
            for i in range(ub.n_tokens):
                for q in ub.seq_id[i]:
                    out[(q, int(ub.pos[i]))] = y[i]
            if not ctx.next():
                break
        if undo:
            assert ctx.undo() == ()
        return out

    def run_step(self, step, toks: np.ndarray):  # type: ignore[no-untyped-def]
        """Every layer of one applied ubatch (a subclass may run its own kernels)."""
        return run_layers(self.dev, step, self.tables, toks)

    def state(self, seq: int, plane_rows: bool = False):  # type: ignore[no-untyped-def]
        """The logical state rows of ``seq`` ({layer: {tensor: row}}), read from its source row."""
        c = self.mem.cell_of(seq)
        assert c >= 0
        b = self.mem.book_snapshot()
        row = int(b.src[c])
        return {L: {n: buf.numpy()[row] for n, buf in p.items()} for L, p in self.mem.pools.items()}
