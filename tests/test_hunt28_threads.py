"""Remembered cpu calls from two Python threads at once, and with the thread
count changed between calls: every result equals the fresh call's, bitwise."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from test_launch_probe import CASES, _fresh, _upload

from statecache.backends.cpu.device import CpuDevice, load_kernels

ffi, lib, why = load_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason=f"the C kernels are not usable here: {why}")


def _expected(name: str, steps: int) -> dict[str, np.ndarray]:
    case = CASES[name]
    arrays, written, _, _ = case
    host = {k: v.copy() for k, v in arrays.items()}
    oracle = CpuDevice(ffi, lib)
    for _ in range(steps):
        host.update(_fresh(oracle, case, host))
    return {k: host[k] for k in written}


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_python_threads_running_remembered_calls_at_once(name: str) -> None:
    """Each thread its own written Buffers, the inputs shared: the blocks are
    read by both at once (the GIL released for big calls, not for these)."""
    arrays, written, _, call = CASES[name]
    steps = 40
    want = _expected(name, steps)
    dev = CpuDevice(ffi, lib)
    shared = _upload(dev, {k: v for k, v in arrays.items() if k not in written})
    mine = [shared | _upload(dev, {k: arrays[k] for k in written}) for _ in range(2)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(bufs: dict[str, Any]) -> None:
        try:
            barrier.wait()
            for _ in range(steps):
                call(dev, bufs)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(b,)) for b in mine]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for bufs in mine:
        for k in written:
            np.testing.assert_array_equal(dev.download(bufs[k]), want[k], err_msg=f"{name}: {k}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_thread_count_changed_between_remembered_calls(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays, written, _, call = CASES[name]
    counts = ["1", "2", "3", "1", None, "2"]
    want = _expected(name, len(counts))
    dev = CpuDevice(ffi, lib)
    bufs = _upload(dev, arrays)
    seen = []
    for n in counts:
        if n is None:
            monkeypatch.delenv("STATECACHE_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("STATECACHE_NUM_THREADS", n)
        seen.append(dev._threads())
        call(dev, bufs)
    assert seen[:4] == [1, 2, 3, 1] and seen[5] == 2
    for k in written:
        np.testing.assert_array_equal(dev.download(bufs[k]), want[k], err_msg=f"{name}: {k}")


def test_remembered_row_copies_big_enough_to_release_the_gil_from_two_threads() -> None:
    """Calls of at least SC_LAUNCH_GIL_WORK elements run without the GIL: two threads
    running their remembered blocks at once, each into its own pool, copy exactly."""
    rng = np.random.default_rng(3)
    rows, width = 6, 1 << 15
    dev = CpuDevice(ffi, lib)
    src = dev.upload(rng.standard_normal((rows, width)).astype(np.float32))
    pools = [dev.upload(np.zeros((rows, width), np.float32)) for _ in range(2)]
    picks = [(dev.indices([0, 5, 2]), dev.indices([1, 3, 4])), (dev.indices([4, 1]), dev.indices([0, 2]))]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            barrier.wait()
            for _ in range(30):
                dev.copy_rows(src, picks[k][0], pools[k], picks[k][1])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    host = dev.download(src)
    for k in range(2):
        want = np.zeros((rows, width), np.float32)
        want[dev.index_values(picks[k][1])] = host[dev.index_values(picks[k][0])]
        np.testing.assert_array_equal(dev.download(pools[k]), want)
    assert any(isinstance(e.launch.__self__[0], bytes) for e in dev._launches._entries.values() if e.launch)
