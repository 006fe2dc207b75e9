"""An in-process stand-in for ``torch.distributed``'s point-to-point messages, between
threads, so that a transfer's bytes really travel in a one-process test (the NCCL
device branches, a gloo group's landing of rows straight into free pool rows)."""

from __future__ import annotations

import datetime
import queue
import threading


class _Work:
    def __init__(self, done=None):
        self.done = done

    def wait(self, timeout=None):
        if self.done is not None:
            self.done(timeout)
        return True


class FakeDist:
    """Point-to-point messages between threads: rank = the thread's ``rank``."""

    def __init__(self, backend="nccl"):
        self.backend = backend
        self.local = threading.local()
        self.lines = {}
        self.lock = threading.Lock()
        self.devices = []  # the device of every tensor sent or received

    def line(self, src, dst, tag):
        with self.lock:
            return self.lines.setdefault((src, dst, tag), queue.Queue())

    def get_backend(self, group=None):
        return self.backend

    def isend(self, t, dst, group=None, tag=0):
        self.devices.append(t.device)
        self.line(self.local.rank, dst, tag).put(t.clone())
        return _Work()

    def irecv(self, t, src, group=None, tag=0):
        self.devices.append(t.device)
        line = self.line(src, self.local.rank, tag)

        def done(timeout):
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
            try:
                got = line.get(timeout=seconds)
            except queue.Empty:
                raise RuntimeError("timed out") from None
            assert got.numel() <= t.numel()
            t[: got.numel()].copy_(got)

        return _Work(done)


def run_sender(fake, fn):
    """Run ``fn`` as rank 0 on a thread (this thread becomes rank 1); returns the thread
    and the list its exception, if any, goes to."""
    errors = []

    def run():
        fake.local.rank = 0
        try:
            fn()
        except Exception as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    fake.local.rank = 1
    return thread, errors
