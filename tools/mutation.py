#!/usr/bin/env python3
"""Mutation testing of one core module with the tests that cover it (mutmut).

    .venv/bin/pip install -e '.[test,mutation]'        # mutmut, pinned in the `mutation` extra
    .venv/bin/python tools/mutation.py recurrent        # ~minutes on 2 cores; prints the kill rate
    .venv/bin/python tools/mutation.py batch --survivors   # ... and the diff of every survivor
    .venv/bin/python tools/mutation.py kv_cells --tests tests/test_kv_cache.py

mutmut rewrites every function of the module into a set of mutants (flipped
comparisons, off-by-ones, dropped arguments, changed constants ...), runs the
test suite once to learn which tests call which function, then runs, for
each mutant, only the tests that reach it (stopping at the first failure).
A mutant no test fails on *survived*: either a test is missing or the
mutant is equivalent (behaves like the original; judge by its diff).

The package is installed under the import name ``statecache`` from the
folder ``core/``, a layout mutmut cannot follow (it names modules after
their paths), so the run happens in a staging folder where ``core/`` is
copied as ``statecache/`` (with ``backends/`` and ``conformance/`` inside,
as installed) next to a copy of ``tests/``.  Nothing in the work tree is
modified.  The staging folder (``build/mutation/<module>`` unless
``--workdir``) is kept, so ``mutmut show NAME`` and ``mutmut browse`` work
there afterwards.  The run is ``nice``d; run one module at a time.

Kill rate = (killed + timeout) / mutants.  "no tests" mutants sit in code
that no selected test reaches; they count as not killed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The tests that cover each core module (the module's own tests, the
#: behaviour tests and the mutation-kill tests; composites reach the parts).
TESTS: dict[str, list[str]] = {
    "recurrent": ["test_recurrent_*.py", "test_mrope_positions.py", "test_behaviours_recurrent.py",
                  "test_mutation_kills_recurrent.py"],
    # the iSWA pair and the composite contexts' undo are exercised through the hybrids
    "kv_cache": ["test_kv_cache.py", "test_mrope_positions.py", "test_behaviours_kv.py", "test_mutation_kills_kv.py",
                 "test_hybrid.py", "test_hybrid_undo.py"],
    "kv_cells": ["test_kv_cache.py", "test_mrope_positions.py", "test_behaviours_kv.py", "test_mutation_kills_kv.py",
                 "test_hybrid_undo.py", "test_mutation_kills_hybrid.py"],
    "hybrid": ["test_hybrid*.py", "test_behaviours_hybrid.py", "test_behaviours_state.py",
               "test_mutation_kills_hybrid.py"],
    "hybrid_idx": ["test_hybrid_idx*.py", "test_kpool.py", "test_behaviours_hybrid.py",
                   "test_mutation_kills_hybrid.py"],
    "batch": ["test_batch.py", "test_mrope_positions.py", "test_behaviours_batch.py", "test_mutation_kills_batch.py"],
    "state_io": ["test_state_io.py", "test_behaviours_state.py", "test_mutation_kills_state_io.py"],
    "primitives": ["test_reference_backend.py", "test_launch_memo.py", "test_behaviours_primitives.py",
                   "test_mutation_kills_primitives.py"],
}  # fmt: skip

#: ``reference``: the NumPy reference backend's kernels, killed by the
#: conformance kit on the reference device (the oracle family does the work:
#: the primitive family compares the reference with itself).
KIT = ["test_oracle.py", "test_device.py", "test_metamorphic.py", "test_memory.py"]

_PYTEST_INI = """
[tool.pytest.ini_options]
addopts = "--strict-markers"
filterwarnings = ["error"]
markers = [
    "slow: long-running tests",
    "torch: needs the torch extra",
    "opencl: needs an OpenCL platform",
    "cuda: needs a CUDA GPU",
]
"""


def _tests_for(module: str, given: list[str] | None) -> list[str]:
    """Test files, as paths inside the staging folder."""
    if given:
        patterns = given
    elif module == "reference":
        return [f"statecache/conformance/{name}" for name in KIT]
    else:
        patterns = [f"tests/{name}" for name in TESTS.get(module, ["test_*.py"])]
    found: list[str] = []
    for pattern in patterns:
        matches = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
        found += [m for m in matches if m not in found]
    if not found:
        raise SystemExit(f"no test file matches {patterns}")
    return found


def stage(module: str, workdir: pathlib.Path, tests: list[str]) -> None:
    """Lay out ``workdir`` as the installed package would be named."""
    if module == "reference":  # the kernels (device.py is buffer glue, tested by the device family)
        kernels = ("rows", "ssm_conv", "ssm_scan", "delta_net")
        mutate, extra = (
            ", ".join(f'"statecache/backends/reference/{k}.py"' for k in kernels),
            ', "--backend", "reference"',
        )
    elif (ROOT / "core" / f"{module}.py").exists():
        mutate, extra = f'"statecache/{module}.py"', ""
    else:
        known = sorted(p.stem for p in (ROOT / "core").glob("*.py") if p.stem != "__init__")
        raise SystemExit(f"no core module {module!r}; core modules: {', '.join(known)}, or reference")
    if workdir.exists():
        shutil.rmtree(workdir)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "build")
    shutil.copytree(ROOT / "core", workdir / "statecache", ignore=junk)
    shutil.copytree(ROOT / "backends", workdir / "statecache" / "backends", ignore=junk)
    shutil.copytree(ROOT / "conformance", workdir / "statecache" / "conformance", ignore=junk)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=junk)
    selection = ", ".join(json.dumps(t) for t in tests)
    (workdir / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["statecache/"]\n'
        f"only_mutate = [{mutate}]\n"
        'do_not_mutate = ["*/__init__.py"]\n'
        f'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"{extra}]\n'
        f"pytest_add_cli_args_test_selection = [{selection}]\n"
        "use_git_change_detection = false\n" + _PYTEST_INI,
        encoding="utf-8",
    )


def _mutmut(workdir: pathlib.Path, *args: str, log: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run mutmut in ``workdir``, ``nice``d; its progress spinner goes to ``log``."""
    exe = pathlib.Path(sys.executable).with_name("mutmut")
    if not exe.exists():
        raise SystemExit("mutmut is not installed: pip install -e '.[mutation]' (pins mutmut 3.8.1)")
    env = dict(os.environ, HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "ci"), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    cmd = ["nice", "-n", "10", str(exe), *args]
    if log is None:
        return subprocess.run(cmd, cwd=workdir, env=env, text=True, capture_output=True)
    with open(workdir / log, "a", encoding="utf-8") as fh:
        return subprocess.run(cmd, cwd=workdir, env=env, text=True, stdout=fh, stderr=subprocess.STDOUT)


def results(workdir: pathlib.Path) -> dict[str, str]:
    """mutant name -> status, from mutmut's result files."""
    out: dict[str, str] = {}
    from mutmut.stats import status_by_exit_code  # type: ignore[import-not-found]

    for meta in (workdir / "mutants").rglob("*.meta"):
        data = json.loads(meta.read_text(encoding="utf-8"))
        for name, code in data.get("exit_code_by_key", {}).items():
            out[name] = status_by_exit_code[code]
    return out


def summary(module: str, statuses: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    total = len(statuses)
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    rate = 100.0 * killed / total if total else 0.0
    detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"\n{module}: {killed} of {total} mutants killed ({rate:.1f}%): {detail}")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("module", help="a module of core/ (recurrent, kv_cache, batch, ...), or reference (the kit)")
    p.add_argument("--tests", nargs="+", default=None, help="test files or globs (default: the module's list)")
    p.add_argument("--max-children", type=int, default=2, help="parallel mutants (default 2)")
    p.add_argument("--workdir", default=None, help="staging folder (default build/mutation/MODULE)")
    p.add_argument("--sample", type=int, default=0, metavar="N", help="test a seeded random sample of N mutants")
    p.add_argument("--seed", type=int, default=20, help="seed of --sample (default 20)")
    p.add_argument("--survivors", action="store_true", help="print the diff of every surviving mutant")
    p.add_argument("--json", default=None, metavar="PATH", help="write {mutant: status} here")
    args = p.parse_args(argv)
    workdir = pathlib.Path(args.workdir or ROOT / "build" / "mutation" / args.module).resolve()
    tests = _tests_for(args.module, args.tests)
    stage(args.module, workdir, tests)
    print(f"mutating {args.module} with {len(tests)} test files in {workdir}")
    t0 = time.monotonic()
    names: list[str] = []
    if args.sample:
        # Generate the mutants and the test map only (a name that matches no
        # mutant), then run a seeded random sample of them.
        _mutmut(
            workdir,
            "run",
            "--max-children",
            str(args.max_children),
            "statecache.none.x_none__mutmut_0",
            log="mutmut.log",
        )
        every = sorted(results(workdir))
        rng = random.Random(args.seed)
        names = sorted(rng.sample(every, min(args.sample, len(every))))
        print(f"sampled {len(names)} of {len(every)} mutants (seed {args.seed})")
    run = _mutmut(workdir, "run", "--max-children", str(args.max_children), *names, log="mutmut.log")
    elapsed = time.monotonic() - t0
    statuses = results(workdir)
    if names:
        statuses = {n: statuses[n] for n in names}
    if not statuses:
        print(f"mutmut produced no results (exit {run.returncode})")
        return 1
    summary(args.module, statuses)
    print(f"({elapsed:.0f} s)")
    survivors = sorted(n for n, s in statuses.items() if s not in ("killed", "timeout"))
    if survivors:
        print("not killed:")
        for name in survivors:
            print(f"  {statuses[name]:>10}  {name}")
            if args.survivors:
                diff = _mutmut(workdir, "show", name).stdout
                print(re.sub(r"^", "      ", diff.strip(), flags=re.M))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(statuses, indent=1, sort_keys=True), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
