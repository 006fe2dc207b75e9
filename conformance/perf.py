"""``statecache conformance --perf``: the CPU issue's benchmark shapes on each
device, printed as GB/s and the ratio to the device's own memcpy bound.

The shapes and measurement functions are those of
:mod:`statecache.conformance.benchmarks` (``bench/primitives.py`` is its
command-line front end).
Numbers are printed, never asserted.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from statecache.backend import Device

EXIT_OK = 0
EXIT_FAILED = 1


def bench_module() -> ModuleType:
    """The benchmark machinery (shapes, timing, bounds) shipped with the suite."""
    from statecache.conformance import benchmarks

    return benchmarks


def _cpu_baseline(devices: list[Device]) -> Device | None:
    """The C backend's device, to compare other backends with (None if unusable)."""
    for device in devices:
        if device.backend_name == "cpu":
            return device
    try:
        from statecache.registry import default_registry

        return default_registry().get_device("cpu")
    except Exception:  # no C backend here: the column is left out
        return None


def run(devices: list[Device], console: Any, min_time: float = 0.1) -> int:
    from rich.table import Table

    bench = bench_module()
    baseline = _cpu_baseline(devices)
    baseline_rows: dict[str, float] | None = None
    for device in devices:
        if device.backend_name == "reference":
            # The oracle computes in float64 loops: timing it says nothing about a backend.
            console.print(f"{device.id}: skipped (the NumPy reference is the oracle, not a performance backend)")
            continue
        compare = baseline is not None and baseline is not device
        if compare and baseline_rows is None:
            assert baseline is not None
            baseline_rows = {
                r["shape"]: r["seconds"]
                for r in bench.run(baseline, reference=False, scalar=False, min_time=min_time, out=None)
            }
        table = Table(title=f"{device.id} ({device.name})")
        cols = ["shape", "us/call", "GB/s", "x memcpy bound"]
        if compare:
            assert baseline is not None
            cols.append(f"x {baseline.id}")  # > 1: faster than the C backend on the same shape
        for col in cols:
            table.add_column(col, justify="left" if col == "shape" else "right")
        rows = bench.run(device, reference=False, scalar=False, min_time=min_time, out=None)
        for row in rows:
            cells = [row["shape"], f"{row['seconds'] * 1e6:.1f}", f"{row['gbps']:.1f}", f"{row['memcpy_ratio']:.2f}"]
            if compare and baseline_rows is not None:
                cells.append(f"{baseline_rows[row['shape']] / row['seconds']:.2f}")
            table.add_row(*cells)
        console.print(table)
    return EXIT_OK
