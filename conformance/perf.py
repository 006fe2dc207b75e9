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


def run(devices: list[Device], console: Any, min_time: float = 0.1) -> int:
    from rich.table import Table

    bench = bench_module()
    for device in devices:
        if device.backend_name == "reference":
            # The oracle computes in float64 loops: timing it says nothing about a backend.
            console.print(f"{device.id}: skipped (the NumPy reference is the oracle, not a performance backend)")
            continue
        table = Table(title=f"{device.id} ({device.name})")
        for col in ("shape", "us/call", "GB/s", "x memcpy bound"):
            table.add_column(col, justify="left" if col == "shape" else "right")
        rows = bench.run(device, reference=False, scalar=False, min_time=min_time, out=None)
        for row in rows:
            table.add_row(
                row["shape"], f"{row['seconds'] * 1e6:.1f}", f"{row['gbps']:.1f}", f"{row['memcpy_ratio']:.2f}"
            )
        console.print(table)
    return EXIT_OK
