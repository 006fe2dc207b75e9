"""The radix index of the prefix cache: token edges, checkpoint entries, counters.

Plain Python only (no device, no NumPy): the tree knows which token prefixes
have a checkpoint and in which tier it lives, never the bytes.  One tree
holds one root per namespace (see :mod:`statecache.prefix.key`), so two
requests whose extra keys differ never share a node.

Invariants (checked by :func:`statecache.prefix.check.check_invariants`,
which rebuilds every counter from the nodes and raises ``InvariantError``
naming the number):

* **P1** a root is never evictable: it has no edge and no entry, counts in
  no tier, and pruning stops below it; a namespace's root goes away only
  when its last child has (:meth:`Tree.drop_namespace_if_empty`).
* **P2** sibling keys are disjoint: a node's children are keyed by the first
  token of their edge, every non-root edge is non-empty, and
  ``child.depth == parent.depth + len(child.edge)``.
* **P3** a checkpoint sits only at a node boundary: an entry of length ``L``
  is the entry of the node of depth ``L`` on its path (``entry.node.depth ==
  entry.length``), and a node without an entry has at least two children
  (otherwise it is merged away), so the tree stays compressed and a split
  never turns a valid hit into a miss (the SGLang split-node bug: matching
  walks tokens, never relies on nodes holding states).
* **P4** a device hold covers its ancestors, a pin only its entry:
  ``node.held`` counts the device-resident entries in the node's subtree
  (itself included), so the attention cells of every token on the path to a
  device entry are known to be on the device; ``Tree.held_tokens`` is the sum
  of the edges with ``held > 0`` (the distinct attention cells the cache
  keeps on the device).  Pins count live users of one entry and protect that
  entry only.
* **P5** per tier, ``evictable + protected == resident <= budget``, with an
  entry's bytes moving between evictable and protected only when its pin
  count steps 0 -> 1 or 1 -> 0 (:class:`statecache.prefix.pool.Tier`).
* **P6** an entry's tier is derived, never stored: it is on the device when
  ``device_seq is not None`` and on the host when ``host_blob is not None``,
  exactly one of the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

#: Why a checkpoint was taken (policies weigh them; metrics count them).
ORIGINS = ("interval", "junction", "before_end", "prompt_end", "generation_end", "loaded")


@dataclasses.dataclass(eq=False)
class Entry:
    """One checkpoint: the exact state of every part after ``length`` tokens.

    ``device_seq``: the reserved sequence id that holds it in the memory
    (device tier); ``host_blob``: its state blob (host tier).  Exactly one is
    set (P6).  ``nbytes``: what it costs in its current tier.  ``pins``:
    live requests that restored from it (P4, P5).  ``hits`` / ``last_use`` /
    ``origin`` feed the eviction policies.
    """

    node: Node
    length: int
    origin: str
    nbytes: int
    device_seq: int | None = None
    host_blob: bytes | None = None
    pins: int = 0
    hits: int = 0
    last_use: int = 0
    created: int = 0

    @property
    def tier(self) -> str:
        """``"device"`` or ``"host"`` (P6: derived from which field is set)."""
        return "device" if self.device_seq is not None else "host"


@dataclasses.dataclass(eq=False)
class Node:
    """A radix node: the tokens of the edge from its parent, its depth (tokens
    from the root to its end), children by first token, the entry that ends
    here (if any) and ``held``, the device entries in its subtree (P4)."""

    edge: tuple[int, ...]
    depth: int
    parent: Node | None = None
    children: dict[int, Node] = dataclasses.field(default_factory=dict)
    entry: Entry | None = None
    held: int = 0

    def path(self) -> Iterator[Node]:
        """This node and its ancestors up to (excluding) the root, deepest first."""
        n: Node | None = self
        while n is not None and n.parent is not None:
            yield n
            n = n.parent

    def tokens(self) -> tuple[int, ...]:
        """Every token from the root to the end of this node."""
        parts = [n.edge for n in self.path()]
        return tuple(t for e in reversed(parts) for t in e)


@dataclasses.dataclass(frozen=True)
class Walk:
    """Where a token list leads: the fully matched nodes (shallow to deep, root
    excluded), the number of tokens matched (``matched`` may end inside the
    edge of ``partial``), and the node whose edge was partly matched."""

    nodes: tuple[Node, ...]
    matched: int
    partial: Node | None


def _shared(edge: tuple[int, ...], tokens: Sequence[int], i: int) -> int:
    """How many tokens of ``edge`` match ``tokens[i:]`` (the first one is known to)."""
    k, lim = 1, min(len(edge), len(tokens) - i)
    while k < lim and edge[k] == tokens[i + k]:
        k += 1
    return k


class Tree:
    """Radix trees over token ids, one root per namespace (P1)."""

    def __init__(self) -> None:
        self.roots: dict[bytes, Node] = {}
        #: distinct tokens on paths to device entries (P4)
        self.held_tokens = 0

    def root(self, namespace: bytes, create: bool = False) -> Node | None:
        node = self.roots.get(namespace)
        if node is None and create:
            node = self.roots[namespace] = Node((), 0)
        return node

    # -- lookup ------------------------------------------------------------------
    def walk(self, namespace: bytes, tokens: Sequence[int]) -> Walk:
        """Follow ``tokens`` from the namespace root as far as the tree goes."""
        node = self.roots.get(namespace)
        if node is None:
            return Walk((), 0, None)
        nodes: list[Node] = []
        i, n = 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _shared(child.edge, tokens, i)
            if k < len(child.edge):
                return Walk(tuple(nodes), i + k, child)
            nodes.append(child)
            node = child
            i += k
        return Walk(tuple(nodes), i, None)

    def find(self, namespace: bytes, tokens: Sequence[int]) -> Node | None:
        """The node that ends exactly after ``tokens``, if there is one."""
        w = self.walk(namespace, tokens)
        if w.partial is None and w.nodes and w.matched == len(tokens):
            return w.nodes[-1]
        return None

    def entries(self) -> Iterator[Entry]:
        return (node.entry for node in self.nodes() if node.entry is not None)

    def nodes(self) -> Iterator[Node]:
        for root in self.roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    # -- edits -------------------------------------------------------------------
    def insert(self, namespace: bytes, tokens: Sequence[int]) -> Node:
        """The node ending exactly after ``tokens`` (created, splitting an edge
        where needed).  ``tokens`` must be non-empty."""
        if not tokens:
            raise ValueError("a checkpoint covers at least one token")
        node = self.root(namespace, create=True)
        assert node is not None
        i, n = 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(tuple(tokens[i:]), n, node)
                node.children[tokens[i]] = leaf
                return leaf
            k = _shared(child.edge, tokens, i)
            if k < len(child.edge):
                child = self._split(child, k)
            node = child
            i += k
        return node

    def _split(self, child: Node, k: int) -> Node:
        """Cut ``child``'s edge after ``k`` tokens; returns the new upper node.
        The upper node inherits ``held`` (same subtree), so ``held_tokens`` is
        unchanged (P4)."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.edge[:k], child.depth - len(child.edge) + k, parent, held=child.held)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[k:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def attach(self, node: Node, entry: Entry) -> None:
        """Give ``node`` its entry (P3: ``entry.length == node.depth``)."""
        if node.entry is not None or entry.length != node.depth or entry.node is not node:
            raise ValueError("an entry must end at its own node, one per node")
        node.entry = entry
        if entry.device_seq is not None:
            self.hold(node, +1)

    def hold(self, node: Node, step: int) -> None:
        """A device entry appears (+1) or leaves (-1) at ``node``: update ``held``
        on the whole path and ``held_tokens`` on 0 <-> 1 steps (P4)."""
        for n in node.path():
            before = n.held
            n.held += step
            if before == 0 and n.held > 0:
                self.held_tokens += len(n.edge)
            elif before > 0 and n.held == 0:
                self.held_tokens -= len(n.edge)

    def detach(self, entry: Entry) -> None:
        """Remove ``entry`` from its node and prune what no longer earns its place
        (P3: a node without an entry keeps at least two children)."""
        node = entry.node
        if node.entry is not entry:
            raise ValueError("entry is not attached")
        if entry.device_seq is not None:
            self.hold(node, -1)
        node.entry = None
        self._prune(node)

    def _prune(self, node: Node) -> None:
        while node.parent is not None and node.entry is None:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                # merging keeps held_tokens: node.held == child.held here (no entry)
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
            return

    def ancestor_entry(self, node: Node) -> Entry | None:
        """The nearest entry strictly above ``node`` (what a hit falls back to)."""
        n = node.parent
        while n is not None and n.parent is not None:
            if n.entry is not None:
                return n.entry
            n = n.parent
        return None

    def drop_namespace_if_empty(self, namespace: bytes) -> None:
        root = self.roots.get(namespace)
        if root is not None and not root.children:
            del self.roots[namespace]
