"""Every environment variable statecache reads, in one place, read lazily.

The README documents the same table; a test checks the two agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from statecache.errors import SettingsError

#: libgomp spin iterations before an idle CPU-backend worker sleeps, when the
#: user sets no wait policy (see :func:`openmp_defaults`).
SHORT_SPIN = 1000


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    default: str | None
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "STATECACHE_DEVICE",
        None,
        "Device chosen when none is named, e.g. `cpu`, `opencl:1`, `cuda:0`, `reference`.",
    ),
    Variable(
        "STATECACHE_BACKENDS",
        None,
        "Comma-separated allowlist of backend names to load (unset: all; empty: none).",
    ),
    Variable(
        "STATECACHE_NUM_THREADS",
        None,
        "Threads used by the C CPU backend (default: `torch.get_num_threads()` when torch is imported in the "
        "process, else the cores this process may use).",
    ),
    Variable(
        "STATECACHE_CACHE_DIR",
        None,
        "Where built kernels (the CUDA library) are cached (default: the user cache dir).",
    ),
    Variable(
        "PYOPENCL_CTX",
        None,
        "pyopencl's device choice `platform[:device]` (index or name substring); "
        "restricts the devices the opencl backend offers.",
    ),
    Variable(
        "STATECACHE_TRACE_PLUGINS",
        None,
        "When set to 1, print every plugin hook call and its result.",
    ),
    Variable(
        "OMP_WAIT_POLICY",
        None,
        "OpenMP wait policy of the C CPU backend's threads; when neither it nor `GOMP_SPINCOUNT` is set, "
        "the kernels load with a short spin (`GOMP_SPINCOUNT` "
        f"{SHORT_SPIN}: an idle worker spins about 10-50 us, then sleeps). `passive` sleeps at once (a futex "
        "wake per call, 10-15 us in a VM), `active` spins for milliseconds (holds a core torch's next op "
        "wants).",
    ),
    Variable(
        "GOMP_SPINCOUNT",
        None,
        "libgomp's spin count before an idle thread sleeps; setting it (or `OMP_WAIT_POLICY`) replaces "
        "statecache's short-spin default.",
    ),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str) -> str | None:
    """The value of a documented variable (unknown names are a bug)."""
    var = _BY_NAME[name]
    return os.environ.get(name, var.default)


def device() -> str | None:
    value = get("STATECACHE_DEVICE")
    return value.strip() or None if value is not None else None


def backend_allowlist() -> frozenset[str] | None:
    """``None`` when unset (load all); an empty set when set to ''."""
    value = get("STATECACHE_BACKENDS")
    if value is None:
        return None
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def problems() -> list[str]:
    """One line per variable whose value cannot be used (empty: all fine).

    Commands check this first, so a bad value is one clear usage error
    instead of a failure inside every kernel call that reads it."""
    out = []
    try:
        num_threads()
    except SettingsError as exc:
        out.append(str(exc))
    return out


def num_threads() -> int:
    """Threads per C kernel: ``STATECACHE_NUM_THREADS`` when set, else torch's
    intra-op thread count when torch is imported in this process, else the
    cores this process may use.

    Why follow torch: a runtime interleaves torch ops and statecache kernels
    on one thread, one after the other, and both run on OpenMP (torch's pip
    wheels ship ``libgomp.so.1``, so the process has one OpenMP runtime and
    one pool of threads).  Teams of different sizes there leave threads
    spinning or waking for the wrong team: measured on 2 cores with spinning
    waits (``bench/tensor_calls.py --threads``), a small ``nn.Linear`` took
    11 ms at p90 (84 us median) when statecache used 1 thread and torch 2,
    and a scan 16 ms at p90 when statecache used 2 and torch 1 (the old
    default next to ``torch.set_num_threads(1)``); with equal counts every
    p90 stayed under 0.35 ms.  Following ``torch.get_num_threads()`` keeps
    the counts equal, and honours a runtime that gives torch fewer threads
    to leave cores to others.  torch is looked up, never imported.

    Read at every kernel call (so a changed variable, or torch's
    ``set_num_threads``, takes effect at once), and cheaply: a decode step
    is only a few microseconds.  ``os.environ.get`` encodes the name and
    goes through two Python frames (0.8 us); the raw mapping behind
    ``os.environ`` holds the same entries (``os.environ[...] = ...``,
    ``putenv`` through it and ``monkeypatch.setenv`` all write it), so it is
    read directly, found again whenever ``os.environ`` is not the object it
    was.  Parsing is cached per value."""
    seen, get, key = _raw_threads_var
    value = get(key) if os.environ is seen else _raw_threads_value()
    if value:
        return _threads_from_raw(value)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            n = torch.get_num_threads()
        except Exception:  # torch is still being imported (no such attribute yet), or a stand-in
            n = None
        if type(n) is int and n >= 1:
            return n
        if n is not None:
            follow = _torch_threads(torch)
            if follow is not None:
                return follow
    return _threads_from(None)


def _never_seen(key: Any) -> Any:
    raise AssertionError("unreachable: no os.environ is None")


#: (os.environ as last seen, the lookup of its raw mapping, STATECACHE_NUM_THREADS's key there)
_raw_threads_var: tuple[object, Callable[[Any], Any], Any] = (None, _never_seen, None)


def _raw_threads_value() -> Any:
    """``STATECACHE_NUM_THREADS`` undecoded (bytes on POSIX) or None, with
    :data:`_raw_threads_var` set for the next call to read it directly; for a
    stand-in ``os.environ`` without a raw mapping behind it, its ``get``."""
    global _raw_threads_var
    env = os.environ
    data = getattr(env, "_data", None)
    encode = getattr(env, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        _raw_threads_var = (env, data.get, encode(_NUM_THREADS))
    else:
        _raw_threads_var = (None, _never_seen, None)
    return env.get(_NUM_THREADS)


_NUM_THREADS = "STATECACHE_NUM_THREADS"


def _torch_threads(torch: object) -> int | None:
    get = getattr(torch, "get_num_threads", None)
    if get is None:
        return None  # torch is still being imported, or a stand-in
    try:
        return max(1, int(get()))
    except Exception:
        return None


@functools.lru_cache(maxsize=8)
def _threads_from_raw(value: Any) -> int:
    return _threads_from(os.fsdecode(value) if isinstance(value, bytes) else value)


@functools.lru_cache(maxsize=8)
def _threads_from(value: str | None) -> int:
    if value:
        try:
            n = int(value)
        except ValueError:
            raise SettingsError(f"STATECACHE_NUM_THREADS must be a positive integer, got {value!r}") from None
        if n < 1:
            raise SettingsError(f"STATECACHE_NUM_THREADS must be a positive integer, got {value!r}")
        return n
    return _available_cores()


@functools.cache
def _available_cores() -> int:
    # Asked once: kernels read num_threads() on every call, and the affinity
    # syscall would cost more than a small decode kernel's bookkeeping.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def openmp_defaults() -> Iterator[None]:
    """Load OpenMP code inside this block to get statecache's wait policy.

    libgomp reads its settings once, when it is loaded.  Its default spins
    idle threads for milliseconds (300000 iterations) after each parallel
    region, so the spinning thread holds a core that torch's next op, or
    another job, wants.  Passive waiting sleeps at once, but then every call
    pays a futex wake of its workers: in a VM (this project's 2-core host)
    that was 10-15 us, more than a one-sequence decode kernel itself (conv
    decode 20.6 us passive against 4.9 us with a short spin; RWKV-7 27.8
    against 11.9).  A short spin (``SHORT_SPIN`` iterations, about 10-50 us
    by the CPU's pause) keeps the workers awake between the calls of one
    decode step, whose layers follow each other within microseconds, and
    lets them sleep while the runtime does anything longer; a small
    ``nn.Linear`` between scans was not slowed by it (``bench/tensor_calls.py
    --threads``).  The environment is restored afterwards so that nothing
    else the process or its children load sees a changed variable."""
    if get("OMP_WAIT_POLICY") is not None or get("GOMP_SPINCOUNT") is not None:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = str(SHORT_SPIN)
    try:
        yield
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)


def cache_dir() -> str:
    value = get("STATECACHE_CACHE_DIR")
    if value:
        return value
    import platformdirs

    return platformdirs.user_cache_dir("statecache")


def opencl_ctx() -> str | None:
    """``PYOPENCL_CTX`` stripped, or ``None`` when unset or empty."""
    value = get("PYOPENCL_CTX")
    return value.strip() or None if value is not None else None


def trace_plugins() -> bool:
    return get("STATECACHE_TRACE_PLUGINS") in ("1", "true", "yes")
