"""Draft sources for speculative decoding.

A draft source is any callable ``(context, k) -> list[int]`` that proposes
up to ``k`` tokens to follow ``context`` (the request's prompt and generated
tokens).  The engine verifies the proposal with one forward of the target
model and rolls back exactly what it rejects, so a draft source only affects
speed, never the tokens produced.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramDraft:
    """Prompt-lookup drafting: find the most recent earlier occurrence of the
    context's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) and
    propose the tokens that followed it.  Costs no model; pays off on inputs
    that repeat themselves (code, extraction, summaries, loops)."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = int(max_n)
        self.min_n = int(min_n)

    def __call__(self, context: Sequence[int], k: int) -> list[int]:
        ctx = list(context)
        L = len(ctx)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = ctx[L - n :]
            # latest earlier match first: recent text predicts the continuation best
            for start in range(L - n - 1, -1, -1):
                if ctx[start : start + n] == tail:
                    follow = ctx[start + n : start + n + k]
                    if follow:
                        return follow
        return []
