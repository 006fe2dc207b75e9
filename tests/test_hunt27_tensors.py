"""Hunt 27: the linear-attention and delta primitives on the tensor surface.

``test_tensors_args`` mixes Buffers, tensors and padded views for conv, scan and
the scalar-gate delta rule in decode; here the RWKV-6, RWKV-7, GLA and KDA
calls (and the delta rule) get torch tensors and NumPy arrays of other
geometries -- transposed (inner stride > 1), offset into a larger tensor,
negative strides -- int32 or int64 index tensors, the packed form with
zero-length sequences, several tokens with snapshot planes, and outputs that
alias an input.  The truth is the reference backend called with contiguous
Buffers; on the cpu device a call with tensors must also give, bitwise, what
the same call with Buffers gives.  A geometry a device refuses must raise
ArgumentError naming the argument and leave the pool and outputs untouched.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from statecache.errors import ArgumentError
from statecache.registry import get_device

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

REF = get_device("reference")
CPU = get_device("cpu")
INPUTS = {
    "rwkv_wkv6": ("r", "k", "v", "w", "u"),
    "rwkv_wkv7": ("r", "w", "k", "v", "a", "b"),
    "gated_linear_attn": ("q", "k", "v", "g"),
    "gated_delta_net": ("q", "k", "v", "g", "beta"),
    "kda": ("q", "k", "v", "g", "beta"),
}
GEOMETRIES = ("contiguous", "offset", "transposed", "reversed")


def _inputs(op: str, rng: np.random.Generator, lead: tuple[int, ...], H: int, S: int) -> dict[str, np.ndarray]:
    u = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)  # noqa: E731
    tok = (*lead, H, S)
    out: dict[str, np.ndarray] = {}
    for name in INPUTS[op]:
        if name == "u":
            out[name] = u(H, S)
        elif name in ("w", "g") and op != "gated_delta_net":
            out[name] = -rng.uniform(0.05, 0.8, tok).astype(np.float32)
        elif name == "g":
            out[name] = -rng.uniform(0.05, 0.8, (*lead, H)).astype(np.float32)
        elif name == "beta":
            out[name] = rng.uniform(0.1, 0.9, (*lead, H)).astype(np.float32)
        elif name in ("a", "b"):
            out[name] = u(*tok) / 4
        elif name in ("q", "k") and op in ("gated_delta_net", "kda"):
            x = u(*tok)
            out[name] = x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
        else:
            out[name] = u(*tok)
    return out


def _geometry(host: np.ndarray, how: str, as_tensor: bool) -> Any:
    """``host``'s values in a tensor / array of the given geometry."""
    if how == "offset":  # a window of a larger buffer, not at its start
        big = np.zeros((*host.shape[:-1], host.shape[-1] + 3), dtype=host.dtype)
        big[..., 2 : 2 + host.shape[-1]] = host
        return torch.from_numpy(big)[..., 2 : 2 + host.shape[-1]] if as_tensor else big[..., 2 : 2 + host.shape[-1]]
    if how == "transposed" and host.ndim >= 2:  # the last two axes stored the other way round
        t = np.ascontiguousarray(np.swapaxes(host, -1, -2))
        return torch.from_numpy(t).transpose(-1, -2) if as_tensor else np.swapaxes(t, -1, -2)
    if how == "reversed":  # negative strides (NumPy only: torch has none)
        t = np.ascontiguousarray(host[..., ::-1])
        return torch.from_numpy(t.copy()).flip(-1) if as_tensor else t[..., ::-1]
    return torch.from_numpy(host.copy()) if as_tensor else host.copy()


def _read(dev: Any, value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().numpy().copy()
    if isinstance(value, np.ndarray):
        return value.copy()
    return dev.download(value)


def _call(dev: Any, op: str, args: dict[str, Any], kw: dict[str, Any]) -> None:
    name = "gated_delta_net" if op == "kda" else op
    getattr(dev, name)(args["pool"], args["start_rows"], args["dst_rows"], *(args[n] for n in INPUTS[op]), args["o"],
                       **kw)  # fmt: skip


@given(
    op=st.sampled_from(sorted(INPUTS)),
    H=st.integers(1, 3),
    S=st.sampled_from([1, 3, 8, 16]),
    lens=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    packed=st.booleans(),
    n_snap=st.integers(1, 4),
    geometry=st.lists(st.sampled_from(GEOMETRIES), min_size=6, max_size=6),
    tensors=st.lists(st.booleans(), min_size=9, max_size=9),
    index_dtype=st.sampled_from([np.int32, np.int64]),
    alias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tensor_geometries_give_the_reference_result(
    op: str, H: int, S: int, lens: list[int], packed: bool, n_snap: int, geometry: list[str],
    tensors: list[bool], index_dtype: Any, alias: bool, seed: int,
) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    n_s = len(lens)
    if not packed:
        lens = [max(1, lens[0])] * n_s  # the equal-length form: n_t >= 1 for every sequence
    T = sum(lens)
    lead = (T,) if packed else (n_s, lens[0])
    hosts = _inputs(op, rng, lead, H, S)
    size = 4
    pool = rng.uniform(-1, 1, (size * n_snap, H * S * S)).astype(np.float32)
    start = rng.permutation(size)[:n_s].astype(index_dtype)
    dst = start.copy()
    kw: dict[str, Any] = {"n_snap": n_snap, "plane_stride": size} if n_snap > 1 else {}
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)

    # the truth: the reference backend with contiguous Buffers
    ref = {n: REF.upload(h) for n, h in hosts.items()}
    ref.update(pool=REF.upload(pool), start_rows=REF.indices(start), dst_rows=REF.indices(dst))
    ref["o"] = REF.alloc((*lead, H, S))
    rkw = dict(kw, cu_seqlens=REF.indices(cu)) if packed else kw
    _call(REF, op, ref, rkw)
    want_pool, want_o = REF.download(ref["pool"]), REF.download(ref["o"])

    # the cpu device with Buffers: the bitwise reference for the tensor call
    buf = {n: CPU.upload(h) for n, h in hosts.items()}
    buf.update(pool=CPU.upload(pool), start_rows=CPU.indices(start), dst_rows=CPU.indices(dst))
    buf["o"] = CPU.alloc((*lead, H, S))
    bkw = dict(kw, cu_seqlens=CPU.indices(cu)) if packed else kw
    _call(CPU, op, buf, bkw)
    buf_pool, buf_o = CPU.download(buf["pool"]), CPU.download(buf["o"])
    np.testing.assert_allclose(buf_pool, want_pool, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(buf_o, want_o, rtol=1e-4, atol=1e-5)

    # the cpu device with tensors / arrays of the drawn geometries
    args: dict[str, Any] = {}
    for i, (n, h) in enumerate(hosts.items()):
        how = geometry[i]
        if how == "reversed" and tensors[i]:
            how = "offset"  # torch has no negative strides
        args[n] = _geometry(h, how, tensors[i])
    t_pool = torch.from_numpy(pool.copy()) if tensors[6] else pool.copy()
    args["pool"] = t_pool
    idx = (lambda a: torch.from_numpy(a.copy())) if tensors[7] else (lambda a: a.copy())
    args["start_rows"], args["dst_rows"] = idx(start), idx(dst)
    first = INPUTS[op][0]
    if alias and geometry[0] == "contiguous" and first not in ("w", "g"):
        args["o"] = args[first]  # the output over an input of the same shape
        event("aliased output")
    else:
        args["o"] = torch.zeros((*lead, H, S)) if tensors[8] else np.zeros((*lead, H, S), np.float32)
    tkw = dict(kw, cu_seqlens=idx(cu)) if packed else kw
    before_pool = _read(CPU, args["pool"])
    try:
        _call(CPU, op, args, tkw)
    except ArgumentError as exc:
        event("refused: " + re.sub(r"[-\d(), ]+", " ", str(exc).split(":", 1)[-1])[:60])
        assert exc.argument, exc
        np.testing.assert_array_equal(_read(CPU, args["pool"]), before_pool, err_msg="a refused call wrote the pool")
        return
    event("accepted")
    np.testing.assert_array_equal(_read(CPU, args["pool"]), buf_pool, err_msg=f"{op}: pool, tensors vs Buffers")
    np.testing.assert_array_equal(_read(CPU, args["o"]), buf_o, err_msg=f"{op}: o, tensors vs Buffers")


@pytest.mark.parametrize("op", sorted(INPUTS))
@pytest.mark.parametrize(("H", "S"), [(1, 64), (2, 48)])
def test_long_prefill_with_snapshots_through_tensors(op: str, H: int, S: int) -> None:
    """Several hundred tokens (past every chunk and tile of the C kernels) of two
    sequences of other lengths, packed, with four snapshot planes, from transposed and
    offset torch tensors: every plane and output as the reference computes them."""
    rng = np.random.default_rng(3)
    lens = [301, 130]
    T, size, n_snap = sum(lens), 3, 4
    hosts = _inputs(op, rng, (T,), H, S)
    pool = rng.uniform(-1, 1, (size * n_snap, H * S * S)).astype(np.float32) / 4
    start, cu = np.array([2, 0]), np.array([0, lens[0], T], np.int32)
    kw = {"n_snap": n_snap, "plane_stride": size}
    ref = {n: REF.upload(h) for n, h in hosts.items()}
    ref.update(
        pool=REF.upload(pool), start_rows=REF.indices(start), dst_rows=REF.indices(start), o=REF.alloc((T, H, S))
    )
    _call(REF, op, ref, dict(kw, cu_seqlens=REF.indices(cu)))
    args = {n: _geometry(h, ("transposed", "offset")[i % 2], True) for i, (n, h) in enumerate(hosts.items())}
    args.update(pool=torch.from_numpy(pool.copy()), start_rows=torch.from_numpy(start.astype(np.int64)))
    args.update(dst_rows=args["start_rows"], o=torch.zeros((T, H, S)))
    _call(CPU, op, args, dict(kw, cu_seqlens=torch.from_numpy(cu)))
    np.testing.assert_allclose(args["pool"].numpy(), REF.download(ref["pool"]), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(args["o"].numpy(), REF.download(ref["o"]), rtol=2e-4, atol=2e-5)


@given(
    op=st.sampled_from(sorted(INPUTS)),
    plan=st.lists(st.sampled_from(["fresh", "same", "rewritten"]), min_size=6, max_size=14),
    rows=st.lists(st.sampled_from(["fresh", "same", "rewritten"]), min_size=14, max_size=14),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_a_decode_loop_of_tensors_relaunched_gives_the_buffer_result(
    op: str, plan: list[str], rows: list[str], index_dtype: Any, seed: int
) -> None:
    """A decode loop on the cpu device whose activations are fresh tensors, the same
    tensors again, or the same tensors rewritten in place (torch ``copy_``), and whose
    row tensors rotate through the planes (new tensors, or one tensor rewritten in place,
    or the same rows again): every step's pool and output equal the same loop with
    Buffers, bitwise (the launch memo and the C relaunch must never replay a stale call)."""
    rng = np.random.default_rng(seed)
    H, S, n_s, size, n_snap = 2, 8, 2, 3, 3
    pool_host = rng.uniform(-1, 1, (size * n_snap, H * S * S)).astype(np.float32) / 4
    t_pool, b_pool = torch.from_numpy(pool_host.copy()), CPU.upload(pool_host)
    cells = np.array([2, 0])
    live = 0
    t_in: dict[str, Any] = {}
    t_start = t_dst = None
    for step, how in enumerate(plan):
        hosts = _inputs(op, np.random.default_rng([seed, step]), (n_s, 1), H, S)
        if how == "fresh" or not t_in:
            t_in = {n: torch.from_numpy(h.copy()) for n, h in hosts.items()}
        elif how == "rewritten":
            for n, h in hosts.items():
                t_in[n].copy_(torch.from_numpy(h))
        else:  # the same tensors, unchanged
            hosts = {n: t.numpy().copy() for n, t in t_in.items()}
        nxt = (live + 1) % n_snap
        start, dst = cells + live * size, cells + nxt * size
        if rows[step] == "same" and t_start is not None:
            nxt = live  # decode in place: the same rows as before
            start = dst = cells + live * size
            t_start = t_dst = torch.from_numpy(start.copy()).to(index_dtype)
        elif rows[step] == "rewritten" and t_start is not None and t_start is not t_dst:
            t_start.copy_(torch.from_numpy(start))
            t_dst.copy_(torch.from_numpy(dst))
        else:
            t_start = torch.from_numpy(start.copy()).to(index_dtype)
            t_dst = torch.from_numpy(dst.copy()).to(index_dtype)
        t_o = torch.zeros((n_s, 1, H, S))
        _call(CPU, op, {"pool": t_pool, "start_rows": t_start, "dst_rows": t_dst, **t_in, "o": t_o}, {})
        b = {n: CPU.upload(h) for n, h in hosts.items()}
        b.update(pool=b_pool, start_rows=CPU.indices(start), dst_rows=CPU.indices(dst), o=CPU.alloc((n_s, 1, H, S)))
        _call(CPU, op, b, {})
        np.testing.assert_array_equal(t_o.numpy(), CPU.download(b["o"]), err_msg=f"{op} step {step} o")
        np.testing.assert_array_equal(t_pool.numpy(), CPU.download(b_pool), err_msg=f"{op} step {step} pool")
        live = nxt
