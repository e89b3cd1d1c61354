"""What the static baselines (checkpointing, vDNN) share: the activations saved for backward.

Not a policy (the registry skips modules starting with ``_``).

# Note: [Saved activations]
# Gradient checkpointing and vDNN act on the tensors the forward pass produces and the backward
# pass reads again. Here that is a storage the problem marks evictable, allocated by a forward
# op, with an access gap ``(e, b)`` where ``e`` is its last forward access and ``b`` its first
# backward access: the one gap a static policy evicts it in. A trace without a backward phase
# (a DTR log with no BACKWARD marker) has no saved activations, so these policies plan nothing.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, replace

from ...tracer.schema import Phase
from ..lineage import MAX_REPLAY_OPS, EvictionWindows, keepable, replay_for
from ..plan import Decision, Method
from ..problem import Problem

# Convolutions and matrix multiplies: OpenAI's "speed mode" keeps their outputs, vDNN offloads
# the inputs of convolutions. Names are aten ("aten.mm.default") or DTR logs' ("cudnn_convolution").
_CONV = re.compile(r"conv", re.IGNORECASE)
_MATMUL = re.compile(
    r"(?:^|[._])(?:mm|addmm|bmm|baddbmm|addbmm|matmul|linear|einsum|"
    r"_?scaled_dot_product\w*)(?:[._]|$)",
    re.IGNORECASE,
)
_BACKWARD_NAME = re.compile(r"backward", re.IGNORECASE)


def is_conv(op_name: str) -> bool:
    """A forward convolution (not its backward)."""
    return bool(_CONV.search(op_name)) and not _BACKWARD_NAME.search(op_name)


def is_matmul(op_name: str) -> bool:
    """A forward matrix multiply (mm, addmm, bmm, matmul, linear, einsum, attention)."""
    return bool(_MATMUL.search(op_name)) and not _BACKWARD_NAME.search(op_name)


@dataclass(frozen=True)
class Saved:
    """A saved activation: ``storage_id`` leaves after op ``evict_op`` (its last forward access)
    and is needed again at op ``back_op`` (its first backward access)."""

    storage_id: str
    size_bytes: int
    producer_op: int
    evict_op: int
    back_op: int


def saved_activations(problem: Problem) -> list[Saved]:
    """The saved activations of ``problem``, by producer op; see Note [Saved activations]."""
    ops = problem.ops
    out = []
    for sid, s in problem.storages.items():
        if not s.evictable or s.alloc_op is None or ops[s.alloc_op].phase != Phase.FORWARD:
            continue
        fwd = [k for k in s.accesses if ops[k].phase == Phase.FORWARD]
        if not fwd:
            continue
        back = s.next_access(fwd[-1])
        if back is None or ops[back].phase != Phase.BACKWARD or back - fwd[-1] < 2:
            continue
        out.append(Saved(sid, s.size_bytes, s.alloc_op, fwd[-1], back))
    return sorted(out, key=lambda x: (x.producer_op, x.storage_id))


def first_backward_op(problem: Problem) -> int | None:
    """Index of the first backward op, or None."""
    return next((o.index for o in problem.ops if o.phase == Phase.BACKWARD), None)


def recomputable(problem: Problem, saved: Saved) -> bool:
    """The storage can be regenerated for its back-access at all (its sources stay alive and
    unmodified, or can themselves be regenerated); see planner/lineage.py."""
    return (
        replay_for(problem, saved.storage_id, saved.evict_op, saved.back_op, max_ops=MAX_REPLAY_OPS)
        is not None
    )


def segment_replays(
    problem: Problem, decisions: list[Decision], boundaries: list[int]
) -> list[Decision]:
    """Recompute decisions with their replay filled in, keeping regenerated intermediates only
    within the backward *segment* of the decision.

    # Note: [Segment-wise recomputation]
    # Checkpointing recomputes one segment (the ops between two checkpoints) when backward
    # reaches it, and keeps what it regenerated until that segment's backward is done. Left to
    # itself, the builder keeps every dropped storage a replay regenerates (collective
    # recomputation); when a chain runs past the checkpoints (a residual stream in speed mode)
    # that would bring back, at the first backward op, activations needed only at the very end.
    # So: ``boundaries`` are the first backward accesses of the checkpoints; a regenerated
    # storage is kept only when its own back-access falls before the next boundary after this
    # decision's back-access; otherwise it is freed after the replay and recomputed again later.
    """
    res = EvictionWindows(decisions)
    bounds = sorted(set(boundaries))
    backs: dict[str, list[int]] = {}
    for x in decisions:
        backs.setdefault(x.storage_id, []).append(x.back_op)
    out = []
    for d in decisions:
        if d.method != Method.RECOMPUTE or d.replay_ops:
            out.append(d)
            continue
        r = replay_for(problem, d.storage_id, d.evict_op, d.back_op, res)
        if r is None:  # left for the builder to report
            out.append(d)
            continue
        ops, srcs = r
        i = bisect_right(bounds, d.back_op)
        limit = bounds[i] if i < len(bounds) else problem.n_ops
        keep = [
            x
            for x in keepable(problem, d, ops, res)
            if any(d.back_op <= b < limit for b in backs.get(x, ()))
        ]
        out.append(replace(d, replay_ops=tuple(ops), sources=tuple(srcs), keep=tuple(keep)))
    return out
