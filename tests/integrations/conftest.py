"""Shared setup of the transformers integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():  # type: ignore[no-untyped-def]
    """Tiny models gain nothing from intra-op threads, and torch's spinning OpenMP workers
    compete with statecache's kernel threads on a two-core CI machine: run torch on one
    thread here and restore the setting afterwards."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
