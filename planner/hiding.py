"""Hidden swaps: a plan's replays and stalled swaps made swaps that the simulation hides. No torch.

``hide(problem, decisions, sim, bound)`` reads one simulated plan and returns it with
recomputations switched to swaps, and stalled swaps given earlier in-triggers, wherever the copy
channels as simulated leave room to hide the copy and the simulated memory curve leaves room for
the storage; kept only when the simulator confirms that the plan got faster with its peak at
most ``bound``. search.py offers these variants next to the grid's plans (Note [Hidden swaps, on
the grid] there).

# Note: [Hidden swaps]
# Algorithm 1 places each in-trigger against a *peak window*, the ops whose estimated memory is
# above the target when the swap is chosen (swapping.py Note [In-trigger search]). At a low
# target that window covers most of the backward pass, so a swap chosen there has no trigger
# outside it and becomes an on-demand restore, stalled. The simulated-cost switches of search.py
# estimate a replay's swap on a fitting plan with no window at all, so a prefetch can land where
# the plan has no room (such a trial is refused), and they switch one replay at a time. Once a
# plan is simulated the room is known per storage: a storage of ``size`` bytes may be back from
# op ``k`` on when every op from ``k`` to where it is back now has ``op_peak + size <= bound``,
# and a replayed storage may be swapped when the ops that run before its swap-out ends have that
# room too. So each replay, and each stalled swap, gets the latest in-trigger whose copy the
# channels as simulated hide and whose residency fits that room; they are taken greedily,
# largest saving first (recompute or stall time, less the host work a swap adds on CPU:
# ``Problem.host``), each one's copies and bytes reserved before the next is estimated, on the
# simulated op times. A replay that waited for a swapped-out source (restored on demand) makes
# that source's prefetch due when the replay starts, and adds its wait to that swap's saving. A
# replayed storage that another replay regenerates (its producer in that replay, or kept by it)
# is left alone: switching it would re-resolve the other replay, which costs as much as a plan's
# whole lineage on long chains. The switches are tried all at once; when refused, the first half
# of them, then the first quarter, and so on (``HIDE_SIMULATIONS`` trials at most per round,
# ``HIDE_ROUNDS`` rounds while one is kept: improve Note [One improvement kernel]). The result
# depends on the plan and the bound alone.
#
# Note: [Partly hidden swaps]
# A stalled swap whose copy the channels cannot hide whole still stalls less when its prefetch
# starts earlier, and the switches above leave it as it is. After them, ``advance`` moves the
# in-triggers of all stalled swaps together (a swap without one from its back-access), by each
# of ``ADVANCE_STEPS`` ops, and keeps the fastest trial the accept rule keeps; rounds repeat
# while one is kept, at most ``ADVANCE_ROUNDS``. Together, because the prefetches queue on the one
# in-channel: moving one earlier helps little while the copy ahead of it stays late (one at a
# time reached the same plans in many more simulations). Like the switches, the result depends
# on the plan and the bound alone.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter

import numpy as np

from .improve import Attempt, improve
from .lineage import reresolved
from .plan import Decision, Method, window_key
from .problem import Problem
from .simulator import SimResult
from .swapping import Channel

HIDE_ROUNDS = 3  # Note [Hidden swaps]
HIDE_SIMULATIONS = 4  # per round
ADVANCE_STEPS = (1, 2, 4, 8, 16, 32, 64)  # ops earlier tried per round (Note [Partly hidden swaps])
ADVANCE_ROUNDS = 4  # Note [Partly hidden swaps]


def hide(
    problem: Problem,
    decisions: list[Decision],
    sim: SimResult,
    bound: int,
    regen: frozenset = frozenset(),
) -> tuple[list[Decision], SimResult]:
    """Note [Hidden swaps]: ``decisions`` (simulated as ``sim``) with replays and stalled swaps
    switched to hidden swaps while the simulation confirms the plan gets faster with its peak at
    most ``bound``; the input (the same objects) when nothing does. ``regen``: the plan's
    recomputations whose replays regenerate their swapped-out sources (search.Attempt)."""

    def halved(cur: Attempt):  # the round's switches, then the first half of them, ...
        switches = _switches(problem, cur.decisions, cur.sim, bound)
        n = len(switches)
        for _ in range(HIDE_SIMULATIONS if n else 0):
            yield _switched(problem, cur.decisions, dict(switches[:n]), regen), regen
            if n == 1:
                return
            n //= 2

    # improve Note [One improvement kernel]
    got = improve(problem, Attempt(decisions, sim, regen), bound, halved, rounds=HIDE_ROUNDS)
    return advance(problem, got.decisions, got.sim, bound)


def advance(
    problem: Problem, decisions: list[Decision], sim: SimResult, bound: int
) -> tuple[list[Decision], SimResult]:
    """Note [Partly hidden swaps]: ``decisions`` (simulated as ``sim``) with the stalled swaps'
    in-triggers moved earlier while the simulation confirms the plan gets faster with its peak
    at most ``bound``; the input (the same objects) when nothing does."""

    def steps(cur: Attempt):  # every stalled swap's in-trigger moved by each step
        stalled = [
            i
            for i, (d, o) in enumerate(zip(cur.decisions, cur.sim.outcomes, strict=True))
            if d.method == Method.SWAP and not d.wraps and o.stall_ns > 0
        ]
        for step in ADVANCE_STEPS:
            trial = list(cur.decisions)
            for i in stalled:
                d = cur.decisions[i]
                now = d.back_op if d.trigger_op is None else d.trigger_op
                k = max(d.evict_op + 1, now - step)
                trial[i] = d.switched(Method.SWAP, k)
            yield trial, frozenset()

    # improve Note [One improvement kernel]: the fastest step of each round
    got = improve(problem, Attempt(decisions, sim), bound, steps, rounds=ADVANCE_ROUNDS, best=True)
    return got.decisions, got.sim


def _switched(
    problem: Problem,
    decisions: list[Decision],
    new: dict[tuple[str, int], Decision],
    regen: frozenset,
) -> list[Decision] | None:
    """``decisions`` with the switches ``new``; the replays that regenerated a switched storage
    read it as a source instead (``lineage.reresolved``; None when one has no replay left), the
    others unchanged."""
    trial = [new.get(window_key(d), d) for d in decisions]  # by window: plan.py Note [Several
    return reresolved(problem, trial, {sid for sid, _ in new}, regen)  # windows per storage]


def _switches(
    problem: Problem, decisions: list[Decision], sim: SimResult, bound: int
) -> list[tuple[tuple[str, int], Decision]]:
    """The switches to hidden swaps of one round, in the order taken (largest saving first)."""
    start = sim.op_start_ns.tolist()
    # replays that waited for a swapped-out source: that swap's prefetch is due when they start
    due: dict[str, tuple[int, int]] = {}  # source -> (earliest replay start, total wait)
    swapped = {d.storage_id: d for d in decisions if d.method == Method.SWAP and not d.wraps}
    for d, o in zip(decisions, sim.outcomes, strict=True):
        if d.method != Method.RECOMPUTE or o.stall_ns <= 0:
            continue
        begin = start[d.back_op] - o.stall_ns - o.recompute_ns
        for src in d.sources:
            x = swapped.get(src)
            if x is not None and x.evict_op < d.back_op <= x.back_op:
                t, w = due.get(src, (begin, 0))
                due[src] = (min(t, begin), w + o.stall_ns)
    cands = []  # (saving, storage, decision, outcome)
    # a storage another replay regenerates stays as it is (switching it re-resolves that one)
    regenerated = Counter(k for d in decisions for k in d.keep)
    replayed = Counter(j for d in decisions for j in d.replay_ops)
    for d, o in zip(decisions, sim.outcomes, strict=True):
        if d.wraps or not problem.storages[d.storage_id].swappable:
            continue
        if d.method == Method.RECOMPUTE:
            producer = problem.storages[d.storage_id].alloc_op
            if regenerated[d.storage_id] or replayed[producer] > (producer in d.replay_ops):
                continue
        # what the switch adds on the compute stream (Problem.host): the trigger's action, and
        # a swap's two host hand-overs where a replay and its drop were
        host = problem.host.action_op_ns + (
            2 * problem.host.swap_ns - problem.host.drop_ns if d.method == Method.RECOMPUTE else 0
        )
        saving = o.stall_ns + o.recompute_ns + due.get(d.storage_id, (0, 0))[1]
        if saving > host:
            cands.append((-saving, window_key(d), d, o))
    if not cands:
        return []
    cands.sort(key=lambda c: (c[0], c[1]))
    end = sim.op_end_ns.tolist()
    peak = sim.op_peak_bytes.astype(np.int64)
    own_in = {c[1]: (c[3].in_start_ns, c[3].in_end_ns) for c in cands if c[3].in_start_ns >= 0}
    d2h, h2d = Channel(), Channel()
    for d, o in zip(decisions, sim.outcomes, strict=True):
        if o.out_start_ns >= 0:
            d2h.reserve(o.out_start_ns, o.out_end_ns)
        if o.in_start_ns >= 0 and window_key(d) not in own_in:
            h2d.reserve(o.in_start_ns, o.in_end_ns)
    bw_out, bw_in = problem.bandwidth_d2h_bytes_per_s, problem.bandwidth_h2d_bytes_per_s
    out: list[tuple[tuple[str, int], Decision]] = []

    def switch(d: Decision, o) -> Decision | None:
        """The hidden swap of ``d`` with its copies and bytes reserved, or None."""
        size, a, b = d.size_bytes, d.evict_op, d.back_op
        if b <= a + 1:
            return None
        t_in = int(round(size / bw_in * 1e9))
        if d.method == Method.SWAP:  # a stalled swap: its swap-out stays as simulated
            out_end = o.out_end_ns
            first_in = bisect_right(end, o.in_start_ns)  # ops already with it back
            lo_out = a + 1
        else:
            t_out = int(round(size / bw_out * 1e9))
            out_start = d2h.first_fit(end[a], t_out)
            out_end = out_start + t_out
            first_in = b
            lo_out = max(a + 1, bisect_left(start, out_end))  # ops before it is out
            if lo_out > a + 1 and int(peak[a + 1 : lo_out].max()) + size > bound:
                return None
        deadline = min(start[b], due.get(d.storage_id, (start[b], 0))[0])
        if h2d.latest_fit(out_end, deadline, t_in) is None:  # no room on the channel at all
            return None
        # the earliest op from which every op up to first_in has room for the storage
        over = np.flatnonzero(peak[lo_out:first_in] + size > bound)
        k0 = lo_out + (int(over[-1]) + 1 if len(over) else 0)
        if k0 >= b:
            return None
        slot = h2d.latest_fit(max(out_end, start[k0]), deadline, t_in)
        if slot is None:
            return None
        k = max(k0, bisect_right(start, slot) - 1)
        in_start = h2d.first_fit(max(start[k], out_end), t_in)
        if k >= b or in_start + t_in > deadline or k == d.trigger_op:
            return None
        if d.method == Method.RECOMPUTE:
            d2h.reserve(out_start, out_end)
            if lo_out > a + 1:
                peak[a + 1 : lo_out] += size
        h2d.reserve(in_start, in_start + t_in)
        k_in = bisect_right(end, in_start)
        if k_in < first_in:
            peak[k_in:first_in] += size
        return Decision(d.storage_id, Method.SWAP, size, a, b, trigger_op=k)

    for _, w, d, o in cands:
        new = switch(d, o)
        if new is not None:
            out.append((w, new))
        elif w in own_in:  # a stalled swap left as it is keeps its copy
            h2d.reserve(*own_in[w])
    return out
