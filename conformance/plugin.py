"""pytest plugin of the conformance suite (registered under ``pytest11``).

pytest loads this module in every run of this environment, so it is inert
unless the suite's own test modules are collected: it only adds options.
Importing it must stay cheap (no backend, no registry) until then.

Run::

    pytest --pyargs statecache.conformance --backend cpu --device all
    pytest --pyargs statecache.conformance --backend cpu --device 0 --conformance-report report.json

Statuses: pass, fail, not supported (the device declares it cannot run the
case; never a failure, never a silent skip), xfail (listed as expected).
"""

from __future__ import annotations

import datetime
import json
import platform
from typing import Any

import pytest

NOT_SUPPORTED = "not supported: "
_STASH: pytest.StashKey[Any] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("statecache-conformance", "statecache conformance suite")
    group.addoption(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend to test (repeatable, or comma-separated; default: every available backend)",
    )
    group.addoption(
        "--device",
        default="all",
        metavar="SPEC",
        help="'all' (default), a device index such as 0, or ids such as cpu:0,opencl:1",
    )
    group.addoption("--conformance-report", default=None, metavar="PATH", help="write the JSON report here")
    group.addoption(
        "--require-device",
        action="store_true",
        default=False,
        help="fail when a named backend has no usable device (for CI on accelerator machines)",
    )
    group.addoption(
        "--xfails-file",
        action="append",
        default=[],
        metavar="[BACKEND=]PATH",
        help="expected failures, one case id or pattern per line (repeatable)",
    )
    group.addoption(
        "--statecache-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this statecache plugin module and register it (a backend not installed as entry point)",
    )


class _Run:
    """Lazily built state of one conformance run."""

    def __init__(self, config: pytest.Config) -> None:
        from statecache.conformance import selection

        self.config = config
        try:
            self.selection = selection.select(
                config.getoption("backend"),
                config.getoption("device"),
                config.getoption("statecache_plugin"),
            )
            self.expect = selection.expectations(self.selection, config.getoption("xfails_file"))
        except selection.SelectionError as exc:
            # pytest.exit, not UsageError: raised during collection, a usage error
            # would be repeated as a collection error of every suite module.
            pytest.exit(f"statecache conformance: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
        if config.getoption("require_device"):
            # The same rule as the CLI: a *named* backend without a usable device
            # (or nothing selected at all) is an error; unnamed ones are listed.
            missing = {n: why for n, why in self.selection.missing.items() if n in self.selection.named}
            if missing or not self.selection.devices:
                why = "; ".join(f"{n}: {w}" for n, w in missing.items()) or "no device selected"
                pytest.exit(f"--require-device: {why}", returncode=1)
        self.results: dict[str, dict[str, Any]] = {}  # nodeid -> record
        self.stale: list[tuple[str, str, str]] = []
        #: when the run began, in UTC (the report gives it as ISO 8601)
        self.started = datetime.datetime.now(datetime.UTC)

    def record(self, item: pytest.Item) -> dict[str, Any]:
        device = item.callspec.params["conformance_device"]  # type: ignore[attr-defined]
        case = item.callspec.params["conformance_case"]  # type: ignore[attr-defined]
        return self.results.setdefault(
            item.nodeid,
            {"case": case.id, "family": case.family, "device": device.id, "status": None, "time_s": 0.0, "detail": ""},
        )


def _run(config: pytest.Config) -> _Run:
    run = config.stash.get(_STASH, None)
    if run is None:
        run = _Run(config)
        config.stash[_STASH] = run
    return run


def _active(config: pytest.Config) -> _Run | None:
    return config.stash.get(_STASH, None)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" not in metafunc.fixturenames:
        return
    from statecache.conformance.catalog import cases_of

    run = _run(metafunc.config)
    family = metafunc.module.CASE_FAMILY
    params = [(d, c) for d in run.selection.devices for c in cases_of(family)]
    metafunc.parametrize(
        ("conformance_device", "conformance_case"),
        params,
        ids=[f"{d.id}-{c.id}" for d, c in params],
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    run = _active(config)
    if run is None:
        return
    from statecache.conformance.cases import Case
    from statecache.conformance.catalog import all_cases

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "conformance_case" not in params:
            continue
        device, case = params["conformance_device"], params["conformance_case"]
        if not isinstance(case, Case):  # an empty parameter set (no device selected)
            continue
        source = run.expect.matches(device.backend_name, case.id)
        if source is not None:
            item.add_marker(pytest.mark.xfail(reason=f"expected failure of {device.backend_name} ({source})"))
    run.stale = run.expect.stale(c.id for c in all_cases())
    # One device after another (stable: each device keeps the suite's order), so
    # progress, timings and a device that hangs are each about one device.
    rank = {device.id: i for i, device in enumerate(run.selection.devices)}

    def device_rank(item: pytest.Item) -> int:
        device = getattr(getattr(item, "callspec", None), "params", {}).get("conformance_device")
        return rank.get(getattr(device, "id", ""), len(rank))

    items.sort(key=device_rank)


def run_case(device: Any, case: Any) -> None:
    """What every suite test does: gate on capabilities, then run."""
    ok, reason = case.support(device)
    if not ok:
        pytest.skip(NOT_SUPPORTED + reason)
    import numpy as np

    # NaN/Inf and overflow cases make NumPy warn on purpose; every comparison is explicit.
    with np.errstate(all="ignore"):
        case.run(device)


def _is_not_supported(report: pytest.TestReport) -> bool:
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return False
    # Only run_case's own skip counts: its message starts with the marker.
    return str(report.longrepr[2]).removeprefix("Skipped: ").startswith(NOT_SUPPORTED)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    if _active(config) is not None and _is_not_supported(report) and not hasattr(report, "wasxfail"):
        return "not supported", "n", "NOT SUPPORTED"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    run = _active(item.config)
    if run is None or "conformance_case" not in getattr(getattr(item, "callspec", None), "params", {}):
        return report
    from statecache.conformance.cases import Case

    if not isinstance(item.callspec.params["conformance_case"], Case):  # type: ignore[attr-defined]
        return report
    rec = run.record(item)
    rec["time_s"] += report.duration
    if hasattr(report, "wasxfail"):
        if report.skipped:
            rec["status"] = "xfail"
        elif report.passed and report.when == "call":
            rec["status"] = "pass"
            rec["detail"] = "listed as expected failure but passed: remove it from the list"
        rec["detail"] = rec["detail"] or str(report.wasxfail)
    elif report.failed:
        rec["status"] = "fail"
        rec["detail"] = _short(report)
    elif _is_not_supported(report):
        rec["status"] = "not supported"
        rec["detail"] = str(report.longrepr[2]).split(NOT_SUPPORTED, 1)[1]  # type: ignore[index]
    elif report.skipped:
        # A case may end only as pass, fail, not supported or xfail: any other
        # skip (a pytest.skip or importorskip inside a case or a backend) would
        # hide a case that never ran, so it is a failure.
        why = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        report.outcome = "failed"
        report.longrepr = f"skipped without a not-supported reason (a case must run or be gated by caps): {why}"
        rec["status"] = "fail"
        rec["detail"] = report.longrepr
    elif report.passed and report.when == "call" and rec["status"] is None:
        rec["status"] = "pass"
    return report


def _short(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(report.longrepr)[-2000:]


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    run = _active(config)
    if run is None:
        return None
    from statecache import __version__
    from statecache.conformance import SUITE_VERSION

    lines = [f"statecache {__version__}, conformance suite {SUITE_VERSION}"]
    for device in run.selection.devices:
        backend = run.selection.backend_of(device)
        caps = device.caps
        lines.append(
            f"  {device.id}: {device.name} [{backend.name} {backend.version}] ops={len(caps.ops)} "
            f"dtypes={','.join(sorted(d.value for d in caps.storage_dtypes))} max_snapshots={caps.max_snapshots}"
        )
    for name, why in run.selection.missing.items():
        lines.append(f"  {name}: no device ({why})")
    if not run.selection.devices:
        lines.append("  no device selected: nothing to test")
    return lines


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-device counts: pass, fail, not supported, xfail, skipped, time."""
    out: dict[str, dict[str, Any]] = {}
    for rec in results:
        row = out.setdefault(
            rec["device"], {"pass": 0, "fail": 0, "not supported": 0, "xfail": 0, "skipped": 0, "time_s": 0.0}
        )
        status = rec["status"] or "fail"  # no status: the test never completed
        row[status] = row.get(status, 0) + 1
        row["time_s"] += rec["time_s"]
    return out


def build_report(run: _Run) -> dict[str, Any]:
    from statecache import __version__
    from statecache.conformance import SUITE_VERSION

    devices = []
    for device in run.selection.devices:
        backend = run.selection.backend_of(device)
        devices.append(
            {
                "id": device.id,
                "backend": backend.name,
                "backend_version": backend.version,
                "properties": device.properties,
            }
        )
    results = sorted(run.results.values(), key=lambda r: (r["device"], r["case"]))
    for rec in results:
        rec["status"] = rec["status"] or "fail"
    return {
        "suite": "statecache.conformance",
        "suite_version": SUITE_VERSION,
        "statecache_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "started": run.started.isoformat(timespec="seconds"),
        "devices": devices,
        "missing_backends": run.selection.missing,
        "stale_expected_failures": [{"backend": b, "entry": e, "source": s} for b, e, s in run.stale],
        "summary": summarize(results),
        "cases": results,
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = _active(session.config)
    if run is None:
        return
    path = session.config.getoption("conformance_report")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(build_report(run), fh, indent=1, default=str)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    run = _active(config)
    if run is None:
        return
    tr = terminalreporter
    tr.section("statecache conformance")
    for device, row in summarize(list(run.results.values())).items():
        tr.write_line(
            f"{device}: {row['pass']} passed, {row['fail']} failed, {row['not supported']} not supported, "
            f"{row['xfail']} xfail, {row['time_s']:.1f}s"
        )
    for name, why in run.selection.missing.items():
        tr.write_line(f"{name}: no device ({why})")
    for backend, entry, source in run.stale:
        # A warning, not an error: pytest's warning filters would turn a real
        # warning into a crash of the whole run under filterwarnings=error.
        tr.write_line(
            f"WARNING stale expected failure for {backend}: {entry!r} ({source}) matches no case", yellow=True
        )
