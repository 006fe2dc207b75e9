"""Every Python example in the README runs as written (on the reference device)."""

from __future__ import annotations

import inspect
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, monkeypatch):
    # A block that shows an optional integration needs that extra; the README
    # test command installs every extra, a tox env without it skips by name.
    for extra_module in ("torch", "transformers"):
        if re.search(rf"^\s*(import|from) {extra_module}\b", BLOCKS[index], flags=re.M):
            pytest.importorskip(extra_module, reason=f"README block {index} needs the {extra_module} extra")
    monkeypatch.setenv("STATECACHE_DEVICE", "reference")
    from statecache.registry import reset_default_registry

    reset_default_registry()
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
    reset_default_registry()


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


# -- docs/writing-a-backend.md: the minimal backend runs as written ----------------------

BACKEND_DOC = README.parent / "docs" / "writing-a-backend.md"
#: Python blocks of the doc whose first line names the file they are: ``# my_backend/device.py``.
DOC_FILES = re.findall(r"```python\n# (my_backend/\w+\.py)\n(.*?)```", BACKEND_DOC.read_text(), flags=re.S)


def test_the_doc_names_every_method_a_backend_implements():
    from statecache.backend import Backend, Buffer, Device

    text = BACKEND_DOC.read_text()
    for cls in (Device, Backend):
        for name in sorted(cls.__abstractmethods__):
            assert f"`{name}(" in text, f"docs/writing-a-backend.md does not describe {cls.__name__}.{name}"
    for name in ("storage", "offset", "strides", "capacity", "properties", "caps", "memory_bytes", "priority"):
        assert f"`{name}`" in text, name
    assert "Buffer(device, storage, dtype, shape, *, strides=None, offset=0, capacity=None)" in text
    assert list(inspect.signature(Buffer).parameters) == [
        "device",
        "storage",
        "dtype",
        "shape",
        "strides",
        "offset",
        "capacity",
    ]


def test_the_minimal_backend_of_the_doc_passes_the_kit(tmp_path):
    assert [path for path, _ in DOC_FILES] == ["my_backend/__init__.py", "my_backend/device.py"]
    for path, body in DOC_FILES:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "statecache.cli", "conformance", "--plugin", "my_backend", "--backend", "mine"]
    proc = subprocess.run([*cmd, "--report", str(report)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["devices"][0]["properties"]["numpy"] == np.__version__  # assigned in __init__
    by_status: dict[str, list[dict]] = {}
    for case in data["cases"]:
        by_status.setdefault(case["status"], []).append(case)
    assert set(by_status) == {"pass", "not supported"}
    passed = {c["case"] for c in by_status["pass"]}
    assert {"device.write_views[f32]", "device.index_views[f32]", "set_rows[r64-e4096-n8-f32]"} <= passed
    # the doc's backend predates the linear-attention primitives (not abstract): they are simply "not supported"
    lacking = ("ssm_", "gated_delta_net", "rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn", "bf16")
    assert all(any(op in c["detail"] for op in lacking) for c in by_status["not supported"])
    assert any("rwkv_wkv7" in c["detail"] for c in by_status["not supported"])


def test_the_readme_says_what_the_apt_step_adds_and_what_happens_without_it():
    line = next(line for line in README.read_text().splitlines() if "apt-get install pocl-opencl-icd" in line)
    assert "adds PoCL" in line and "on the CPU" in line
    assert "without a platform both commands still pass" in line and "skip" in line


def test_the_readme_names_the_output_width_and_every_conformance_option():
    text = README.read_text()
    assert "`--width N`" in text
    from statecache.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for action in sub.choices["conformance"]._actions:
        flag = max(action.option_strings, key=len, default="")
        if flag and flag not in ("--help", "--width", "--exitfirst"):
            assert flag in text, f"README.md's command table does not name {flag}"


def test_every_doc_page_is_reachable_from_the_readme_and_every_named_page_exists():
    """A page under docs/ that the README never names is found only by browsing; a
    page the README names must exist (names appear as `docs/x.md` or, in the
    further-reading line, as `x.md` relative to docs/)."""
    text = README.read_text()
    docs = README.parent / "docs"
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    named = {name.removeprefix("docs/") for name in re.findall(r"`([\w/.-]+\.md)", text)}
    named.discard("README.md")
    assert named - pages == set(), f"README names missing pages: {sorted(named - pages)}"
    assert pages - named == set(), f"docs pages the README never names: {sorted(pages - named)}"
