"""Run a function in ``world`` fresh processes joined by a gloo group on 127.0.0.1.

Every process runs ``fn(rank, world, *args)`` after ``init_process_group``;
what it returns comes back to the parent in rank order.  A process that
raises sends its traceback, which the parent re-raises; a process that dies
or hangs past ``timeout`` seconds fails the call (and is killed), so a test
never hangs CI.  Only loopback is used (``GLOO_SOCKET_IFNAME=lo``).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _main(fn: Callable[..., Any], rank: int, world: int, port: int, timeout: float, out: Any, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world, *args)
        if isinstance(result, tuple) and result and result[0] == "exit":  # a rank meant to die
            out.put((rank, "ok", result[2]))
            out.close()
            out.join_thread()
            os._exit(result[1])
        if isinstance(result, tuple) and result and result[0] == "skip_destroy":  # its peer is gone
            out.put((rank, "ok", result[1]))
            return
        out.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0, expect_exit: dict[int, int] | None = None
) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in its own process.

    ``fn`` may return ``("exit", code, result)`` to deliver ``result`` and then die
    with ``os._exit(code)`` (list the rank in ``expect_exit``), or
    ``("skip_destroy", result)`` when its group lost a member.
    """
    expect_exit = expect_exit or {}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_main, args=(fn, r, world, port, timeout, out, args), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout + 30  # process start-up (importing torch) on a busy machine
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results) - set(errors))} did not finish"
                ) from None
            (results if status == "ok" else errors)[rank] = value
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    for rank, code in expect_exit.items():
        assert procs[rank].exitcode == code, f"rank {rank} exited with {procs[rank].exitcode}, expected {code}"
    return [results.get(r) for r in range(world)]
