"""DTR's eviction score (Kirisame et al., ICLR'21), shared by the planner's ``dtr`` policy
(planner/policies/dtr.py, DTR simulated on a trace) and the runtime's dynamic mode
(runtime/guards/dtr.py, DTR on the live run). No torch, no planner, no runtime: plain numbers.

# Note: [DTR's score]
# A resident candidate ``s`` is scored
#     h(s) = (c(s) + e*(s)) / (M(s) * L(s))
# and the smallest is evicted first. ``c(s)``: what bringing ``s`` back costs (its replay; the
# runtime may price a swap instead); ``M(s)``: its bytes; ``L(s)``: its staleness on the
# caller's clock (ns in the planner, ops in the runtime); both at least 1, so an empty storage or
# one touched this instant neither divides by zero nor wins by it. ``e*(s)``: the value of its
# evicted neighbourhood (simrd's h_DTR^eq, capuchin.md §4.3): evicted storages form sets by a
# union-find; evicting ``s`` makes a set of value c(s) and merges it with the sets of its evicted
# neighbours (the storages its replay reads, and those whose replay reads it); bringing ``s``
# back subtracts its own cost from its set's value (sets never split: the approximation DTR
# accepts). ``e*(s)`` sums each distinct set next to ``s`` once, in the order the neighbours are
# given (the sum's order is part of the result when the values are not integers).
# Nodes are objects, not keys: a runtime storage key may be reused after its storage dies, and a
# node stays reachable from the nodes that point through it.
"""

from __future__ import annotations

from collections.abc import Iterable


class Node:
    """A union-find node of one evicted storage; ``value`` is meaningful at a root only."""

    __slots__ = ("parent", "value")

    def __init__(self, value: float):
        self.parent = self
        self.value = value

    def root(self) -> Node:
        r = self
        while r.parent is not r:
            r = r.parent
        x = self
        while x.parent is not r:  # path compression
            x.parent, x = r, x.parent
        return r


def union(a: Node, b: Node) -> None:
    """Merge ``b``'s set into ``a``'s (``a``'s root stays the root); values add."""
    ra, rb = a.root(), b.root()
    if ra is not rb:
        rb.parent = ra
        ra.value += rb.value
        rb.value = 0.0


def neighbourhood(nodes: Iterable[Node | None]) -> float:
    """e*: the values of the distinct sets of ``nodes`` (None: a neighbour not evicted)."""
    roots = set()
    total = 0.0
    for n in nodes:
        if n is not None:
            r = n.root()
            if r not in roots:
                roots.add(r)
                total += r.value
    return total


def score(cost: float, nbytes: int, staleness: float) -> float:
    """h = cost / (bytes * staleness), each of the two at least 1 (Note [DTR's score])."""
    return cost / (max(1, nbytes) * max(1, staleness))
