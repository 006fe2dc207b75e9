"""Every Python example in docs/prefix-cache.md runs as written (reference device)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "prefix-cache.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"prefix-cache.md[python block {index}]", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_doc_has_an_example():
    assert BLOCKS
