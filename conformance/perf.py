"""``statecache conformance --perf``: the CPU issue's benchmark shapes on each
device, printed as GB/s and the ratio to the device's own memcpy bound.

The shapes and measurement functions are those of ``bench/primitives.py``
(loaded from the source checkout; it is not part of the installed package).
Numbers are printed, never asserted.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType
from typing import Any

from statecache.backend import Device

EXIT_OK = 0
EXIT_FAILED = 1


def bench_module() -> ModuleType | None:
    """``bench/primitives.py`` of the checkout this package was installed from, if any."""
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "primitives.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("statecache_bench_primitives", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(devices: list[Device], console: Any, min_time: float = 0.1) -> int:
    from rich.table import Table

    bench = bench_module()
    if bench is None:
        console.print("[red]--perf needs bench/primitives.py from a source checkout of statecache[/red]")
        return EXIT_FAILED
    for device in devices:
        if device.backend_name == "reference":
            # The oracle computes in float64 loops: timing it says nothing about a backend.
            console.print(f"{device.id}: skipped (the NumPy reference is the oracle, not a performance backend)")
            continue
        table = Table(title=f"{device.id} ({device.name})")
        for col in ("shape", "us/call", "GB/s", "x memcpy bound"):
            table.add_column(col, justify="left" if col == "shape" else "right")
        rows = bench.run(device.id, reference=False, scalar=False, min_time=min_time, out=None)
        for row in rows:
            table.add_row(
                row["shape"], f"{row['seconds'] * 1e6:.1f}", f"{row['gbps']:.1f}", f"{row['memcpy_ratio']:.2f}"
            )
        console.print(table)
    return EXIT_OK
