"""Batch validation details that survived mutation of ``core/batch.py``: the
rule each refusal names, the allocator left empty after a refusal, payload
shapes and dtypes, single-id tuples, coupled tokens after a lone one, and the
M-RoPE start rule at memory position 0."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.batch import Batch, BatchAllocator
from statecache.errors import BatchError


class Positions:
    """A memory as the allocator sees it: the last position of each sequence."""

    def __init__(self, last: dict[int, int]) -> None:
        self.last = last

    def seq_pos_min(self, s: int) -> int:
        return 0 if s in self.last else -1

    def seq_pos_max(self, s: int) -> int:
        return self.last.get(s, -1)


def rule_of(batch: Batch, memory=None, **kw) -> str:  # type: ignore[no-untyped-def]
    b = BatchAllocator(4)
    with pytest.raises(BatchError) as err:
        b.init(batch, memory, **kw)
    # a refused batch leaves the allocator empty
    assert b.n_tokens == 0 and b.pos.size == 0 and b.seq_id_unq == ()
    return err.value.rule


def test_each_refusal_names_its_rule_and_leaves_the_allocator_empty():
    assert rule_of(Batch()) == "payload"
    assert rule_of(Batch(tokens=[1], embd=np.zeros((1, 2)))) == "payload"
    assert rule_of(Batch(tokens=np.zeros((2, 2), dtype=np.int32))) == "payload"  # 2-D integer tokens
    assert rule_of(Batch(tokens=[1.5, 2.0])) == "payload"
    assert rule_of(Batch(tokens=[1, 99]), n_vocab=10) == "token_range"
    assert rule_of(Batch(tokens=[1, 2], seq_ids=[(0, 1), (1, 1)])) == "seq_id_dup"
    assert rule_of(Batch(embd=np.zeros((2, 3))), n_embd=4) == "payload"
    assert rule_of(Batch(embd=np.zeros(3))) == "payload"


def test_embeddings_of_the_right_width_are_taken_as_float32():
    b = BatchAllocator(2)
    b.init(Batch(embd=np.ones((3, 4), dtype=np.float64)), None, n_embd=4)
    ub = b.split_simple(8)
    assert ub.embd.dtype == np.float32 and ub.embd.shape == (3, 4)


def test_single_id_tuples_are_plain_sequence_ids():
    b = BatchAllocator(3)
    b.init(Batch(tokens=[5, 6, 7], seq_ids=[(2,), (0,), (2,)]), None)
    assert b.primary.tolist() == [2, 0, 2]
    assert b.pos.tolist() == [0, 0, 1]
    ub = b.split_equal(8)
    assert sorted(ub.seq_id_unq) == [0, 2]


def test_coupled_token_after_a_lone_one_still_checks_the_memory():
    """Sequences 0 and 1 differ in the memory: a token coupling them is refused
    even when a single-sequence token comes first."""
    mem = Positions({0: 3, 1: 5})
    b = BatchAllocator(3)
    with pytest.raises(BatchError) as err:
        b.init(Batch(tokens=[1, 2], pos=[4, 5], seq_ids=[(0,), (0, 1)]), mem)
    assert err.value.rule == "coupled_pos" and err.value.token == 1 and err.value.seq == 1


@pytest.mark.parametrize("embd", [False, True])
def test_mrope_start_is_checked_against_a_memory_at_position_0(embd):
    """The memory holds position 0: a token batch must start after it, an
    embedding batch (an image continuing a grid) at or after it."""
    mem = Positions({0: 0})
    pos = np.array([[0, 0], [0, 0], [0, 1], [0, 0]])  # temporal positions 0, 0
    payload = {"embd": np.zeros((2, 2))} if embd else {"tokens": [1, 2]}
    b = BatchAllocator(2)
    if embd:
        b.init(Batch(pos=pos, **payload), mem)  # at position 0: allowed
        assert b.pos.tolist() == [0, 0]
    else:
        with pytest.raises(BatchError) as err:
            b.init(Batch(pos=pos, **payload), mem)
        assert err.value.rule == "pos_start"
        assert "must continue after position 0" in str(err.value)
    early = np.array([[0, 0], [0, 0], [0, 0], [0, 0]])
    mem1 = Positions({0: 1})
    with pytest.raises(BatchError, match="at or after position 1" if embd else "continue after position 1"):
        b.init(Batch(pos=early, **payload), mem1)
