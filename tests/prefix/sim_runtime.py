"""A runtime over :class:`statecache.prefix.SimulatedMemory` for the pool-free tests."""

from __future__ import annotations

from collections.abc import Sequence

from statecache.prefix import PrefixCache, Request, SimulatedMemory


def serve(  # type: ignore[no-untyped-def]
    cache: PrefixCache, mem: SimulatedMemory, seq: int, prompt: Sequence[int], gen: Sequence[int] = (), extra=None
):
    """Start, check the restored state is exactly the prompt's first ``resume``
    tokens, absorb piece by piece, finish.  Returns the request."""
    prompt = list(prompt)
    req: Request = cache.start(seq, prompt, extra)
    assert mem.history(seq) == tuple(prompt[: req.resume]), (mem.history(seq), req.resume)
    assert 0 <= req.resume <= len(prompt) - 1
    prev = req.resume
    for end in req.pieces:
        mem.absorb(seq, prompt[prev:end])
        prev = end
        cache.reached(req, end)
    mem.absorb(seq, gen)
    cache.finish(req, list(gen))
    return req
