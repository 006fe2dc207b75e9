"""Memory constructors refuse fractional sizes naming them (hunt26).

Sequence operations refuse a non-integer position or id (``check_int32``);
the constructors took ``int()`` of their sizes instead, so ``n_rs_seq=1.5``
built one plane, ``size=10.5`` ten cells, a ``KVLayer`` of width 4.5 was
accepted, and ``n_seq_max=2.5`` failed later with a bare ``TypeError``.
"""

from __future__ import annotations

import pytest
from recurrent_toy import toy_spec

import statecache
from statecache.errors import ArgumentError
from statecache.kv_cache import KVCache, KVLayer
from statecache.recurrent import RecurrentMemory

DEV = statecache.get_device("reference")
KV = dict(size=16, n_seq_max=2, unified=True, dtype="f32", n_pad=8)


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: RecurrentMemory(toy_spec(), DEV, n_seq_max=2.5), "n_seq_max"),
        (lambda: RecurrentMemory(toy_spec(), DEV, n_seq_max=2, n_rs_seq=1.5), "n_rs_seq"),
        (lambda: RecurrentMemory(toy_spec(), DEV, n_seq_max=2, size=3.5), "size"),
        (lambda: RecurrentMemory(toy_spec(), DEV, n_seq_max=True), "n_seq_max"),
        (lambda: KVCache(DEV, [KVLayer(0, 4, 4)], **{**KV, "size": 10.5}), "size"),
        (lambda: KVCache(DEV, [KVLayer(0, 4, 4)], **{**KV, "n_pad": 2.5}), "n_pad"),
        (lambda: KVCache(DEV, [KVLayer(0, 4, 4)], **{**KV, "n_seq_max": 2.0}), "n_seq_max"),
        (lambda: KVLayer(0, 4.5, 4), "layers"),
    ],
)
def test_fractional_sizes_are_refused_naming_them(build, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArgumentError) as e:
        build()
    assert e.value.argument == name


def test_numpy_integers_are_fine() -> None:
    import numpy as np

    mem = RecurrentMemory(toy_spec(), DEV, n_seq_max=np.int64(2), n_rs_seq=np.int32(1), size=np.int64(3))
    assert (mem.n_seq_max, mem.n_rs_seq, mem.size) == (2, 1, 3)
    cache = KVCache(DEV, [KVLayer(0, np.int64(4), 4)], **{**KV, "size": np.int64(16)})
    assert cache.size == 16
