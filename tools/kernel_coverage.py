#!/usr/bin/env python3
"""Which branches of the CPU backend's C kernels does the conformance kit reach?

Builds the kernels of ``backends/cpu`` a second time, into a temporary
directory, with gcc's ``--coverage``; runs the kit on the ``cpu`` device with
that build loaded in place of the installed one; then reads the counters back
with ``gcov`` and prints, per source file, the lines executed and the branches
taken at least once (both directions of an ``if`` count as two branches).
The installed build is never touched.

    .venv/bin/python tools/kernel_coverage.py                   # every family
    .venv/bin/python tools/kernel_coverage.py --family primitive --family oracle
    .venv/bin/python tools/kernel_coverage.py --missed          # list the lines with a branch never taken

``--replace FILE OLD NEW`` (repeatable) plants a bug in the copied sources
first (each OLD must occur exactly once), builds without coverage and only
reports whether the kit caught it: the way to prove that the kit's inputs
reach a branch.  ``--expect-fail`` turns "the kit failed" into exit status 0:

    .venv/bin/python tools/kernel_coverage.py --family primitive \\
        --replace sc_internal.h 'return z > 20.0f ? z : pos + l;' 'return z > 2.0f ? z : pos + l;' \\
        --replace sc_internal.h '_mm256_set1_ps(20.0f)' '_mm256_set1_ps(2.0f)' --expect-fail

Needs gcc and gcov (the build uses the same flags as the installed one, plus
``--coverage -O0`` so that each source branch is one branch of the object).
It runs the kit in a child process (the counters are written when a process
exits) with one OpenMP thread.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU = ROOT / "backends" / "cpu"
FAMILIES = ("device", "primitive", "oracle", "metamorphic", "memory", "prefix")
_TEST_MODULE = {
    "device": "test_device",
    "primitive": "test_primitives",
    "oracle": "test_oracle",
    "metamorphic": "test_metamorphic",
    "memory": "test_memory",
    "prefix": "test_prefix",
}

# The child: load the kernels built here instead of the installed ones, then
# run the kit.  load_kernels() is cached per process, so injecting the module
# before anything imports the CPU device is enough; the child checks that the
# device really runs the injected library.
_CHILD = r"""
import importlib.util, sys
so_path, module_name = sys.argv[1], sys.argv[2]
from statecache import settings
import statecache.backends.cpu  # the parent package of the injected module
with settings.openmp_defaults():
    spec = importlib.util.spec_from_file_location(module_name, so_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
sys.modules[module_name] = mod
from statecache.backends.cpu.device import load_kernels
_, lib, reason = load_kernels()
if lib is not mod.lib:
    sys.exit(f"the CPU device did not load the instrumented kernels: {reason}")
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""


def _load_build_module() -> Any:
    spec = importlib.util.spec_from_file_location("_statecache_cpu_build", CPU / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(workdir: pathlib.Path, replacements: list[tuple[str, str, str]], coverage: bool) -> tuple[Any, pathlib.Path]:
    """Copy the kernel sources into ``workdir/src``, apply the replacements,
    compile; returns (the build module, the path of the extension)."""
    from cffi import FFI

    b = _load_build_module()
    src = workdir / "src"
    src.mkdir(parents=True)
    for path in [*CPU.glob("*.c"), *CPU.glob("*.h")]:
        shutil.copy(path, src / path.name)
    for name, old, new in replacements:
        target = src / name
        if not target.exists():
            raise SystemExit(f"--replace: no kernel source named {name}; have {sorted(p.name for p in src.iterdir())}")
        text = target.read_text(encoding="utf-8")
        if text.count(old) != 1:
            raise SystemExit(f"--replace: {old!r} occurs {text.count(old)} times in {name}, not once")
        target.write_text(text.replace(old, new), encoding="utf-8")
    args = b.compile_args(b.ISA)
    link = ["-fopenmp"]
    if coverage:
        args += ["--coverage", "-O0", "-fprofile-update=atomic"]
        link += ["--coverage"]
    ffi = FFI()
    ffi.cdef(b.cdef_source())
    ffi.set_source(
        b.MODULE,
        f'#include "{b.HEADER}"',
        sources=[str(src / name) for name in b.SOURCES],
        include_dirs=[str(src)],
        extra_compile_args=args,
        extra_link_args=link,
        libraries=["m"],
    )
    so_path = ffi.compile(tmpdir=str(workdir / "build"), verbose=False)
    return b, pathlib.Path(so_path)


def run_kit(so_path: pathlib.Path, module: str, families: list[str], pytest_args: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    targets = [f"statecache.conformance.{_TEST_MODULE[f]}" for f in families]
    cmd = [sys.executable, "-c", _CHILD, str(so_path), module, "--pyargs", *targets]
    cmd += ["--backend", "cpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *pytest_args]
    return subprocess.run(cmd, env=env, cwd=tempfile.gettempdir()).returncode


def _gcov_json(workdir: pathlib.Path) -> list[dict[str, Any]]:
    gcdas = sorted(glob.glob(str(workdir / "build" / "**" / "*.gcda"), recursive=True))
    if not gcdas:
        raise SystemExit("no coverage data was written (did the kit run the cpu device?)")
    out = subprocess.run(
        ["gcov", "--json-format", "--stdout", "--branch-probabilities", *gcdas],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def coverage_table(workdir: pathlib.Path) -> dict[str, dict[int, dict[str, Any]]]:
    """file name -> line -> {"count", "branches": [taken counts]}, merged over
    every translation unit (the header's inline helpers are compiled into each)."""
    files: dict[str, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    src = workdir / "src"
    for unit in _gcov_json(workdir):
        for f in unit["files"]:
            path = pathlib.Path(f["file"])
            if not path.is_absolute():
                path = (workdir / path).resolve()
            if path.parent != src.resolve():
                continue  # system headers (immintrin.h ...)
            lines = files[path.name]
            for ln in f["lines"]:
                entry = lines.setdefault(ln["line_number"], {"count": 0, "branches": []})
                entry["count"] += ln["count"]
                counts = [br["count"] for br in ln["branches"]]
                merged = entry["branches"]
                for i, c in enumerate(counts):
                    if i < len(merged):
                        merged[i] += c
                    else:
                        merged.append(c)
    return files


def _row(name: str, done_lines: int, lines: int, taken: int, branches: int) -> str:
    pl = 100 * done_lines / max(lines, 1)
    pb = 100 * taken / max(branches, 1)
    return f"{name:<16} {done_lines:>6}/{lines:<5} {pl:5.1f}% {taken:>6}/{branches:<5} {pb:5.1f}%"


def report(workdir: pathlib.Path, missed: bool) -> dict[str, tuple[int, int, int, int]]:
    """Print the table (and with ``missed`` the lines with a branch never
    taken); returns file -> (lines executed, lines, branches taken, branches)."""
    table = coverage_table(workdir)
    totals: dict[str, tuple[int, int, int, int]] = {}
    print(f"{'file':<16} {'lines executed':>18} {'branches taken':>18}")
    for name in sorted(table):
        lines = table[name]
        n_lx = sum(1 for e in lines.values() if e["count"] > 0)
        n_b = sum(len(e["branches"]) for e in lines.values())
        n_bt = sum(1 for e in lines.values() for c in e["branches"] if c > 0)
        totals[name] = (n_lx, len(lines), n_bt, n_b)
        print(_row(name, *totals[name]))
    all_four = [sum(t[i] for t in totals.values()) for i in range(4)]
    print(_row("all", *all_four))
    if missed:
        print("\nlines with a branch never taken (or never executed):")
        for name in sorted(table):
            text = (workdir / "src" / name).read_text(encoding="utf-8").splitlines()
            for line_no in sorted(table[name]):
                e = table[name][line_no]
                never = sum(1 for c in e["branches"] if c == 0)
                if never or e["count"] == 0:
                    what = (
                        "never executed" if e["count"] == 0 else f"{never} of {len(e['branches'])} branches never taken"
                    )
                    print(f"  {name}:{line_no}: {what}: {text[line_no - 1].strip()[:90]}")
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", action="append", choices=FAMILIES, help="case families to run (default: all)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression over case ids")
    p.add_argument("--missed", action="store_true", help="list every line with a branch the kit never takes")
    p.add_argument("--replace", nargs=3, action="append", default=[], metavar=("FILE", "OLD", "NEW"),
                   help="plant a bug: replace OLD (must occur once) by NEW in a copy of FILE; no coverage")  # fmt: skip
    p.add_argument("--expect-fail", action="store_true", help="exit 0 when the kit fails (a planted bug was caught)")
    p.add_argument(
        "--keep", default=None, metavar="DIR", help="build here and keep it (default: a temporary directory)"
    )
    args = p.parse_args(argv)
    families = args.family or list(FAMILIES)
    pytest_args = ["-k", args.keyword] if args.keyword else []
    coverage = not args.replace
    workdir = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="statecache-kcov-"))
    try:
        b, so_path = build(workdir, [tuple(r) for r in args.replace], coverage)
        rc = run_kit(so_path, b.MODULE, families, pytest_args)
        if coverage:
            print(f"\nC kernel coverage of the kit ({', '.join(families)}) on the cpu device:")
            report(workdir, args.missed)
        if args.expect_fail:
            caught = rc == 1
            print("planted bug caught by the kit" if caught else f"planted bug NOT caught (pytest exit {rc})")
            return 0 if caught else 1
        return rc
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
