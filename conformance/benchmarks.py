"""Primitive benchmarks against physical limits, for any device.

Shipped inside the package so ``statecache conformance --perf`` works from
any install; ``bench/primitives.py`` is the command-line front end:

    python bench/primitives.py --device cpu
    python bench/primitives.py --device cpu --rounds 3   # shared machine: fastest of 3 rounds
    python bench/primitives.py --device opencl:0 --no-reference --only mamba2

For every shape it prints the time per call, the achieved GB/s (bytes read +
bytes written), the time of the two floors a shape cannot beat and the ratio
to the one that applies (a roofline):

* the **memcpy floor**: the shape's bytes (half of what it reads + writes)
  moved once each way by ``device.copy_buffer`` into another buffer,
  measured in the same run right after the call (see :func:`floor_seconds`;
  issue 18 states its decode targets against this copy).  It repeats on one
  buffer kept for every round, as the call repeats on one pool, so the floor
  sees the cache the call sees (a small shape's state stays in L2 or L3 from
  one call to the next, and so does the floor's buffer); a row over many
  layers' pools (the rollback rows) copies over as many pairs of buffers in
  turn, so its floor runs from memory as the row does (:func:`floor_key`).  Beside it, column
  ``x inplace``, a stricter floor for a call that updates its state in place
  (a plain decode or prefill loop: start row = destination row, no snapshot
  planes) on the C CPU device: the fastest in-place pass over as many bytes
  (each float read and written back, ``y = a x + b``) on 1 and on the
  device's threads.  Why print it: it moves exactly the bytes an in-place
  update must move, with the footprint of its state, where a copy into
  another buffer needs twice that footprint.  At one-sequence decode sizes
  (0.5 to 1 MiB per thread) the doubled footprint alone decides whether the
  copy stays in a 2 MiB L2: on this host a one-thread copy of 1 MiB took
  30-40 us where an in-place pass over 1 MiB took 20, and two shapes of
  nearly the same bytes got copy floors of 11 and 30 us in one run (fresh
  buffers every round also drew other physical pages, so another pattern of
  cache conflicts, every round).  No call that updates in place can move
  its bytes faster than a pass that does nothing else, so a ratio above 1 to
  the copy shows the copy's footprint, not a kernel beating memory.  Every
  way's time is printed under the table.  Under ``--clock cpu`` a two-thread
  pass counts both threads' time;
* the **compute floor**: the FMAs the recurrence needs at the FMA peak (a C
  loop of independent FMAs) plus the exponentials it needs at the exp rate
  (the kernels' own vectorised exp, ``sc_exp8``, over an L1-resident array),
  both compiled with the CPU backend's flags and run on its threads.

The larger floor is the shape's bound (column ``bound``: ``memcpy``, ``fma``
or ``exp`` for a compute floor made mostly of exponentials, as the Mamba-1
scan's per-element decays); ``x bound`` is that floor over the time.  Below
the table a line per shape says why its bound applies: its lane FMAs and
exponentials per byte moved, and the two floors they give on this machine
(the conv prefill, a few FMAs per 8 bytes, is bound by its SiLU's one
exponential per output element wherever that costs more than the copy).  The
operation counts are those of the token-by-token definition (a chunked
kernel may do a little more or less arithmetic than that).  Also printed:
the speed-up over the NumPy reference backend, and for the Mamba-1 scan and
the conv the speed-up over a straightforward scalar C loop kept here as a
baseline (compiled with the same flags as the CPU backend, run with the same
threads).

``--clock cpu`` (host devices) times every call and every floor by the
process's CPU time instead of the wall clock: on a machine shared with other
jobs a call whose thread was descheduled for a scheduler slice then costs
what it ran, not what it waited (threads waiting at a barrier sleep and do
not count either, so this hides load imbalance between threads).
Every time is the fastest repetition (see :func:`time_call`).  Every shape
repeats one call with the same buffers, as a decode loop does, so after the
first call the device's launch memo skips validation.  A last line gives each
op's fixed cost per call outside the kernels, timed on tiny shapes, both
remembered and validated (memo emptied before every call): the first is what
holds small decode calls below the memcpy bound.  The line after it is that
cost's floor (:func:`call_floor`), timed the same way: a bare cffi call of an
empty C function, and one starting an empty team of the kernels' threads, with
each remembered cost as a multiple of the bare call.  Decode with rollback
planes is timed both ways (the 1-D form, which also copies the input state
into plane 1, and plane rotation, which writes only the next plane) and its
time printed as a ratio to decode without rollback; so is a whole decode step
through a ``RecurrentMemory`` (batch, plan, apply, the primitive on every
layer) with ``n_rs_seq = 3`` against ``n_rs_seq = 0``, per family: the
memory rotates its planes, so the primitive writes one row per sequence
either way, in place without rollback and into the next plane with it.
These rows walk :data:`ROLLBACK_STATE_BYTES` of state per step (4x the
host's L3, 128 to 512 MiB, see :func:`rollback_state_bytes`), so that both
forms run from memory as a model's state does; the size and why are printed.
Before they are timed, these rows call every (layer, plane) pair once, as a
decode loop long past its first steps has (the launch memo knows them all).
Next to those ratios, their floor on this host (:func:`host_rotation_floor`):
a bare ``y = a x + b`` pass over the same state in place against one
streamed into another plane; the same bytes move, but the in-place pass
writes lines already in cache and its state has half the footprint, so on a
host where that pass is slower rotated, no kernel's rollback ratio can beat it.
The floor is printed again over a quarter of the L3, where both passes stay
in cache (the regime of one small layer repeated, not of a model).

Importable: :data:`SHAPES`, :func:`make_case`, :func:`time_call`,
:func:`memcpy_seconds`, :func:`host_memcpy_seconds`, :func:`host_rotation_floor`, :func:`fma_peak`,
:func:`exp_rate`, :func:`bound_reason`, :func:`run` (returns one dict per shape), so a conformance
``--perf`` run can reuse them.  Ratios are printed, never asserted: this is not a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statecache import settings
from statecache.backend import Device
from statecache.dtypes import DType
from statecache.hostmem import aligned_empty
from statecache.registry import get_device

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark: ``op`` and its sizes.  Which physical limit applies is
    measured, not declared (see the module docstring)."""

    name: str
    op: str
    params: dict[str, Any]
    scalar_baseline: bool = False


def host_l3_bytes() -> int | None:
    """Bytes of the host's last-level (L3) cache as the OS reports it, or None."""
    try:
        folder = "/sys/devices/system/cpu/cpu0/cache"
        for index in sorted(os.listdir(folder)):
            with open(os.path.join(folder, index, "level"), encoding="utf-8") as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(folder, index, "size"), encoding="utf-8") as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        return None
    return size if size > 0 else None


def rollback_state_bytes() -> tuple[int, str]:
    """State walked by one decode step of the rollback rows and their floor,
    and why: 4x the host's L3 (at least 128 MiB, at most 512 MiB), so that
    both the in-place pass and the rotated one (twice the footprint) run
    from memory, as a model's state does (Mamba-2 130M: 24 layers of 24
    heads x 64 x 128 f32, 19 MiB per sequence, 150 MiB for 8 sequences; the
    2.7B models many times that).  Near the L3's size an in-place pass keeps
    part of its state in cache where the rotated one (twice the footprint)
    cannot, which measures cache sizes, not kernels: on a 105 MiB L3 shared
    with other guests, an in-place pass over 128 MiB ran ~10% faster per byte
    than over 512 MiB, and a quarter of the L3 runs it 2x faster than the
    rotated pass (the "in cache" floor line)."""
    l3 = host_l3_bytes()
    if l3 is None:
        return 256 * MiB, "L3 size unknown: 256 MiB"
    want = 4 * l3
    size = min(max(want, 128 * MiB), 512 * MiB)
    how = "4x L3" if size == want else ("capped at 512 MiB" if want > size else "at least 128 MiB")
    return size, f"L3 {l3 / MiB:.0f} MiB, state {how}"


#: Total state of the rollback rows (see :func:`rollback_state_bytes`).
ROLLBACK_STATE_BYTES, ROLLBACK_STATE_WHY = rollback_state_bytes()

#: The rollback rows per family: its primitive, the primitive's shape, the
#: memory rows' layer parameters, and one layer's state for 8 sequences.
_ROLLBACK_FAMILIES: tuple[tuple[str, str, dict[str, Any], dict[str, Any], int], ...] = (
    ("mamba2", "ssm_scan", {"N": 128, "P": 64, "H": 32, "G": 1}, {"N": 128, "P": 64, "H": 32}, 8 * MiB),
    ("gdn", "gdn", {"H": 16, "S": 128, "kda": False}, {"H": 16, "S": 128}, 8 * MiB),
    # a GDN layer's 5376-channel conv window (d_conv 4: 3 columns)
    ("conv", "ssm_conv", {"ch": 5376, "d_conv": 4}, {"H": 14, "S": 128}, 8 * 5376 * 3 * 4),
)


def rollback_layers(layer_bytes: int) -> int:
    """Layers of ``layer_bytes`` that make up :data:`ROLLBACK_STATE_BYTES`."""
    return -(-ROLLBACK_STATE_BYTES // layer_bytes)


#: (variant, heads, head size) of the linear-attention shapes.
LINEAR_ATTN_SIZES = (("rwkv6", 32, 64), ("rwkv7", 32, 64), ("gla", 16, 128))

#: Per variant: the primitive, its per-token inputs besides the output, and the
#: lane-FMA operations per state element and token (RWKV-6 and GLA: decay
#: multiply-add, k * v, output FMA; RWKV-7: the a-dot, decay, b and k terms,
#: output FMA).
_LINEAR_ATTN = {"rwkv6": ("rwkv_wkv6", 4, 3), "rwkv7": ("rwkv_wkv7", 6, 5), "gla": ("gated_linear_attn", 4, 3)}

SHAPES: tuple[Shape, ...] = (
    Shape("gather 8 x 1 MiB", "get_rows", {"n": 8}),
    Shape("gather 32 x 1 MiB", "get_rows", {"n": 32}),
    Shape("scatter 8 x 1 MiB", "set_rows", {"n": 8}),
    Shape("scatter 32 x 1 MiB", "set_rows", {"n": 32}),
    *(
        Shape(f"mamba2 decode n_s={n}", "ssm_scan", {"N": 128, "P": 64, "H": 32, "G": 1, "n_t": 1, "n_s": n, "K": 1})
        for n in (1, 8, 32)
    ),
    *(
        Shape(
            f"mamba2 prefill K={k}",
            "ssm_scan",
            {"N": 128, "P": 64, "H": 48, "G": 1, "n_t": 512, "n_s": 1, "K": k},
        )
        for k in (1, 4)
    ),
    *(
        Shape(
            f"mamba1 decode n_s={n}",
            "ssm_scan",
            {"N": 16, "P": 1, "H": 5120, "G": 1, "n_t": 1, "n_s": n, "K": 1},
            scalar_baseline=True,
        )
        for n in (1, 8)
    ),
    Shape("mamba1 prefill", "ssm_scan", {"N": 16, "P": 1, "H": 5120, "G": 1, "n_t": 512, "n_s": 1, "K": 1}, True),
    *(
        Shape(f"conv decode n_s={n}", "ssm_conv", {"ch": 5376, "d_conv": 4, "n_t": 1, "n_s": n}, scalar_baseline=True)
        for n in (1, 8, 32)
    ),
    Shape("conv prefill", "ssm_conv", {"ch": 3328, "d_conv": 4, "n_t": 512, "n_s": 1}, True),
    *(Shape(f"gdn decode n_s={n}", "gdn", {"H": 16, "S": 128, "n_t": 1, "n_s": n, "kda": False}) for n in (1, 8)),
    Shape("gdn prefill", "gdn", {"H": 16, "S": 128, "n_t": 512, "n_s": 1, "kda": False}),
    # Decode with rollback (K = 1 + n_rs_seq = 4 planes) against decode without,
    # each call on the next of `layers` pools as a model's decode step walks its
    # layers, so that the state is out of cache as it is in a model (one layer's
    # state repeated stays in cache, and in place beats a write elsewhere there):
    # ROLLBACK_STATE_BYTES in all, sized from the host's L3.
    # The 1-D form also copies the input state into plane 1; rotation reads
    # plane p and writes only plane p + 1.
    *(
        Shape(
            f"{family} decode n_s=8 {how}",
            op,
            {
                **params,
                "n_t": 1,
                "n_s": 8,
                "K": 1 if how == "x layers" else 4,
                "rotate": how == "K=4 rotate",
                "layers": rollback_layers(layer_bytes),
            },
        )
        for family, op, params, _, layer_bytes in _ROLLBACK_FAMILIES
        for how in ("x layers", "K=4 planes", "K=4 rotate")
    ),
    # The same decode through a RecurrentMemory (batch, plan, apply, step: what a
    # runtime runs) with n_rs_seq = 3 against n_rs_seq = 0: the memory rotates
    # its planes, so a decode with rollback writes one row per state tensor too.
    # Each family steps one state tensor of its layers (the conv: a GDN layer's
    # 5376-channel window), ROLLBACK_STATE_BYTES in all.
    *(
        Shape(
            f"{family} memory n_s=8 rs={rs}",
            "memory",
            {**params, "family": family, "n_s": 8, "n_rs_seq": rs, "layers": rollback_layers(layer_bytes)},
        )
        for family, _, _, params, layer_bytes in _ROLLBACK_FAMILIES
        for rs in (0, 3)
    ),
    Shape("kda prefill", "gdn", {"H": 16, "S": 128, "n_t": 512, "n_s": 1, "kda": True}),
    # Linear attention at model sizes: RWKV-6 / RWKV-7 1.5B (n_embd 2048, heads of 64), GLA with
    # heads of 128.  A decode token streams the state once each way (the memcpy bound); a prefill
    # token does 3 (RWKV-6, GLA) or 5 (RWKV-7) lane-FMA operations per state element and one exp per key.
    *(
        Shape(f"{name} decode n_s={n}", "linear_attn", {"variant": name, "H": H, "S": S, "n_t": 1, "n_s": n})
        for name, H, S in LINEAR_ATTN_SIZES
        for n in (1, 8, 32)
    ),
    *(
        Shape(f"{name} prefill", "linear_attn", {"variant": name, "H": H, "S": S, "n_t": 512, "n_s": 1})
        for name, H, S in LINEAR_ATTN_SIZES
    ),
)


# -- timing ---------------------------------------------------------------------------


#: The clocks a benchmark can time with: wall time, or the process's CPU
#: time summed over its threads (``--clock cpu``, host devices only).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_call(
    fn: Callable[[], None],
    device: Device | None = None,
    min_time: float = 0.25,
    max_reps: int = 5000,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds (of ``clock``) per call over repetitions filling about
    ``min_time`` (at least 3 when ``max_reps`` allows): the fastest by the
    wall clock, the median by the process CPU clock.

    Wall clock, the minimum: this machine is shared, and a repetition during
    which another job held a core (a two-thread team then waits at its
    barrier for a whole scheduler slice) measures the other job, not ours.
    Short calls repeat until ``min_time`` has passed, so that the repetitions
    span several scheduler slices and some of them find both cores free.

    CPU clock, the median: the process clock adds up a worker thread's time
    only when the kernel next accounts it (a tick or a switch), so a
    repetition of a threaded call can read less than it used, even less than
    its wall time; the minimum would keep exactly those readings (seen: 520
    CPU-us for a two-thread call of 532-545 wall-us).  Load barely moves CPU
    time, so the median loses nothing there.
    """

    def once() -> float:
        t0 = clock()
        fn()
        if device is not None:
            device.synchronize()
        return clock() - t0

    first = once()  # warm-up: first touch of memory, caches, thread pool
    times = [once()] if max_reps > 1 else []
    while (sum(times) < min_time or len(times) < 3) and len(times) < max_reps:
        times.append(once())
    if clock is time.process_time and len(times) >= 3:
        return statistics.median(times)
    return min([first, *times])


def memcpy_seconds(
    device: Device,
    nbytes: int,
    clock: Callable[[], float] = time.perf_counter,
    keep: dict[Any, Any] | None = None,
    min_time: float = 0.25,
    layers: int = 1,
) -> float:
    """Seconds for ``device.copy_buffer`` of ``nbytes`` (f32 elements) into
    another buffer.  ``keep``: a dict that holds the two buffers for later
    measurements of the same size (the same pages, so the same cache
    conflicts, every round).  ``layers`` > 1: each copy takes the next of
    that many pairs of buffers, in turn, as a row over many layers calls the
    next layer's pool, so the floor runs from memory where the row does
    (those pairs, hundreds of MiB, are freed after and never kept)."""
    n = max(nbytes // 4, 1)
    if layers > 1:
        pairs = [(device.upload(np.ones(n, np.float32)), device.alloc((n,), "f32")) for _ in range(layers)]
        turn = [0]

        def walk() -> None:
            src, dst = pairs[turn[0]]
            turn[0] = (turn[0] + 1) % layers
            device.copy_buffer(src, dst)

        for _ in range(layers):  # every pair touched once, as the rows' warm-up does
            walk()
        return time_call(walk, device, min_time=min_time, clock=clock)
    pair = keep.get(("copy", n)) if keep is not None else None
    if pair is None:
        pair = (device.upload(np.ones(n, np.float32)), device.alloc((n,), "f32"))
        if keep is not None:
            keep[("copy", n)] = pair
    src, dst = pair
    return time_call(lambda: device.copy_buffer(src, dst), device, min_time=min_time, clock=clock)


def host_inplace_seconds(
    nbytes: int,
    threads: int,
    clock: Callable[[], float] = time.perf_counter,
    keep: dict[Any, Any] | None = None,
    min_time: float = 0.25,
) -> float:
    """Seconds for one in-place pass of ``y = a x + b`` over ``nbytes`` of
    floats on ``threads`` threads (``bench_update`` with the destination its
    source: normal stores, contiguous split): every byte read and written
    back where it lies, as a decode that updates its state in place must.
    ``keep`` as for :func:`memcpy_seconds`."""
    ffi, lib = bench_lib()
    n = max(nbytes // 4, 1)
    held = keep.get(("inplace", n)) if keep is not None else None
    if held is None:
        array = aligned_empty(n, DType.F32)
        array[:] = 1.0  # the pass keeps ones near one: no subnormals, no overflow
        held = (array, ffi.cast("float *", array.ctypes.data))
        if keep is not None:
            keep[("inplace", n)] = held
    ptr = held[1]
    return time_call(lambda: lib.bench_update(ptr, ptr, n, threads), min_time=min_time, clock=clock)


def updates_in_place(shape: Shape) -> bool:
    """Whether a shape's call reads and writes its state at the same rows:
    one pool, start row = destination row, no snapshot planes to write."""
    p = shape.params
    stateful = shape.op in ("ssm_scan", "ssm_conv", "gdn", "linear_attn")
    return stateful and int(p.get("layers", 1)) == 1 and not p.get("rotate") and int(p.get("K", 1)) == 1


def floor_key(shape: Shape, case: Case) -> tuple[int, bool, int]:
    """What a shape's memcpy floor depends on: the bytes one call moves each
    way, whether it updates in place, and over how many layers' pools its
    calls walk.  A row over many layers runs from memory (its state is 4x the
    L3), so its floor walks as many buffers: a floor measured on one buffer
    kept in cache had those rows read 0.2-0.7 of a copy that no call over
    that state could reach.  A ``memory`` row's call is a whole step over
    every layer (its bytes are all the layers'), so one buffer of them is
    already out of cache."""
    layers = 1 if shape.op == "memory" else int(shape.params.get("layers", 1))
    return case.traffic // 2, updates_in_place(shape), layers


def floor_seconds(
    device: Device,
    nbytes: int,
    in_place: bool,
    threads: int,
    clock: Callable[[], float] = time.perf_counter,
    keep: dict[Any, Any] | None = None,
    min_time: float = 0.25,
    layers: int = 1,
) -> dict[str, float]:
    """The ways of moving ``nbytes`` once each way that the memcpy floor
    takes the fastest of (see the module docstring), in seconds by name:
    ``"copy"`` (``device.copy_buffer`` into another buffer; over ``layers``
    pairs in turn for a row over many layers), and with ``in_place`` on the
    C CPU device ``"in place, 1 thread"`` and ``"in place, N threads"``."""
    out = {"copy": memcpy_seconds(device, nbytes, clock, keep, min_time, layers)}
    if in_place and device.backend_name == "cpu":
        for t in sorted({1, max(threads, 1)}):
            out[f"in place, {t} thread{'s' if t > 1 else ''}"] = host_inplace_seconds(nbytes, t, clock, keep, min_time)
    return out


# -- C helpers of the benchmark (baselines and machine limits) ---------------------------

_BENCH_C = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
/* The CPU backend's own helpers: bench_exp_loop times the kernels' exp. */
#include "sc_internal.h"

void bench_memcpy(void *dst, const void *src, int64_t nbytes, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t lines = (nbytes + 63) / 64, lo = lines * tid / nt * 64, hi = lines * (tid + 1) / nt * 64;
        if (hi > nbytes) hi = nbytes;
        if (hi > lo) memcpy((char *)dst + lo, (const char *)src + lo, (size_t)(hi - lo));
    }
}

/* One pass of y = a * x + b over n floats, as a decode passes over a layer's
 * state: in place (dst == src, normal stores: the lines are in cache from the
 * read) or into another buffer with non-temporal stores in address order, the
 * cheapest way to write lines that are out of cache (rotated planes).  The
 * floor of decode with rollback against decode without, free of any kernel's
 * arithmetic or access pattern. */
void bench_update(float *dst, const float *src, int64_t n, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t lo = n / 16 * tid / nt * 16, hi = tid + 1 == nt ? n : n / 16 * (tid + 1) / nt * 16;
        int64_t i = lo;
#ifdef SC_HAVE_AVX2
        const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
        if (dst != src && ((uintptr_t)dst & 31) == 0) {
            for (; i + 8 <= hi; i += 8) _mm256_stream_ps(dst + i, _mm256_fmadd_ps(_mm256_loadu_ps(src + i), a, b));
            _mm_sfence();
        } else {
            for (; i + 8 <= hi; i += 8) _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(_mm256_loadu_ps(src + i), a, b));
        }
#endif
        for (; i < hi; i++) dst[i] = src[i] * 0.999f + 1e-3f;
    }
}

/* Independent FMA chains: iters * 96 lane-FMAs per thread. */
float bench_fma_loop(int64_t iters, int threads) {
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        float acc[96];
        for (int j = 0; j < 96; j++) acc[j] = (float)j * 1e-3f;
        const float m = 0.999999f, c = 1e-7f;
        for (int64_t it = 0; it < iters; it++) {
#pragma omp simd
            for (int j = 0; j < 96; j++) acc[j] = acc[j] * m + c;
        }
        for (int j = 0; j < 96; j++) sink += acc[j];
    }
    return sink;
}

/* The kernels' vectorised exp over an L1-resident array of 1024 arguments:
 * iters * 1024 exponentials per thread.  One argument changes per pass, so
 * no pass can be hoisted out of the loop. */
float bench_exp_loop(int64_t iters, int threads) {
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        float in[1024] __attribute__((aligned(64))), out[1024] __attribute__((aligned(64)));
        for (int j = 0; j < 1024; j++) in[j] = -10.0f + (float)j * (10.0f / 1024.0f);
        for (int64_t it = 0; it < iters; it++) {
#ifdef SC_HAVE_AVX2
            for (int j = 0; j < 1024; j += 8) _mm256_store_ps(out + j, sc_exp8(_mm256_load_ps(in + j)));
#else
#pragma omp simd
            for (int j = 0; j < 1024; j++) out[j] = sc_exp(in[j]);
#endif
            in[it & 1023] -= out[(it * 7) & 1023] * 1e-9f;
        }
        for (int j = 0; j < 1024; j++) sink += out[j];
    }
    return sink;
}

static float softplus(float z) { return z > 20.0f ? z : log1pf(expf(z)); }

/* The straightforward Mamba-1 scan: contiguous inputs, f32 state in place. */
void scalar_mamba1(float *state, const float *x, const float *dt, const float *A, const float *B, const float *C,
                   float *y, int64_t n_t, int64_t H, int64_t N, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        float *S = state + h * N;
        for (int64_t t = 0; t < n_t; t++) {
            float d = softplus(dt[t * H + h]), xd = x[t * H + h] * d, acc = 0.0f;
            for (int64_t k = 0; k < N; k++) {
                S[k] = S[k] * expf(d * A[h * N + k]) + B[t * N + k] * xd;
                acc += S[k] * C[t * N + k];
            }
            y[t * H + h] = acc;
        }
    }
}

/* The straightforward conv: window [ch, W] in place, x/y [n_t, ch]. */
void scalar_conv(float *win, const float *x, const float *w, const float *bias, float *y, int64_t n_t, int64_t ch,
                 int64_t d_conv, int threads) {
    const int64_t W = d_conv - 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < ch; c++) {
        float ext[4096];
        for (int64_t m = 0; m < W; m++) ext[m] = win[c * W + m];
        for (int64_t t = 0; t < n_t; t++) ext[W + t] = x[t * ch + c];
        for (int64_t t = 0; t < n_t; t++) {
            float acc = bias[c];
            for (int64_t k = 0; k < d_conv; k++) acc += ext[t + k] * w[c * d_conv + k];
            y[t * ch + c] = acc / (1.0f + expf(-acc));
        }
        for (int64_t m = 0; m < W; m++) win[c * W + m] = ext[n_t + m];
    }
}

/* The floor of a primitive call's fixed cost (call_floor): a function doing
 * nothing, and one starting a team of `threads` that does nothing. */
void bench_empty(void) {}

void bench_team(int threads) {
#pragma omp parallel num_threads(threads)
    { __asm__ volatile("" ::: "memory"); }
}
"""

_BENCH_CDEF = """
void bench_memcpy(void *dst, const void *src, int64_t nbytes, int threads);
void bench_update(float *dst, const float *src, int64_t n, int threads);
float bench_fma_loop(int64_t iters, int threads);
float bench_exp_loop(int64_t iters, int threads);
void scalar_mamba1(float *state, const float *x, const float *dt, const float *A, const float *B, const float *C,
                   float *y, int64_t n_t, int64_t H, int64_t N, int threads);
void scalar_conv(float *win, const float *x, const float *w, const float *bias, float *y, int64_t n_t, int64_t ch,
                 int64_t d_conv, int threads);
void bench_empty(void);
void bench_team(int threads);
"""


@functools.cache
def bench_lib() -> tuple[Any, Any]:
    """Compile (once, cached by source hash) the benchmark's own C helpers
    with the CPU backend's flags."""
    from cffi import FFI

    from statecache.backends.cpu import build

    flags = build.compile_args(build.host_isa())
    headers = ""
    for header in ("sc_internal.h", build.HEADER):
        with open(os.path.join(build.HERE, header), encoding="utf-8") as f:
            headers += f.read()
    key = hashlib.sha256((_BENCH_C + _BENCH_CDEF + headers + " ".join(flags)).encode()).hexdigest()[:16]
    name = f"_statecache_bench_{key}"
    folder = os.path.join(settings.cache_dir(), "bench")
    os.makedirs(folder, exist_ok=True)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(name)
    except ImportError:
        ffi = FFI()
        ffi.cdef(_BENCH_CDEF)
        ffi.set_source(
            name,
            _BENCH_C,
            include_dirs=[build.HERE],
            extra_compile_args=flags,
            extra_link_args=["-fopenmp"],
            libraries=["m"],
        )
        ffi.compile(tmpdir=folder)
        module = importlib.import_module(name)
    return module.ffi, module.lib


def host_memcpy_seconds(nbytes: int, threads: int, clock: Callable[[], float] = time.perf_counter) -> float:
    ffi, lib = bench_lib()
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    ps, pd = ffi.from_buffer(src), ffi.from_buffer(dst)
    return time_call(lambda: lib.bench_memcpy(pd, ps, nbytes, threads), clock=clock)


def host_rotation_floor(
    layers: int, nbytes: int, threads: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """Seconds of one pass of ``bench_update`` over ``layers`` buffers of
    ``nbytes``: in place, and from one of two planes into the other (the planes
    swap every pass, as rotated rollback planes do; two planes have the same
    traffic and reuse distance as four).  Their ratio is what decode with
    rollback can reach against decode without on this host when both are
    bound by memory: the same bytes move, but an in-place pass finds the
    lines it writes in cache and its state has half the footprint."""
    ffi, lib = bench_lib()
    n = nbytes // 4
    live = [np.ones(n, np.float32) for _ in range(layers)]
    planes = [[np.ones(n, np.float32), np.ones(n, np.float32)] for _ in range(layers)]
    ptr = {id(a): ffi.cast("float *", a.ctypes.data) for a in live + [p for pair in planes for p in pair]}
    turn = [0]

    def in_place() -> None:
        for a in live:
            lib.bench_update(ptr[id(a)], ptr[id(a)], n, threads)

    def rotate() -> None:
        turn[0] ^= 1
        for pair in planes:
            lib.bench_update(ptr[id(pair[turn[0]])], ptr[id(pair[1 - turn[0]])], n, threads)

    return time_call(in_place, clock=clock), time_call(rotate, clock=clock)


def _rate(
    loop: Callable[[int, int], float], per_iter: int, iters: int, threads: int, clock: Callable[[], float]
) -> float:
    """Operations per second (of ``clock``) of a C loop: its fastest run, timed
    as the kernels are (:func:`time_call`).  ``iters`` keeps one run a few
    milliseconds long on a quiet machine, as long as a prefill call: a few
    long runs on a loaded machine rarely found both cores free, which
    understated the peak (10x once) and so overstated every ratio to it."""
    return iters * per_iter * threads / time_call(lambda: loop(iters, threads), min_time=0.25, clock=clock)


def fma_peak(threads: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Lane-FMAs per second the machine sustains on ``threads`` threads."""
    return _rate(bench_lib()[1].bench_fma_loop, 96, 1_000_000, threads, clock)


def exp_rate(threads: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Exponentials per second of the kernels' vectorised exp (``sc_exp8`` on
    the x86-64-v3 build) on ``threads`` threads, arguments in L1: the most a
    kernel whose work is mostly exponentials can reach."""
    return _rate(bench_lib()[1].bench_exp_loop, 1024, 20_000, threads, clock)


# -- cases ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    call: Callable[[], None]
    traffic: int  # bytes read + written by the primitive
    fma_ops: int  # lane FMA-unit operations it needs (mul and fma count one each)
    scalar: Callable[[], None] | None = None
    exp_ops: int = 0  # exponentials it needs (decays, softplus, SiLU)


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def make_case(device: Device, shape: Shape, threads: int | None = None, with_scalar: bool = False) -> Case:
    """Allocate the shape's buffers on ``device`` and return a Case."""
    rng = np.random.default_rng(0)
    p = shape.params
    up = device.upload
    if shape.op in ("get_rows", "set_rows"):
        n, E = p["n"], p.get("E", MiB // 4)
        pool = up(_u(rng, (2 * n, E)))
        rows_host = rng.permutation(2 * n)[:n]
        rows = device.indices(rows_host)
        dense = up(_u(rng, (n, E)))
        fn = (lambda: device.get_rows(pool, rows, dense)) if shape.op == "get_rows" else (
            lambda: device.set_rows(pool, rows, dense))  # fmt: skip
        return Case(fn, 2 * n * MiB, 0)
    if shape.op == "memory":
        return _memory_decode(device, p, rng)
    n_s, n_t = p["n_s"], p["n_t"]
    start = dst = device.indices(np.arange(n_s))  # in-place, as in decode
    K = p.get("K", 1)
    rotate = bool(p.get("rotate"))
    layers = int(p.get("layers", 1))
    turn = [0]

    def pools(shape: tuple[int, ...]) -> Callable[[], Any]:
        """The state pool of the next call: one of `layers`, in turn (each its
        own buffer; their values are one draw, copied)."""
        values = _u(rng, shape)
        made = [up(values) for _ in range(layers)]
        if layers == 1:
            return lambda: made[0]

        def next_pool() -> Any:
            turn[0] = (turn[0] + 1) % layers
            return made[turn[0]]

        return next_pool

    # Plane rotation: step i reads plane i % K and writes only plane (i + 1) % K
    # (a 2-D snapshot table [[row, -1]]); each (start, table) pair is remembered.
    seqs = np.arange(n_s)
    turns = [
        (device.indices(q * n_s + seqs), device.indices(np.stack([((q + 1) % K) * n_s + seqs, np.full(n_s, -1)], 1)))
        for q in (range(K) if rotate else ())
    ]
    step = [0]

    def rows() -> tuple[Any, Any, dict[str, int]]:
        """Start rows, destination rows and plane arguments of the next call
        (rotation advances one plane per pass over the layers)."""
        if not rotate:
            return start, dst, {"n_snap": K, "plane_stride": n_s}
        if turn[0] == 0:
            step[0] = (step[0] + 1) % K
        return (*turns[step[0]], {})

    if shape.op == "ssm_scan":
        N, P, H, G = p["N"], p["P"], p["H"], p["G"]
        pool = pools((n_s * max(K, 1), H * P * N))
        x, dt = up(_u(rng, (n_s, n_t, H, P))), up(_u(rng, (n_s, n_t, H), -4, 1))
        A = up(-_u(rng, (H, N) if P == 1 else (H,), 0.2, 2.0))
        B, C = up(_u(rng, (n_s, n_t, G, N))), up(_u(rng, (n_s, n_t, G, N)))
        y = device.alloc((n_s, n_t, H, P))

        def fn() -> None:
            p_now = pool()
            s_rows, d_rows, planes = rows()
            device.ssm_scan(p_now, s_rows, d_rows, x, dt, A, B, C, y, **planes)

        if layers == 1 and not rotate:  # the plain decode loop: nothing but the call

            def fn() -> None:
                device.ssm_scan(first, start, dst, x, dt, A, B, C, y, n_snap=K, plane_stride=n_s)

        first = pool()

        state = H * P * N * 4 * n_s
        io = 4 * n_s * n_t * (2 * H * P + H + 2 * G * N)
        traffic = state * (1 + (1 if rotate else min(n_t + 1, K))) + io
        # decay mul, update fma, output fma per element; exps: softplus(dt) per
        # (token, head), the decay per (token, head) (Mamba-2) or per state
        # element (Mamba-1)
        decays = H * N if P == 1 else H
        case = Case(fn, traffic, 3 * H * P * N * n_t * n_s, exp_ops=(H + decays) * n_t * n_s)
        if with_scalar and P == 1 and n_s * n_t > 0:
            case.scalar = _scalar_mamba1(rng, n_s, n_t, H, N, threads or settings.num_threads())
        return case
    if shape.op == "ssm_conv":
        ch, d_conv = p["ch"], p["d_conv"]
        W = d_conv - 1
        pool = pools((n_s * K, ch * W))
        x, w, b = up(_u(rng, (n_s, n_t, ch))), up(_u(rng, (ch, d_conv))), up(_u(rng, (ch,)))
        y = device.alloc((n_s, n_t, ch))

        def fn() -> None:
            p_now = pool()
            s_rows, d_rows, planes = rows()
            device.ssm_conv(p_now, s_rows, d_rows, x, w, y, bias=b, apply_silu=True, **planes)

        if layers == 1 and not rotate:  # the plain decode loop: nothing but the call

            def fn() -> None:
                device.ssm_conv(first, start, dst, x, w, y, bias=b, apply_silu=True, n_snap=K, plane_stride=n_s)

        first = pool()

        windows = 1 + (1 if rotate else min(n_t + 1, K))
        # the taps' FMAs, and the exp of each output's SiLU
        case = Case(fn, 4 * n_s * (windows * ch * W + 2 * n_t * ch), d_conv * ch * n_t * n_s, exp_ops=ch * n_t * n_s)
        if with_scalar:
            case.scalar = _scalar_conv(rng, n_s, n_t, ch, d_conv, threads or settings.num_threads())
        return case
    if shape.op == "gdn":
        H, S, kda = p["H"], p["S"], p["kda"]
        pool = pools((n_s * K, H * S * S))
        qk = _u(rng, (2, n_s, n_t, H, S))
        qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
        q, k, v = up(qk[0]), up(qk[1]), up(_u(rng, (n_s, n_t, H, S)))
        g = up(_u(rng, (n_s, n_t, H, S) if kda else (n_s, n_t, H), -1.0, -1e-3))
        beta, o = up(_u(rng, (n_s, n_t, H), 0, 1)), device.alloc((n_s, n_t, H, S))

        def fn() -> None:
            p_now = pool()
            s_rows, d_rows, planes = rows()
            device.gated_delta_net(p_now, s_rows, d_rows, q, k, v, g, beta, o, **planes)

        if layers == 1 and not rotate:  # the plain decode loop: nothing but the call

            def fn() -> None:
                device.gated_delta_net(first, start, dst, q, k, v, g, beta, o, n_snap=K, plane_stride=n_s)

        first = pool()

        state = H * S * S * 4 * n_s
        states = 1 + (1 if rotate else min(n_t + 1, K))
        # decay, k-dot, update, q-dot per element; exps: the decay per (token,
        # head), or per key for KDA
        gates = H * S if kda else H
        return Case(
            fn, states * state + 4 * n_s * n_t * H * S * 5, 4 * H * S * S * n_t * n_s, exp_ops=gates * n_t * n_s
        )
    if shape.op == "linear_attn":
        H, S, variant = p["H"], p["S"], p["variant"]
        op, n_in, fma_per = _LINEAR_ATTN[variant]
        pool = pools((n_s * K, H * S * S))
        shape_t = (n_s, n_t, H, S)
        if variant == "rwkv7":
            kk = rng.uniform(-1, 1, shape_t)
            kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
            decay = -0.6 * rng.uniform(0, 1, shape_t)
            ins = [_u(rng, shape_t), decay, _u(rng, shape_t), _u(rng, shape_t), -kk, kk * rng.uniform(0, 1, shape_t)]
        else:
            ins = [_u(rng, shape_t), _u(rng, shape_t), _u(rng, shape_t), -rng.uniform(0.001, 1.0, shape_t)]
        bufs = [up(np.asarray(a, np.float32)) for a in ins]
        if variant == "rwkv6":
            bufs.append(up(_u(rng, (H, S))))
        o = device.alloc(shape_t)
        kernel = getattr(device, op)

        def fn() -> None:
            p_now = pool()
            s_rows, d_rows, planes = rows()
            kernel(p_now, s_rows, d_rows, *bufs, o, **planes)

        if layers == 1 and not rotate:  # the plain decode loop: nothing but the call

            def fn() -> None:
                kernel(first, start, dst, *bufs, o, n_snap=K, plane_stride=n_s)

        first = pool()

        state = H * S * S * 4 * n_s
        states = 1 + (1 if rotate else min(n_t + 1, K))
        # exps: the decay (RWKV-6 / RWKV-7) or gate (GLA) of each key, per token
        return Case(
            fn,
            states * state + 4 * n_s * n_t * H * S * (n_in + 1),
            fma_per * H * S * S * n_t * n_s,
            exp_ops=H * S * n_t * n_s,
        )
    raise ValueError(f"unknown benchmark op {shape.op!r}")


def _memory_decode(device: Device, p: dict[str, Any], rng: np.random.Generator) -> Case:
    """One decode token for each of ``n_s`` sequences through a RecurrentMemory of
    ``layers`` layers with ``n_rs_seq`` rollback planes: batch, plan, apply, then
    the family's primitive on one state tensor of every layer, as a runtime that
    keeps its activation buffers runs it.  The sequences' positions grow from
    call to call; the states stay finite (decaying scans, normalised keys)."""
    from statecache.batch import Batch, BatchAllocator
    from statecache.recurrent import RecurrentMemory
    from statecache.spec import MemorySpec, RecurrentLayerSpec

    family, n_s, n_layers, n_rs_seq = p["family"], p["n_s"], p["layers"], p["n_rs_seq"]
    up = device.upload
    if family == "mamba2":
        N, P, H = p["N"], p["P"], p["H"]
        layer = RecurrentLayerSpec.mamba2(d_inner=H * P, d_state=N, d_conv=4, n_group=1, head_dim=P)
        x, dt = up(_u(rng, (n_s, 1, H, P))), up(_u(rng, (n_s, 1, H), -4, 1))
        A, B, C = up(-_u(rng, (H,), 0.2, 2.0)), up(_u(rng, (n_s, 1, 1, N))), up(_u(rng, (n_s, 1, 1, N)))
        y = device.alloc((n_s, 1, H, P))
        tensor, row, io = "s", H * P * N, 2 * H * P + H + 2 * N

        def kernel(step: Any, i: int) -> None:
            step.scan(i, x, dt, A, B, C, y)

    else:
        H, S = p["H"], p["S"]
        layer = RecurrentLayerSpec.gdn(n_head=H, head_dim=S, d_conv=4)
        if family == "conv":
            ch = layer.params["channels"]
            x, w, b = up(_u(rng, (n_s, 1, ch))), up(_u(rng, (ch, 4))), up(_u(rng, (ch,)))
            y = device.alloc((n_s, 1, ch))
            tensor, row, io = "r", 3 * ch, 2 * ch

            def kernel(step: Any, i: int) -> None:
                step.conv(i, x, w, y, bias=b, apply_silu=True)

        else:
            qk = _u(rng, (2, n_s, 1, H, S))
            qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
            q, k, v = up(qk[0]), up(qk[1]), up(_u(rng, (n_s, 1, H, S)))
            g, beta = up(_u(rng, (n_s, 1, H), -1.0, -1e-3)), up(_u(rng, (n_s, 1, H), 0, 1))
            o = device.alloc((n_s, 1, H, S))
            tensor, row, io = "s", H * S * S, 5 * H * S

            def kernel(step: Any, i: int) -> None:
                step.delta(i, q, k, v, g, beta, o)

    # only the benchmarked state tensor gets a pool
    layer = dataclasses.replace(layer, tensors=tuple(t for t in layer.tensors if t.name == tensor))
    spec = MemorySpec.build(n_layers, dict.fromkeys(range(n_layers), layer))
    mem = RecurrentMemory(spec, device, n_seq_max=n_s, n_rs_seq=n_rs_seq)
    balloc = BatchAllocator(n_s)
    ones = np.ones(n_s, dtype=np.int32)
    batch = Batch(tokens=ones, seq_ids=np.arange(n_s, dtype=np.int32), output=ones.astype(bool))

    def fn() -> None:
        balloc.init(batch, mem)  # positions continue each sequence's state
        ctx = mem.init_batch(balloc, max(n_s, n_rs_seq + 2))
        if not ctx.apply():
            raise RuntimeError(f"decode step refused: {ctx.status}")
        step = ctx.step()
        for i in range(n_layers):
            kernel(step, i)
        ctx.next()

    # Steps until the rotation has come round twice: the first write to each
    # plane faults in fresh zero pages, and each layer's call meets each
    # plane's rows for the first time (its launch memo learns them once).  A
    # serving runtime is long past both; n_rs_seq + 1 steps were not enough
    # (the conv with n_rs_seq=3 ran 2-3x slower for its first 8 steps).
    for _ in range(4 * (n_rs_seq + 1)):
        fn()
    # per layer: the state read and written once (either way), plus the token's inputs and outputs
    return Case(fn, n_layers * 4 * n_s * (2 * row + io), 0)


def _scalar_mamba1(rng: np.random.Generator, n_s: int, n_t: int, H: int, N: int, threads: int) -> Callable[[], None]:
    ffi, lib = bench_lib()
    arrays = [_u(rng, (n_s, H * N)), _u(rng, (n_s, n_t, H)), _u(rng, (n_s, n_t, H), -4, 1), -_u(rng, (H, N), 0.2, 2)]
    arrays += [_u(rng, (n_s, n_t, N)), _u(rng, (n_s, n_t, N)), np.zeros((n_s, n_t, H), np.float32)]
    ptrs = [ffi.from_buffer("float[]", a) for a in arrays]

    def fn() -> None:
        for s in range(n_s):
            state, x, dt, A, B, C, y = (ptrs[i] + (0 if i == 3 else s * arrays[i][0].size) for i in range(7))
            lib.scalar_mamba1(state, x, dt, A, B, C, y, n_t, H, N, threads)

    fn.keep = (arrays, ptrs)  # type: ignore[attr-defined]
    return fn


def _scalar_conv(
    rng: np.random.Generator, n_s: int, n_t: int, ch: int, d_conv: int, threads: int
) -> Callable[[], None]:
    ffi, lib = bench_lib()
    arrays = [_u(rng, (n_s, ch * (d_conv - 1))), _u(rng, (n_s, n_t, ch)), _u(rng, (ch, d_conv)), _u(rng, (ch,))]
    arrays.append(np.zeros((n_s, n_t, ch), np.float32))
    ptrs = [ffi.from_buffer("float[]", a) for a in arrays]

    def fn() -> None:
        for s in range(n_s):
            win, x, w, b, y = (ptrs[i] + (s * arrays[i][0].size if i in (0, 1, 4) else 0) for i in range(5))
            lib.scalar_conv(win, x, w, b, y, n_t, ch, d_conv, threads)

    fn.keep = (arrays, ptrs)  # type: ignore[attr-defined]
    return fn


# -- driver ---------------------------------------------------------------------------


def bound_of(case: Case, memcpy: float, peak: float, exps: float) -> tuple[str, float, float]:
    """``(name, floor seconds, compute floor seconds)`` of a case: the larger
    of its memcpy floor (``memcpy`` seconds) and its compute floor (its FMAs
    at ``peak``, plus its exponentials at ``exps`` per second; 0 when the
    limits were not measured), named ``memcpy``, ``fma`` or ``exp`` (the part
    of the compute floor that dominates)."""
    if not peak or not exps:
        return "memcpy", memcpy, 0.0
    t_fma, t_exp = case.fma_ops / peak, case.exp_ops / exps
    compute = t_fma + t_exp
    if memcpy >= compute:
        return "memcpy", memcpy, compute
    return ("exp" if t_exp > t_fma else "fma"), compute, compute


def bound_reason(case: Case, memcpy: float, peak: float, exps: float) -> str:
    """Why a case has the bound :func:`bound_of` names: its arithmetic
    intensity (lane FMAs and exponentials per byte moved) and the floors that
    intensity gives on this machine, the larger one first.  A depthwise conv
    does a few FMAs per 8 bytes, yet one SiLU exponential per output element
    can cost more than moving the element's bytes: the line shows which."""
    mb = case.traffic / 1e6
    intensity = f"{case.fma_ops / case.traffic:.2f} FMA + {case.exp_ops / case.traffic:.3f} exp per byte"
    if not peak or not exps:
        return f"memcpy: {mb:.1f} MB moved, {intensity} (compute floor not measured)"
    t_fma, t_exp = case.fma_ops / peak * 1e6, case.exp_ops / exps * 1e6
    copy = f"memcpy floor of {mb:.1f} MB {memcpy * 1e6:.0f} us"
    compute = f"{case.fma_ops / 1e6:.2f} M FMA {t_fma:.0f} us + {case.exp_ops / 1e6:.2f} M exp {t_exp:.0f} us"
    bound = bound_of(case, memcpy, peak, exps)[0]
    if bound == "memcpy":
        return f"memcpy: {intensity}; {copy} >= {compute}"
    return f"{bound}: {intensity}; {compute} > {copy}"


def run(
    device_name: str | Device = "cpu",
    *,
    only: str | None = None,
    reference: bool = True,
    scalar: bool = True,
    min_time: float = 0.25,
    rounds: int = 1,
    out: Callable[[str], None] | None = print,
    shapes: Sequence[Shape] | None = None,
    on_measured: Callable[[Shape], None] | None = None,
    clock: str = "wall",
) -> list[dict[str, Any]]:
    """Run every shape (or those whose name contains ``only``, or the given
    ``shapes``) and return one dict per shape with times and ratios.
    ``on_measured(shape)`` is called after each shape's measurement (a
    progress display); the host memcpy and per-call cost lines are measured
    only for a full run.

    With ``rounds`` > 1 every measurement (kernel, memcpy floor, scalar
    baseline, FMA peak, exp rate) is repeated that many times, rounds apart,
    and the fastest kept: on a shared machine a later round may find the
    cores free when an earlier one did not.  ``clock``: ``"wall"`` or
    ``"cpu"`` (the process's CPU time, host devices only; see the module
    docstring)."""
    device = device_name if isinstance(device_name, Device) else get_device(device_name)
    host = device.backend_name == "cpu"
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and not host:
        raise ValueError(f"clock 'cpu' times host work only; {device.id} runs on its own device")
    tick = CLOCKS[clock]
    ref = get_device("reference") if reference and device.backend_name != "reference" else None
    threads = settings.num_threads()
    say = out or (lambda _: None)
    full_run = only is None and shapes is None
    shapes = [shape for shape in (SHAPES if shapes is None else shapes) if not only or only in shape.name]

    def build(shape: Shape) -> Case:
        case = make_case(device, shape, threads, with_scalar=scalar and host and shape.scalar_baseline)
        # A row over many layers calls every (layer, plane) pair once before it
        # is timed, as a decode loop long past its first steps has: each pair is
        # a call the launch memo validates once.  Timed cold, the conv rotation
        # (1041 layers x 4 planes, ~70 us a call) spent its whole measurement
        # in first calls and read 2.08x of decode without rollback; warm, the
        # same kernel calls run at about 0.9-1.0x of it.
        p = shape.params
        if many_layers(shape):
            for _ in range(int(p["layers"]) * (int(p.get("K", 1)) if p.get("rotate") else 1)):
                case.call()
        return case

    # Shapes over many layers (the rollback rows: hundreds of MiB, four planes
    # of it with rollback) exist only while they are timed; the rest are built once.
    def many_layers(shape: Shape) -> bool:
        return int(shape.params.get("layers", 1)) > 1

    cases = {shape.name: build(shape) for shape in shapes if not many_layers(shape)}
    inf = float("inf")
    best: dict[str, dict[str, float]] = {shape.name: {"t": inf, "copy": inf, "scalar": inf} for shape in shapes}
    # per (bytes, in place): the fastest time of each way of moving them (floor_seconds)
    floor_best: dict[tuple[int, bool], dict[str, float]] = {}
    floor_keep: dict[Any, Any] = {}  # the floors' buffers, the same every round
    host_best: dict[tuple[int, int], float] = {}
    peak = exps = 0.0
    # with rollback rows on a host: the floor of their ratio, over the rows' state
    # (out of cache) and over a quarter of the L3 (both passes in cache)
    floor_rows = host and any(s.op == "memory" or "rotate" in s.name for s in shapes)
    floor_sizes = {"out of cache": rollback_layers(8 * MiB), "in cache": max((host_l3_bytes() or 0) // (32 * MiB), 1)}
    rotation_best = {where: [inf, inf] for where in floor_sizes}
    for _ in range(max(rounds, 1)):
        if host or scalar:
            peak = max(peak, fma_peak(threads, tick))
            exps = max(exps, exp_rate(threads, tick))
        for shape in shapes:
            case, b = build(shape) if many_layers(shape) else cases[shape.name], best[shape.name]
            b["t"] = min(b["t"], time_call(case.call, device, min_time, clock=tick))
            if many_layers(shape):  # keep its sizes, free its buffers
                cases[shape.name] = case = Case(lambda: None, case.traffic, case.fma_ops, None, case.exp_ops)
            key = floor_key(shape, case)
            # Measured again for every shape, right after it, and the fastest
            # kept: the bound must not inherit a moment when another job held a core.
            ways = floor_best.setdefault(key, {})
            nbytes, in_place, layers = key
            measured = floor_seconds(device, nbytes, in_place, threads, tick, floor_keep, min_time, layers)
            for how, seconds in measured.items():
                ways[how] = min(ways.get(how, inf), seconds)
            if case.scalar is not None:
                b["scalar"] = min(b["scalar"], time_call(case.scalar, None, min_time, clock=tick))
            if on_measured is not None:
                on_measured(shape)
        if floor_rows:
            for where, n_layers in floor_sizes.items():
                measured = host_rotation_floor(n_layers, 8 * MiB, threads, tick)
                rotation_best[where] = [min(a, b) for a, b in zip(rotation_best[where], measured)]
        if host and full_run:
            for nbytes in (8 * MiB, 32 * MiB):
                for n_threads in (1, 2):
                    key = (nbytes, n_threads)
                    host_best[key] = min(host_best.get(key, inf), host_memcpy_seconds(nbytes, n_threads, tick))
    timed = "process CPU time" if clock == "cpu" else "wall time"
    say(f"device {device.id}: {device.name}; threads {threads}; fastest of {max(rounds, 1)} round(s); {timed}")
    if peak:
        say(
            f"FMA peak ({threads} threads): {peak / 1e9:.1f} G lane-FMA/s; "
            f"exp rate (the kernels' vectorised exp): {exps / 1e9:.2f} G exp/s"
        )
    say(
        f"{'shape':28} {'us/call':>10} {'GB/s':>7} {'memcpy':>8} {'compute':>8} {'bound':>7} {'x bound':>8} "
        f"{'x memcpy':>8} {'x inplace':>9} {'x ref':>8} {'x scalar':>9}"
    )

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    rows = []
    for shape in shapes:
        case, b = cases[shape.name], best[shape.name]
        t, ways = b["t"], floor_best[floor_key(shape, case)]
        # The bound is the copy (the memcpy floor issue 18 states its targets
        # against); an in-place pass, where one applies, is printed beside it
        # as a stricter floor (x in-place), not folded into the bound.
        how, t_copy = "copy", ways["copy"]
        in_place_ways = {w: v for w, v in ways.items() if w != "copy"}
        t_inplace = min(in_place_ways.values()) if in_place_ways else None
        bound, floor, compute = bound_of(case, t_copy, peak, exps)
        row: dict[str, Any] = {
            "shape": shape.name,
            "seconds": t,
            "gbps": case.traffic / t / 1e9,
            "memcpy_seconds": t_copy,
            "memcpy_ratio": t_copy / t,
            "compute_seconds": compute or None,
            "bound": bound,
            "bound_ratio": floor / t,
            "fma_ratio": (case.fma_ops / peak) / t if peak and bound != "memcpy" else None,
            "why": bound_reason(case, t_copy, peak, exps),
            "memcpy_how": how,
            "memcpy_ways": dict(ways),
            "inplace_seconds": t_inplace,
            "inplace_ratio": t_inplace / t if t_inplace is not None else None,
        }
        if ref is not None:
            ref_case = make_case(ref, shape)
            row["ref_speedup"] = time_call(ref_case.call, ref, min_time=0.0, max_reps=1, clock=tick) / t
        if case.scalar is not None:
            row["scalar_speedup"] = b["scalar"] / t
        rows.append(row)
        say(
            f"{shape.name:28} {t * 1e6:10.1f} {row['gbps']:7.1f} {t_copy * 1e6:8.1f} "
            f"{fmt(compute * 1e6 if compute else None, '8.1f'):>8} {bound:>7} {row['bound_ratio']:8.2f} "
            f"{row['memcpy_ratio']:8.2f} {fmt(row['inplace_ratio'], '9.2f'):>9} "
            f"{fmt(row.get('ref_speedup'), '8.1f'):>8} "
            f"{fmt(row.get('scalar_speedup'), '9.1f'):>9}"
        )
    if peak:
        say(
            "memcpy / compute: the floors in us (the shape's bytes moved once each way, see below; its FMAs at "
            "the FMA peak plus its exps at the exp rate); bound: the larger one; x bound: that floor / the time"
        )
        say("why each bound applies (the shape's work per byte moved, and the floors it gives here):")
        for row in rows:
            say(f"  {row['shape']:28} {row['why']}")
    say(
        "memcpy floor: a copy of the shape's bytes into another buffer, repeated on one buffer kept for every "
        "round as the call repeats on one pool (rows over many layers: over as many pairs of buffers in turn, "
        "from memory as those rows run); x inplace: the ratio to a stricter floor, for calls that update "
        f"their state in place (host), an in-place pass over as many bytes (read, written back) on 1 and {threads} "
        "threads (the fastest), which moves what such a call must move with the footprint of its state"
    )
    for row in rows:
        others = ", ".join(f"{w} {v * 1e6:.1f}" for w, v in row["memcpy_ways"].items() if w != row["memcpy_how"])
        say(
            f"  {row['shape']:28} {row['memcpy_how']} {row['memcpy_seconds'] * 1e6:.1f} us"
            + (f" (other ways: {others} us)" if others else "")
        )
    if host and full_run:
        for nbytes in (8 * MiB, 32 * MiB):
            t1, t2 = host_best[(nbytes, 1)], host_best[(nbytes, 2)]
            say(
                f"host memcpy {nbytes // MiB} MiB: 1 thread {2 * nbytes / t1 / 1e9:.1f} GB/s, "
                f"2 threads {2 * nbytes / t2 / 1e9:.1f} GB/s"
            )
    times = {row["shape"]: row["seconds"] for row in rows}
    ratios = []
    for family in ("mamba2", "gdn", "conv"):
        base = times.get(f"{family} decode n_s=8 x layers")
        parts = [
            f"{how} {times[name] / base:.2f}x"
            for how in ("K=4 planes", "K=4 rotate")
            if base is not None and (name := f"{family} decode n_s=8 {how}") in times
        ]
        if parts:
            ratios.append(f"{family} " + ", ".join(parts))
    if ratios:
        say("decode with rollback vs without (n_s=8, state of many layers): " + "; ".join(ratios))
    memory = [
        f"{family} {times[with_] / times[without]:.2f}x"
        for family in ("mamba2", "gdn", "conv")
        if (with_ := f"{family} memory n_s=8 rs=3") in times and (without := f"{family} memory n_s=8 rs=0") in times
    ]
    if memory:
        say("decode through the memory, n_rs_seq=3 vs 0 (n_s=8, every layer): " + "; ".join(memory))
    if floor_rows:
        say(f"rollback rows' state: {ROLLBACK_STATE_BYTES / MiB:.0f} MiB per decode step ({ROLLBACK_STATE_WHY})")
        for where, n_layers in floor_sizes.items():
            t_in, t_rot = rotation_best[where]
            say(
                f"floor of those ratios on this host, {where} (y = a x + b over {n_layers} layers x 8 MiB): "
                f"in place {t_in * 1e6:.0f} us, streamed into the other plane {t_rot * 1e6:.0f} us: "
                f"{t_rot / t_in:.2f}x"
            )
    if full_run:
        remembered = {op: call_overhead(device, op, clock=tick) for op in _TINY}
        costs = ", ".join(
            f"{op} {remembered[op] * 1e6:.1f} / {call_overhead(device, op, remembered=False, clock=tick) * 1e6:.0f} us"
            for op in _TINY
        )
        say(f"fixed cost per call on tiny shapes, remembered / validated: {costs}")
        if host:
            empty, team = call_floor(threads, tick)
            say(
                f"floor of that fixed cost: a bare cffi call of an empty C function {empty * 1e6:.2f} us, "
                f"the same starting an empty {threads}-thread team {team * 1e6:.2f} us; remembered calls "
                "are " + ", ".join(f"{op} {remembered[op] / empty:.0f}x" for op in _TINY) + " the bare call"
            )
    return rows


# Smallest shapes of each op: their time is the per-call cost outside the kernels,
# which bounds what a decode step of any size can reach.
_TINY = {
    "get_rows": Shape("tiny gather", "get_rows", {"n": 1, "E": 16}),
    "ssm_scan": Shape("tiny scan", "ssm_scan", {"N": 8, "P": 8, "H": 1, "G": 1, "n_t": 1, "n_s": 1, "K": 1}),
    "ssm_conv": Shape("tiny conv", "ssm_conv", {"ch": 8, "d_conv": 4, "n_t": 1, "n_s": 1}),
    "gated_delta_net": Shape("tiny gdn", "gdn", {"H": 1, "S": 8, "n_t": 1, "n_s": 1, "kda": False}),
    "rwkv_wkv7": Shape("tiny rwkv7", "linear_attn", {"variant": "rwkv7", "H": 1, "S": 8, "n_t": 1, "n_s": 1}),
}


def call_overhead(
    device: Device, op: str, remembered: bool = True, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds per call of ``op`` on a shape too small for its kernel to matter.

    ``remembered``: the call repeats with the same buffers, as in a decode
    loop, so the device's launch memo skips validation; otherwise the memo is
    emptied before every call, which measures validation and dispatch."""
    call = make_case(device, _TINY[op]).call
    if not remembered:
        inner = call

        def call() -> None:
            memo = device._launches
            if memo is not None:
                memo.clear()
            inner()

    return time_call(call, device, min_time=0.05, clock=clock)


def call_floor(threads: int, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Seconds per call, from Python, of an empty C function through cffi
    (what any primitive call pays at the least) and of one that starts an
    empty OpenMP team of ``threads`` (what a call split over the team pays
    at the least), both compiled with the CPU backend's flags."""
    _, lib = bench_lib()
    empty = time_call(lib.bench_empty, None, min_time=0.05, clock=clock)
    team = time_call(lambda: lib.bench_team(threads), None, min_time=0.05, clock=clock)
    return empty, team


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="device to measure, e.g. cpu, opencl:0, cuda:0")
    parser.add_argument("--only", default=None, help="run shapes whose name contains this text")
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) NumPy reference timings")
    parser.add_argument("--no-scalar", action="store_true", help="skip the scalar C baselines")
    parser.add_argument("--min-time", type=float, default=0.25, help="seconds of repetitions per measurement")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every measurement, keep the fastest")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time by the wall clock, or by the process's CPU time (host devices; steadier on a shared machine)",
    )
    args = parser.parse_args(argv)
    try:
        run(
            args.device,
            only=args.only,
            reference=not args.no_reference,
            scalar=not args.no_scalar,
            min_time=args.min_time,
            rounds=args.rounds,
            clock=args.clock,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
