"""Hunt 27: the newer state families through the memory at unusual sizes.

The family harness of ``test_recurrent_families`` (fork, rollback, save/restore
into a dirty memory, a staged step, every output against a recompute from a
zero state on the same device) runs here on shapes its own test does not
reach: head sizes on both sides of the C kernels' compiled-apart sizes (64,
128) and odd ones (8, 16, 48, 96), one head, conv windows of 2, 3 and 5, three
token-shift vectors, and states on both sides of the cpu launcher's 32768
element small-call bound, with one and two kernel threads.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_recurrent_families import (
    VOCAB,
    Family,
    Model,
    StepOps,
    _compiled_backends,
    _compiled_device,
    _delta,
    _linear,
    _mamba,
    _nmse,
    _shortconv,
)

from statecache.backend import Buffer, Device
from statecache.batch import Batch, BatchAllocator
from statecache.spec import RecurrentLayerSpec as L

SHAPES = [
    _linear("rwkv7", L.rwkv7(n_embd=64, head_size=64)),  # the compiled-apart S = 64, one head
    _linear("rwkv7", L.rwkv7(n_embd=256, head_size=128)),  # S = 128, 32768 state elements
    _linear("rwkv7", L.rwkv7(n_embd=96, head_size=48)),
    _linear("rwkv7", L.rwkv7(n_embd=16, head_size=8, token_shift_count=3)),
    _linear("rwkv6", L.rwkv6(n_embd=96, head_size=96)),
    _linear("rwkv6", L.rwkv6(n_embd=32, head_size=16)),
    _linear("gla", L.gla(n_head=1, head_dim=32)),
    _linear("gla", L.gla(n_head=3, head_dim=16)),
    _delta("kda", L.kda(n_head=1, head_dim=16, d_conv=2)),
    _delta("kda", L.kda(n_head=2, head_dim=48, d_conv=5)),
    _delta("gdn", L.gdn(n_head=2, head_dim=96, d_conv=3, n_head_k=1)),
    _delta("gdn", L.gdn(n_head=4, head_dim=8, d_conv=5, n_head_k=2, head_map="grouped")),
    _mamba("mamba1", L.mamba1(d_inner=48, d_state=16, d_conv=2)),
    _mamba("mamba1", L.mamba1(d_inner=5, d_state=3, d_conv=5)),
    _shortconv(L.shortconv(n_embd=33, l_cache=2)),
    _shortconv(L.shortconv(n_embd=700, l_cache=5)),
]


def _id(f: Family) -> str:
    return f"{f.name}-" + "-".join(f"{k}{v}" for k, v in sorted(f.spec.params.items()))


@pytest.fixture(params=[(b, t) for b in _compiled_backends() for t in ((1, 2) if b == "cpu" else (1,))],
                ids=lambda p: f"{p[0]}-t{p[1]}")  # fmt: skip
def hunt_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Device:
    name, threads = request.param
    monkeypatch.setenv("STATECACHE_NUM_THREADS", str(threads))
    return _compiled_device(name)


@pytest.mark.parametrize("fam", SHAPES, ids=_id)
def test_unusual_shapes_match_a_recompute(hunt_device: Device, fam: Family) -> None:
    rng = np.random.default_rng(27)

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    m = Model(hunt_device, fam, seed=1)
    m.decode({0: toks(5), 1: toks(1)})  # a prompt next to a one-token sequence
    m.decode({0: toks(1), 1: toks(1)})  # decode, two sequences
    m.decode({1: toks(1)})  # decode, one sequence (n_s = 1)
    m.seq_cp(0, 2)
    m.decode({0: toks(1), 2: toks(3)})
    m.decode({1: toks(4)})
    m.seq_rm(1, len(m.history[1]) - 3)  # rollback by the full budget
    m.decode({1: toks(1), 2: toks(1)})
    m.decode({0: toks(9)}, n_ubatch=5)
    m.seq_rm(0, len(m.history[0]) - 1)
    m.decode({0: toks(1)})
    blob = m.mem.state_write(2)
    other = Model(hunt_device, fam, seed=2)
    other.decode({0: toks(3), 1: toks(2)})
    other.mem.state_read(blob, 1)  # over a sequence that lives there
    other.history[1] = list(m.history[2])
    cont = toks(3)
    other.decode({1: list(cont), 0: toks(1)})
    m.decode({2: list(cont)})


class PackedOps(StepOps):
    """The step of a varlen ubatch for the family forwards, which see every packed token
    as one sequence ``[1, T, ...]``: per-token Buffers go to the step as ``[T, ...]``."""

    def __init__(self, dev: Device, step: object, n_tokens: int) -> None:
        super().__init__(dev, step)
        self.T = n_tokens

    def _flat(self, b: Buffer) -> Buffer:
        return b.view(b.shape[1:]) if b.shape[:2] == (1, self.T) else b

    def conv(self, x: Buffer, w: Buffer, y: Buffer) -> None:
        super().conv(self._flat(x), w, self._flat(y))

    def call(self, op: str, *args: Buffer) -> None:
        super().call(op, *(self._flat(a) for a in args))

    def shift(self, x: np.ndarray, part: int) -> np.ndarray:
        return super().shift(np.ascontiguousarray(x[0]), part)[None]


class PackedModel(Model):
    """:class:`Model` planning varlen ubatches (``init_batch(varlen=True)``): the sequences
    of a ubatch packed along one axis, each with its own token count."""

    def decode(self, batch: dict[int, list[int]], n_ubatch: int = 512) -> None:
        balloc = BatchAllocator(self.mem.n_seq_max)
        balloc.init(Batch.for_sequences(batch, output_all=True), self.mem)
        ctx = self.mem.init_batch(balloc, n_ubatch, varlen=True)
        assert not ctx.status.is_fail, ctx.status
        got: dict[tuple[int, int], np.ndarray] = {}
        while True:
            ub = ctx.get_ubatch()
            assert ctx.apply()
            step = ctx.step()
            y = self.fam.forward(self.dev, PackedOps(self.dev, step, ub.n_tokens), ub.token[None], self.tables)[0]
            for i in range(ub.n_tokens):
                for q in ub.seq_id[i]:
                    got[(q, int(ub.pos[i]))] = y[i]
            if not ctx.next():
                break
        for seq, toks in batch.items():
            hist = self.history.setdefault(seq, [])
            first = len(hist)
            hist += toks
            want = self.recompute(hist)
            for j in range(first, len(hist)):
                err = _nmse(got[(seq, j)], want[j])
                assert err < self.nmse, f"{self.fam.name}: sequence {seq} position {j}: NMSE {err:.2e} (varlen)"


#: one shape per family for the packed form (the 32768-element RWKV-7, three token-shift vectors, d_conv 5)
PACKED = [SHAPES[i] for i in (1, 3, 5, 6, 9, 11, 12, 15)]


@pytest.mark.parametrize("fam", PACKED, ids=_id)
def test_unusual_shapes_packed_match_a_recompute(hunt_device: Device, fam: Family) -> None:
    """The same with varlen ubatches: a prompt, a one-token step and a draft of another
    length in one packed call, a rollback, a fork, save/restore into a dirty memory."""
    rng = np.random.default_rng(28)

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    m = PackedModel(hunt_device, fam, seed=1)
    m.decode({0: toks(6), 1: toks(1), 2: toks(3)})
    m.decode({0: toks(1), 1: toks(4), 2: toks(2)})
    m.seq_rm(1, len(m.history[1]) - 2)
    m.seq_cp(2, 3)
    m.decode({1: toks(1), 2: toks(2), 3: toks(5)})
    blob = m.mem.state_write(3)
    other = PackedModel(hunt_device, fam, seed=2)
    other.decode({0: toks(2), 2: toks(3)})
    other.mem.state_read(blob, 0)
    other.history[0] = list(m.history[3])
    cont = toks(3)
    other.decode({0: list(cont), 2: toks(1)})
    m.decode({3: list(cont), 0: toks(1)})
