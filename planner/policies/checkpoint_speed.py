"""The ``checkpoint-speed`` policy: OpenAI gradient-checkpointing's "speed" mode.

Keep (checkpoint) the outputs of the ops that are expensive to recompute, convolutions and
matrix multiplies, and recompute everything else (normalizations, activations, element-wise ops)
from them in backward. capuchin.md §5: "so it doesn't work for networks other than CNNs"; here it
applies to any trace whose op names show convolutions or matrix multiplies (see
``_saved.is_conv``/``is_matmul``).
"""

from __future__ import annotations

from ..plan import Decision, Method
from ..problem import Problem
from ..registry import PolicyResult, register
from ._saved import is_conv, is_matmul, recomputable, saved_activations, segment_replays


@register("checkpoint-speed")
def checkpoint_speed(problem: Problem, budget_bytes: int) -> PolicyResult:
    """Drop every saved activation (Note [Saved activations]) not produced by a convolution or a
    matrix multiply; recompute it at its first backward access.

    Contract (Note [Policy contract] in planner/registry.py): recompute decisions only, evicted
    after the last forward access, back at the first backward access, replayed from the kept
    conv/matmul outputs segment-wise (Note [Segment-wise recomputation] in _saved.py). Nothing is
    evicted when the baseline peak fits;
    otherwise the budget is not consulted (a fixed scheme), so the plan may be infeasible.
    """
    if problem.peak_bytes <= budget_bytes:
        return PolicyResult()
    ops = problem.ops
    out, firsts = [], []
    for a in saved_activations(problem):
        name = ops[a.producer_op].name
        if is_conv(name) or is_matmul(name):
            firsts.append(a.back_op)
        elif recomputable(problem, a):
            out.append(
                Decision(a.storage_id, Method.RECOMPUTE, a.size_bytes, a.evict_op, a.back_op)
            )
    return PolicyResult.of(segment_replays(problem, out, firsts))
