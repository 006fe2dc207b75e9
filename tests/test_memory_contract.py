"""The memory contract as documented: every refusal sentence of the
:class:`~statecache.memory.Memory` docstrings holds on every memory class
(the refusal happens, and the memory is left exactly as it was), and every
citation of the semantics points at what ships (docs/memory-semantics.md).

Out-of-range sequence ids (``ArgumentError`` in every method) are proved by
the tests of the memories themselves.
"""

from __future__ import annotations

import inspect
import pathlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hybrid_toy import ATTN, E, make_hybrid
from recurrent_toy import toy_spec

from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, StateError
from statecache.hybrid import HybridISWAMemory, HybridMemory
from statecache.hybrid_idx import HybridIdxMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.memory import Memory, MemoryStatus
from statecache.recurrent import RecurrentMemory

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEMANTICS = ROOT / "docs" / "memory-semantics.md"
N_SEQ = 3


def _build(kind: str, dev: Any, unified: bool = True) -> Memory:
    common = dict(n_seq_max=N_SEQ, unified=unified, dtype="f32", n_pad=8)
    mem: Any
    if kind == "recurrent":
        mem = RecurrentMemory(toy_spec(), dev, n_seq_max=N_SEQ, n_rs_seq=0)
    elif kind == "kv":
        mem = KVCache(dev, [KVLayer(ATTN, E, E)], size=24, **common)
    elif kind == "kv_iswa":
        mem = KVCacheISWA(dev, [KVLayer(ATTN, E, E)], [ATTN], size=24, n_ubatch=8, n_swa=4, **common)
    else:
        mem = make_hybrid(dev, {"hybrid": "hybrid", "hybrid_iswa": "iswa", "hybrid_idx": "idx"}[kind], n_seq_max=N_SEQ)
    if hasattr(mem, "fill_garbage"):
        mem.fill_garbage(5)
    _decode(mem, {0: [1, 2, 3, 4, 5], 1: [6, 7, 8]})
    mem.seq_cp(0, 2)  # sequence 2 shares sequence 0's cells (or, between streams, gets a copy)
    update = mem.init_update()
    if update.status is MemoryStatus.SUCCESS:
        update.apply()
    return mem


def _decode(mem: Memory, tokens: dict[int, list[int]]) -> MemoryStatus:
    balloc = BatchAllocator(N_SEQ)
    balloc.init(Batch.for_sequences(tokens), mem)
    ctx = mem.init_batch(balloc, 8)
    if ctx.status.is_fail:
        return ctx.status
    while True:
        assert ctx.apply()
        if not ctx.next():
            return ctx.status


KINDS = ("recurrent", "kv", "kv_iswa", "hybrid", "hybrid_iswa", "hybrid_idx")
CLASSES = {
    "recurrent": RecurrentMemory,
    "kv": KVCache,
    "kv_iswa": KVCacheISWA,
    "hybrid": HybridMemory,
    "hybrid_iswa": HybridISWAMemory,
    "hybrid_idx": HybridIdxMemory,
}
HAS_RECURRENT = {"recurrent", "hybrid", "hybrid_iswa", "hybrid_idx"}


def _witness(mem: Memory) -> tuple[Any, ...]:
    """Everything a refusal must leave as it was: every sequence's positions, the
    whole saved state (book and data), and hybrid-idx's stale marks."""
    positions = tuple((mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in range(N_SEQ))
    marks = getattr(mem, "marks", None)
    return positions, mem.state_write(-1), None if marks is None else marks.copy().tobytes()


#: (method, sentence of its documented contract, attempt, who refuses, how).
#: ``how``: "false" (returns False) or an (exception, argument) pair.
Attempt = Callable[[Memory], Any]
REFUSALS: list[tuple[str, str, Attempt, set[str], Any]] = [
    (
        "seq_rm",
        "False when refused, and then nothing changed",
        lambda m: m.seq_rm(1, 2, -1),  # the tail of sequence 1 without a snapshot plane
        HAS_RECURRENT,
        "false",
    ),
    (
        "seq_rm",
        "``seq=-1`` is refused for a range that is neither empty nor\n            complete",
        lambda m: m.seq_rm(-1, 1, 3),
        HAS_RECURRENT,
        "false",
    ),
    ("seq_div", ":raises ArgumentError: ``d < 1``", lambda m: m.seq_div(1, 0, -1, 0), set(KINDS), (ArgumentError, "d")),
    (
        "seq_add",
        "belongs to a cell another sequence shares",
        lambda m: m.seq_add(0, 0, -1, 3),
        set(KINDS),
        (ArgumentError, "seq"),
    ),
    (
        "seq_div",
        "a\n            divided position belongs to a shared cell",
        lambda m: m.seq_div(2, 0, -1, 2),
        set(KINDS),
        (ArgumentError, "seq"),
    ),
    (
        "seq_cp",
        "a range that leaves out a position ``src`` holds is refused by every memory with one",
        lambda m: m.seq_cp(1, 0, 0, 2),  # sequence 1 holds positions 0..2
        HAS_RECURRENT,
        (ArgumentError, "p0/p1"),
    ),
    (
        "seq_cp",
        "any partial range on hybrid-idx (whole sequences only)",
        lambda m: m.seq_cp(1, 0, 0, 10),  # every position of sequence 1, yet a range
        {"hybrid_idx"},
        (ArgumentError, "p0/p1"),
    ),
    (
        "state_read",
        "so the memory\n            is left exactly as it was",
        lambda m: m.state_read(m.state_write(0)[:-3], 1),  # a truncated blob
        set(KINDS),
        (StateError, None),
    ),
    (
        "state_read",
        "so the memory\n            is left exactly as it was",
        lambda m: m.state_read(b"SCST" + bytes(12), -1),  # a container with garbage sections
        set(KINDS),
        (StateError, None),
    ),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("index", range(len(REFUSALS)), ids=lambda i: f"{REFUSALS[i][0]}-{i}")
def test_documented_refusals_hold_and_change_nothing(ref_device, kind, index):
    method, sentence, attempt, refusers, how = REFUSALS[index]
    doc = inspect.getdoc(getattr(Memory, method)) or ""
    assert " ".join(sentence.split()) in " ".join(doc.split()), f"Memory.{method} no longer documents: {sentence}"
    mem = _build(kind, ref_device)
    before = _witness(mem)
    if kind not in refusers:
        attempt(mem)  # accepted: the contract says so for this memory (checked elsewhere)
        return
    if how == "false":
        assert attempt(mem) is False
    else:
        error, argument = how
        with pytest.raises(error) as info:
            attempt(mem)
        if argument is not None:
            assert info.value.argument == argument
    assert _witness(mem) == before, f"{CLASSES[kind].__name__}.{method} refused but changed the memory"


@pytest.mark.parametrize("kind", ["kv", "kv_iswa"])
def test_a_kv_cache_never_refuses_seq_rm(ref_device, kind):
    assert "A KV cache never refuses" in (inspect.getdoc(Memory.seq_rm) or "")
    mem = _build(kind, ref_device)
    assert mem.seq_rm(1, 2, -1) is True
    assert mem.seq_pos_max(1) == 1
    assert mem.seq_rm(-1, 1, 3) is True


@pytest.mark.parametrize("kind", ["kv", "hybrid", "hybrid_idx"])
def test_a_plan_that_does_not_fit_fails_and_changes_nothing(ref_device, kind):
    assert "``FAILED_PREPARE`` (nothing changed)" in (inspect.getdoc(Memory.init_batch) or "")
    mem = _build(kind, ref_device)
    before = _witness(mem)
    assert _decode(mem, {1: list(range(30))}) is MemoryStatus.FAILED_PREPARE  # 30 tokens, 24 cells
    assert _witness(mem) == before


def test_a_partial_copy_between_streams_is_refused(ref_device):
    mem = _build("kv", ref_device, unified=False)
    before = _witness(mem)
    with pytest.raises(ArgumentError) as info:
        mem.seq_cp(0, 1, 1, 3)
    assert info.value.argument == "p0/p1"
    assert "a partial range between two streams" in " ".join((inspect.getdoc(Memory.seq_cp) or "").split())
    assert _witness(mem) == before


# -- the interface is documented ----------------------------------------------------------

INTERFACE = sorted(name for name, member in vars(Memory).items() if callable(member) and not name.startswith("_"))


@pytest.mark.parametrize("name", INTERFACE)
def test_every_method_of_the_interface_states_its_contract(name):
    doc = inspect.getdoc(getattr(Memory, name)) or ""
    assert len(doc.split()) >= 8, f"Memory.{name} has no real docstring"
    signature = inspect.signature(getattr(Memory, name))
    for param in signature.parameters:
        if param in ("self", "balloc", "n_ubatch", "embd_all", "data", "flags", "optimize", "p0", "p1", "seq"):
            continue  # named in prose (see the docstring)
        assert param in doc, f"Memory.{name} does not say what {param!r} is"
    if name.startswith("seq_") and name not in ("seq_pos_min", "seq_pos_max"):
        assert ":raises ArgumentError:" in doc or ":return:" in doc, name


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=lambda c: c.__name__)
def test_every_memory_answers_help_with_the_contract(cls):
    for name in INTERFACE:
        assert inspect.getdoc(getattr(cls, name)), f"{cls.__name__}.{name} has no docstring (not even inherited)"


# -- citations point at what ships ---------------------------------------------------------

ANCHORS = set(re.findall(r'<a id="([\w-]+)"></a>', SEMANTICS.read_text()))
CITING = [
    *sorted((ROOT / "core").rglob("*.py")),
    ROOT / "tests" / "INVARIANTS.md",
    ROOT / "docs" / "writing-a-backend.md",
]


def test_every_citation_of_the_semantics_resolves():
    cited = {}
    for path in CITING:
        for anchor in re.findall(r"memory-semantics\.md#([\w-]+)", path.read_text()):
            cited.setdefault(anchor, path.name)
    assert cited, "nothing cites docs/memory-semantics.md"
    missing = {a: p for a, p in cited.items() if a not in ANCHORS}
    assert not missing, f"citations of anchors docs/memory-semantics.md does not have: {missing}"


def test_nothing_cites_a_spec_that_does_not_ship():
    offenders = []
    for path in CITING:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "§" in line or re.search(r"kpool-spec|llama-memory-spec|\bK\.\d", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_invariant_in_the_table_has_its_anchor():
    table = (ROOT / "tests" / "INVARIANTS.md").read_text()
    memory, kpool = table.split("## Indexer pool invariants", 1)
    for items, prefix in ((memory, "inv"), (kpool, "kinv")):
        numbers = [int(n) for n in re.findall(r"^\| (\d+) \|", items, flags=re.M)]
        assert numbers == list(range(1, len(numbers) + 1))
        assert {f"{prefix}-{n}" for n in numbers} <= ANCHORS
    assert {f"inv-{n}" for n in range(57, 63)} <= ANCHORS  # the conformance kit's items


def test_the_recurrent_book_check_raises_invariant_errors(ref_device):
    """The checks survive ``python -O``: explicit raises naming the invariant."""
    from statecache.errors import InvariantError

    mem = _build("recurrent", ref_device)
    mem.check_invariants()
    mem._book.used += 1  # a counter that skipped a move
    with pytest.raises(InvariantError, match="I2") as info:
        mem.check_invariants()
    assert info.value.invariant == "I2"
    kv = _build("kv", ref_device)
    cells = kv.cells[0]
    cells.check()
    cells.used -= 1
    with pytest.raises(InvariantError, match="kv-used"):
        cells.check()
    assert np.all(cells.pos[: cells.used + 1] >= -1)
