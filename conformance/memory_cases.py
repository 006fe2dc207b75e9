"""Memory cases: a tiny hybrid model run through statecache's memories on the
device under test (see model.py).  Filled in as the core memories land."""

from __future__ import annotations

from statecache.conformance.cases import Case


def all_cases() -> list[Case]:
    return []
