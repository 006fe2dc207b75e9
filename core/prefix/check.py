"""Invariant checks of the prefix cache that survive ``python -O``.

:func:`check_invariants` rebuilds every counter from the nodes and compares
(no ``assert``: a stripped assert would check nothing), raising
:class:`~statecache.errors.InvariantError` with the number of the invariant (P1-P6 of
:mod:`statecache.prefix.tree`) and what differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statecache.errors import InvariantError
from statecache.prefix.tree import ORIGINS, Node

if TYPE_CHECKING:
    from statecache.prefix.cache import PrefixCache


def _fail(inv: str, msg: str) -> None:
    raise InvariantError(inv, msg)


def check_invariants(cache: PrefixCache, memory: bool = True) -> None:
    """Raise :class:`~statecache.errors.InvariantError` unless P1-P6 hold for ``cache``.

    :param memory: also check that every device entry's sequence is still at
        its length in the memory (skip it where a test drops them on purpose).
    """
    tree = cache.tree
    held_tokens = 0
    tiers = {"device": [0, 0, 0], "host": [0, 0, 0]}  # evictable, protected, entries
    handles: set[int] = set()

    # P4 rebuilt bottom-up: device entries in each subtree
    held_of: dict[int, int] = {}
    order: list[Node] = []
    for root in tree.roots.values():
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
    for node in reversed(order):  # children come after their parent in ``order``
        own = int(node.entry is not None and node.entry.device_seq is not None)
        held_of[id(node)] = own + sum(held_of[id(c)] for c in node.children.values())

    for ns, root in tree.roots.items():
        if root.parent is not None or root.edge or root.entry is not None or root.depth != 0:  # P1
            _fail("P1", f"root of namespace {ns.hex()} has a parent, an edge or an entry")
        stack = [root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                if not child.edge or child.edge[0] != first:  # P2
                    _fail("P2", f"child keyed {first} has edge starting {child.edge[:1]}")
                if child.parent is not node:
                    _fail("P2", f"child at depth {child.depth} does not point back to its parent")
                if child.depth != node.depth + len(child.edge):
                    _fail("P2", f"depth {child.depth} != parent depth {node.depth} + edge {len(child.edge)}")
                stack.append(child)
            if node.parent is None:
                continue
            e = node.entry
            if e is None and len(node.children) < 2:  # P3
                _fail("P3", f"node at depth {node.depth} has no entry and {len(node.children)} child(ren)")
            if e is not None:
                if e.node is not node or e.length != node.depth:
                    _fail("P3", f"entry of length {e.length} sits at a node of depth {node.depth}")
                if e.origin not in ORIGINS:
                    _fail("P3", f"entry origin {e.origin!r} unknown")
                if (e.device_seq is None) == (e.host_blob is None):  # P6
                    _fail("P6", f"entry of length {e.length} is in {'both tiers' if e.host_blob else 'no tier'}")
                if e.pins < 0:
                    _fail("P5", f"entry of length {e.length} has {e.pins} pins")
                t = tiers[e.tier]
                t[1 if e.pins else 0] += e.nbytes
                t[2] += 1
                if e.device_seq is not None:
                    if e.device_seq in handles or e.device_seq not in cache.reserved:
                        _fail("P6", f"device handle {e.device_seq} duplicated or not reserved")
                    handles.add(e.device_seq)
                    if e.nbytes != cache.layout.checkpoint_bytes:
                        _fail(
                            "P5",
                            f"device entry counts {e.nbytes} bytes, a checkpoint is {cache.layout.checkpoint_bytes}",
                        )
                    if memory and cache.memory.seq_pos_max(e.device_seq) != e.length - 1:
                        _fail(
                            "P6", f"device entry of length {e.length}: sequence {e.device_seq} is at "
                            f"{cache.memory.seq_pos_max(e.device_seq)}"
                        )  # fmt: skip
                elif e.host_blob is not None and e.nbytes != len(e.host_blob):
                    _fail("P5", f"host entry counts {e.nbytes} bytes, its blob has {len(e.host_blob)}")
            want = held_of[id(node)]
            if node.held != want:  # P4
                _fail("P4", f"node at depth {node.depth} counts {node.held} device entries below, there are {want}")
            if want:
                held_tokens += len(node.edge)
    if tree.held_tokens != held_tokens:
        _fail("P4", f"held_tokens is {tree.held_tokens}, the held edges add up to {held_tokens}")
    for name, tier in (("device", cache.device), ("host", cache.host)):
        ev, pr, n = tiers[name]
        if (tier.evictable, tier.protected, tier.entries) != (ev, pr, n):
            _fail(
                "P5", f"{name} tier counts evictable {tier.evictable}, protected {tier.protected}, entries "
                f"{tier.entries}; the entries add up to {ev}, {pr}, {n}"
            )  # fmt: skip
        if tier.resident > tier.budget:
            _fail("P5", f"{name} tier holds {tier.resident} bytes over its budget {tier.budget}")
    if cache.store.free + len(handles) != len(cache.reserved):
        _fail("P6", f"{cache.store.free} free handles + {len(handles)} used != {len(cache.reserved)} reserved")
