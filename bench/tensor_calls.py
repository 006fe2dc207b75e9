"""Torch tensors as primitive arguments: what a fresh tensor per call costs.

A decode step of a small Mamba-2 layer stack (4 layers; conv + scan per
layer, with the dt_bias / D / z epilogues) driven by torch modules, the way
a runtime embeds statecache: statecache holds the conv windows and SSM
states, torch does the projections.  Two ways to pass the activations:

* ``fresh``: what ``nn.Linear`` returns, a new tensor every step, and its
  views (x, B, C, dt, z), passed straight to the primitives;
* ``stable``: torch tensors allocated once and written with ``out=``, passed
  as tensors: fresh tensors as the allocator hands them out when it reuses
  the same addresses every step (torch's CUDA caching allocator; on the CPU
  only larger tensors come back at the same address);
* ``wrapped``: activation buffers allocated once, torch writing into them
  (``matmul(..., out=)``), the primitives getting the same Buffer objects
  every step (the fastest way before tensors were arguments).

Only the statecache calls are timed (the projections are the runtime's),
by the wall clock or, with ``--clock cpu``, by the process's CPU time (all
its threads: the kernels' OpenMP workers included), which a shared, loaded
machine disturbs less.
Prints calls per step, microseconds per call for each way (median over
steps, the ways alternating step by step), and the ratio fresh / wrapped
(target: at most 1.5), for a
130m-sized layer (d_model 768) and for a tiny one where the per-call
overhead is everything.

    python bench/tensor_calls.py [--device cpu] [--steps N] [--rounds R] [--clock wall|cpu]
    python bench/tensor_calls.py --threads     (the thread default next to torch)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import statecache
from statecache.hostmem import as_array

#: What the statecache calls are timed with (``--clock``).
clock = time.perf_counter


class Layer:
    """One Mamba-2 mixer's parameters and state pools."""

    def __init__(
        self, torch: Any, dev: Any, n_seq: int, d_model: int, n_head: int, head_dim: int, d_state: int
    ) -> None:
        self.H, self.P, self.N, self.G = n_head, head_dim, d_state, 1
        d_inner = n_head * head_dim
        self.d_inner = d_inner
        self.conv_dim = d_inner + 2 * self.G * d_state
        self.d_conv = 4
        self.in_proj = torch.nn.Linear(d_model, 2 * d_inner + 2 * self.G * d_state + n_head, bias=False)
        self.out_proj = torch.nn.Linear(d_inner, d_model, bias=False)
        self.conv_w = torch.nn.Parameter(torch.randn(self.conv_dim, self.d_conv) * 0.3)
        self.conv_b = torch.nn.Parameter(torch.randn(self.conv_dim) * 0.1)
        self.A = torch.nn.Parameter(-torch.rand(n_head) - 0.5)
        self.D = torch.nn.Parameter(torch.randn(n_head))
        self.dt_bias = torch.nn.Parameter(torch.randn(n_head) * 0.1)
        self.conv_pool = dev.alloc((n_seq, self.conv_dim * (self.d_conv - 1)))
        self.ssm_pool = dev.alloc((n_seq, n_head * head_dim * d_state))


def fresh_step(dev: Any, torch: Any, layers: list[Layer], h: Any, rows: Any, timer: list[float]) -> Any:
    n_s = h.shape[0]
    for lay in layers:
        zxbcdt = lay.in_proj(h)  # [n_s, 1, ...], a new tensor every step
        d = lay.d_inner
        z = zxbcdt[..., :d].view(n_s, 1, lay.H, lay.P)
        xbc = zxbcdt[..., d : d + lay.conv_dim]
        dt = zxbcdt[..., d + lay.conv_dim :]
        conv_out = torch.empty(n_s, 1, lay.conv_dim)
        y = torch.empty(n_s, 1, lay.H, lay.P)
        conv_and_scan(dev, lay, rows, xbc, z, dt, conv_out, y, timer)
        h = lay.out_proj(y.view(n_s, 1, d))
    return h


def conv_and_scan(
    dev: Any, lay: Layer, rows: Any, xbc: Any, z: Any, dt: Any, conv_out: Any, y: Any, timer: list[float]
) -> None:
    """A layer's two statecache calls with torch tensors; adds their time (not the views') to ``timer``."""
    n_s, d = y.shape[0], lay.d_inner
    t0 = clock()
    dev.ssm_conv(lay.conv_pool, rows, rows, xbc, lay.conv_w, conv_out, bias=lay.conv_b, apply_silu=True)
    t1 = clock()
    x = conv_out[..., :d].view(n_s, 1, lay.H, lay.P)  # the runtime's views: not timed
    B = conv_out[..., d : d + lay.N].view(n_s, 1, 1, lay.N)
    C = conv_out[..., d + lay.N :].view(n_s, 1, 1, lay.N)
    t2 = clock()
    dev.ssm_scan(lay.ssm_pool, rows, rows, x, dt, lay.A, B, C, y, D=lay.D, z=z, dt_bias=lay.dt_bias)
    timer[0] += clock() - t2 + t1 - t0


class Stable:
    """Per layer: torch activation tensors allocated once, written with ``out=``
    and passed as tensors: the fresh path when the allocator hands out the
    same addresses every step (torch's CUDA caching allocator does)."""

    def __init__(self, torch: Any, layers: list[Layer], n_s: int) -> None:
        self.per_layer = []
        for lay in layers:
            width = 2 * lay.d_inner + 2 * lay.N + lay.H
            zx = torch.empty(n_s, 1, width)
            co = torch.empty(n_s, 1, lay.conv_dim)
            y = torch.empty(n_s, 1, lay.H, lay.P)
            self.per_layer.append((zx, co, y, lay.in_proj.weight.detach().t().contiguous()))

    def step(self, dev: Any, torch: Any, layers: list[Layer], h: Any, rows: Any, timer: list[float]) -> Any:
        n_s = h.shape[0]
        for lay, (zx, co, y, w_t) in zip(layers, self.per_layer):
            torch.matmul(h, w_t, out=zx)
            d = lay.d_inner
            z = zx[..., :d].view(n_s, 1, lay.H, lay.P)
            xbc = zx[..., d : d + lay.conv_dim]
            dt = zx[..., d + lay.conv_dim :]
            conv_and_scan(dev, lay, rows, xbc, z, dt, co, y, timer)
            h = lay.out_proj(y.view(n_s, 1, d))
        return h


class Wrapped:
    """Per layer: the activation Buffers allocated once, and torch views of them."""

    def __init__(self, dev: Any, torch: Any, layers: list[Layer], n_s: int) -> None:
        self.per_layer = []
        for lay in layers:
            d, cd = lay.d_inner, lay.conv_dim
            width = 2 * d + 2 * lay.N + lay.H
            zx = dev.alloc((n_s, 1, width))
            co = dev.alloc((n_s, 1, cd))
            y = dev.alloc((n_s, 1, lay.H, lay.P))
            bufs = {
                "zx": zx,
                "co": co,
                "y": y,
                "z": zx.view((n_s, 1, lay.H, lay.P), (width, width, lay.P, 1), 0),
                "xbc": zx.view((n_s, 1, cd), (width, width, 1), d),
                "dt": zx.view((n_s, 1, lay.H), (width, width, 1), d + cd),
                "x": co.view((n_s, 1, lay.H, lay.P), (cd, cd, lay.P, 1), 0),
                "B": co.view((n_s, 1, 1, lay.N), (cd, cd, lay.N, 1), d),
                "C": co.view((n_s, 1, 1, lay.N), (cd, cd, lay.N, 1), d + lay.N),
                "conv_w": dev.upload(lay.conv_w.detach().numpy()),
                "conv_b": dev.upload(lay.conv_b.detach().numpy()),
                "A": dev.upload(lay.A.detach().numpy()),
                "D": dev.upload(lay.D.detach().numpy()),
                "dt_bias": dev.upload(lay.dt_bias.detach().numpy()),
            }
            views = {k: torch.from_numpy(as_array(bufs[k])) for k in ("zx", "y")}
            self.per_layer.append((bufs, views, lay.in_proj.weight.detach().t().contiguous()))

    def step(self, dev: Any, torch: Any, layers: list[Layer], h: Any, rows: Any, timer: list[float]) -> Any:
        n_s = h.shape[0]
        for lay, (b, v, w_t) in zip(layers, self.per_layer):
            torch.matmul(h, w_t, out=v["zx"])
            t0 = clock()
            dev.ssm_conv(lay.conv_pool, rows, rows, b["xbc"], b["conv_w"], b["co"], bias=b["conv_b"], apply_silu=True)
            dev.ssm_scan(
                lay.ssm_pool, rows, rows, b["x"], b["dt"], b["A"], b["B"], b["C"], b["y"],
                D=b["D"], z=b["z"], dt_bias=b["dt_bias"],
            )  # fmt: skip
            timer[0] += clock() - t0
            h = lay.out_proj(v["y"].view(n_s, 1, lay.d_inner))
        return h


MODES = ("fresh", "stable", "wrapped")


def measure(dev: Any, config: dict[str, int], n_seq: int, steps: int, rounds: int) -> tuple[int, dict[str, float]]:
    """Calls per step and, per mode, the median seconds per statecache call."""
    import torch

    torch.manual_seed(0)
    layers = [Layer(torch, dev, n_seq, **config) for _ in range(4)]
    rows = dev.indices(np.arange(n_seq))
    wrapped = Wrapped(dev, torch, layers, n_seq)
    stable = Stable(torch, layers, n_seq)
    steppers = {"fresh": fresh_step, "stable": stable.step, "wrapped": wrapped.step}
    h0 = torch.randn(n_seq, 1, config["d_model"]) * 0.1
    calls_per_step = 2 * len(layers)
    per_call: dict[str, list[float]] = {mode: [] for mode in MODES}
    with torch.no_grad():
        for _ in range(5):  # warm up: wraps remembered, calls validated once
            for mode in MODES:
                steppers[mode](dev, torch, layers, h0, rows, [0.0])
        # The modes alternate step by step, so a burst of load on a shared
        # machine hits each alike; medians over every step of every round.
        for _ in range(rounds * steps):
            for mode in MODES:
                timer = [0.0]
                steppers[mode](dev, torch, layers, h0, rows, timer)
                per_call[mode].append(timer[0] / calls_per_step)
    return calls_per_step, {mode: statistics.median(v) for mode, v in per_call.items()}


CONFIGS = {
    "130m-like (d_model 768, 24 heads x 64, d_state 128)": dict(d_model=768, n_head=24, head_dim=64, d_state=128),
    "tiny (d_model 64, 2 heads x 16, d_state 16)": dict(d_model=64, n_head=2, head_dim=16, d_state=16),
}


def interleaved(steps: int = 400) -> str:
    """One line: a small nn.Linear and a statecache CPU scan, alternated on one
    thread (a runtime's decode loop); median and p90 of each."""
    import torch

    dev = statecache.get_device("cpu")
    H, P, N, n_s = 24, 64, 128, 4  # large enough for the kernel to use its threads
    pool = dev.alloc((n_s, H * P * N))
    x, dt, B, C, y = (
        dev.alloc(s) for s in [(n_s, 1, H, P), (n_s, 1, H), (n_s, 1, 1, N), (n_s, 1, 1, N), (n_s, 1, H, P)]
    )
    A = dev.upload(-np.ones(H, np.float32))
    rows = dev.indices(np.arange(n_s))
    lin = torch.nn.Linear(256, 256)
    h = torch.randn(4, 256)
    t_torch, t_sc = [], []
    with torch.no_grad():
        for i in range(steps):
            t0 = time.perf_counter()
            lin(h)
            t1 = time.perf_counter()
            dev.ssm_scan(pool, rows, rows, x, dt, A, B, C, y)
            t2 = time.perf_counter()
            if i >= steps // 8:
                t_torch.append(t1 - t0)
                t_sc.append(t2 - t1)

    def q(v: list[float]) -> str:
        return f"{statistics.median(v) * 1e6:8.1f} {float(np.percentile(v, 90)) * 1e6:9.1f}"

    return f"{torch.get_num_threads():>6} {dev.num_threads:>6} {q(t_torch)} {q(t_sc)}"


def threads_table() -> None:
    """The thread-default measurement behind settings.num_threads: every
    combination of torch's and statecache's thread counts, with no wait
    policy set (statecache's default: its kernels load with a short spin,
    torch keeps its own), passive (every idle thread sleeps at once) and
    active (every idle thread spins for milliseconds)."""
    import os
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores; a small nn.Linear and a 4-sequence Mamba-2 scan alternated, us (median, p90)")
    print(f"{'wait':<8} {'torch':>6} {'sc':>6} {'linear':>8} {'p90':>9} {'scan':>8} {'p90':>9}")
    for policy in ("default", "passive", "active"):
        for torch_threads in sorted({cores, 1}, reverse=True):
            for sc_threads in ("", *sorted({str(cores), "1"}, reverse=True)):
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                env["STATECACHE_NUM_THREADS"] = sc_threads
                if policy != "default":
                    env["OMP_WAIT_POLICY"] = policy
                code = (
                    f"import torch; torch.set_num_threads({torch_threads}); import sys; sys.path.insert(0, 'bench'); "
                    "import tensor_calls; print(tensor_calls.interleaved())"
                )
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
                label = "follow" if not sc_threads else sc_threads
                print(f"{policy:<8} {out.stdout.strip()}   (statecache threads: {label})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall, or cpu: the process CPU time")
    ap.add_argument("--threads", action="store_true", help="measure the thread default instead (cpu)")
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        threads_table()
        return
    dev = statecache.get_device(args.device)
    print(
        f"device {dev.id}; {args.seqs} sequence(s); 4 Mamba-2 layers; "
        f"medians of {args.rounds * args.steps} steps per way; {args.clock} clock"
    )
    print("us per statecache call; ratio = fresh / wrapped (target <= 1.5), stable / wrapped")
    print(f"{'layer':<52} {'calls/step':>10} {'fresh':>9} {'stable':>9} {'wrapped':>9} {'ratio':>6} {'stable':>7}")
    for name, config in CONFIGS.items():
        calls, t = measure(dev, config, args.seqs, args.steps, args.rounds)
        fresh, stable, wrap = t["fresh"] * 1e6, t["stable"] * 1e6, t["wrapped"] * 1e6
        print(
            f"{name:<52} {calls:>10} {fresh:>9.2f} {stable:>9.2f} {wrap:>9.2f} "
            f"{fresh / wrap:>6.2f} {stable / wrap:>7.2f}"
        )


if __name__ == "__main__":
    main()
