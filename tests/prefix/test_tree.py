"""The radix index alone (ints as tokens, no memory): walks, splits, pruning and the
device-hold counters (P2-P4), against a plain set-of-tuples model."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from statecache.prefix.tree import Entry, Node, Tree

NS = b"n" * 16


def _entry(tree: Tree, tokens: tuple[int, ...], device: bool) -> Entry:
    node = tree.insert(NS, tokens)
    e = Entry(node, len(tokens), "interval", 1, device_seq=0 if device else None, host_blob=None if device else b"x")
    tree.attach(node, e)
    return e


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _check_shape(tree: Tree) -> None:
    for node in tree.nodes():
        if node.parent is None:
            continue
        assert node.edge and node.parent.children[node.edge[0]] is node
        assert node.depth == node.parent.depth + len(node.edge)
        assert node.entry is not None or len(node.children) >= 2  # P3: compressed


def test_split_keeps_a_shorter_checkpoint_reachable():
    tree = Tree()
    long = _entry(tree, (1, 2, 3, 4, 5), device=True)
    short = _entry(tree, (1, 2, 3), device=False)  # splits the edge
    assert tree.find(NS, (1, 2, 3)) is short.node
    assert tree.find(NS, (1, 2, 3, 4, 5)) is long.node
    w = tree.walk(NS, (1, 2, 3, 9))
    assert [n.depth for n in w.nodes] == [3] and w.matched == 3 and w.partial is None
    w = tree.walk(NS, (1, 2, 3, 4, 7))
    assert w.matched == 4 and w.partial is long.node
    assert tree.held_tokens == 5  # the upper half inherited the hold
    _check_shape(tree)


def test_detach_merges_and_releases_held_tokens():
    tree = Tree()
    a = _entry(tree, (1, 2, 3, 4), device=True)
    b = _entry(tree, (1, 2, 7), device=True)
    assert tree.held_tokens == 5  # (1, 2) + (3, 4) + (7,)
    tree.detach(a)
    assert tree.held_tokens == 3
    assert tree.find(NS, (1, 2)) is None  # the junction node without an entry was merged away
    assert tree.find(NS, (1, 2, 7)) is b.node
    assert tree.ancestor_entry(b.node) is None
    tree.detach(b)
    assert tree.held_tokens == 0 and not tree.roots[NS].children
    tree.drop_namespace_if_empty(NS)
    assert NS not in tree.roots


def test_namespaces_never_share():
    tree = Tree()
    _entry(tree, (1, 2, 3), device=False)
    assert tree.walk(b"m" * 16, (1, 2, 3)).matched == 0


keys = st.lists(st.integers(0, 3), min_size=1, max_size=7).map(tuple)
ops = st.lists(st.tuples(st.booleans(), keys, st.booleans()), max_size=30)


@given(ops=ops, probes=st.lists(keys, max_size=8))
def test_tree_matches_a_set_model(ops, probes):
    """Random inserts (True) and removals (False) of entries, device or host; the tree
    must agree with a dict of token tuples on lookups, matches and held tokens."""
    tree = Tree()
    model: dict[tuple[int, ...], Entry] = {}
    for insert, key, device in ops:
        if insert and key not in model:
            model[key] = _entry(tree, key, device)
        elif not insert and key in model:
            tree.detach(model.pop(key))
        _check_shape(tree)
    for key, e in model.items():
        assert tree.find(NS, key) is e.node and e.node.depth == len(key)
    # matched: the longest common prefix with any path, i.e. with any key
    for probe in [*probes, *model]:
        w = tree.walk(NS, probe)
        assert w.matched == max((_lcp(probe, k) for k in model), default=0)
        assert [n.entry.length for n in w.nodes if n.entry is not None] == sorted(
            len(k) for k in model if probe[: len(k)] == k
        )
    # P4: held counts and distinct held tokens
    held_prefixes = {k[:i] for k, e in model.items() if e.device_seq is not None for i in range(1, len(k) + 1)}
    assert tree.held_tokens == len(held_prefixes)
    for node in tree.nodes():
        if node.parent is not None:
            below = sum(1 for k, e in model.items() if e.device_seq is not None and k[: node.depth] == node.tokens())
            assert node.held == below


def test_node_tokens_and_path():
    tree = Tree()
    e = _entry(tree, (5, 6, 7), device=False)
    _entry(tree, (5, 6, 9), device=False)
    assert e.node.tokens() == (5, 6, 7)
    assert [n.depth for n in e.node.path()] == [3, 2]
    assert isinstance(e.node.parent, Node)
