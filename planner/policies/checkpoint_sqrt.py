"""The ``checkpoint-sqrt`` policy: sublinear checkpointing (Chen et al. 2016), OpenAI's memory mode.

Chen et al. keep ~sqrt(n) checkpoints of the forward pass and recompute each segment between
two checkpoints when backward reaches it, for O(sqrt(n)) activation memory at the cost of about
one extra forward pass. OpenAI's ``gradient-checkpointing`` "memory" mode chooses the checkpoints
automatically among *articulation points* of the forward graph (tensors whose removal splits it
in two, so a segment between two of them depends on nothing else), sorted in program order, one
every ``ceil(len(points) / sqrt(n))``. capuchin.md §5.

# Note: [Forward graph for articulation points]
# Undirected, bipartite: one node per forward op, one per storage a forward op allocates
# (activations), an edge between an op and each activation it reads or produces. Parameters and
# inputs are left out: a weight read by many ops would otherwise tie distant parts together and
# hide every articulation point. An articulation point of this graph that is a storage is a
# candidate checkpoint. ``n`` is the number of forward activations.
#
# The policy ignores the budget beyond "nothing to do when the baseline peak fits": like Chen's
# scheme it is a fixed transformation of the graph. Every saved activation (Note [Saved
# activations]) that is not a checkpoint is dropped after its last forward access and recomputed
# at its first backward access; the builder resolves each replay from the nearest resident
# sources, and the intermediates it regenerates stay (collective recomputation), which is Chen's
# segment-wise recomputation.
"""

from __future__ import annotations

import math

from ...tracer.schema import Phase
from ..plan import Decision, Method
from ..problem import Problem
from ..registry import PolicyResult, register
from ._saved import recomputable, saved_activations, segment_replays


def articulation_checkpoints(problem: Problem) -> list[str]:
    """Checkpoint storages chosen OpenAI-style; see Note [Forward graph for articulation points]."""
    import networkx as nx

    ops = problem.ops
    acts = {
        sid
        for sid, s in problem.storages.items()
        if s.alloc_op is not None and ops[s.alloc_op].phase == Phase.FORWARD and not s.persistent
    }
    g = nx.Graph()
    for op in ops:
        if op.phase != Phase.FORWARD:
            continue
        g.add_node(("op", op.index))
        for s in op.accessed:
            if s in acts:
                g.add_edge(("op", op.index), ("st", s))
    n = len(acts)
    if n == 0:
        return []
    points = sorted(
        (node[1] for node in nx.articulation_points(g) if node[0] == "st"),
        key=lambda s: (problem.storages[s].alloc_op, s),
    )
    if len(points) <= math.sqrt(n):
        return points
    step = math.ceil(len(points) / math.sqrt(n))
    return points[step::step]


@register("checkpoint-sqrt")
def checkpoint_sqrt(problem: Problem, budget_bytes: int) -> PolicyResult:
    """Chen et al.'s sqrt(n) checkpointing with OpenAI's automatic checkpoint choice.

    Contract (Note [Policy contract] in planner/registry.py): recompute decisions only, one per
    saved activation that is not a checkpoint and can be recomputed, evicted after its last
    forward access and back at its first backward access, replayed segment-wise (Note
    [Segment-wise recomputation] in _saved.py). Nothing is evicted when the
    baseline peak fits the budget; otherwise the budget is not consulted (the scheme is fixed), so
    the plan may be infeasible (or cost more than needed).
    """
    if problem.peak_bytes <= budget_bytes:
        return PolicyResult()
    checkpoints = articulation_checkpoints(problem)
    keep = set(checkpoints)
    saved = saved_activations(problem)
    drop = [
        Decision(a.storage_id, Method.RECOMPUTE, a.size_bytes, a.evict_op, a.back_op)
        for a in saved
        if a.storage_id not in keep and recomputable(problem, a)
    ]
    firsts = [a.back_op for a in saved if a.storage_id in keep]
    return PolicyResult.of(segment_replays(problem, drop, firsts))
