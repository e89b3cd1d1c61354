"""What running a plan costs beyond the device's own work: the runtime's per-op bookkeeping and,
on CPU, the copies. The constants live here, each with where it was measured; ``build_plan``
adds ``runtime_cost_ns`` to the simulated iteration for the plan's predicted time
(``Predictions.runtime_cost_ns``). No torch.

# Note: [Runtime cost model]
# The simulator (simulator.py) replays the plan on the device's streams: compute, one copy
# channel per direction. What it does not see is what the runtime pays on the host to carry the
# plan out (runtime/tracker.py, Note [Hot path]):
# - an empty plan installs nothing (Note [Empty plan] in runtime/engine.py): cost 0;
# - otherwise every op passes through the dispatch mode (``hot_op_ns``);
# - ops inside an eviction window (between a decision's evicted-access and back-access) take the
#   guarded hot path (``guarded_op_ns`` more: one storage-key lookup per tensor argument);
# - ops with an action (evict, prefetch, back-access, recorded for a replay, a planned swap-out
#   wait) and in-place ops inside a window take the slow path (``slow_op_ns`` more);
# - each swap pays its host-side bookkeeping twice (out and in, ``swap_action_ns``), and each
#   replayed op the replay machinery (``replay_op_ns``);
# - on CPU there is no copy engine: the copy threads share the cores with compute, so a swap's
#   copies (both directions, at the trace's measured bandwidth or the runtime's measured copy
#   cost per byte, whichever is slower) are added to the compute time
#   (``copies_share_compute``); on CUDA the copy engines are separate and the simulator's copy
#   channels already model them.
# The policies do not see this cost: they compare the simulator's streams (``SimResult``), and a
# larger budget never costs them more there; ``build_plan`` adds it to the plan's prediction.
# Sources: ``python benchmarks/runtime.py`` prints the per-op figures (its "per-op cost" lines:
# a 16-float ``aten.add`` without a mode, through a passthrough mode, on the runtime's hot path and
# on its slow path; a swap cycle through the CPU backend) and the table whose "measured /
# predicted" column checks this model; the figures below are from its run recorded in
# docs/runtime.md (CPU, 1 intra-op thread, a quiet 2-core host: load average below 1). Under
# load the host-side costs grow with it (about 3x at load 10), and so do the op times a trace
# records: trace and run on a quiet machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .plan import Decision, Method
from .problem import Problem


@dataclass(frozen=True)
class RuntimeCosts:
    """Host-side costs of the runtime on one kind of device (ns)."""

    hot_op_ns: int  # every op, through the dispatch mode (passthrough mode minus no mode)
    guarded_op_ns: int  # more, per op inside an eviction window (the evicted-input check)
    slow_op_ns: int  # more, per op on the slow path (slow path minus hot path)
    swap_action_ns: int  # per swap-out and per swap-in: copy-thread handoff, views, bookkeeping
    replay_op_ns: int  # per replayed op: argument views, version checks
    copies_share_compute: bool  # no separate copy engine (CPU)
    copy_ns_per_byte: float = 0.0  # the runtime's own copy path, when slower than the trace's
    #                                measured bandwidth (fresh pages after a resize, thread handoff)


# hot/guarded/slow: the per-op lines of benchmarks/runtime.py (5.3 - 2.0 µs passthrough minus no
# mode, +0.04 µs hot path, +39.6 µs slow path, rounded; guarded: the argument check, 1.1 µs at
# load 10, scaled by the 3x the other figures fell from there);
# swap_action_ns and copy_ns_per_byte: its "swap cycle" lines (a swap-out and swap-in through the
# CPU backend: 64 KiB cost 89 µs per direction, 2-8 MiB 0.05-0.07 ns per byte); replay_op_ns: the
# slow path's cost again (a replay re-enters the same bookkeeping).
CPU = RuntimeCosts(
    hot_op_ns=3_400,
    guarded_op_ns=400,
    slow_op_ns=40_000,
    swap_action_ns=90_000,
    replay_op_ns=40_000,
    copies_share_compute=True,
    copy_ns_per_byte=0.06,
)
# not measured (no GPU here): the host-side costs are those of CPU; the copies run on the copy
# engines, which the simulator's channels model.
CUDA = RuntimeCosts(
    hot_op_ns=3_400,
    guarded_op_ns=400,
    slow_op_ns=40_000,
    swap_action_ns=90_000,
    replay_op_ns=40_000,
    copies_share_compute=False,
)


def costs_for(device: str) -> RuntimeCosts:
    return CUDA if str(device).startswith("cuda") else CPU


def runtime_cost_ns(
    problem: Problem, decisions: Sequence[Decision], costs: RuntimeCosts | None = None
) -> int:
    """What the runtime adds to the simulated iteration time for ``decisions`` on ``problem``'s
    device (Note [Runtime cost model])."""
    if not decisions:
        return 0
    c = costs if costs is not None else costs_for(problem.device)
    n = problem.n_ops
    action = set()
    edges = [0] * (n + 1)  # +1 where a decision's window opens, -1 after it closes
    swaps = 0
    replays = 0
    copy_ns = 0.0
    for d in decisions:
        action.update((d.evict_op, d.back_op))
        if d.method == Method.SWAP:
            swaps += 1
            if d.trigger_op is not None:
                action.add(d.trigger_op)
            if d.out_done_op is not None:
                action.add(d.out_done_op)
            for bw in (problem.bandwidth_d2h_bytes_per_s, problem.bandwidth_h2d_bytes_per_s):
                copy_ns += d.size_bytes * max(1e9 / bw, c.copy_ns_per_byte)
        else:
            action.update(d.replay_ops)
            replays += len(d.replay_ops)
        lo, hi = (d.evict_op, d.back_op) if d.evict_op <= d.back_op else (0, n - 1)
        lo, hi = max(0, lo), min(n, hi + 1)
        if lo < hi:
            edges[lo] += 1
            edges[hi] -= 1
    in_window = (np.cumsum(edges[:n]) > 0).tolist()  # linear in ops + decisions
    guarded = slow = 0
    for k, op in enumerate(problem.ops):
        if k in action or (in_window[k] and op.writes):
            slow += 1
        elif in_window[k]:
            guarded += 1
    total = (
        n * c.hot_op_ns
        + guarded * c.guarded_op_ns
        + slow * c.slow_op_ns
        + 2 * swaps * c.swap_action_ns
        + replays * c.replay_op_ns
    )
    if c.copies_share_compute:
        total += copy_ns
    return int(total)
