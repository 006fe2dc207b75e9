"""Calls with fresh tensors relaunched by geometry (statecache.tensor_args.Relaunches).

Once a call has been matched by geometry, a later call whose tensors have
the same geometry at other addresses skips wrapping and validation and
relaunches the backend's prepared call with the new addresses.  Every test
here first makes sure that path is taken (it counts relaunches), then
checks that it gives the Buffer result bitwise and keeps every guarantee
of docs/embedding.md ("Passing torch tensors"): overlaps refused, index
Buffers validated by value, misaligned or retyped memory not taken on
trust, nothing kept alive, parameters that require grad accepted.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_tensors_args import _POSITIONAL, _host, _make, _stateful_hosts, _tensor

from statecache.dtypes import DType
from statecache.errors import ArgumentError
from statecache.hostmem import as_array
from statecache.registry import get_device
from statecache.tensor_args import Relaunches

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

WEIGHTS = {"weight", "bias", "A", "D", "dt_bias"}


@pytest.fixture
def relaunches(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """How many calls were relaunched by geometry."""
    count = [0]
    real = Relaunches.relaunched

    def counting(self, *args):  # type: ignore[no-untyped-def]
        done = real(self, *args)
        count[0] += done
        return done

    monkeypatch.setattr(Relaunches, "relaunched", counting)
    return count


def _call(dev, op: str, args: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    positional = [args[n] for n in _POSITIONAL[op]]
    getattr(dev, op)(*positional, **{n: v for n, v in args.items() if n not in _POSITIONAL[op]})


def _as_tensors(dev, hosts: dict, pool, rows, as_buffers: bool = False) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """The arguments as a runtime passes them: fresh tensors, weights as
    parameters that require grad, the memory's pool and row Buffers (or,
    ``as_buffers``, the same call with Buffers only)."""
    out = {}
    for name, host in hosts.items():
        if name == "pool":
            out[name] = pool
        elif name in ("start_rows", "dst_rows"):
            out[name] = rows
        elif as_buffers:
            out[name] = dev.upload(host, DType.parse(host.dtype))
        elif name in WEIGHTS:
            out[name] = torch.nn.Parameter(torch.from_numpy(host.copy()))
        else:
            out[name] = _tensor(host)
    return out


def _as_buffers(dev, hosts: dict, pool, rows) -> dict:  # type: ignore[no-untyped-def,type-arg]
    return _as_tensors(dev, hosts, pool, rows, as_buffers=True)


def _read(dev, value) -> np.ndarray:  # type: ignore[no-untyped-def]
    return _host(value) if hasattr(value, "detach") else dev.download(value)


def _steps(dev, op: str, n_steps: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A decode loop with fresh tensors (kept alive, so each step's land at new
    addresses), checked step by step against the same loop with Buffers.
    Returns the pools and the last step's arguments."""
    rng = np.random.default_rng(seed)
    hosts, _, outputs = _stateful_hosts(op, rng, 2)
    rows_host = hosts["start_rows"].astype(np.int32)
    pool, want_pool = dev.upload(hosts["pool"]), dev.upload(hosts["pool"])
    rows, want_rows = dev.indices(rows_host), dev.indices(rows_host)
    keep = []
    with torch.no_grad():
        for step in range(n_steps):
            step_hosts, _, _ = _stateful_hosts(op, np.random.default_rng([seed, step]), 2)
            step_hosts = {n: hosts[n] if n in WEIGHTS else h for n, h in step_hosts.items()}
            args = _as_tensors(dev, step_hosts, pool, rows)
            want = _as_buffers(dev, step_hosts, want_pool, want_rows)
            _call(dev, op, args)
            _call(dev, op, want)
            for name in outputs:
                np.testing.assert_array_equal(_read(dev, args[name]), dev.download(want[name]), err_msg=f"{op} {name}")
                assert getattr(args[name], "grad_fn", None) is None
            np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool), err_msg=f"{op} step {step}")
            keep.append(args)
    return pool, want_pool, keep[-1], step_hosts


@pytest.mark.parametrize("op", ["ssm_conv", "ssm_scan", "gated_delta_net"])
def test_fresh_tensors_every_step_are_relaunched_and_match_buffers(op, relaunches) -> None:  # type: ignore[no-untyped-def]
    dev = get_device("cpu")
    _steps(dev, op, 6)
    # step 0 validates, step 1 matches by geometry and is remembered, the rest relaunch
    assert relaunches[0] >= 4


def test_an_output_over_an_input_is_refused_after_relaunches(relaunches) -> None:  # type: ignore[no-untyped-def]
    """The same geometry again, now with y over x's memory: refused by name,
    nothing written."""
    dev = get_device("cpu")
    pool, _, last, hosts = _steps(dev, "ssm_scan", 4)
    done = relaunches[0]
    assert done >= 2
    before = dev.download(pool)
    shape = hosts["x"].shape
    n = int(np.prod(shape))
    storage = torch.zeros(2 * n)
    over = {**last, "x": storage[:n].view(shape), "y": storage[n // 2 : n // 2 + n].view(shape)}
    with pytest.raises(ArgumentError, match="y: shares storage with x"):
        _call(dev, "ssm_scan", over)
    # the very same tensor as input and output
    same = torch.zeros(shape)
    with pytest.raises(ArgumentError, match="y: shares storage with x"):
        _call(dev, "ssm_scan", {**last, "x": same, "y": same})
    # an input over the state pool's memory (a torch view of a Buffer)
    in_pool = torch.from_numpy(as_array(pool)).view(-1)[:n].view(shape)
    with pytest.raises(ArgumentError, match="x: overlaps the state pool"):
        _call(dev, "ssm_scan", {**last, "x": in_pool})
    np.testing.assert_array_equal(dev.download(pool), before)
    assert relaunches[0] == done
    # apart again: relaunched
    apart = storage[n:].view(shape)
    _call(dev, "ssm_scan", {**last, "x": storage[:n].view(shape), "y": apart})
    assert relaunches[0] == done + 1


def test_other_dtype_or_strides_at_a_remembered_address_is_not_taken_on_trust(relaunches) -> None:  # type: ignore[no-untyped-def]
    dev = get_device("cpu")
    pool, want_pool, last, hosts = _steps(dev, "ssm_scan", 4)
    shape = hosts["x"].shape
    n = int(np.prod(shape))
    memory = torch.zeros(4 * n)
    x32 = memory[:n].view(shape)
    x32.copy_(torch.from_numpy(hosts["x"]))
    y = torch.zeros(shape)
    want_y = dev.alloc(shape)
    rows = last["start_rows"]
    buffers = _as_buffers(dev, hosts, want_pool, dev.indices(dev.download(rows)))
    _call(dev, "ssm_scan", {**last, "x": x32, "y": y})
    _call(dev, "ssm_scan", {**buffers, "x": dev.upload(hosts["x"]), "y": want_y})
    np.testing.assert_array_equal(y.numpy(), dev.download(want_y))
    done = relaunches[0]
    # f16 at the same address
    x16 = memory.view(torch.float16)[:n].view(shape)
    assert x16.data_ptr() == x32.data_ptr()
    x16.copy_(torch.from_numpy(hosts["x"]))
    _call(dev, "ssm_scan", {**last, "x": x16, "y": y})
    _call(dev, "ssm_scan", {**buffers, "x": dev.upload(hosts["x"].astype(np.float16), DType.F16), "y": want_y})
    np.testing.assert_array_equal(y.numpy(), dev.download(want_y))
    # other strides at the same address (every other element)
    wide = memory[: 2 * n].view(*shape[:-1], 2 * shape[-1])[..., ::2]
    assert wide.data_ptr() == x32.data_ptr() and wide.stride() != x32.stride()
    wide.copy_(torch.from_numpy(hosts["x"]) * 2)
    _call(dev, "ssm_scan", {**last, "x": wide, "y": y})
    _call(dev, "ssm_scan", {**buffers, "x": dev.upload(hosts["x"] * 2), "y": want_y})
    np.testing.assert_array_equal(y.numpy(), dev.download(want_y))
    np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool))
    # float64 at the same address: refused by name
    before = dev.download(pool)
    x64 = memory.view(torch.float64)[:n].view(shape)
    assert x64.data_ptr() == x32.data_ptr()
    with pytest.raises(ArgumentError, match="x: dtype float64"):
        _call(dev, "ssm_scan", {**last, "x": x64, "y": y})
    np.testing.assert_array_equal(dev.download(pool), before)
    assert relaunches[0] == done  # none of these were the remembered geometry


def test_misaligned_memory_in_a_remembered_geometry_is_refused(relaunches) -> None:  # type: ignore[no-untyped-def]
    """NumPy arrays can sit at any byte: the geometry matches, the address must still be checked."""
    dev = get_device("cpu")
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(1), 2)
    pool, rows = dev.upload(hosts["pool"]), dev.indices(hosts["start_rows"])
    base = {**hosts, "pool": pool, "start_rows": rows, "dst_rows": rows}
    keep = [(hosts["x"].copy(), np.zeros_like(hosts["y"])) for _ in range(4)]  # new addresses every call
    for x, y in keep:
        _call(dev, "ssm_scan", {**base, "x": x, "y": y})
    assert relaunches[0] >= 2
    raw = np.zeros(hosts["x"].nbytes + 1, np.uint8)[1:].view(np.float32).reshape(hosts["x"].shape)
    before = dev.download(pool)
    with pytest.raises(ArgumentError, match="x: is not aligned"):
        _call(dev, "ssm_scan", {**base, "x": raw, "y": np.zeros_like(hosts["y"])})
    np.testing.assert_array_equal(dev.download(pool), before)


def test_rows_rewritten_after_relaunches_are_validated_again(relaunches) -> None:  # type: ignore[no-untyped-def]
    dev = get_device("cpu")
    pool, want_pool, last, hosts = _steps(dev, "ssm_scan", 4)
    done = relaunches[0]
    rows = last["start_rows"]
    before = dev.download(pool)
    dev.write(rows, np.array([7, 0], np.int32))  # the pool has 4 rows
    with pytest.raises(ArgumentError, match="start_rows"):
        _call(dev, "ssm_scan", {**last, "y": torch.zeros(hosts["y"].shape)})
    np.testing.assert_array_equal(dev.download(pool), before)
    dev.write(rows, np.array([3, 1], np.int32))
    y, want_y = torch.zeros(hosts["y"].shape), dev.alloc(hosts["y"].shape)
    _call(dev, "ssm_scan", {**last, "y": y})
    want_rows = dev.indices([3, 1])
    buffers = _as_buffers(dev, {n: _host(t) if hasattr(t, "detach") else None for n, t in last.items()}, want_pool,
                          want_rows)  # fmt: skip
    _call(dev, "ssm_scan", {**buffers, "y": want_y})
    np.testing.assert_array_equal(y.numpy(), dev.download(want_y))
    np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool))
    assert relaunches[0] == done  # the rewritten rows sent both calls through validation


def test_relaunched_calls_keep_no_tensor_alive(relaunches) -> None:  # type: ignore[no-untyped-def]
    dev = get_device("cpu")
    _, _, last, hosts = _steps(dev, "ssm_scan", 4)
    done = relaunches[0]
    fresh = {n: torch.from_numpy(hosts[n].copy()) for n in ("x", "dt", "B", "C")}
    y = torch.zeros(hosts["y"].shape)
    _call(dev, "ssm_scan", {**last, **fresh, "y": y})
    assert relaunches[0] == done + 1
    refs = [weakref.ref(t) for t in (*fresh.values(), y)]
    del fresh, y, last
    gc.collect()
    assert all(r() is None for r in refs)


@given(
    op=st.sampled_from(["ssm_conv", "ssm_scan", "gated_delta_net"]),
    dtype=st.sampled_from([DType.F32, DType.F16, DType.BF16]),
    plan=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=3, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_any_sequence_of_geometries_gives_the_buffer_result(op, dtype, plan, seed) -> None:  # type: ignore[no-untyped-def]
    """A decode loop whose tensors switch between contiguous and strided
    views, new and reused memory, step by step: every step equals the Buffer
    call (relaunched or not)."""
    dev = get_device("cpu")
    hosts, token_inputs, outputs = _stateful_hosts(op, np.random.default_rng(seed), 2)
    rows_host = hosts["start_rows"].astype(np.int32)
    pool, want_pool = dev.upload(hosts["pool"]), dev.upload(hosts["pool"])
    rows, want_rows = dev.indices(rows_host), dev.indices(rows_host)
    held: dict = {}  # type: ignore[type-arg]  # reused memory: the previous step's tensors
    for step, (strided, reuse) in enumerate(plan):
        step_hosts, _, _ = _stateful_hosts(op, np.random.default_rng([seed, step]), 2)
        args, want = {"pool": pool, "start_rows": rows, "dst_rows": rows}, {
            "pool": want_pool, "start_rows": want_rows, "dst_rows": want_rows}  # fmt: skip
        for name, host in step_hosts.items():
            if name in args:
                continue
            if name in token_inputs | outputs:
                host = host.astype(dtype.numpy)
            view = strided and name in token_inputs
            if reuse and name in held and tuple(held[name].shape) == host.shape and name not in WEIGHTS:
                t = held[name]
                t.copy_(_tensor(host))  # new values in the memory of the step before
            else:
                t = _make(dev, host, "tensor", view)
            args[name] = t
            want[name] = _make(dev, host, "buffer", view)
        _call(dev, op, args)
        _call(dev, op, want)
        for name in outputs:
            np.testing.assert_array_equal(_host(args[name]), dev.download(want[name]), err_msg=f"{op} {name} {step}")
        np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool), err_msg=f"{op} pool {step}")
        held = {n: v for n, v in args.items() if hasattr(v, "copy_")}


def test_a_new_pool_at_a_dead_pools_id_is_validated(relaunches) -> None:  # type: ignore[no-untyped-def]
    """Buffers are keyed by id; a pool freed and another one made at its id
    (CPython reuses them) must not be taken for the remembered one: here the
    new pool has one row, and the remembered rows reach row 3."""
    dev = get_device("cpu")
    pool, _, last, hosts = _steps(dev, "ssm_scan", 4)
    assert relaunches[0] >= 2
    old_id, row_size = id(pool), pool.shape[1]
    del pool, last["pool"]
    gc.collect()
    candidates = []
    for _ in range(200):
        candidates.append(dev.alloc((1, row_size)))
        if id(candidates[-1]) == old_id:
            break
    small = candidates[-1]
    assert id(small) == old_id, "CPython did not reuse the id (the check needs it)"
    done = relaunches[0]
    with pytest.raises(ArgumentError, match="start_rows"):
        _call(dev, "ssm_scan", {**last, "pool": small, "y": torch.zeros(hosts["y"].shape)})
    assert relaunches[0] == done


def test_relaunching_resumes_once_rewritten_rows_are_validated(relaunches) -> None:  # type: ignore[no-untyped-def]
    """Rows rewritten in range: the next call is validated (the remembered
    index shadow is stale), and from the call after on the new rows are
    relaunched, each step still equal to the Buffer call."""
    dev = get_device("cpu")
    pool, want_pool, last, hosts = _steps(dev, "ssm_scan", 4)
    rows = last["start_rows"]
    dev.write(rows, np.array([2, 3], np.int32))
    want_rows = dev.indices([2, 3])
    counts = []
    for step in range(4):
        step_hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng([9, step]), 2)
        step_hosts = {n: hosts[n] if n in WEIGHTS else h for n, h in step_hosts.items()}
        args = {**_as_tensors(dev, step_hosts, pool, rows), **{n: last[n] for n in WEIGHTS & set(last)}}
        want = _as_buffers(dev, step_hosts, want_pool, want_rows)
        with torch.no_grad():
            _call(dev, "ssm_scan", args)
        _call(dev, "ssm_scan", want)
        np.testing.assert_array_equal(args["y"].numpy(), dev.download(want["y"]))
        np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool))
        counts.append(relaunches[0])
    assert counts[-1] - counts[1] == 2  # validated, matched by geometry (learned again), then relaunched


def test_calls_with_and_without_an_option_at_one_pool_are_told_apart(relaunches) -> None:  # type: ignore[no-untyped-def]
    """One pool, one geometry, the gate z passed or not (None) step by step:
    both forms are remembered and relaunched, and each gives its own Buffer
    result (a relaunch never takes None for a tensor, or a tensor for None)."""
    dev = get_device("cpu")
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(5), 2)
    rows_host = hosts["start_rows"].astype(np.int32)
    pool, want_pool = dev.upload(hosts["pool"]), dev.upload(hosts["pool"])
    rows, want_rows = dev.indices(rows_host), dev.indices(rows_host)
    weights = {n: torch.nn.Parameter(torch.from_numpy(hosts[n].copy())) for n in WEIGHTS & set(hosts)}
    keep = []
    with torch.no_grad():
        for step in range(10):
            step_hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng([5, step]), 2)
            gated = step % 2 == 0
            if not gated:
                del step_hosts["z"]
            args = {**_as_tensors(dev, step_hosts, pool, rows), **{n: weights[n] for n in weights}}
            want = _as_buffers(dev, {n: hosts[n] if n in WEIGHTS else h for n, h in step_hosts.items()}, want_pool,
                               want_rows)  # fmt: skip
            _call(dev, "ssm_scan", args)
            _call(dev, "ssm_scan", want)
            np.testing.assert_array_equal(args["y"].numpy(), dev.download(want["y"]), err_msg=f"step {step}")
            np.testing.assert_array_equal(dev.download(pool), dev.download(want_pool), err_msg=f"step {step}")
            keep.append(args)  # new addresses every step
    assert relaunches[0] >= 6  # each form: validated, matched by geometry, then relaunched


def test_a_type_found_lying_is_not_relaunched_any_more(relaunches, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Once any type read directly is found to disagree with its own export
    (statecache.dlpack.confirm_fingerprint), geometries remembered from direct
    readings are not trusted: the call takes the ordinary path."""
    from statecache import dlpack

    dev = get_device("cpu")
    _, _, last, hosts = _steps(dev, "ssm_scan", 4)
    done = relaunches[0]
    assert done >= 2
    y = torch.zeros(hosts["y"].shape)
    monkeypatch.setitem(dlpack.READERS, torch.Tensor, dlpack.READERS[torch.Tensor])  # restored after the test
    probe = torch.zeros(3)
    fp = dlpack.fingerprint(probe)
    assert fp is not None
    lying = (fp[0], fp[1] + 4, *fp[2:])  # a direct reading 4 bytes off the export
    assert not dlpack.confirm_fingerprint(probe, lying, dlpack.describe(probe))
    with torch.no_grad():
        _call(dev, "ssm_scan", {**last, "y": y})
    assert relaunches[0] == done


def test_another_shape_or_device_in_a_remembered_geometry_is_refused(relaunches) -> None:  # type: ignore[no-untyped-def]
    """Strides, dtype and address alike, but x holds one sequence of the two
    the rows name, or lives on another device (torch's meta device, with no
    memory): refused by name, nothing written, never relaunched."""
    dev = get_device("cpu")
    pool, _, last, hosts = _steps(dev, "ssm_scan", 4)
    done = relaunches[0]
    before = dev.download(pool)
    x = last["x"]
    short = x[:1]
    assert short.stride() == x.stride() and short.dtype == x.dtype and short.data_ptr() == x.data_ptr()
    with torch.no_grad(), pytest.raises(ArgumentError, match="shape"):  # (names the first argument x disagrees with)
        _call(dev, "ssm_scan", {**last, "x": short, "y": torch.zeros(hosts["y"].shape)})
    meta = torch.empty(x.shape, device="meta")
    assert meta.stride() == x.stride() and meta.dtype == x.dtype
    with torch.no_grad(), pytest.raises(ArgumentError, match=r"^x: "):
        _call(dev, "ssm_scan", {**last, "x": meta, "y": torch.zeros(hosts["y"].shape)})
    np.testing.assert_array_equal(dev.download(pool), before)
    assert relaunches[0] == done
