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


# -- the rest of the docs' code and claims: a page that drifts from the code fails here --


def _doc_python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (README.parent / "docs" / page).read_text(), flags=re.S)


def test_the_transformers_page_example_runs_around_a_tiny_model():
    """The page's first block is a fragment (the reader brings `model` and the token
    lists); given the smallest such context it must run as written."""
    pytest.importorskip("torch", reason="docs/integrations/transformers.md needs the torch extra")
    transformers = pytest.importorskip("transformers", reason="the page needs the transformers extra")
    block = _doc_python_blocks("integrations/transformers.md")[0]
    cfg = transformers.Mamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=1
    )
    scope = {
        "model": transformers.Mamba2ForCausalLM(cfg).eval(),
        "prompt_ids": [1, 2, 3, 4],
        "other_ids": [5, 6, 7],
        "code_ids": [8, 9, 8, 9, 8, 9],
        "token": 3,
        "print": lambda *args: None,
    }
    exec(compile(block, "docs/integrations/transformers.md[python block 0]", "exec"), scope)
    eng = scope["eng"]
    assert len(eng.tokens(scope["a"])) == 64 and len(eng.tokens(scope["c"])) == 64


def test_the_optional_expected_failures_hook_names_a_real_case():
    """The second-hook example of docs/writing-a-backend.md returns a case id; an id the
    kit no longer has would only be reported as stale, so check it here."""
    hook_file = "# my_backend/__init__.py (optional"
    blocks = [b for b in _doc_python_blocks("writing-a-backend.md") if b.startswith(hook_file)]
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "docs/writing-a-backend.md[expected failures hook]", "exec"), scope)
    ids = scope["statecache_conformance_expected_failures"]("mine")
    assert scope["statecache_conformance_expected_failures"]("other") is None
    cmd = [sys.executable, "-m", "statecache.cli", "conformance", "--backend", "reference", "--list", "-k", "ssm_scan"]
    listed = set(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout.split())
    assert ids and set(ids) <= listed, f"ids not in the kit: {set(ids) - listed}"


def test_the_backend_page_gives_the_signatures_the_device_declares():
    """The 'What a Device implements' table must list each primitive's parameters as
    core/backend.py declares them (a backend author copies them)."""
    from statecache.backend import Device

    text = BACKEND_DOC.read_text()
    rows = re.findall(r"^\| `(_\w+)\(([^)]*)\)", text, flags=re.M)
    assert {name for name, _ in rows} >= {"_ssm_conv", "_ssm_scan", "_gated_delta_net", "_get_rows"}
    for name, params in rows:
        declared = [p for p in inspect.signature(getattr(Device, name)).parameters if p != "self"]
        assert [p.strip() for p in params.split(",")] == declared, f"docs/writing-a-backend.md: {name}"
    # the signature block of the stateful primitives, too
    for name, params in re.findall(r"^def (_\w+)\(self, ([^)]*)\)", text, flags=re.M):
        declared = [p for p in inspect.signature(getattr(Device, name)).parameters if p != "self"]
        assert [p.strip() for p in params.split(",")] == declared, f"docs/writing-a-backend.md: def {name}"


def test_the_builtin_priorities_are_the_documented_ones():
    """`get_device()` with nothing named takes the highest priority: a usable GPU
    first, the NumPy reference last, as docs/writing-a-backend.md says."""
    from statecache.backends.cpu.device import CpuBackend
    from statecache.backends.cuda.device import CudaBackend
    from statecache.backends.opencl.device import OpenCLBackend
    from statecache.backends.reference.device import ReferenceBackend

    actual = {b.name: b.priority for b in (ReferenceBackend, OpenCLBackend, CpuBackend, CudaBackend)}
    line = next(line for line in BACKEND_DOC.read_text().splitlines() if "| `priority` |" in line)
    assert {name: int(value) for value, name in re.findall(r"(\d+) \((\w+)\)", line)} == actual
    assert actual["cuda"] > actual["cpu"] > actual["opencl"] > actual["reference"]


def test_the_readme_command_table_names_only_what_exists():
    text = README.read_text()
    assert "`backends/cuda/gpu_check.sh [limit_s]`" in text
    script = README.parent / "backends" / "cuda" / "gpu_check.sh"
    assert script.is_file() and script.stat().st_mode & 0o111
    main = (README.parent / "backends" / "cuda" / "__main__.py").read_text()
    assert '"build"' in main or "'build'" in main
    from statecache.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for command in re.findall(r"^\| `statecache (\w+)", text, flags=re.M):
        assert command in sub.choices, f"README names `statecache {command}`, which the CLI lacks"


def test_the_tensor_parallel_example_builds_a_shard_of_either_spec_kind():
    """docs/distributed.md's first block says `model_spec` may be a ModelSpec or a
    MemorySpec; the same line (n_ctx included) must build both."""
    import statecache
    from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec

    block = _doc_python_blocks("distributed.md")[0]
    assert "ModelSpec or MemorySpec" in block
    layer = RecurrentLayerSpec.mamba2(d_inner=32, d_state=16, d_conv=4, n_group=2, head_dim=8)
    specs = {
        "HybridMemory": ModelSpec.build(2, recurrent={0: layer}, attention={1: AttentionLayerSpec(2, 8)}),
        "RecurrentMemory": MemorySpec.build(1, {0: layer}),
    }
    for kind, model_spec in specs.items():
        scope = dict(model_spec=model_spec, rank=1, world=2, n_seq_max=2, n_rs_seq=2, n_ctx=16)
        scope["device"] = statecache.get_device("reference")
        exec(compile(block, "docs/distributed.md[python block 0]", "exec"), scope)
        assert type(scope["memory"]).__name__ == kind
        assert scope["local"] == model_spec.shard(1, 2)
