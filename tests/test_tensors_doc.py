"""docs/embedding.md, sections "Passing torch tensors", "Slot rows: running your own kernels" and
"One call per layer: the varlen form":
their examples run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "embedding.md"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


BLOCKS = re.findall(r"```python\n(.*?)```", _section("Passing torch tensors"), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_passing_torch_tensors_examples_run(index) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch", reason="the torch extra is not installed")
    exec(compile(BLOCKS[index], f"docs/embedding.md[tensors block {index}]", "exec"), {})


def test_the_section_has_an_example_and_names_the_bench() -> None:
    assert BLOCKS
    section = _section("Passing torch tensors")
    for needle in ("bench/tensor_calls.py", "STATECACHE_NUM_THREADS", "use_stream", "torch.cuda.graph"):
        assert needle in section, needle


SLOT_BLOCKS = re.findall(r"```python\n(.*?)```", _section("Slot rows: running your own kernels"), flags=re.S)


def test_the_slot_rows_example_runs() -> None:
    pytest.importorskip("torch", reason="the torch extra is not installed")
    assert len(SLOT_BLOCKS) == 1
    exec(compile(SLOT_BLOCKS[0], "docs/embedding.md[slot rows block]", "exec"), {})


VARLEN_BLOCKS = re.findall(r"```python\n(.*?)```", _section("One call per layer: the varlen form"), flags=re.S)


def test_the_varlen_example_runs() -> None:
    pytest.importorskip("torch", reason="the torch extra is not installed")
    assert len(VARLEN_BLOCKS) == 1
    exec(compile(VARLEN_BLOCKS[0], "docs/embedding.md[varlen block]", "exec"), {})
