"""An approximate, multi-tenant radix tree over request text (SGLang router's data structure).

Each node holds an edge label (a string) and, per tenant (worker), a logical last-access tick. A tenant
holding a node holds all its ancestors, so a tenant's match length is the depth of the deepest node on
the request's path that it holds. Sizes are counted in characters per tenant; a tenant over its budget
loses its least-recently-used leaves first. The tree only remembers what the router sent: it never
hears about evictions in the engines (that is what makes it approximate).
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("children", "label", "parent", "tenants")

    def __init__(self, label: str, parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, int] = {}


class TextTree:
    def __init__(self) -> None:
        self.root = _Node("", None)
        self.sizes: dict[str, int] = {}
        self._tick = itertools.count(1)

    def insert(self, text: str, tenant: str) -> None:
        """Record that ``tenant`` now caches ``text`` (and so every prefix of it)."""
        tick = next(self._tick)
        node, i = self.root, 0
        node.tenants[tenant] = tick
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                node.children[text[i]] = leaf
                leaf.tenants[tenant] = tick
                self.sizes[tenant] = self.sizes.get(tenant, 0) + len(leaf.label)
                return
            common = _common_len(child.label, text, i)
            if common < len(child.label):
                child = self._split(child, common)
            if tenant not in child.tenants:
                self.sizes[tenant] = self.sizes.get(tenant, 0) + len(child.label)
            child.tenants[tenant] = tick
            node, i = child, i + common

    def match(self, text: str) -> dict[str, int]:
        """Per tenant: how many leading characters of ``text`` it holds (tenants with 0 omitted)."""
        best: dict[str, int] = {}
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            common = _common_len(child.label, text, i)
            for tenant in child.tenants:
                best[tenant] = i + common
            if common < len(child.label):
                break
            node, i = child, i + common
        return best

    def size(self, tenant: str) -> int:
        return self.sizes.get(tenant, 0)

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything of a tenant (a worker that left)."""
        for node in self._nodes_of(tenant):
            del node.tenants[tenant]
        self.root.tenants.pop(tenant, None)
        stack = [self.root]
        while stack:  # a node nobody holds has no holder below it either: unlink it
            node = stack.pop()
            for key, child in list(node.children.items()):
                if child.tenants:
                    stack.append(child)
                else:
                    del node.children[key]
        self.sizes.pop(tenant, None)

    def evict(self, tenant: str, max_size: int) -> None:
        """Drop ``tenant``'s least-recently-used leaves until it holds at most ``max_size`` characters."""
        if self.size(tenant) <= max_size:
            return
        leaves = [(n.tenants[tenant], id(n), n) for n in self._nodes_of(tenant) if self._is_leaf_of(n, tenant)]
        heapq.heapify(leaves)
        while leaves and self.size(tenant) > max_size:
            _, _, node = heapq.heappop(leaves)
            if tenant not in node.tenants or not self._is_leaf_of(node, tenant):
                continue
            del node.tenants[tenant]
            self.sizes[tenant] -= len(node.label)
            parent = node.parent
            self._prune(node)
            if parent is not None and parent is not self.root and self._is_leaf_of(parent, tenant):
                heapq.heappush(leaves, (parent.tenants[tenant], id(parent), parent))

    def _nodes_of(self, tenant: str) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if tenant in node.tenants:
                out.append(node)
                stack.extend(node.children.values())
        return out

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    def _prune(self, node: _Node) -> None:
        """Unlink nodes no tenant holds (their subtrees are empty too)."""
        for key, child in list(node.children.items()):
            if not child.tenants:
                del node.children[key]
        if node is not self.root and not node.tenants and node.parent is not None:
            node.parent.children.pop(node.label[0], None)

    def _split(self, child: _Node, at: int) -> _Node:
        """Split ``child``'s edge at ``at`` characters; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.label[:at], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.label[0]] = upper
        child.label = child.label[at:]
        child.parent = upper
        upper.children[child.label[0]] = child
        return upper


def _common_len(label: str, text: str, start: int) -> int:
    """Length of the common prefix of ``label`` and ``text[start:]``."""
    n = min(len(label), len(text) - start)
    if text.startswith(label[:n], start):
        return n
    lo, hi = 0, n
    while lo < hi:  # binary search on C-speed startswith: O(log n) comparisons
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo
