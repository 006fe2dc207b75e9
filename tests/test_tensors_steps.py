"""``step.conv`` / ``step.scan`` / ``step.delta`` with torch tensors: the
recurrent memory driven by fresh tensors every call (parameters that require
grad included) computes, bitwise, what it computes with Buffers, through
prefill, decode, new sequences, reordered cells and rollback."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import recurrent_toy as toy
from recurrent_toy import Toy

from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError
from statecache.registry import get_device

torch = pytest.importorskip("torch", reason="the torch extra is not installed")


def run_layers_with_tensors(dev, step, tables, toks):  # type: ignore[no-untyped-def]
    """recurrent_toy.run_layers, every argument a fresh torch tensor (weights and A parameters)."""
    n_s, n_t = toks.shape
    outs = []
    for L in (0, 2):
        xc = torch.from_numpy(tables.conv_x[L][toks])
        wc = torch.nn.Parameter(torch.from_numpy(tables.conv_w[L].copy()))
        yc = torch.empty(n_s, n_t, toy.CH)
        step.conv(L, xc, wc, yc)
        if L == 0:
            args = [torch.from_numpy(a) for a in (tables.x[toks], tables.dt[toks])]
            args.append(torch.nn.Parameter(torch.from_numpy(tables.A.copy())))
            args += [torch.from_numpy(a) for a in (tables.B[toks], tables.C[toks])]
            ys = torch.empty(n_s, n_t, toy.H, toy.P)
            step.scan(L, *args, ys)
        else:
            args = [torch.from_numpy(a) for a in (tables.q[toks], tables.k[toks], tables.v[toks], tables.g[toks])]
            args.append(torch.from_numpy(tables.beta[toks]))
            ys = torch.empty(n_s, n_t, toy.HV, toy.S)
            step.delta(L, *args, ys)
        outs += [yc.numpy().reshape(n_s, n_t, -1), ys.numpy().reshape(n_s, n_t, -1)]
    return np.concatenate(outs, axis=-1)


BATCHES = [
    {0: [1, 2, 3], 1: [4, 5, 6]},  # prefill
    {0: [7], 1: [8]},
    {1: [9], 2: [10, 11]},  # a new sequence joins
    {0: [12, 13], 1: [14, 15], 2: [16, 17]},
    {2: [18], 0: [19]},
]


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_steps_with_tensors_equal_steps_with_buffers(device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dev = get_device(device)
    with_buffers, with_tensors = Toy(dev, n_seq_max=4, n_rs_seq=2), Toy(dev, n_seq_max=4, n_rs_seq=2)
    for batch in BATCHES:
        want = with_buffers.decode(batch)
        with torch.no_grad():
            monkeypatch.setattr(toy, "run_layers", run_layers_with_tensors)
            got = with_tensors.decode(batch)
            monkeypatch.undo()
        assert want is not None and got is not None and want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
        if batch is BATCHES[3]:  # roll sequence 1 back one token on both, then continue
            assert with_buffers.mem.seq_rm(1, with_buffers.mem.seq_pos_max(1), -1)
            assert with_tensors.mem.seq_rm(1, with_tensors.mem.seq_pos_max(1), -1)
    for seq in (0, 1, 2):
        for L, tensors in with_buffers.state(seq).items():
            for name, row in tensors.items():
                np.testing.assert_array_equal(with_tensors.state(seq)[L][name], row)


def _decode_step():  # type: ignore[no-untyped-def]
    """A cpu Toy after a prefill of sequence 0, and the step of a decode of sequences 0 and 1."""
    dev = get_device("cpu")
    t = Toy(dev, n_seq_max=2)
    t.decode({0: [1, 2]})
    balloc = BatchAllocator(t.mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [3], 1: [4]}, output_all=True), t.mem)
    ctx = t.mem.init_batch(balloc, 512)
    assert ctx.apply()
    return dev, t, ctx.step()


def test_a_bad_tensor_is_refused_before_anything_is_written() -> None:
    _, t, step = _decode_step()
    pools = {L: {n: b.numpy() for n, b in p.items()} for L, p in t.mem.pools.items()}
    x = torch.zeros(2, 1, toy.CH, dtype=torch.float64)  # not an activation dtype
    with pytest.raises(ArgumentError, match="x: dtype float64"):
        step.conv(0, x, torch.zeros(toy.CH, toy.D_CONV), torch.empty(2, 1, toy.CH))
    for L, p in t.mem.pools.items():
        for n, b in p.items():
            np.testing.assert_array_equal(b.numpy(), pools[L][n])
    step.conv(0, x.float(), torch.zeros(toy.CH, toy.D_CONV), torch.empty(2, 1, toy.CH))  # corrected: runs


def test_temporary_tensors_given_to_a_step_stay_allocated_until_the_kernel_ran(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``step.conv(L, x, torch.zeros(...), torch.empty(...))``: no reference but
    the step's own parameters; they must outlive the launch (regression: a
    use-after-free that crashed the process in a later garbage collection)."""
    dev, _, step = _decode_step()
    freed: list[str] = []
    at_launch: list[list[str]] = []
    impl = dev._ssm_conv

    def launch(*args):  # type: ignore[no-untyped-def]
        at_launch.append(list(freed))
        impl(*args)

    def temporary(name, *shape):  # type: ignore[no-untyped-def]
        out = torch.ones(*shape)
        weakref.finalize(out, freed.append, name)
        return out

    monkeypatch.setattr(dev, "_ssm_conv", launch)
    monkeypatch.setattr(dev, "_prepare_launch", lambda op, args: None)
    step.conv(0, temporary("x", 2, 1, toy.CH), temporary("weight", toy.CH, toy.D_CONV), temporary("y", 2, 1, toy.CH))
    gc.collect()
    assert at_launch == [[]]
    assert sorted(freed) == ["weight", "x", "y"]
