"""``statecache conformance --perf``: the CPU issue's benchmark shapes on each
device, printed as GB/s and the ratio to the device's own memcpy bound.

The shapes and measurement functions are those of
:mod:`statecache.conformance.benchmarks` (``bench/primitives.py`` is its
command-line front end).  ``-k`` picks shapes by name, ``--report`` writes
the rows as JSON.  Numbers are printed, never asserted.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import platform
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from statecache.backend import Device
from statecache.errors import SelectionError

EXIT_OK = 0
EXIT_FAILED = 1

#: What each column of the tables means, printed under them.
COLUMNS_EXPLAINED = (
    ("us/call", "the fastest of repeated calls with the same buffers (what a decode loop does)"),
    ("GB/s", "bytes the call must read plus bytes it must write, divided by its time"),
    (
        "x memcpy bound",
        "the time this device takes to move the same bytes, divided by the call's time: the faster of its "
        "copy_buffer into another buffer and, on the C CPU device for a call that updates its state in place "
        "(decode reads a state row and writes it back to the same row), an in-place pass over as many bytes, "
        "each repeated on one buffer as the call repeats on one pool. 1.00 is as fast as moving what the call "
        "reads and writes; a device without the in-place pass can exceed 1 on such calls: their writes land "
        "on cache lines they have just read, while the copy must also fetch or allocate the lines of another "
        "buffer",
    ),
    ("x BASELINE", "the C backend's time on the same shape divided by this device's (above 1: faster than it)"),
)


def bench_module() -> ModuleType:
    """The benchmark machinery (shapes, timing, bounds) shipped with the suite."""
    from statecache.conformance import benchmarks

    return benchmarks


def selected_shapes(keyword: str | None) -> list[Any]:
    """The benchmark shapes ``-k`` selects (all without one); selecting none
    is a :class:`SelectionError` naming the shapes there are."""
    shapes = list(bench_module().SHAPES)
    if not keyword:
        return shapes
    from statecache.conformance.selection import keyword_matcher

    matches = keyword_matcher(keyword)
    picked = [s for s in shapes if matches(s.name)]
    if not picked:
        raise SelectionError(f"-k {keyword!r} selects no benchmark shape; shapes: {', '.join(s.name for s in shapes)}")
    return picked


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


def run(
    devices: list[Device],
    console: Any,
    min_time: float = 0.1,
    *,
    keyword: str | None = None,
    report: str | None = None,
) -> int:
    """Measure the shapes ``keyword`` selects on every device, print a table
    per device (and what its columns mean), and write the rows to ``report``
    as JSON when given.  Raises :class:`SelectionError` when ``keyword``
    selects no shape."""
    from rich.table import Table
    from rich.text import Text

    from statecache.cli import say

    bench = bench_module()
    shapes = selected_shapes(keyword)
    started = datetime.datetime.now(datetime.UTC)
    baseline = _cpu_baseline(devices)
    baseline_rows: dict[str, float] | None = None
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}

    def measure(device: Device, label: str) -> list[dict[str, Any]]:
        with _progress(console, label, len(shapes)) as advance:
            rows: list[dict[str, Any]] = bench.run(
                device, reference=False, scalar=False, min_time=min_time, out=None, shapes=shapes, on_measured=advance
            )
        return rows

    for device in devices:
        if device.backend_name == "reference":
            # The oracle computes in float64 loops: timing it says nothing about a backend.
            why = "the NumPy reference is the oracle, not a performance backend"
            skipped[device.id] = why
            say(console, f"{device.id}: skipped ({why})")
            continue
        compare = baseline is not None and baseline is not device
        if compare and baseline_rows is None:
            assert baseline is not None
            baseline_rows = {r["shape"]: r["seconds"] for r in measure(baseline, f"{baseline.id} (baseline)")}
        table = Table(title=Text(f"{device.id} ({device.name})"))
        cols = ["shape", "us/call", "GB/s", "x memcpy bound"]
        if compare:
            assert baseline is not None
            cols.append(f"x {baseline.id}")  # > 1: faster than the C backend on the same shape
        for col in cols:
            table.add_column(col, justify="left" if col == "shape" else "right")
        rows = measure(device, device.id)
        for row in rows:
            cells = [row["shape"], f"{row['seconds'] * 1e6:.1f}", f"{row['gbps']:.1f}", f"{row['memcpy_ratio']:.2f}"]
            if compare and baseline_rows is not None:
                row["baseline"] = baseline.id if baseline is not None else None
                row["baseline_speedup"] = baseline_rows[row["shape"]] / row["seconds"]
                cells.append(f"{row['baseline_speedup']:.2f}")
            table.add_row(*(Text(c) for c in cells))
            results.append({"device": device.id, **row})
        console.print(table)
    if results:
        baseline_name = baseline.id if baseline is not None else "the C backend"
        for column, meaning in COLUMNS_EXPLAINED:
            say(console, meaning, label=column.replace("BASELINE", baseline_name) + ":", style="bold")
    if report:
        _write_report(report, devices, started, results, skipped)
        say(console, report, label="report written to")
    return EXIT_OK


@contextlib.contextmanager
def _progress(console: Any, label: str, total: int) -> Iterator[Callable[[Any], None]]:
    """A progress bar over one device's shapes (and a line in a log that is not a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from statecache.cli import say

    if not console.is_terminal:
        say(console, f"measuring {total} benchmark shape{'' if total == 1 else 's'} on {label}")
    progress = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[shape]}", markup=False),
        console=console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    task = progress.add_task(label, total=total, shape="")

    def advance(shape: Any) -> None:
        progress.update(task, advance=1, shape=f"measured {shape.name}")

    progress.start()
    try:
        yield advance
    finally:
        progress.stop()


def _write_report(
    path: str, devices: list[Device], started: datetime.datetime, rows: list[dict[str, Any]], skipped: dict[str, str]
) -> None:
    from statecache import __version__

    data = {
        "suite": "statecache.conformance --perf",
        "statecache_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "started": started.isoformat(timespec="seconds"),
        "devices": [d.properties for d in devices],
        "skipped": skipped,
        "perf": rows,
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, default=str)
