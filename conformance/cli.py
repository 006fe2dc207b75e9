"""``statecache conformance``: run the suite on every selected device.

Runs pytest in-process on the installed ``statecache.conformance`` package
(so a third-party backend is tested by exactly the same code), shows progress
per device with rich, and ends with one row per device: passed, failed, not
supported, expected failures, time.  Exit codes: 0 all passed; 1 a case
failed, nothing ran, or ``--require-device`` found a named backend without a
usable device; 2 usage error (unknown backend or device, a missing
``--xfails-file``, a ``--report`` path that cannot be written, ``-k`` that
selects nothing, an unusable environment variable), reported in one line
before anything runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from collections import Counter
from typing import IO, Any

from statecache.cli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    NON_TERMINAL_WIDTH,
    make_console,
    reported_warnings,
    say,
    usage_error,
)

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "add_parser", "run"]


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
        "-k",
        dest="keyword",
        default=None,
        metavar="EXPR",
        help="only cases (with --perf: benchmark shapes) matching this pytest -k expression",
    )
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("--perf", action="store_true", help="benchmark the primitives on each device instead")
    p.add_argument(
        "--list",
        dest="list_cases",
        action="store_true",
        help="print every case id (those -k selects), one per line, and run nothing (for xfail files)",
    )
    p.add_argument(
        "--xfails-file", action="append", default=[], metavar="[BACKEND=]PATH", help="expected failures (repeatable)"
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import and register this statecache plugin module (a backend not installed as an entry point); "
        "looked for on the import path, then in the current directory",
    )
    p.add_argument(
        "--width", type=int, default=None, help=f"output width (default: the terminal's, or {NON_TERMINAL_WIDTH})"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.list_cases:
        return _list_cases(args)
    stream = _terminal_stream()
    try:
        return _run(args, make_console(args.width, stream))
    finally:
        if stream is not sys.stdout:
            stream.close()


def _terminal_stream() -> IO[str]:
    """Our own handle on standard output.

    pytest captures file descriptor 1 while each case runs, so a progress bar
    writing to ``sys.stdout`` froze during long cases (its refreshes went to
    the capture of the running test).  A duplicate of the descriptor, taken
    before pytest starts, keeps writing to the terminal."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # not a real file (a test's capture)
        return sys.stdout
    sys.stdout.flush()
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=encoding, errors="replace")


def _list_cases(args: argparse.Namespace) -> int:
    """Every case id, device-independent, without touching a device."""
    from statecache.conformance.catalog import all_cases
    from statecache.conformance.selection import SelectionError, keyword_matcher

    console = make_console(args.width)
    try:
        matches = keyword_matcher(args.keyword) if args.keyword else None
    except SelectionError as exc:
        return usage_error(console, str(exc))
    ids = [case.id for case in all_cases() if matches is None or matches(case.id)]
    if not ids:
        return usage_error(console, f"-k {args.keyword!r} selects no case")
    sys.stdout.write("".join(f"{case_id}\n" for case_id in ids))
    return EXIT_OK


def _run(args: argparse.Namespace, console: Any) -> int:
    from statecache import settings
    from statecache.conformance import selection

    # Everything a user can get wrong is checked before anything runs: a
    # mistake found after a ten-minute suite costs the ten minutes.
    problems = settings.problems()
    if problems:
        return usage_error(console, problems[0])
    if args.report:
        problem = _unwritable(args.report)
        if problem:
            return usage_error(console, problem)
    try:
        if args.keyword:
            selection.keyword_matcher(args.keyword)  # a malformed expression, in our words
        with reported_warnings(console):
            sel = selection.select(args.backend, args.device, args.plugin)
        selection.expectations(sel, args.xfails_file)
        if args.perf:
            from statecache.conformance import perf

            perf.selected_shapes(args.keyword)
    except selection.SelectionError as exc:
        return usage_error(console, str(exc))
    named_missing = {n: why for n, why in sel.missing.items() if n in sel.named}
    for name, why in sel.missing.items():
        say(console, why, label=f"{name}: no usable device:", style="yellow")
    if args.require_device and named_missing:
        say(
            console,
            "; ".join(f"{n}: {w}" for n, w in named_missing.items()),
            label="--require-device:",
            style="bold red",
        )
        return EXIT_FAILED
    if not sel.devices:
        why = sel.registry.why_empty()
        say(console, why or "no usable device", label="no device selected, nothing to test:", style="bold red")
        return EXIT_FAILED
    if args.perf:
        from statecache.conformance import perf

        return perf.run(sel.devices, console, keyword=args.keyword, report=args.report)
    return _run_suite(args, console)


def _unwritable(path: str) -> str:
    """Why the report cannot be written to ``path`` ("" when it can)."""
    if os.path.isdir(path):
        return f"--report {path!r} is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"--report {path!r} cannot be written: {exc.strerror or exc}"
    if not existed:
        os.remove(path)
    return ""


class _Progress:
    """pytest plugin object that drives a rich progress bar per device and keeps errors."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed", markup=False),
            TimeElapsedColumn(),
            TextColumn("{task.fields[case]}", markup=False),
            console=console,
            transient=False,
            # A long case (a memory case on a slow device) keeps its elapsed
            # time moving; pytest's capture is bypassed by the console's own
            # handle on the terminal (see _terminal_stream).
            refresh_per_second=4,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.tasks: dict[str, Any] = {}  # device id -> rich task
        self.device_of: dict[str, str] = {}  # node id -> device id
        self.case_of: dict[str, str] = {}  # node id -> case id
        self.failed: Counter[str] = Counter()
        self.collect_errors: list[str] = []

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {report.longreprtext[-3000:]}")

    def pytest_collection_finish(self, session: Any) -> None:
        per_device: Counter[str] = Counter()
        for item in session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            device_id = getattr(params.get("conformance_device"), "id", "other")
            self.device_of[item.nodeid] = device_id
            self.case_of[item.nodeid] = getattr(params.get("conformance_case"), "id", item.name)
            per_device[device_id] += 1
        for device_id, total in per_device.items():  # in the order the cases run
            self.tasks[device_id] = self.progress.add_task(device_id, total=total, failed=0, case="", start=False)
        self.progress.start()

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        task = self.tasks.get(self.device_of.get(nodeid, ""))
        if task is not None:
            self.progress.start_task(task)  # the clock of a device starts with its first case
            self.progress.update(task, case=self.case_of.get(nodeid, nodeid))

    def pytest_runtest_logreport(self, report: Any) -> None:
        device_id = self.device_of.get(report.nodeid, "")
        if report.failed and not hasattr(report, "wasxfail"):
            self.failed[device_id] += 1
        task = self.tasks.get(device_id)
        if report.when == "teardown" and task is not None:
            self.progress.update(task, advance=1, failed=self.failed[device_id])
            if self.progress.tasks[task].finished:
                self.progress.update(task, case="")

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        if self.tasks:
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
            say(console, err, label="collection error", style="red")
        if rc == pytest.ExitCode.NO_TESTS_COLLECTED and args.keyword and not progress.collect_errors:
            return usage_error(
                console,
                f"-k {args.keyword!r} selects no case on the selected devices "
                "(statecache conformance --list prints the case ids)",
            )
        if rc == pytest.ExitCode.USAGE_ERROR:
            return usage_error(console, "pytest refused the arguments of the run")
        if not os.path.exists(report_path):
            say(console, f"the suite did not complete (pytest exit code {int(rc)})", style="red")
            return EXIT_FAILED
        with open(report_path, encoding="utf-8") as fh:
            report = json.load(fh)
    failed = _print_report(report, console)
    if rc not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        say(console, f"pytest ended with exit code {int(rc)}", style="red")
        return EXIT_FAILED
    if args.report:
        say(console, args.report, label="report written to")
    return EXIT_FAILED if failed or progress.collect_errors or not report["cases"] else EXIT_OK


def _print_report(report: dict[str, Any], console: Any) -> int:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"statecache conformance {report['suite_version']}")
    for col in ("backend", "device", "passed", "failed", "not supported", "xfail", "time"):
        table.add_column(col, justify="left" if col in ("backend", "device") else "right")
    failed = 0
    for dev in report["devices"]:
        row = report["summary"].get(dev["id"], {})
        n_fail = row.get("fail", 0)
        failed += n_fail
        table.add_row(
            Text(f"{dev['backend']} {dev['backend_version']}"),
            Text(dev["id"]),
            str(row.get("pass", 0)),
            Text(str(n_fail), style="red" if n_fail else ""),
            str(row.get("not supported", 0)),
            str(row.get("xfail", 0)),
            f"{row.get('time_s', 0.0):.1f}s",
        )
    for name in report.get("missing_backends", {}):
        table.add_row(Text(name), "no device", "-", "-", "-", "-", "-")
    console.print(table)
    # Names and reasons go below the table: they are long, and a narrow
    # terminal (or a CI log) would fold every column around them.
    for dev in report["devices"]:
        say(console, f"  {dev['id']}: {dev['properties'].get('name', '')}")
    for name, why in report.get("missing_backends", {}).items():
        say(console, f"  {name}: no usable device ({why})")
    failures = [c for c in report["cases"] if c["status"] == "fail"]
    for case in failures[:40]:
        say(console, f"{case['device']} {case['case']}: {case['detail'][:400]}", label="FAIL", style="bold red")
    if len(failures) > 40:
        say(console, f"... and {len(failures) - 40} more failures (see --report)")
    for stale in report.get("stale_expected_failures", []):
        say(
            console,
            f"stale expected failure for {stale['backend']}: {stale['entry']!r} ({stale['source']}) matches no case",
            label="warning:",
            style="yellow",
        )
    return failed
