"""``bench/transfer.py --trace`` times each side's steps of a sequence transfer between
stamps taken where the transfer's internal functions start and end.  If a refactor of
``statecache.distributed.transfer`` renamed or dropped one of them, the trace would
silently lose a step; here a real transfer (over the in-process stand-in for
``isend``/``irecv``, host branches) is traced and every step of both sides must be
there, in order, tiling the side's time from its start to its end."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import threading
import time

import pytest
from dist_fake import FakeDist, run_sender
from dist_memories import garbage_memory

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import statecache  # noqa: E402
from statecache.distributed import recv_sequence, send_sequence  # noqa: E402
from statecache.distributed import transfer as T  # noqa: E402

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "transfer.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_transfer", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("coalesced", ["none", "some", "all"])
def test_the_trace_has_every_step_of_both_sides(monkeypatch, coalesced):
    bench = _bench()
    fake = FakeDist("gloo")
    monkeypatch.setattr(T, "torch_dist", lambda: (torch, fake))
    monkeypatch.setattr(T, "group_device", lambda group=None: torch.device("cpu"))
    src = garbage_memory("hybrid_iswa", statecache.get_device("cpu"), seed=41)
    dst = garbage_memory("hybrid_iswa", statecache.get_device("cpu"), seed=44)
    dst.seq_rm(0, -1, -1)
    total = T._Outgoing.of(src, 1, 0).nbytes
    monkeypatch.setattr(T, "SMALL_BLOCK", 0 if coalesced == "none" else total)
    monkeypatch.setattr(T, "SMALL_TOTAL", total // 2 if coalesced == "some" else total)
    logs = {0: [], 1: []}

    def stamp(label):
        logs[fake.local.rank].append((label, time.perf_counter(), time.thread_time()))

    bench.install_trace(stamp, monkeypatch.setattr)
    ready = threading.Event()

    def send():
        stamp("start")
        ready.set()
        send_sequence(src, 1, 1, timeout=10)
        stamp("end")

    thread, errors = run_sender(fake, send)
    ready.wait(10)
    stamp("start")
    recv_sequence(dst, 0, 0, timeout=10)
    stamp("end")
    thread.join(10)
    assert not errors and not thread.is_alive()
    for rank, steps in ((0, bench.SENDER_STEPS), (1, bench.RECEIVER_STEPS)):
        at = bench.trace_steps(logs[rank])
        spans = bench.spans(at, steps)
        missing = [name for name, _, _ in steps if name not in spans]
        if coalesced == "all":  # every block coalesced: no row message to wait for
            missing = [m for m in missing if m not in ("small rows", "rows")]
        assert not missing, (rank, missing, [label for label, _, _ in logs[rank]])
        assert all(wall >= 0 for wall, _ in spans.values()), spans
        chain = [(a, b) for _, a, b in steps]
        assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(chain))  # the steps tile the side
        if len(spans) == len(steps):
            total = at["end"][0] - at["start"][0]
            assert sum(wall for wall, _ in spans.values()) == pytest.approx(total)
