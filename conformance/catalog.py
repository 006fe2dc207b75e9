"""Every conformance case, by family, built once per process."""

from __future__ import annotations

import functools

from statecache.conformance.cases import Case

FAMILIES = ("device", "primitive", "oracle", "metamorphic", "memory", "prefix")


@functools.cache
def all_cases() -> tuple[Case, ...]:
    from statecache.conformance import (
        device_cases,
        epilogue_cases,
        linear_attn_cases,
        memory_cases,
        metamorphic_cases,
        nonfinite_cases,
        oracle_cases,
        prefix_cases,
        primitive_cases,
        tensor_cases,
        varlen_cases,
    )

    cases = [
        *device_cases.all_cases(),
        *tensor_cases.all_cases(),
        *primitive_cases.all_cases(),
        *varlen_cases.all_cases(),
        *epilogue_cases.all_cases(),
        *linear_attn_cases.all_cases(),
        *nonfinite_cases.all_cases(),
        *oracle_cases.all_cases(),
        *metamorphic_cases.all_cases(),
        *memory_cases.all_cases(),
        *prefix_cases.all_cases(),
    ]
    seen: set[str] = set()
    for case in cases:
        if case.id in seen:
            raise RuntimeError(f"duplicate conformance case id {case.id}")
        seen.add(case.id)
    return tuple(cases)


def cases_of(family: str) -> list[Case]:
    if family not in FAMILIES:
        raise ValueError(f"unknown case family {family!r}; known: {', '.join(FAMILIES)}")
    return [c for c in all_cases() if c.family == family]
