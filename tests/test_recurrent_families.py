"""Every state family of ``spec.py`` steps through the recurrent memory.

For each family (Mamba-1, Mamba-2, GDN, KDA, short-conv, RWKV-6, RWKV-7,
GLA) a one-layer model whose inputs are fixed functions of the token ids
runs through a :class:`~statecache.recurrent.RecurrentMemory` (pools filled
with garbage, rollback planes on) via its :class:`~statecache.recurrent_step.
RecurrentStep` methods, across prompts of several tokens, decode steps, a
fork (``seq_cp``) whose branches diverge, a rollback (``seq_rm`` of the last
tokens of a multi-token write), save/restore (``state_write`` /
``state_read``) into another, dirty memory, and a step whose rows must be
staged (two sequences swapping cells).  Every output is compared with a full
recompute of the sequence's tokens from a zero state: one direct primitive
call per state tensor on the same device, the RWKV token shift on the host
(the previous token's input, zeros before the first).

The reference device always runs it; so does every compiled backend that
loads here (cpu, opencl: the step uses only public primitives, but the token
shift's conv on a view of the pool and the staged copies go through each
backend's row and view handling).  A backend that does not load is not a
hidden failure: its own tests fail on a broken build.

RWKV layers use both token-shift parts, the second one after (and from) the
output of the first part's wkv, as a real block's channel mixing does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from statecache.backend import Buffer, Device
from statecache.batch import Batch, BatchAllocator
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec, RecurrentLayerSpec

VOCAB = 16
NMSE = 1e-9  # float64 reference both ways: only the state rounding to f32 between calls differs
#: f32 math: the step splits a sequence's tokens into other calls (ubatches, staging)
#: than the recompute's one call, so sums run in another order
NMSE_F32 = 1e-6


def _compiled_device(name: str) -> Device:
    from statecache.registry import BackendRegistry

    return BackendRegistry(load_entry_points=True, allowlist=[name]).get_device(name)


def _compiled_backends() -> list[str]:
    found = []
    for name in ("cpu", "opencl"):
        try:
            _compiled_device(name)
        except Exception:  # not installed or no usable device here
            continue
        found.append(name)
    return found


@pytest.fixture(params=["reference", *_compiled_backends()])
def family_device(request: pytest.FixtureRequest) -> Device:
    from statecache.registry import BackendRegistry

    name = request.param
    return BackendRegistry(allowlist=[name]).get_device(name) if name == "reference" else _compiled_device(name)


def _nmse(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return float(np.sum((g - w) ** 2) / max(float(np.sum(w * w)), 1e-30))


# -- the stateful calls, through the step or directly from a zero state -----------------------


class StepOps:
    """The layer's stateful work through the memory's step (layer 0)."""

    def __init__(self, dev: Device, step: Any) -> None:
        self.dev, self.step = dev, step

    def conv(self, x: Buffer, w: Buffer, y: Buffer) -> None:
        self.step.conv(0, x, w, y, apply_silu=True)

    def call(self, op: str, *args: Buffer) -> None:
        method = {"ssm_scan": self.step.scan, "gated_delta_net": self.step.delta, "rwkv_wkv6": self.step.wkv6,
                  "rwkv_wkv7": self.step.wkv7, "gated_linear_attn": self.step.gla}[op]  # fmt: skip
        method(0, *args)

    def shift(self, x: np.ndarray, part: int) -> np.ndarray:
        prev = self.dev.alloc(x.shape)
        self.step.shift(0, self.dev.upload(x), prev, part=part)
        return self.dev.download(prev)


class RecomputeOps:
    """The same work for one sequence from a zero state, in one call per tensor."""

    def __init__(self, dev: Device, spec: RecurrentLayerSpec) -> None:
        self.dev = dev
        self.pools = {t.name: dev.alloc((1, t.row_size)) for t in spec.tensors}  # zero-filled
        self.row = dev.indices([0])

    def conv(self, x: Buffer, w: Buffer, y: Buffer) -> None:
        self.dev.ssm_conv(self.pools["r"], self.row, self.row, x, w, y, apply_silu=True)

    def call(self, op: str, *args: Buffer) -> None:
        getattr(self.dev, op)(self.pools["s"], self.row, self.row, *args)

    def shift(self, x: np.ndarray, part: int) -> np.ndarray:
        out = np.zeros_like(x)
        out[:, 1:] = x[:, :-1]
        return out


# -- the families: one layer each, inputs from token tables ------------------------------------


@dataclasses.dataclass
class Family:
    name: str
    spec: RecurrentLayerSpec
    forward: Callable[[Device, Any, np.ndarray, dict[str, np.ndarray]], np.ndarray]
    tables: Callable[[np.random.Generator], dict[str, np.ndarray]]


def _n(rng: np.random.Generator, *shape: int, scale: float = 0.5) -> np.ndarray:
    return rng.normal(0.0, scale, shape).astype(np.float32)


def _unit(a: np.ndarray) -> np.ndarray:
    return (a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)


def _conv_first(dev: Device, ops: Any, toks: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
    """The conv of every conv-carrying family: embedded tokens through the window, SiLU."""
    x = dev.upload(t["emb"][toks])
    y = dev.alloc(x.shape)
    ops.conv(x, dev.upload(t["conv"]), y)
    return dev.download(y)


def _mamba(name: str, spec: RecurrentLayerSpec) -> Family:
    p = spec.params
    H, P, N, ch = p["n_head"], p["head_dim"], p["d_state"], p["channels"]
    G = p.get("n_group", 1)
    d_inner = H * P

    def tables(rng: np.random.Generator) -> dict[str, np.ndarray]:
        A = -rng.uniform(0.3, 1.5, (H, N) if name == "mamba1" else (H,)).astype(np.float32)
        return {"emb": _n(rng, VOCAB, ch), "conv": _n(rng, ch, p["d_conv"]), "dt": _n(rng, VOCAB, H), "A": A}

    def forward(dev: Device, ops: Any, toks: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
        xbc = _conv_first(dev, ops, toks, t)
        n_s, n_t = toks.shape
        if name == "mamba1":  # B and C are not convolved in Mamba-1: from the tokens
            x, B, C = xbc, xbc[..., :N] * 0.7, xbc[..., -N:]
        else:
            x, B, C = xbc[..., :d_inner], xbc[..., d_inner : d_inner + G * N], xbc[..., d_inner + G * N :]
        args = [x.reshape(n_s, n_t, H, P), t["dt"][toks], t["A"], B.reshape(n_s, n_t, G, N), C.reshape(n_s, n_t, G, N)]
        y = dev.alloc((n_s, n_t, H, P))
        ops.call("ssm_scan", *(dev.upload(np.ascontiguousarray(a)) for a in args), y)
        return np.concatenate([xbc, dev.download(y).reshape(n_s, n_t, -1)], axis=-1)

    return Family(name, spec, forward, tables)


def _delta(name: str, spec: RecurrentLayerSpec) -> Family:
    p = spec.params
    Hv, Hk, S, ch = p["n_head"], p["n_head_k"], p["head_dim"], p["channels"]

    def tables(rng: np.random.Generator) -> dict[str, np.ndarray]:
        gshape = (VOCAB, Hv, S) if name == "kda" else (VOCAB, Hv)
        return {
            "emb": _n(rng, VOCAB, ch),
            "conv": _n(rng, ch, p["d_conv"]),
            "g": -rng.uniform(0.05, 1.0, gshape).astype(np.float32),
            "beta": rng.uniform(0.1, 0.9, (VOCAB, Hv)).astype(np.float32),
        }

    def forward(dev: Device, ops: Any, toks: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
        qkv = _conv_first(dev, ops, toks, t)
        n_s, n_t = toks.shape
        q = _unit(qkv[..., : Hk * S].reshape(n_s, n_t, Hk, S))
        k = _unit(qkv[..., Hk * S : 2 * Hk * S].reshape(n_s, n_t, Hk, S))
        v = qkv[..., 2 * Hk * S :].reshape(n_s, n_t, Hv, S)
        o = dev.alloc((n_s, n_t, Hv, S))
        args = [q, k, v, t["g"][toks], t["beta"][toks]]
        ops.call("gated_delta_net", *(dev.upload(np.ascontiguousarray(a)) for a in args), o)
        return np.concatenate([qkv, dev.download(o).reshape(n_s, n_t, -1)], axis=-1)

    return Family(name, spec, forward, tables)


def _shortconv(spec: RecurrentLayerSpec) -> Family:
    p = spec.params

    def tables(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"emb": _n(rng, VOCAB, p["channels"]), "conv": _n(rng, p["channels"], p["d_conv"])}

    def forward(dev: Device, ops: Any, toks: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
        return _conv_first(dev, ops, toks, t)

    return Family("shortconv", spec, forward, tables)


def _linear(name: str, spec: RecurrentLayerSpec) -> Family:
    p = spec.params
    H = p["n_head"]
    S = p.get("head_size", p.get("head_dim"))
    D = H * S
    rwkv = name != "gla"

    def tables(rng: np.random.Generator) -> dict[str, np.ndarray]:
        t = {"emb": _n(rng, VOCAB, D), "mix": _n(rng, D, 6 * D, scale=0.4), "u": _n(rng, H, S)}
        t["emb2"] = _n(rng, VOCAB, D)
        return t

    def forward(dev: Device, ops: Any, toks: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
        n_s, n_t = toks.shape
        x = t["emb"][toks]
        prev = ops.shift(x, 0) if rwkv else np.zeros_like(x)
        proj = ((x + 0.6 * prev) @ t["mix"]).reshape(n_s, n_t, 6, H, S)
        r, k, v = proj[:, :, 0], proj[:, :, 1], proj[:, :, 2]
        o = dev.alloc((n_s, n_t, H, S))
        if name == "rwkv6":
            w = -np.exp(np.minimum(proj[:, :, 3], 2.0))
            args = [r, k, v, w, t["u"]]
        elif name == "rwkv7":
            kk = _unit(proj[:, :, 4])
            iclr = 1.0 / (1.0 + np.exp(-proj[:, :, 5]))
            args = [r, -0.6 / (1.0 + np.exp(-proj[:, :, 3])), k, v, -kk, kk * iclr]
        else:
            args = [r, k, v, -np.log1p(np.exp(-proj[:, :, 3])) / 4.0]
        op = {"rwkv6": "rwkv_wkv6", "rwkv7": "rwkv_wkv7", "gla": "gated_linear_attn"}[name]
        ops.call(op, *(dev.upload(np.ascontiguousarray(a, dtype=np.float32)) for a in args), o)
        out = dev.download(o).reshape(n_s, n_t, D)
        if not rwkv:
            return out
        x2 = (out + t["emb2"][toks]).astype(np.float32)  # the channel mixing's input exists only now
        return np.concatenate([prev, out, ops.shift(x2, 1)], axis=-1)

    return Family(name, spec, forward, tables)


FAMILIES = [
    _mamba("mamba1", RecurrentLayerSpec.mamba1(d_inner=4, d_state=3, d_conv=3)),
    _mamba("mamba2", RecurrentLayerSpec.mamba2(d_inner=4, d_state=3, d_conv=3, n_group=1, head_dim=2)),
    _delta("gdn", RecurrentLayerSpec.gdn(n_head=2, head_dim=3, d_conv=3, n_head_k=1)),
    _delta("kda", RecurrentLayerSpec.kda(n_head=2, head_dim=3, d_conv=4)),
    _shortconv(RecurrentLayerSpec.shortconv(n_embd=5, l_cache=3)),
    _linear("rwkv6", RecurrentLayerSpec.rwkv6(n_embd=6, head_size=3)),
    _linear("rwkv7", RecurrentLayerSpec.rwkv7(n_embd=6, head_size=3)),
    _linear("gla", RecurrentLayerSpec.gla(n_head=2, head_dim=3)),
]


def test_every_family_of_the_spec_is_covered() -> None:
    from statecache.spec import ROLLBACK_FAMILIES

    assert {f.spec.family for f in FAMILIES} == set(ROLLBACK_FAMILIES)


# -- a memory of one family and its oracle -------------------------------------------------------


class Model:
    def __init__(self, dev: Device, fam: Family, seed: int, n_rs_seq: int = 3) -> None:
        self.dev, self.fam = dev, fam
        self.tables = fam.tables(np.random.default_rng(99))
        self.mem = RecurrentMemory(MemorySpec.build(1, {0: fam.spec}), dev, n_seq_max=4, n_rs_seq=n_rs_seq)
        for k, (_, buf) in enumerate(sorted(self.mem.pools[0].items())):
            dev.fill_bytes(buf, seed * 10 + k)  # nothing may rely on zeroed rows
        self.history: dict[int, list[int]] = {}
        self.staged_steps = 0
        self.nmse = NMSE if dev.backend_name == "reference" else NMSE_F32

    def decode(self, batch: dict[int, list[int]], n_ubatch: int = 512) -> None:
        balloc = BatchAllocator(self.mem.n_seq_max)
        balloc.init(Batch.for_sequences(batch, output_all=True), self.mem)
        ctx = self.mem.init_batch(balloc, n_ubatch)
        assert not ctx.status.is_fail, ctx.status
        got: dict[tuple[int, int], np.ndarray] = {}
        while True:
            ub = ctx.get_ubatch()
            assert ctx.apply()
            step = ctx.step()
            self.staged_steps += int(step.inputs.staged)
            toks = ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
            y = self.fam.forward(self.dev, StepOps(self.dev, step), toks, self.tables)
            for s in range(ub.n_seqs):
                for t in range(ub.n_seq_tokens):
                    i = s * ub.n_seq_tokens + t
                    for q in ub.seq_id[i]:
                        got[(q, int(ub.pos[i]))] = y[s, t]
            if not ctx.next():
                break
        for seq, toks in batch.items():
            hist = self.history.setdefault(seq, [])
            first = len(hist)
            hist += toks
            want = self.recompute(hist)
            for j in range(first, len(hist)):
                err = _nmse(got[(seq, j)], want[j])
                assert err < self.nmse, f"{self.fam.name}: sequence {seq} position {j}: NMSE {err:.2e} vs a recompute"

    def recompute(self, tokens: list[int]) -> np.ndarray:
        ops = RecomputeOps(self.dev, self.fam.spec)
        return self.fam.forward(self.dev, ops, np.asarray([tokens]), self.tables)[0]

    def seq_rm(self, seq: int, p0: int) -> None:
        assert self.mem.seq_rm(seq, p0, -1), f"rollback of sequence {seq} to {p0} refused"
        del self.history[seq][p0:]

    def seq_cp(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        self.history[dst] = list(self.history[src])


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_fork_rollback_and_save_restore_match_a_recompute(family_device: Device, fam: Family) -> None:
    rng = np.random.default_rng(7)

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    m = Model(family_device, fam, seed=1)
    m.decode({0: toks(5), 1: toks(3)})  # prompts
    m.decode({0: toks(1), 1: toks(1)})  # decode
    m.seq_cp(0, 2)  # fork, then the branches diverge
    m.decode({0: toks(1), 2: toks(2)})
    m.decode({1: toks(4)})  # a 4-token draft of which 2 are accepted
    m.seq_rm(1, len(m.history[1]) - 2)
    m.decode({1: toks(1), 2: toks(1)})
    m.decode({0: toks(3)})
    m.seq_rm(0, len(m.history[0]) - 3)  # undo the whole write: the input-state plane
    m.decode({0: toks(7)}, n_ubatch=5)  # prefill across two ubatches (the tail of n_rs_seq + 1 in one)
    blob = m.mem.state_write(2)
    other = Model(family_device, fam, seed=2)  # restore into another memory, with its own content
    other.decode({0: toks(4), 1: toks(2)})
    other.mem.state_read(blob, 3)
    other.history[3] = list(m.history[2])
    cont = toks(2)
    other.decode({3: list(cont), 0: toks(1)})
    m.decode({2: list(cont)})  # the source continues identically

    # a step whose reads must be staged: sequence 1 holds cell 0 and sequence 0 cell 1, then both step
    s = Model(family_device, fam, seed=3)
    s.decode({1: toks(2)})
    s.decode({0: toks(3)})
    assert s.mem.cell_of(1) == 0 and s.mem.cell_of(0) == 1
    s.decode({0: toks(2), 1: toks(2)})  # one ubatch of both: the sort swaps their cells
    assert s.staged_steps >= 1
    s.decode({0: toks(2), 1: toks(1)})


@pytest.mark.parametrize("name", ["rwkv6", "rwkv7"])
def test_token_shift_parts_are_refused_twice_and_out_of_range(ref_device, name: str) -> None:
    from statecache.errors import ArgumentError

    fam = next(f for f in FAMILIES if f.name == name)
    m = Model(ref_device, fam, seed=4)
    balloc = BatchAllocator(4)
    balloc.init(Batch.for_sequences({0: [1, 2]}, output_all=True), m.mem)
    ctx = m.mem.init_batch(balloc, 512)
    assert ctx.apply()
    step = ctx.step()
    dev = ref_device
    x = dev.upload(np.ones((1, 2, 6), np.float32))
    prev = dev.alloc((1, 2, 6))
    with pytest.raises(ArgumentError, match="part"):
        step.shift(0, x, prev, part=2)  # token_shift_count is 2
    with pytest.raises(ArgumentError, match="x"):
        step.shift(0, dev.upload(np.ones((1, 2, 5), np.float32)), dev.alloc((1, 2, 5)), part=0)
    step.shift(0, x, prev, part=1)  # parts may come in any order
    with pytest.raises(ArgumentError, match="part"):
        step.shift(0, x, prev, part=1)
    step.shift(0, x, prev, part=0)


@pytest.mark.parametrize("name", ["rwkv6", "rwkv7", "gla"])
def test_wrong_shapes_are_refused_before_anything_is_written(ref_device, name: str) -> None:
    """The step checks the per-token inputs against the ubatch and the layer's rows
    before it zeroes or materialises anything: a refused call leaves every pool as it was."""
    from statecache.errors import ArgumentError

    fam = next(f for f in FAMILIES if f.name == name)
    m = Model(ref_device, fam, seed=5)
    m.decode({0: [1, 2, 3]})
    balloc = BatchAllocator(4)
    balloc.init(Batch.for_sequences({0: [4, 5], 1: [6, 7]}, output_all=True), m.mem)
    ctx = m.mem.init_batch(balloc, 512)
    assert ctx.apply()
    step = ctx.step()
    dev = ref_device
    before = {k: dev.download(b) for k, b in m.mem.pools[0].items()}
    H, S = 2, 3
    good = [dev.upload(np.full((2, 2, H, S), -0.1, np.float32)) for _ in range(6)]
    short = dev.upload(np.zeros((2, 1, H, S), np.float32))  # one token instead of the ubatch's two
    wide = dev.upload(np.zeros((2, 2, H + 1, S), np.float32))  # a head too many for the layer's rows
    o = dev.alloc((2, 2, H, S))
    u = dev.upload(np.zeros((H, S), np.float32))
    if name == "rwkv6":
        transposed_u = dev.upload(np.zeros((S, H), np.float32))
        calls = [
            (lambda: step.wkv6(0, short, *good[:3], u, o), "r"),
            (lambda: step.wkv6(0, *good[:3], wide, u, o), "w"),
            (lambda: step.wkv6(0, *good[:4], transposed_u, o), "u"),
        ]
    elif name == "rwkv7":
        calls = [(lambda: step.wkv7(0, *good[:5], short, o), "b"), (lambda: step.wkv7(0, wide, *good[:5], o), "r")]
    else:
        calls = [(lambda: step.gla(0, *good[:3], short, o), "g"), (lambda: step.gla(0, *good[:3], good[0], short), "o")]
    for call, argument in calls:
        with pytest.raises(ArgumentError) as err:
            call()
        assert err.value.argument == argument, err.value
    for k, b in m.mem.pools[0].items():
        np.testing.assert_array_equal(dev.download(b), before[k], err_msg=f"pool {k} after refused calls")
