"""CLI behaviour and the one table of environment variables."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import pty
import re
import subprocess
import sys

import pytest

from statecache import __version__, settings
from statecache.backend import PROTOCOL_VERSION
from statecache.cli import EXIT_OK, EXIT_USAGE, main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"statecache {__version__}"


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == EXIT_USAGE


def test_backends_table_lists_reference_as_available():
    out = subprocess.run(
        [sys.executable, "-m", "statecache.cli", "backends", "--width", "200"],
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(line for line in out.stdout.splitlines() if "reference" in line and "reference:0" in line)
    assert "available" in line and "unavailable" not in line


def test_readme_documents_exactly_the_settings_variables():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- env-table -->", 1)[1].strip().split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `([A-Z][A-Z_]+)` \|", table, flags=re.M))
    assert documented == {v.name for v in settings.VARIABLES}
    for var in settings.VARIABLES:
        assert var.meaning in table, f"README text for {var.name} differs from settings.py"


def test_env_vars_are_only_read_in_settings():
    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        if path.name == "settings.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ|os\.getenv", text):
            offenders.append(path.name)
    assert not offenders, f"environment read outside settings.py: {offenders}"


def test_num_threads_rejects_garbage(monkeypatch):
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="STATECACHE_NUM_THREADS"):
        settings.num_threads()


# -- what a new user trips over (issue 14) ------------------------------------------------

PLUGIN_PKG = ROOT / "tests" / "plugin_pkg"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_PKG), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _statecache(*args: str, cwd: pathlib.Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: output to a pipe, not a terminal."""
    return subprocess.run(
        [sys.executable, "-m", "statecache.cli", *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=cwd,
        timeout=300,
    )


def test_case_ids_with_brackets_print_literally(tmp_path):
    proc = _statecache("conformance", "--plugin", "statecache_toy", "--backend", "toy_oob", "-k", "set_rows and r64")
    assert proc.returncode == 1, proc.stdout[-3000:]
    # rich markup read "[r64-e4096-n8-f32]" as a style tag and dropped it
    assert "FAIL toy_oob:0 set_rows[r64-e4096-n8-f32]: " in proc.stdout
    assert "'set_rows[no-such-case]'" in proc.stdout  # the stale entry, brackets and all


def test_install_hint_keeps_the_extra_in_brackets(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # `import pyopencl` fails: the backend names the extra
    assert main(["backends"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "opencl: unavailable: pyopencl is not installed" in out
    assert "pip install 'statecache[opencl]'" in out


def test_output_that_is_not_a_terminal_is_not_folded_at_80_columns():
    proc = _statecache("backends")
    assert proc.returncode == 0, proc.stdout
    assert any("reference:0 NumPy reference (float64 math)" in line for line in proc.stdout.splitlines())


def test_backends_help_describes_the_command(capsys):
    with pytest.raises(SystemExit):
        main(["backends", "--help"])
    assert "List every installed backend" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "99"], "--device 99: no selected backend has a device with index 99"),
        (["--backend", "reference", "--xfails-file", "no/such/file.txt"], "--xfails-file 'no/such/file.txt' does not"),
        (["--backend", "reference", "--report", "no/such/dir/report.json"], "--report 'no/such/dir/report.json' cann"),
        (["-k", "device and ("], "-k 'device and (' is not a valid expression"),
    ],
    ids=["device-index", "xfails-file", "report", "bad-k"],
)
def test_usage_errors_exit_2_in_one_line_before_anything_runs(monkeypatch, capsys, args, message):
    from statecache.conformance import cli as conformance_cli

    def run_suite(*a: object) -> int:
        raise AssertionError("the suite ran before the usage error was found")

    monkeypatch.setattr(conformance_cli, "_run_suite", run_suite)
    assert main(["conformance", *args]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("usage error: ") and message in out, out


def test_a_bad_thread_count_is_one_usage_line_without_traceback():
    proc = _statecache("conformance", "--backend", "reference", STATECACHE_NUM_THREADS="zero")
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == "usage error: STATECACHE_NUM_THREADS must be a positive integer, got 'zero'\n"
    assert proc.stderr == ""


def test_backends_reports_a_bad_thread_count_instead_of_cpu_as_fine(monkeypatch, capsys):
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "0")
    assert main(["backends"]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert "cpu: unavailable: STATECACHE_NUM_THREADS must be a positive integer, got '0'" in out
    cpu_row = next(line for line in out.splitlines() if line.startswith("│ cpu "))
    assert "unavailable" in cpu_row


def test_k_that_selects_nothing_says_so_and_exits_2():
    proc = _statecache("conformance", "--backend", "reference", "-k", "no_case_has_this_name")
    assert proc.returncode == EXIT_USAGE, proc.stdout
    assert "-k 'no_case_has_this_name' selects no case" in proc.stdout


def test_backends_allowlist_typo_warns_and_empty_allowlist_is_explained(monkeypatch, capsys):
    monkeypatch.setenv("STATECACHE_BACKENDS", "reference,nosuch")
    assert main(["backends"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "warning: STATECACHE_BACKENDS names 'nosuch', which no installed plugin provides" in out
    monkeypatch.setenv("STATECACHE_BACKENDS", "")
    assert main(["backends"]) == EXIT_OK
    assert "STATECACHE_BACKENDS is set but empty, so no backend is loaded" in capsys.readouterr().out
    assert main(["conformance"]) == 1
    assert "STATECACHE_BACKENDS is set but empty" in capsys.readouterr().out


def test_list_prints_every_case_id_without_touching_a_device(monkeypatch, capsys):
    from statecache import registry
    from statecache.conformance import catalog

    def no_registry(*a: object, **k: object) -> None:
        raise AssertionError("--list must not look for backends")

    monkeypatch.setattr(registry, "BackendRegistry", no_registry)
    assert main(["conformance", "--list"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines() == [c.id for c in catalog.all_cases()]
    assert main(["conformance", "--list", "-k", "get_rows and edge"]) == EXIT_OK
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(i.startswith("get_rows[") and "edge" in i for i in listed)


def test_plugin_module_in_the_current_directory_is_found(tmp_path):
    """The console script puts its own folder, not the current one, first on
    sys.path: a plugin next to the user was not found."""
    (tmp_path / "statecache_here.py").write_text(
        "from statecache.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def statecache_register_backends(registry):\n"
        "    from statecache_toy.backend import ToyBackend\n"
        "    registry.add(ToyBackend('here', broken=False))\n"
    )
    script = (
        "import os, sys\n"
        "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]  # as the console script runs\n"
        "from statecache.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = [sys.executable, "-c", script, "conformance", "--backend", "here", "-k", "device.indices"]
    found = subprocess.run(
        [*run, "--plugin", "statecache_here"], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout[-2000:] + found.stderr[-2000:]
    assert "here:0" in found.stdout
    missing = subprocess.run(
        [*run, "--plugin", "statecache_elsewhere"], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert missing.returncode == EXIT_USAGE
    assert "cannot import statecache plugin module 'statecache_elsewhere'" in missing.stdout
    assert "set PYTHONPATH to the folder that holds it" in missing.stdout


def test_progress_shows_each_device_with_its_own_count():
    proc = _statecache(
        "conformance",
        "--plugin",
        "statecache_toy",
        "--backend",
        "toy,toy_oob",
        "-k",
        "device.indices or fill_bytes_view",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    bars = {line.split()[0]: line for line in proc.stdout.splitlines() if "━" in line and " failed " in line}
    assert set(bars) == {"toy:0", "toy_oob:0"}, proc.stdout
    assert all(" 2/2 " in line for line in bars.values()), bars


@pytest.mark.slow
def test_progress_keeps_refreshing_during_a_long_case(tmp_path):
    """pytest captures the output of a running case: the bar used to stand
    still until the case ended.  A case of 2.5 s must show a second tick."""
    pkg = tmp_path / "statecache_slow.py"
    pkg.write_text(
        "from statecache.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def statecache_register_backends(registry):\n"
        "    import time\n"
        "    from statecache_toy.backend import ToyBackend\n"
        "    backend = ToyBackend('slow', broken=False)\n"
        "    device = backend._devices[0]\n"
        "    read = device._read\n"
        "    def slow_read(buffer):\n"
        "        time.sleep(2.5)\n"
        "        return read(buffer)\n"
        "    device._read = slow_read\n"
        "    registry.add(backend)\n"
    )
    master, slave = pty.openpty()  # rich animates only on a terminal
    env = _env(TERM="xterm", COLUMNS="120")
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), env["PYTHONPATH"]))
    cmd = [sys.executable, "-m", "statecache.cli", "conformance", "--plugin", "statecache_slow", "--backend", "slow"]
    proc = subprocess.Popen([*cmd, "-k", "device.indices"], stdout=slave, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0
    text = out.decode(errors="replace")
    # Elapsed 0:00:01 can only be drawn while the 2.5 s case runs: the final
    # frame shows 0:00:02 or more.
    assert "0:00:01" in text, text[-2000:]
    assert "slow:0" in text


def test_perf_honours_k_and_report_shows_progress_and_explains_its_columns(tmp_path, capsys):
    report = tmp_path / "perf.json"
    args = ["conformance", "--perf", "--backend", "cpu", "-k", "gather and 8", "--report", str(report)]
    assert main(args) == EXIT_OK
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert [(r["device"], r["shape"]) for r in data["perf"]] == [("cpu:0", "gather 8 x 1 MiB")]
    assert data["perf"][0]["seconds"] > 0 and data["perf"][0]["memcpy_ratio"] > 0
    assert "gather 8 x 1 MiB" in out and "scatter" not in out and "mamba2" not in out
    assert "measuring 1 benchmark shape on cpu:0" in out  # progress, as a log line when not a terminal
    explained = {line.split(":", 1)[0] for line in out.splitlines() if line.startswith(("us/call:", "GB/s:", "x "))}
    assert {"us/call", "GB/s", "x memcpy bound"} <= explained
    assert "in place" in out  # why a decode may exceed the copy
    assert datetime.datetime.fromisoformat(data["started"]).tzinfo is not None
    assert main(["conformance", "--perf", "--backend", "cpu", "-k", "no_such_shape"]) == EXIT_USAGE
    assert "-k 'no_such_shape' selects no benchmark shape" in capsys.readouterr().out


def test_backends_prints_a_long_reason_whole_even_in_a_narrow_table(monkeypatch, capsys):
    from statecache import Backend, registry
    from statecache.hookspecs import hookimpl

    why = "the driver said: " + "very long explanation " * 12 + "[see docs/install.md]"

    class Broken(Backend):
        name = "broken"
        protocol = PROTOCOL_VERSION  # current, so listing its devices is what fails

        def availability(self):
            return True, ""

        def devices(self):
            raise RuntimeError(why)

    class Plugin:
        @hookimpl
        def statecache_register_backends(self, registry):
            registry.add(Broken())

    real = registry.BackendRegistry
    monkeypatch.setattr(registry, "BackendRegistry", lambda: real(load_entry_points=False, plugins=[Plugin()]))
    assert main(["backends", "--width", "60"]) == EXIT_OK
    assert f"broken: unavailable: listing devices raised RuntimeError: {why}\n" in capsys.readouterr().out
