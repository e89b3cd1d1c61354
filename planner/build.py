"""From a policy's decisions to a complete, executable ``Plan``: the one place plans are made.

``build_plan`` fills in recompute lineage (lineage.resolve_recompute), runs the simulator (which
checks the plan), writes the simulated stall/recompute time into each decision, derives the
per-op action table (Note [Action timing] in plan.py), and records provenance and predictions.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .. import __version__
from ..errors import PlanError
from .budget import format_bytes
from .collector import gc_paused
from .costs import CPU, calibrated, cuda_calibrated, on_cuda, runtime_cost_ns
from .dead import candidates as dead_candidates
from .dead import choose as choose_dead
from .dead import freed_early
from .lineage import resolve_recompute
from .plan import Action, Decision, Method, Plan, Predictions, Provenance, Step, new_decision
from .problem import Problem
from .registry import PolicyResult, checked, get_policy
from .simulator import SimResult, simulate

# what each measured host cost is charged for, in a plan's notes (Note [Calibrated host costs])
_HOST_COST_LABELS = {
    "hot_op_ns": "an op",
    "guarded_op_ns": "more an op while a storage is out",
    "slow_op_ns": "more an op on the slow path",
    "swap_action_ns": "a swap and direction",
    "replay_op_ns": "a replayed op",
    "drop_action_ns": "a recompute decision's drop",
}

_STEP_ORDER = {
    Step.PREFETCH: 0,
    Step.RESTORE: 1,
    Step.RECOMPUTE: 2,
    Step.EVICT_SWAP: 3,
    Step.EVICT_DROP: 4,
}


def complete_decisions(problem: Problem, decisions: Sequence[Decision]) -> list[Decision]:
    """Decisions with ``size_bytes`` (when 0) and recompute lineage filled in, sorted by
    (evict_op, storage_id): the order they are simulated and executed in, so lineage is resolved
    in that order too (see ``lineage.resolve_recompute``)."""
    out = []
    for d in decisions:
        if d.size_bytes == 0 and d.storage_id in problem.storages:
            d = replace(d, size_bytes=problem.storages[d.storage_id].size_bytes)
        out.append(d)
    out.sort(key=lambda d: (d.evict_op, d.storage_id))
    return resolve_recompute(problem, out)


def action_table(decisions: Sequence[Decision]) -> list[Action]:
    """The runtime's per-op actions, sorted by op index then step (prefetches first, evictions
    last; see Note [Action timing])."""
    acts = []
    for d in decisions:
        if d.method == Method.SWAP:
            acts.append(Action(d.evict_op, Step.EVICT_SWAP, d.storage_id))
            if d.dead:  # Note [Dead storages]: never brought back by the plan
                continue
            if d.trigger_op is not None and (
                d.trigger_op < d.back_op or (d.wraps and d.trigger_op != d.back_op)
            ):  # wraps: Decision.wraps
                acts.append(Action(d.trigger_op, Step.PREFETCH, d.storage_id))
            acts.append(Action(d.back_op, Step.RESTORE, d.storage_id))
        else:
            acts.append(Action(d.evict_op, Step.EVICT_DROP, d.storage_id))
            acts.append(Action(d.back_op, Step.RECOMPUTE, d.storage_id))
    return sorted(acts, key=lambda a: (a.op_index, _STEP_ORDER[a.step]))


@gc_paused  # collector.py Note [Garbage collection while planning]
def build_plan(
    problem: Problem,
    decisions: Sequence[Decision],
    *,
    policy: str,
    budget_bytes: int,
    parameters: dict[str, Any] | None = None,
    solve_time_s: float = 0.0,
    notes: Sequence[str] = (),
) -> tuple[Plan, SimResult]:
    """A complete ``Plan`` from ``decisions`` and the simulation that predicts it.

    Raises ``PlanError`` (from the simulator) when the decisions break an invariant.
    ``predictions.feasible`` says whether the simulated peak is within ``budget_bytes``.
    """
    ds = complete_decisions(problem, decisions)
    sim = simulate(problem, ds)
    ds = [
        replace(
            d,
            predicted_stall_ns=o.stall_ns,
            predicted_recompute_ns=o.recompute_ns,
            out_done_op=_out_done_op(sim, d, o),
        )
        for d, o in zip(ds, sim.outcomes, strict=True)
    ]
    feasible = sim.peak_bytes <= budget_bytes
    notes = list(notes)
    if not ds and problem.peak_bytes <= budget_bytes:
        notes.append("the baseline peak fits the budget: nothing to evict")
    basis = baseline_note(problem)
    if basis:
        notes.append(basis)
    if ds and on_cuda(problem.device):
        notes.append(cuda_host_note(problem))
    measured = calibrated(problem.host_costs) if ds and problem.device == "cpu" else None
    if measured is not None:  # Note [Calibrated host costs] in costs.py
        shown = [
            f"{getattr(measured, k) / 1e3:.1f} us {label} ({getattr(CPU, k) / 1e3:.1f})"
            for k, label in _HOST_COST_LABELS.items()
            if getattr(measured, k) != getattr(CPU, k)
        ]
        notes.append(
            "the runtime's host costs charged as measured in the script when it was traced "
            "(the quiet host's constants in brackets): " + ", ".join(shown)
        )
    prov = Provenance(
        policy=policy,
        parameters=_jsonable(parameters or {}),
        budget_bytes=int(budget_bytes),
        trace_path=problem.trace_path,
        trace_fingerprint=problem.fingerprint(),
        iteration=problem.iteration,
        device=problem.device,
        bandwidth_d2h_bytes_per_s=problem.bandwidth_d2h_bytes_per_s,
        bandwidth_h2d_bytes_per_s=problem.bandwidth_h2d_bytes_per_s,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        solve_time_s=round(float(solve_time_s), 4),
        capuchin_version=__version__,
        device_non_tensor_bytes=int(getattr(problem, "non_tensor_bytes", 0) or 0),
    )
    cost = runtime_cost_ns(problem, ds)  # Note [Runtime cost model] in costs.py
    pred = Predictions(
        baseline_peak_bytes=problem.peak_bytes,
        baseline_time_ns=problem.time_ns,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_time_ns=sim.time_ns + cost,
        feasible=feasible,
        notes=notes,
        runtime_cost_ns=cost,
        time_basis=problem.time_basis,
        plain_time_ns=problem.plain_time_ns,
        duration_scale=round(float(problem.duration_scale), 6),
    )
    plan = Plan(
        provenance=prov,
        predictions=pred,
        decisions=ds,
        ops=problem.op_signatures(),
        actions=action_table(ds),
        op_scratch_bytes=[int(o.scratch_bytes) for o in problem.ops],
        op_peak_bytes=[int(b) for b in sim.op_peak_bytes],
    )
    return plan, sim


def cuda_host_note(problem: Problem) -> str:
    """What a CUDA plan charges of the runtime's host work (Note [Host work on CUDA] in
    costs.py): the per-op figures the trace's probe measured in the script's steps, never a
    swap's own calls; without them nothing, as if the device's kernels hid it, which fails where
    the trace shows the script host-bound (its kernels a small part of its plain step)."""
    measured = cuda_calibrated(problem.host_costs)
    if measured is not None:
        shown = ", ".join(
            f"{getattr(measured, k) / 1e3:.1f} us {label}"
            for k, label in _HOST_COST_LABELS.items()
            if getattr(measured, k)
        )
        return (
            "the runtime's host work charged as the script's steps measured it on the device "
            f"(what the kernels did not hide): {shown}; a swap's own host calls are not charged "
            "on CUDA (docs/runtime.md, On CUDA)"
        )
    line = (
        "on CUDA the runtime's host work (its per-op bookkeeping, each swap's calls) is charged "
        "nothing, as if the device's kernels hid it"
    )
    plain = problem.plain_time_ns
    if plain:
        busy = problem.time_ns / plain
        line += (
            f"; this script's kernels take {busy:.0%} of its plain step "
            f"({problem.time_ns / 1e6:.3f} of {plain / 1e6:.3f} ms)"
        )
        if busy < 0.5:
            line += ": it is host-bound there, and that host work adds to its steps"
    else:
        line += "; a script whose steps are host-bound (short kernels) runs slower than this"
    return line + " (docs/runtime.md, On CUDA)"


def baseline_note(problem: Problem) -> str:
    """One line on what the plan's overhead is relative to (Note [Plain baseline] in
    problem.py); empty when the trace has no plain step (the printed overhead line says so)."""
    basis = problem.time_basis
    if basis == "plain-scaled":
        return (
            f"op times scaled by {problem.duration_scale:.3f} so that the iteration takes the "
            f"plain step ({problem.plain_time_ns / 1e6:.3f} ms, timed without tracer or "
            "profiler); one factor for every op, as if the profiler inflated each alike"
        )
    if basis == "plain":
        return (
            f"overhead against the plain step ({problem.plain_time_ns / 1e6:.3f} ms, timed "
            "without tracer or profiler); op times as traced"
        )
    return ""


DEAD_ROUNDS = 3  # dead.py Note [Dead storages]: plans made at most, one more per round
# the policies planned with dead decisions; the others are comparison baselines that plan as
# published (swap- and recompute-only, checkpointing, DTR, vDNN) or their own model (the ILP)
DEAD_POLICIES = ("capuchin", "capuchin-ls")


def plans_dead(policy) -> bool:
    """Whether ``policy`` (a registered name or its function) is planned with dead decisions."""
    if isinstance(policy, str):
        return policy in DEAD_POLICIES
    return any(policy is get_policy(name) for name in DEAD_POLICIES)


def with_dead(
    problem: Problem, budget_bytes: int, call: Callable[[Problem], PolicyResult]
) -> PolicyResult:
    """``call(problem)``, a policy's result, with the dead decisions ``budget_bytes`` needs
    (dead.py Note [Dead storages]): the policy plans on the problem with those storages freed at
    their last access, its recompute lineage resolved there, and the dead decisions join its
    own. While the simulated plan is over the budget, the dead gaps overlapping the ops over it
    join and the policy plans again (at most ``DEAD_ROUNDS`` plans in all)."""
    cands = dead_candidates(problem)
    if not cands:
        return call(problem)
    dead = choose_dead(problem, budget_bytes)
    result = None
    for _ in range(DEAD_ROUNDS):
        early = freed_early(problem, dead) if dead else problem
        result = call(early)
        ds = complete_decisions(early, result.decisions)
        if dead:
            note = (
                f"{len(dead)} storages ({format_bytes(sum(d.size_bytes for d in dead))}) "
                "swapped out after their last access, where the script still holds them "
                "(dead decisions)"
            )
            result = replace(result, decisions=(*ds, *dead), notes=(*result.notes, note))
        try:
            sim = simulate(problem, complete_decisions(problem, result.decisions))
        except PlanError:
            break  # build_plan reports it
        if sim.peak_bytes <= budget_bytes:
            break
        over = sim.op_peak_bytes > budget_bytes
        have = {d.storage_id for d in dead}
        more = [
            new_decision(sid, Method.SWAP, size, last, free, dead=True)
            for sid, last, free, size in cands
            if sid not in have and over[last + 1 : free + 1].any()
        ]
        if not more:
            break
        dead = sorted([*dead, *more], key=lambda d: d.storage_id)
    return result


def run_policy(
    problem: Problem,
    policy: str,
    budget_bytes: int,
    params: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> tuple[Plan, SimResult, PolicyResult]:
    """The registered ``policy`` called with ``params`` (timed) and the plan built from its
    result: ``params`` and the policy's figures in the provenance (``policy_parameters``), its
    notes after ``notes``. A budget at or above the baseline peak calls no policy: the empty
    plan. Raises what ``build_plan`` raises. One helper for ``api.make_plan`` and
    ``compare.evaluate``."""
    params = dict(params or {})
    result = PolicyResult()
    t0 = time.perf_counter()
    if budget_bytes < problem.peak_bytes:
        fn = get_policy(policy)

        def call(p: Problem) -> PolicyResult:
            return checked(policy, fn(p, budget_bytes, **params))

        result = with_dead(problem, budget_bytes, call) if plans_dead(policy) else call(problem)
    plan, sim = build_plan(
        problem,
        result.decisions,
        policy=policy,
        budget_bytes=budget_bytes,
        parameters=policy_parameters(params, result),
        solve_time_s=time.perf_counter() - t0,
        notes=[*notes, *result.notes],
    )
    return plan, sim, result


def _out_done_op(sim: SimResult, d: Decision, o) -> int | None:
    """The first op starting once the simulated swap-out of ``d`` is complete (None: it completes
    after the back-access's start or the iteration's end, or ``d`` is no swap)."""
    if d.method != Method.SWAP or o.out_end_ns < 0:
        return None
    k = int(np.searchsorted(sim.op_start_ns, o.out_end_ns, side="left"))
    if k >= len(sim.op_start_ns) or k > d.back_op or k <= d.evict_op:
        return None
    return k


def policy_parameters(requested: dict[str, Any] | None, result: PolicyResult) -> dict[str, Any]:
    """What a plan's ``provenance.parameters`` records: the options the policy was called with
    (``requested``) and, over them, the figures the policy reported about its own run
    (``PolicyResult.figures``, e.g. the ``ilp`` policy's ``status``, ``optimality_gap``,
    ``solve_time_s``, ``stages``). One helper for ``api.make_plan`` and ``compare.evaluate``."""
    return {**(requested or {}), **result.figures}


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None  # JSON has no inf/nan: "not known"
        out[k] = v if isinstance(v, str | int | float | bool | type(None) | list | dict) else str(v)
    return out
