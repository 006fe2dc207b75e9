"""Every Python example in the README runs as written (on the reference device)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, monkeypatch):
    monkeypatch.setenv("STATECACHE_DEVICE", "reference")
    from statecache.registry import reset_default_registry

    reset_default_registry()
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
    reset_default_registry()


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
