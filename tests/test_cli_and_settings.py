"""CLI behaviour and the one table of environment variables."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from statecache import __version__, settings
from statecache.cli import EXIT_USAGE, main

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
