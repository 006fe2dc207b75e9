"""Relaunches that read torch tensors through the DLPack C exchange API.

Where the device has a compiled reader (cpu: sc_dlpack.c) and the tensors'
type publishes ``__dlpack_c_exchange_api__`` (torch 2.13 does), a relaunch reads
and compares every tensor of the call, and makes the alignment and overlap
checks, in one C call (:class:`statecache.dlpack.ExchangeReader`); on the
cpu device that same C call also places the addresses found and runs the
kernel (``launch``: a relaunch is then one call from Python).  These tests
check that these paths are taken and that each decides exactly as the
ordinary path (wrapping every tensor afresh, validating by geometry): the
same results bitwise, and the same refusals, for any sequence of calls whose
tensors keep or change their geometry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tensors_args import _POSITIONAL, _host, _stateful_hosts, _tensor

from statecache import dlpack
from statecache.errors import ArgumentError
from statecache.hostmem import as_array
from statecache.launch_memo import STORAGE_WRITES
from statecache.registry import get_device
from statecache.tensor_args import Relaunches

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
pytestmark = pytest.mark.skipif(
    not dlpack.exchange_function(torch.Tensor), reason="this torch publishes no DLPack C exchange API"
)

WEIGHTS = {"weight", "bias", "A", "D", "dt_bias"}


def _cpu():  # type: ignore[no-untyped-def]
    dev = get_device("cpu")
    assert dev._exchange_reader is not None
    return dev


def test_the_reading_is_the_tensor_s_geometry() -> None:
    dev = _cpu()
    reader = dev._exchange_reader
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)[:, 1:, ::2]
    address, ndim, dtype, device, *rest = reader.reading(t)
    assert address == t.data_ptr() and ndim == 3
    assert tuple(rest[:3]) == tuple(t.shape) and tuple(rest[3:]) == t.stride()
    assert dtype == dlpack.KDL_FLOAT | 32 << 8 | 1 << 16 and device == dlpack.KDL_CPU
    p = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))  # requires grad: read all the same
    assert reader.reading(p)[:3] == (p.data_ptr(), 1, dlpack.KDL_BFLOAT | 16 << 8 | 1 << 16)
    assert reader.reading(np.zeros(3)) is None  # no exchange API: not read in C
    assert reader.reading(torch.empty(2, device="meta")) in (None, reader.reading(torch.empty(2, device="meta")))


def _call(dev, op: str, args: dict) -> None:  # type: ignore[no-untyped-def,type-arg]
    positional = [args[n] for n in _POSITIONAL[op]]
    getattr(dev, op)(*positional, **{n: v for n, v in args.items() if n not in _POSITIONAL[op]})


def _plans(dev) -> int:  # type: ignore[no-untyped-def]
    """How many remembered geometries are matched in C."""
    relaunches = dev._relaunches
    if relaunches is None:
        return 0
    return sum(entry.plan is not None for chain in relaunches._chains.values() for entry in chain)


def _entries(relaunches: Relaunches) -> list:  # type: ignore[type-arg]
    return [entry for chain in relaunches._chains.values() for entry in chain]


def _launched_in_c(relaunches: Relaunches) -> int:
    """How many remembered geometries are matched and launched in one C call (a block)."""
    return sum(entry.fused is not None for entry in _entries(relaunches))


#: How a step passes x, y (and, for the scan, dt): the remembered geometry at new addresses, or a change.
VARIANTS = (
    *("same", "same", "same", "strided", "f16", "short", "y_over_x", "y_is_x", "clone", "misaligned", "x_in_pool"),
    "negative_view",  # torch's lazy negation: the memory holds the values without their sign
)


def _materialize(op: str, hosts: dict, variant: str, pool, rows) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """One world's arguments for a step: fresh tensors (weights as parameters that require grad)."""
    x_name, y_name = ("x", "y") if op != "gated_delta_net" else ("q", "o")
    args: dict = {"pool": pool, "start_rows": rows, "dst_rows": rows}  # type: ignore[type-arg]
    for name, host in hosts.items():
        if name in args:
            continue
        if name in WEIGHTS:
            args[name] = torch.nn.Parameter(torch.from_numpy(host.copy()))
        else:
            args[name] = _tensor(host)
    x = args[x_name]
    if variant == "strided":
        big = torch.zeros(*x.shape[:-1], 2 * x.shape[-1])
        view = big[..., ::2]
        view.copy_(x)
        args[x_name] = view
    elif variant == "f16":
        args[x_name] = x.to(torch.float16)
    elif variant == "short":
        args[x_name] = x[:1]
    elif variant == "y_over_x":
        n = x.numel()
        storage = torch.zeros(2 * n)
        storage[:n].copy_(x.reshape(-1))
        args[x_name] = storage[:n].view(x.shape)
        args[y_name] = storage[n // 2 : n // 2 + n].view(args[y_name].shape)
    elif variant == "y_is_x":
        args[y_name] = args[x_name]
    elif variant == "x_in_pool":  # an input over the state pool's memory (a torch view of the Buffer)
        args[x_name] = torch.from_numpy(as_array(pool)).view(-1)[: x.numel()].view(x.shape)
    elif variant == "clone":
        args[x_name] = x.clone()
    elif variant == "negative_view":
        args[x_name] = (-x)._neg_view()  # the same values, seen through a negation view
    elif variant == "misaligned":  # one byte off its 4-byte elements (NumPy memory: torch allows it)
        raw = np.zeros(4 * x.numel() + 1, np.uint8)[1:].view(np.float32).reshape(tuple(x.shape))
        raw[...] = x.numpy()
        args[x_name] = torch.from_numpy(raw)
    return args


def _outcome(dev, op: str, args: dict, outputs: set[str], pool) -> tuple:  # type: ignore[no-untyped-def,type-arg]
    try:
        _call(dev, op, args)
    except ArgumentError as exc:
        return ("refused", str(exc), dev.download(pool).tobytes())
    return ("done", tuple(_host(args[n]).tobytes() for n in sorted(outputs)), dev.download(pool).tobytes())


@settings(max_examples=25, deadline=None)
@given(
    op=st.sampled_from(["ssm_conv", "ssm_scan", "gated_delta_net"]),
    variants=st.lists(st.sampled_from(VARIANTS), min_size=4, max_size=10),
    seed=st.integers(0, 2**16),
    launched=st.booleans(),
)
def test_c_matching_decides_as_freshly_wrapped_buffers(op, variants, seed, launched) -> None:  # type: ignore[no-untyped-def]
    """Two worlds from one state: one relaunches (tensors matched in C, and
    with ``launched`` the kernel run in that same C call; else the addresses
    returned to Python and the call run from there), the other takes the
    ordinary path every call (no relaunches: every tensor wrapped, the call
    matched by geometry or validated).  Every step, with the tensors'
    geometry kept or changed (strides, dtype, shape, an output over an input,
    one tensor as input and output), both give the same outputs and pool
    bitwise, or both refuse with the same message."""
    dev = _cpu()
    hosts, _, outputs = _stateful_hosts(op, np.random.default_rng(seed), 2)
    rows_host = hosts["start_rows"].astype(np.int32)
    pool, ref_pool = dev.upload(hosts["pool"]), dev.upload(hosts["pool"])
    rows, ref_rows = dev.indices(rows_host), dev.indices(rows_host)
    mine = Relaunches()
    keep = []
    blocks = 0
    with torch.no_grad():
        for step, variant in enumerate(["same", "same", *variants]):
            step_hosts, _, _ = _stateful_hosts(op, np.random.default_rng([seed, step]), 2)
            step_hosts = {n: hosts[n] if n in WEIGHTS else h for n, h in step_hosts.items()}
            args = _materialize(op, step_hosts, variant, pool, rows)
            ref = _materialize(op, step_hosts, variant, ref_pool, ref_rows)
            dev._relaunches = mine
            got = _outcome(dev, op, args, outputs, pool)
            blocks = max(blocks, _launched_in_c(mine))
            if not launched:
                for entry in _entries(mine):
                    entry.fused = None  # the plan's match, then the Python launch
            dev._relaunches = None  # the ordinary path (whatever it learns is dropped)
            want = _outcome(dev, op, ref, outputs, ref_pool)
            dev._relaunches = None
            assert got[0] == want[0], f"step {step} ({variant}): {got[0]} vs {want[0]}"
            assert got[1:] == want[1:], f"step {step} ({variant})"
            keep.append((args, ref))  # new addresses every step
    assert sum(entry.plan is not None for chain in mine._chains.values() for entry in chain) >= 1
    assert blocks >= 1  # every op relaunched here can be launched from C


def test_a_decode_loop_is_relaunched_through_c(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Fresh tensors every step, weights as parameters that require grad: from
    the third step on every call is relaunched, its tensors matched in C
    (the Python readers of torch tensors are never called)."""
    dev = _cpu()
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(3), 2)
    rows = dev.indices(hosts["start_rows"].astype(np.int32))
    pool = dev.upload(hosts["pool"])
    dev._relaunches = Relaunches()
    calls = [0]
    real_run = Relaunches.relaunched

    def counting(self, *a):  # type: ignore[no-untyped-def]
        done = real_run(self, *a)
        calls[0] += done
        return done

    monkeypatch.setattr(Relaunches, "relaunched", counting)
    keep = []
    with torch.no_grad():
        for step in range(6):
            if step == 3:  # from here on nothing may read a tensor's geometry in Python
                monkeypatch.setattr(torch.Tensor, "stride", _forbidden)
            args = _materialize("ssm_scan", hosts, "same", pool, rows)
            _call(dev, "ssm_scan", args)
            keep.append(args)
    assert calls[0] >= 4
    assert _plans(dev) >= 1 and _launched_in_c(dev._relaunches) >= 1
    dev._relaunches = None


def _decode_entry(dev, hosts, pool, rows, keep):  # type: ignore[no-untyped-def]
    """The remembered scan geometry of a few decode steps with fresh tensors."""
    with torch.no_grad():
        for _ in range(3):
            args = _materialize("ssm_scan", hosts, "same", pool, rows)
            _call(dev, "ssm_scan", args)
            keep.append(args)
    entries = [e for e in _entries(dev._relaunches) if e.fused is not None]
    assert len(entries) == 1
    return entries[0]


def _given(args: dict) -> tuple:  # type: ignore[type-arg]
    names = ("pool", "start_rows", "dst_rows", "x", "dt", "A", "B", "C", "y", "cu_seqlens", "D", "z", "dt_bias")
    return tuple(args.get(n) for n in names)


def test_a_launch_running_in_another_thread_leaves_the_call_to_the_ordinary_path() -> None:
    """While a block's kernel runs (without the GIL) its structs hold that
    call's pointers: a second thread's launch of the same block does
    nothing and says False, and the call takes the ordinary path, with the
    result of a call never relaunched."""
    dev = _cpu()
    hosts, _, outputs = _stateful_hosts("ssm_scan", np.random.default_rng(7), 2)
    rows_host = hosts["start_rows"].astype(np.int32)
    pool, ref_pool = dev.upload(hosts["pool"]), dev.upload(hosts["pool"])
    rows, ref_rows = dev.indices(rows_host), dev.indices(rows_host)
    dev._relaunches = mine = Relaunches()
    keep: list = []  # type: ignore[type-arg]
    entry = _decode_entry(dev, hosts, pool, rows, keep)
    dev._relaunches = None
    with torch.no_grad():
        for _ in range(3):  # the other world in the same state
            _call(dev, "ssm_scan", _materialize("ssm_scan", hosts, "same", ref_pool, ref_rows))
    block = entry.run.keep[2]  # the int64 words: [0] is busy
    with torch.no_grad():
        args = _materialize("ssm_scan", hosts, "same", pool, rows)
        plan = entry.plan
        block[0] = 1
        try:
            assert plan.launch(_given(args), plan.words, entry.c_fixed, entry.c_shadows, entry.run.block, 1) is False
            dev._relaunches = mine
            before = len(mine)
            _call(dev, "ssm_scan", args)  # relaunched() says False: validated by geometry instead
            assert block[0] == 1  # (not the launch's to clear)
        finally:
            block[0] = 0
        dev._relaunches = None
        ref = _materialize("ssm_scan", hosts, "same", ref_pool, ref_rows)
        _call(dev, "ssm_scan", ref)
    assert len(mine) == before
    for name in outputs:
        assert _host(args[name]).tobytes() == _host(ref[name]).tobytes()
    assert dev.download(pool).tobytes() == dev.download(ref_pool).tobytes()


def test_launch_refuses_what_is_not_a_block_call() -> None:
    """Arguments of the wrong kind, a block naming no kernel, a thread count
    below one: a clear error, nothing run."""
    dev = _cpu()
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(9), 2)
    pool = dev.upload(hosts["pool"])
    rows = dev.indices(hosts["start_rows"].astype(np.int32))
    dev._relaunches = Relaunches()
    keep: list = []  # type: ignore[type-arg]
    entry = _decode_entry(dev, hosts, pool, rows, keep)
    dev._relaunches = None
    plan, block = entry.plan, entry.run.keep[2]
    snapshot = dev.download(pool).tobytes()
    with torch.no_grad():
        given = _given(_materialize("ssm_scan", hosts, "same", pool, rows))
        with pytest.raises(TypeError, match="launch"):
            plan.launch(given, plan.words, list(entry.c_fixed), entry.c_shadows, entry.run.block, 1)
        with pytest.raises(TypeError, match="launch"):
            plan.launch(given, plan.words, entry.c_fixed, entry.c_shadows, entry.run.block)
        with pytest.raises(ValueError, match="n_threads"):
            plan.launch(given, plan.words, entry.c_fixed, entry.c_shadows, entry.run.block, 0)
        kernel = block[1]
        block[1] = 99
        try:
            with pytest.raises(ValueError, match="no kernel"):
                plan.launch(given, plan.words, entry.c_fixed, entry.c_shadows, entry.run.block, 1)
        finally:
            block[1] = kernel
        assert dev.download(pool).tobytes() == snapshot
        assert plan.launch(given, plan.words, entry.c_fixed, entry.c_shadows, entry.run.block, 1) is True
    assert dev.download(pool).tobytes() != snapshot


def _forbidden(*_: object) -> None:
    raise AssertionError("a relaunch matched in C read a stride in Python")


def test_every_device_gets_the_same_live_builtins() -> None:
    """The library's readers are made once and handed out as new references
    (a device made again, as tests do, must not free what another holds)."""
    import gc

    from statecache.backends.cpu.device import _helpers

    dev = _cpu()
    readers = [_helpers(dev._ffi, dev._lib) for _ in range(50)]
    del readers
    gc.collect()
    again, place = _helpers(dev._ffi, dev._lib)
    assert again is not None and again._match is dev._exchange_reader._match and place is dev._place
    assert again._launch is dev._exchange_reader._launch and again.launches
    t = torch.arange(6.0)
    assert again.reading(t)[:2] == (t.data_ptr(), 1)


def test_the_c_match_checks_the_fixed_positions_and_index_shadows() -> None:
    """The plan's match also makes the checks relaunched() made in Python
    before and after it: a fixed position must hold the very Buffer validated
    there (a dead one's reference matches nothing, not even None), None where
    None was; an index Buffer must still hold the host copy it was validated
    with, told by its storage's write count (else False: the ordinary path
    refreshes it)."""
    import weakref

    dev = _cpu()
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(5), 2)
    rows = dev.indices(hosts["start_rows"].astype(np.int32))
    pool = dev.upload(hosts["pool"])
    dev._relaunches = mine = Relaunches()
    keep = []
    with torch.no_grad():
        for _ in range(3):
            args = _materialize("ssm_scan", hosts, "same", pool, rows)
            _call(dev, "ssm_scan", args)
            keep.append(args)
        entries = [e for chain in mine._chains.values() for e in chain if e.plan is not None]
        assert entries
        entry = entries[0]
        args = _materialize("ssm_scan", hosts, "same", pool, rows)
        given = tuple(args.get(n) for n in ("pool", "start_rows", "dst_rows", "x", "dt", "A", "B", "C", "y",
                                            "cu_seqlens", "D", "z", "dt_bias"))  # fmt: skip
        plan = entry.plan
        match = plan.match
        assert isinstance(match(given, plan.words, entry.c_fixed, entry.c_shadows), list)
        assert entry.c_fixed[:2] == (0, entry.fixed[0][1])  # the pool's weak reference
        other = dev.upload(hosts["pool"])
        moved = (other, *given[1:])
        assert match(moved, plan.words, entry.c_fixed, entry.c_shadows) is None  # another pool Buffer
        none_at = entry.c_fixed.index(None) - 1  # a position that held None (cu_seqlens)
        dead = weakref.ref(dev.upload(hosts["pool"]))
        assert dead() is None
        fixed = list(entry.c_fixed)
        fixed[none_at + 1] = dead
        assert match(given, plan.words, tuple(fixed), entry.c_shadows) is None  # dead: not taken for None
        filled = tuple(rows if p == entry.c_fixed[none_at] else g for p, g in enumerate(given))
        assert match(filled, plan.words, entry.c_fixed, entry.c_shadows) is None  # something where None was
        writes, storage, count = entry.c_shadows  # the rows Buffer (start and destination rows)
        assert writes is STORAGE_WRITES and storage == id(rows.storage) and count == STORAGE_WRITES[storage]
        assert match(given, plan.words, entry.c_fixed, (writes, storage, count + 1)) is False  # written since
        assert match(given, plan.words, entry.c_fixed, (writes, storage + 64, count)) is False  # no such storage
        assert match(given, plan.words, entry.c_fixed, ([], storage, count)) is False  # not the counts
        assert match(given, plan.words, entry.c_fixed, (writes, storage)) is False  # malformed
        dev.write(rows, hosts["start_rows"].astype(np.int32))  # the same values, written again
        assert match(given, plan.words, entry.c_fixed, entry.c_shadows) is False
        with pytest.raises(TypeError):
            match(given, plan.words, list(entry.c_fixed), entry.c_shadows)
    dev._relaunches = None


def test_relaunches_from_threads_while_their_entries_are_dropped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two threads run decode loops with fresh tensors on pools of their own
    (relaunched through C, each kernel running without the GIL) while a third
    drops every remembered geometry again and again (the entries of running
    kernels among them): every pool and output ends bitwise as when the same
    loops run one after the other, never relaunched.  (A stress test: freed
    memory is seldom reused at once, so the ownership a running launch needs
    is asserted directly in the test below.)"""
    import threading
    import time

    dev = _cpu()
    # 128 KiB of state per row: kernels long enough to overlap, and large enough to run without the GIL
    # (sc_dlpack.c's SC_LAUNCH_GIL_WORK: 1 token x 32768 state elements)
    H, P, N, n_s, steps = 8, 64, 64, 2, 40

    def step_args(rng: np.random.Generator) -> dict:  # type: ignore[type-arg]
        u = lambda *shape: torch.from_numpy(rng.uniform(-1, 1, shape).astype(np.float32))  # noqa: E731
        return {"x": u(n_s, 1, H, P), "dt": u(n_s, 1, H), "B": u(n_s, 1, 1, N), "C": u(n_s, 1, 1, N),
                "y": torch.empty(n_s, 1, H, P)}  # fmt: skip

    A = torch.nn.Parameter(-torch.rand(H) - 0.5)

    def loop(seed: int, outputs: list) -> tuple[Any, list]:  # type: ignore[type-arg]
        rng = np.random.default_rng(seed)
        pool = dev.upload(np.zeros((4, H * P * N), np.float32))
        rows = dev.indices(np.array([2, 0], np.int32))
        with torch.no_grad():
            for _ in range(steps):
                a = step_args(rng)
                dev.ssm_scan(pool, rows, rows, a["x"], a["dt"], A, a["B"], a["C"], a["y"])
                outputs.append(_host(a["y"]).tobytes())
        return dev.download(pool).tobytes(), outputs

    dev._relaunches = None
    want = [loop(seed, []) for seed in (1, 2)]
    dev._relaunches = mine = Relaunches()
    got: list = [None, None]  # type: ignore[type-arg]
    done = threading.Event()
    relaunched: list[bool] = []
    real = Relaunches.relaunched

    def counting(self, *a):  # type: ignore[no-untyped-def]
        relaunched.append(real(self, *a))
        return relaunched[-1]

    monkeypatch.setattr(Relaunches, "relaunched", counting)

    def worker(i: int) -> None:
        got[i] = loop(i + 1, [])

    def dropper() -> None:
        while not done.is_set():
            mine.clear()  # (the entries are freed at once: nothing else refers to them)
            time.sleep(0)  # (the GIL to the workers)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    drop = threading.Thread(target=dropper)
    drop.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    drop.join()
    dev._relaunches = None
    assert got == want
    assert sum(relaunched) >= 4  # (each thread: validated, matched by geometry, then relaunched until dropped)


def test_what_relaunched_holds_while_a_kernel_runs_owns_the_block() -> None:
    """relaunched() holds the entry's fused tuple until the launch returns;
    that tuple alone keeps the launch closure (owner of the block and of the
    structs its words point into) alive once the entry is dropped."""
    import gc
    import weakref

    dev = _cpu()
    hosts, _, _ = _stateful_hosts("ssm_scan", np.random.default_rng(11), 2)
    pool = dev.upload(hosts["pool"])
    rows = dev.indices(hosts["start_rows"].astype(np.int32))
    dev._relaunches = mine = Relaunches()
    keep: list = []  # type: ignore[type-arg]
    entry = _decode_entry(dev, hosts, pool, rows, keep)
    dev._relaunches = None
    fused, owner = entry.fused, weakref.ref(entry.run)
    assert fused[4] == entry.run.block
    del entry
    mine.clear()
    gc.collect()
    assert owner() is not None and owner().keep[2] is not None
    del fused
    gc.collect()
    assert owner() is None
