"""``statecache conformance``: run the suite on every selected device.

Runs pytest in-process on the installed ``statecache.conformance`` package
(so a third-party backend is tested by exactly the same code), shows progress
with rich, and ends with one row per device: passed, failed, not supported,
expected failures, time.  Exit codes: 0 all passed; 1 a case failed, nothing
ran, or ``--require-device`` found a named backend without a usable device;
2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite on every available device (or the ones named)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--backend", action="append", default=[], metavar="NAME", help="backend to test (repeatable)")
    p.add_argument("--device", default="all", metavar="SPEC", help="'all' (default), an index, or ids like cpu:0")
    p.add_argument("--report", default=None, metavar="PATH", help="write the JSON report here")
    p.add_argument(
        "--require-device", action="store_true", help="fail when a named backend has no usable device (CI on GPUs)"
    )
    p.add_argument(
        "-k", dest="keyword", default=None, metavar="EXPR", help="only cases matching this pytest -k expression"
    )
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("--perf", action="store_true", help="benchmark the primitives on each device instead")
    p.add_argument(
        "--xfails-file", action="append", default=[], metavar="[BACKEND=]PATH", help="expected failures (repeatable)"
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import and register this statecache plugin module (a backend not installed as an entry point)",
    )
    p.add_argument("--width", type=int, default=None, help="output width (default: terminal)")
    p.set_defaults(func=run)
    return p


class _Progress:
    """pytest plugin object that drives a rich progress bar and keeps errors."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task: Any = None
        self.collect_errors: list[str] = []
        self.failed = 0

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {report.longreprtext[-3000:]}")

    def pytest_collection_finish(self, session: Any) -> None:
        self.progress.start()
        self.task = self.progress.add_task("conformance", total=len(session.items), failed=0)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        if self.task is not None:
            where = nodeid.split("[", 1)[1].split("-", 1)[0] if "[" in nodeid else nodeid
            self.progress.update(self.task, description=where)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and not hasattr(report, "wasxfail"):
            self.failed += 1
        if report.when == "teardown" and self.task is not None:
            self.progress.update(self.task, advance=1, failed=self.failed)

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        if self.task is not None:
            self.progress.stop()


def _pytest_args(args: argparse.Namespace, report_path: str, ini_path: str) -> list[str]:
    import statecache.conformance as pkg

    out = [
        "--pyargs",
        "statecache.conformance",
        # Our own ini: the caller's project configuration (addopts, plugins,
        # warning filters) must not change what conformance means.
        "-c",
        ini_path,
        "--rootdir",
        os.path.dirname(pkg.__file__ or "."),
        # Nor may a conftest.py of the directory it is run from (pytest loads
        # the invocation directory's test*/conftest.py when no path is given).
        "--noconftest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:terminal",
        "--device",
        args.device,
        "--conformance-report",
        report_path,
    ]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        out += ["-p", "statecache.conformance.plugin"]
    for name in args.backend:
        out += ["--backend", name]
    for spec in args.xfails_file:
        out += ["--xfails-file", spec]
    for module in args.plugin:
        out += ["--statecache-plugin", module]
    if args.require_device:
        out.append("--require-device")
    if args.keyword:
        out += ["-k", args.keyword]
    if args.exitfirst:
        out.append("-x")
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from statecache.conformance import selection

    console = Console(width=args.width)
    try:
        sel = selection.select(args.backend, args.device, args.plugin)
    except selection.SelectionError as exc:
        console.print(f"[red]usage error:[/red] {exc}")
        return EXIT_USAGE
    named_missing = {n: why for n, why in sel.missing.items() if n in sel.named}
    for name, why in sel.missing.items():
        console.print(f"[yellow]{name}[/yellow]: no usable device ({why})")
    if args.require_device and named_missing:
        console.print("[red]--require-device:[/red] " + "; ".join(f"{n}: {w}" for n, w in named_missing.items()))
        return EXIT_FAILED
    if not sel.devices:
        console.print("[red]no device selected: nothing to test[/red]")
        return EXIT_FAILED
    if args.perf:
        from statecache.conformance import perf

        return perf.run(sel.devices, console)
    return _run_suite(args, console)


def _run_suite(args: argparse.Namespace, console: Any) -> int:
    import pytest

    with tempfile.TemporaryDirectory(prefix="statecache-conformance-") as tmp:
        report_path = args.report or os.path.join(tmp, "report.json")
        ini_path = os.path.join(tmp, "pytest.ini")
        with open(ini_path, "w", encoding="utf-8") as fh:
            fh.write("[pytest]\naddopts = --strict-markers\n")
        progress = _Progress(console)
        rc = pytest.main(_pytest_args(args, report_path, ini_path), plugins=[progress])
        for err in progress.collect_errors:
            console.print(f"[red]collection error[/red] {err}")
        if rc == pytest.ExitCode.USAGE_ERROR:
            return EXIT_USAGE
        if not os.path.exists(report_path):
            console.print(f"[red]the suite did not complete (pytest exit code {int(rc)})[/red]")
            return EXIT_FAILED
        with open(report_path, encoding="utf-8") as fh:
            report = json.load(fh)
    failed = _print_report(report, console)
    if rc not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        console.print(f"[red]pytest ended with exit code {int(rc)}[/red]")
        return EXIT_FAILED
    if args.report:
        console.print(f"report written to {args.report}")
    return EXIT_FAILED if failed or progress.collect_errors or not report["cases"] else EXIT_OK


def _print_report(report: dict[str, Any], console: Any) -> int:
    from rich.table import Table

    table = Table(title=f"statecache conformance {report['suite_version']}")
    for col in ("backend", "device", "passed", "failed", "not supported", "xfail", "time"):
        table.add_column(col, justify="left" if col in ("backend", "device") else "right")
    failed = 0
    for dev in report["devices"]:
        row = report["summary"].get(dev["id"], {})
        n_fail = row.get("fail", 0)
        failed += n_fail
        table.add_row(
            f"{dev['backend']} {dev['backend_version']}",
            dev["id"],
            str(row.get("pass", 0)),
            f"[red]{n_fail}[/red]" if n_fail else "0",
            str(row.get("not supported", 0)),
            str(row.get("xfail", 0)),
            f"{row.get('time_s', 0.0):.1f}s",
        )
    for name in report.get("missing_backends", {}):
        table.add_row(name, "no device", "-", "-", "-", "-", "-")
    console.print(table)
    # Names and reasons go below the table: they are long, and a narrow
    # terminal (or a CI log) would fold every column around them.
    for dev in report["devices"]:
        console.print(f"  {dev['id']}: {dev['properties'].get('name', '')}")
    for name, why in report.get("missing_backends", {}).items():
        console.print(f"  {name}: no usable device ({why})")
    failures = [c for c in report["cases"] if c["status"] == "fail"]
    for case in failures[:40]:
        console.print(f"[red]FAIL[/red] {case['device']} {case['case']}: {case['detail'][:400]}")
    if len(failures) > 40:
        console.print(f"... and {len(failures) - 40} more failures (see --report)")
    for stale in report.get("stale_expected_failures", []):
        console.print(
            f"[yellow]warning:[/yellow] stale expected failure for {stale['backend']}: "
            f"{stale['entry']!r} ({stale['source']}) matches no case"
        )
    return failed
