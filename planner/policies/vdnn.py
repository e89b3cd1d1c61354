"""The ``vdnn`` policy: vDNN's static offload and prefetch (Rhu et al., MICRO'16).

vDNN offloads the feature maps that are inputs of convolution layers to host memory during the
forward pass and brings them back during backward, prefetching one layer ahead; each layer's
backward waits until its own transfer is done. capuchin.md §5; the paper measured 41.3% loss on
Vgg16 and up to 74.4% on ResNet-152 against no swapping.

# Note: [vDNN as a plan]
# Layers are the forward convolutions, in program order; layer i's input ``x_i`` (a saved
# activation, Note [Saved activations]) is swapped out after its last forward access and restored
# at its first backward access ``b_i``. The prefetch of ``x_i`` is issued when backward reaches
# the layer after it: at ``b_{i+1}``, the back-access of the next convolution's input (for the
# last layer: at the first backward op); RESTORE at ``b_i`` makes the layer wait for its copy.
# One thing vDNN does that a plan cannot say: in forward, vDNN also waits for each offload to
# finish before the next layer, whereas the simulator decouples swap-out from compute (paper
# §5.3), so this vDNN's overhead is a lower bound of the original's.
"""

from __future__ import annotations

from ..plan import Decision, Method
from ..problem import Problem
from ..registry import PolicyResult, register
from ._saved import first_backward_op, is_conv, saved_activations


@register("vdnn")
def vdnn(problem: Problem, budget_bytes: int) -> PolicyResult:
    """Offload the inputs of convolutions in forward, prefetch one layer ahead in backward.

    Contract (Note [Policy contract] in planner/registry.py): swap decisions only, one per
    convolution input that is a saved activation, in-trigger as in Note [vDNN as a plan].
    Nothing is evicted when the baseline peak fits; otherwise the budget is not consulted (vDNN
    is static), so the plan may be infeasible. A trace without convolutions gets no decisions.
    """
    if problem.peak_bytes <= budget_bytes:
        return PolicyResult()
    saved = {a.storage_id: a for a in saved_activations(problem)}
    layers = []  # the saved inputs of forward convolutions, in layer order, each once
    seen: set[str] = set()
    for op in problem.ops:
        if not is_conv(op.name):
            continue
        for s in op.inputs:
            if s in saved and s not in seen:
                seen.add(s)
                layers.append(saved[s])
    first_bwd = first_backward_op(problem)
    out = []
    for i, a in enumerate(layers):
        if i + 1 < len(layers):
            trigger = layers[i + 1].back_op
        else:
            trigger = first_bwd if first_bwd is not None else a.back_op
        if not a.evict_op < trigger <= a.back_op:
            trigger = None  # the next layer is not earlier in backward: fetch on demand
        out.append(
            Decision(
                a.storage_id, Method.SWAP, a.size_bytes, a.evict_op, a.back_op, trigger_op=trigger
            )
        )
    return PolicyResult.of(out)
