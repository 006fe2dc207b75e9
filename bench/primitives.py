"""Primitive benchmarks against physical limits, for any device.

    python bench/primitives.py --device cpu
    python bench/primitives.py --device cpu --rounds 3   # shared machine: fastest of 3 rounds
    python bench/primitives.py --device opencl:0 --no-reference --only mamba2

The machinery lives in :mod:`statecache.conformance.benchmarks` (so that
``statecache conformance --perf`` works from any install); see its docstring
for what each column means.
"""

from __future__ import annotations

import sys

from statecache.conformance.benchmarks import main

if __name__ == "__main__":
    sys.exit(main())
