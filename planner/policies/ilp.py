"""The ``ilp`` policy: Checkmate's MILP, extended with swapping, solved by OR-Tools CP-SAT.

The formulation and its simulate-and-cut solve are in ``_ilp_model.py`` (read its docstring
and Note [Where the ILP and the simulator differ] first); this module finds the candidates,
sizes the model to the time limit, warm-starts it and turns the solution into decisions.

Sizes measured on a shared 2-core CPU: the bundled cnn (216 ops, ~70 candidates, ~18,000
variables) and mlp (256 ops, ~4,000-6,000 variables) are planned op by op; the transformer (627
ops) is cut to 256 stages (~27,000-37,000 variables). A first solve takes 0.3-4 s; proofs beyond
the first round usually need the time limit (gaps in the README). On the DTR traces (1,250-7,900
ops, 850-4,300 candidates) the whole model has up to millions of variables: the policy builds
only what its time limit allows (Note [Sizing the model to the time limit]).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ...errors import CapuchinError
from ..coarsen import Stages, coarsen
from ..lineage import chain_ops
from ..plan import Decision, Method
from ..problem import Problem
from ..registry import PolicyResult, checked, register
from ._ilp_model import (  # noqa: F401 - re-exported: the model's names are this policy's API
    Candidate,
    Choice,
    IlpResult,
    Key,
    _Model,
    _OutOfTime,
    _signature,
    copy_ns,
    solve,
    trigger_op,
    window,
)


def candidates(
    problem: Problem, budget_bytes: int, *, swap: bool = True, recompute: bool = True
) -> list[Candidate]:
    """Every access gap of an evictable storage that covers an op over the budget, and with
    ``swap`` those of persistent storages (``Problem.swap_gaps``: their wrap-around gaps
    included, Note [Wrap-around gaps in the model]; swap only)."""
    live = problem.live_bytes
    over = [int(k) for k in range(problem.n_ops) if live[k] > budget_bytes]
    if not over:
        return []
    import bisect

    out = []
    for s in problem.storages.values():
        if s.size_bytes <= 0 or not (s.evictable or swap):
            continue
        for e, b, wraps in problem.swap_gaps(s):
            i = bisect.bisect_right(over, e)
            if wraps:
                if i >= len(over) and over[0] >= b:
                    continue  # no op over the budget after e nor before b
            elif i >= len(over) or over[i] >= b:
                continue  # no op over the budget inside the gap
            chain = chain_ops(problem, s.storage_id, e) if recompute and s.evictable else None
            if chain is None and not swap:
                continue
            out.append(
                Candidate(
                    s.storage_id,
                    s.size_bytes,
                    e,
                    b,
                    tuple(chain) if chain is not None else None,
                    copy_ns(s.size_bytes, problem.bandwidth_d2h_bytes_per_s) if swap else -1,
                    copy_ns(s.size_bytes, problem.bandwidth_h2d_bytes_per_s) if swap else -1,
                    wraps=wraps,
                )
            )
    return out


# -- sizing the model to the time limit -----------------------------------------------------------
# Note: [Sizing the model to the time limit]
# Building the model costs Python time proportional to its size (CP-SAT calls per variable and
# constraint), and its size grows with the candidates' recompute closures (Checkmate's R over the
# upstream of every dropped storage) and the swaps' copy schedules (a window of stages each). On
# the DTR traces (850-4,300 candidates) the full model has up to millions of variables (InceptionV4
# at 60%: 765,000 variables, 1.36 million constraints, 83 s to build before this note, 15 s now),
# whatever the time limit. So the policy (1) runs the warm start in a forked child for at most
# WARM_START_SHARE of the time left (``_bounded``; capuchin, then DTR's greedy: the hybrid takes
# minutes on a cold start), and returns its plan at once when it costs nothing; (2) ranks the
# candidates (``_ranked``: the warm start's first, then by bytes freed over the budget per ns of
# their cheaper method) and admits the longest prefix whose *estimated* size (``_admitted``: a dry
# run of the closure with every candidate as a possible dropper, so an overestimate) can be built
# in BUILD_SHARE of the time left at UNITS_PER_S; (3) builds it under that deadline: a build that
# runs past it is abandoned (``_OutOfTime``) and a quarter of the prefix tried; (4) returns the
# best simulated plan, at worst the warm start's. A model restricted to a prefix proves nothing
# about the candidates it left out: its status is never OPTIMAL (unless the plan costs nothing),
# and the bound reported is 0 (its own is in the notes). Small models are unaffected (all
# candidates fit; the model is the same as without this note).
UNITS_PER_S = 60_000  # model units (~variables + constraints) built per second (measured
# 115,000-275,000 on the shared 2-core machine)
BUILD_SHARE = 0.4  # of the time left, at most this much goes to building the model
WARM_START_SHARE = 0.4  # of the time left, at most this much goes to (each) warm start
WARM_STARTS = ("capuchin", "dtr")  # tried in turn until one returns in time


def _ranked(
    problem: Problem, budget_bytes: int, cands: list[Candidate], first: Mapping[Key, Any] | None
) -> list[Candidate]:
    """``cands`` most useful first: those in ``first`` (the warm start's choices), then by bytes
    times over-budget ops covered per ns of the cheaper method's estimated cost (the recompute
    chain's duration; the copy time not hidden by the gap, so a swap fitting its gap is free)."""
    import numpy as np

    over_before = np.concatenate(([0], np.cumsum(problem.live_bytes > budget_bytes)))
    start = problem.start_ns
    dur = problem.durations_ns

    n, period = problem.n_ops, problem.time_ns

    def score(c: Candidate) -> float:
        e, b = c.evict_op, c.back_op
        begin = int(start[e + 1]) if e + 1 < n else period
        covered = int(over_before[b] - over_before[e + 1])
        gap_ns = int(start[b]) - begin
        if c.wraps:  # after e to the end, then from the start to b
            covered += int(over_before[n])
            gap_ns += period
        cost = float("inf")
        if c.chain is not None:
            cost = float(sum(int(dur[j]) for j in c.chain))
        if c.out_ns >= 0:
            cost = min(cost, float(max(0, c.out_ns + c.in_ns - gap_ns)))
        return c.size_bytes * covered / (1.0 + cost)

    return sorted(cands, key=lambda c: (not first or c.key not in first, -score(c), c.key))


def _admitted(
    problem: Problem, stages: Stages, budget_bytes: int, ranked: list[Candidate], cap_units: float
) -> int:
    """How many of ``ranked`` (a prefix) fit a model of about ``cap_units`` units: an upper
    estimate of the variables, constraints and terms ``_Model`` creates for them (its recompute
    closure is dry-run with every recomputable candidate as a possible dropper)."""
    p = problem
    gaps: dict[str, list[tuple[int, int]]] = {}
    for c in ranked:
        if c.chain is not None:
            gaps.setdefault(c.storage_id, []).append((c.evict_op, c.back_op))
    over_stage = [pk > budget_bytes for pk in stages.peak_bytes]
    seen: set[tuple[int, int]] = set()
    units = 0.0
    for i, c in enumerate(ranked):
        if c.chain is not None:
            units += 4 + 3 * len(c.chain)
            stack = [(c.back_op, j) for j in c.chain]
            while stack:
                b, j = stack.pop()
                units += 1
                if (b, j) in seen:
                    continue
                seen.add((b, j))
                units += 3
                op = p.ops[j]
                for x in op.inputs:
                    if x in op.writes:
                        continue
                    xs = p.storages[x]
                    base_ok = xs.source_at(j, b)
                    ev = base_ok and any(e < b <= bb for e, bb in gaps.get(x, ()))
                    if base_ok and not ev:
                        continue
                    chain = chain_ops(p, x, j - 1)
                    if chain is None:
                        units += 1
                        continue
                    units += 4 if ev else 0
                    stack.extend((b, jj) for jj in chain)
        if c.out_ns >= 0:
            win = window(stages, c)
            if win:
                units += 8 + 9 * (len(win) + 1) + 6 * sum(over_stage[t] for t in win)
        if units > cap_units:
            return i
    return len(ranked)


def to_decisions(
    problem: Problem,
    budget_bytes: int,
    cands: Mapping[Key, Candidate],
    choices: Mapping[Key, Choice],
) -> list[Decision]:
    """The decisions of ``choices`` (recompute lineage left to the builder, planner/build.py)."""
    out = []
    for k, ch in sorted(choices.items()):
        if ch == Choice.KEEP:
            continue
        c = cands[k]
        if ch == Choice.SWAP:
            out.append(c.decision(Method.SWAP, trigger_op=trigger_op(problem, c, budget_bytes)))
        else:
            out.append(c.decision(Method.RECOMPUTE))
    return out


def simulated_extra_ns(
    problem: Problem, budget_bytes: int, decisions: list[Decision]
) -> int | None:
    """Extra ns of ``decisions`` in the simulator (None: over budget or not executable)."""
    from ...errors import PlanError
    from ..build import complete_decisions
    from ..simulator import simulate

    try:
        sim = simulate(problem, complete_decisions(problem, decisions))
    except PlanError:
        return None
    if sim.peak_bytes > budget_bytes:
        return None
    return int(sim.time_ns - problem.time_ns)


@dataclass(frozen=True)
class IlpPolicyResult(PolicyResult):
    """The ``ilp`` policy's result, with the solve's own (``IlpResult``: choices, best, bound)."""

    solve: IlpResult | None = None


DEFAULT_MAX_STAGES = 256
DEFAULT_TICKS = 100_000  # copy schedules in 1/100000ths of the iteration (see _Model)


@register("ilp")
def ilp_policy(
    problem: Problem,
    budget_bytes: int,
    *,
    time_limit_s: float = 30.0,
    max_stages: int = DEFAULT_MAX_STAGES,
    swap: bool = True,
    recompute: bool = True,
    warm_start: bool | str = True,
    workers: int = 1,
    seed: int = 0,
    tick_ns: int | None = None,
    time_limit: float | None = None,
    **_ignored: Any,
) -> IlpPolicyResult:
    """The optimal plan of the stage model: see the module docstring for the formulation.

    ``time_limit_s`` (alias ``time_limit``): wall-clock limit of the whole solve (s, default 30).
    ``max_stages``: coarsening target (default 256; ``>= n_ops`` plans at op granularity, where
    the result is the simulator's optimum over keep/swap/recompute per access gap, if proven).
    ``swap``/``recompute``: allow each method. ``warm_start``: hint CP-SAT with the ``capuchin``
    policy's plan (or the policy named) when it is registered. ``workers``/``seed``: CP-SAT's.

    Output contract: decisions on evictable storages, at most one per access gap, evict/back
    consecutive accesses; swaps carry ``trigger_op`` (rule ``trigger_op``, or the warm start's),
    recomputes leave lineage to the builder. ``status``: OPTIMAL (no plan of the decision space
    is better in the simulator, proven at op granularity, of the stage model otherwise),
    FEASIBLE (stopped by the time limit), INFEASIBLE (no choice fits the budget) or UNKNOWN (no
    plan found in time); ``bound_ns``: the proven lower bound on the extra time; ``solve``: the
    ``IlpResult``. ``figures`` (recorded in the plan's provenance) hold ``status``,
    ``optimality_gap`` ((found - bound) / found), ``ilp_objective_ns`` (the proven lower bound
    on the extra time, ns), ``simulated_extra_ns`` (the returned plan's, ns), ``solve_time_s``,
    ``stages``, ``op_level``, ``candidates``, ``variables``, ``constraints``, ``rounds`` (Benders
    rounds) and ``notes``. When nothing fits the budget the best effort is no decisions. A
    time-limited solve returns the best simulated plan found (at worst the warm start's).
    Unknown keyword options are accepted and ignored (``compare`` passes shared ones).

    The time limit covers the whole call: the warm start (at most 40% of the time left, in a
    forked child; ``capuchin``, then ``dtr`` if it did not return in time), building the model
    (sized to the time left: Note [Sizing the model to the time limit]) and the simulate-and-cut
    loop; measured overrun on the DTR traces: under half a second (README).
    """
    if time_limit is not None:
        time_limit_s = float(time_limit)
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    cands = candidates(problem, budget_bytes, swap=swap, recompute=recompute)
    n = problem.n_ops
    notes: list[str] = []
    hint = None
    if warm_start and cands:
        # the capuchin hybrid can take minutes on a cold start (its plans are cached per
        # problem, so not after a ``compare`` has run it); DTR's greedy is a fast fallback
        hint, triggers = None, {}
        for policy in [warm_start] if isinstance(warm_start, str) else WARM_STARTS:
            left = deadline - time.perf_counter()
            hint, triggers = _warm_start(
                problem,
                budget_bytes,
                {c.key for c in cands},
                policy,
                notes,
                timeout_s=WARM_START_SHARE * left,
            )
            if hint is not None:
                break
        # the warm start's own in-triggers become those of its swaps, so that its plan is a
        # point of the decision space (and the first incumbent)
        cands = [replace(c, trigger=triggers[c.key]) if c.key in triggers else c for c in cands]
    by_key = {c.key: c for c in cands}
    seen: dict[tuple, int | None] = {}

    def evaluate(ch):
        return simulated_extra_ns(
            problem, budget_bytes, to_decisions(problem, budget_bytes, by_key, ch)
        )

    def pins(cs: list[Candidate]) -> dict[int, int]:
        pinned: dict[int, int] = {}
        for c in cs:  # the boundaries that make a gap expressible: after e, before b
            pinned[c.evict_op + 1] = max(pinned.get(c.evict_op + 1, 0), c.size_bytes)
            pinned[c.back_op] = max(pinned.get(c.back_op, 0), c.size_bytes)
        return pinned

    def stages_for(cs: list[Candidate], target: int) -> Stages:
        return coarsen(
            problem.durations_ns.tolist(),
            problem.live_bytes.tolist(),
            max_stages=min(target, max(n, 1)),
            pinned=pins(cs),
        )

    stages = stages_for(cands, max_stages)
    incumbent: tuple[dict[Key, Choice], int] | None = None
    if hint is not None:  # the warm start as a whole, whatever the model below admits
        v = seen.setdefault(_signature(hint), evaluate(hint))
        if v is not None:
            incumbent = (dict(hint), v)
    restricted = False
    res = None
    if incumbent is not None and incumbent[1] == 0:  # nothing costs less than nothing
        res = IlpResult(
            incumbent[0],
            "OPTIMAL",
            0,
            0,
            incumbent[1],
            time.perf_counter() - t0,
            0,
            0,
            0,
            ("the warm start's plan costs no extra time",),
        )
    elif cands:
        if tick_ns is None:
            tick_ns = max(1, problem.time_ns // DEFAULT_TICKS)
        ranked = _ranked(problem, budget_bytes, cands, hint)
        n_keep = len(ranked)
        while True:  # see Note [Sizing the model to the time limit]
            left = deadline - time.perf_counter()
            cap = UNITS_PER_S * BUILD_SHARE * left
            n_keep = min(n_keep, _admitted(problem, stages, budget_bytes, ranked, cap))
            restricted = n_keep < len(ranked)
            if n_keep == 0:
                notes.append(f"time limit: no model fits the {left:.1f} s left")
                break
            keep = {c.key for c in ranked[:n_keep]}
            kept = [c for c in cands if c.key in keep]  # in trace order: the model's is CP-SAT's
            if restricted:
                stages = stages_for(kept, max_stages)
            try:
                res = solve(
                    problem,
                    budget_bytes,
                    stages,
                    kept,
                    evaluate=evaluate,
                    warm_start=hint,
                    workers=workers,
                    seed=seed,
                    tick_ns=tick_ns,
                    time_limit_s=max(0.1, deadline - time.perf_counter()),
                    build_deadline=time.perf_counter() + BUILD_SHARE * left,
                    seen=seen,
                )
            except _OutOfTime:
                notes.append(f"model of {n_keep} candidates not built in time")
                n_keep //= 4
                continue
            # coarse stages are pessimistic about swaps (see Note [Where the ILP and the
            # simulator differ]): "infeasible" is only proven at op granularity
            if (
                res.status != "INFEASIBLE"
                or restricted
                or stages.is_op_level
                or time.perf_counter() - t0 > time_limit_s / 2
            ):
                break
            notes.append(f"no plan with {len(stages)} stages; refined")
            max_stages = min(4 * len(stages), n)
            stages = stages_for(cands, max_stages)
        if res is None:
            res = IlpResult({}, "UNKNOWN", None, 0, None, time.perf_counter() - t0, 0, 0, 0)
        if restricted:
            notes.append(
                f"model restricted to {n_keep} of {len(ranked)} candidates (Note "
                f"[Sizing the model to the time limit]); its own bound "
                f"{res.bound_ns} ns holds for those only"
            )
            # nothing is proven about the candidates left out; only a free plan is optimal
            status = res.status
            if res.best_ns is not None:
                status = "OPTIMAL" if res.best_ns <= 0 else "FEASIBLE"
            elif status == "INFEASIBLE":
                status = "UNKNOWN"
            res = replace(res, status=status, bound_ns=0)
        if incumbent is not None and (res.best_ns is None or incumbent[1] < res.best_ns):
            status = "OPTIMAL" if incumbent[1] <= res.bound_ns else "FEASIBLE"
            res = replace(
                res,
                choices=incumbent[0],
                best_ns=incumbent[1],
                status=status,
                bound_ns=min(res.bound_ns, incumbent[1]),
            )
            notes.append("returned the hint's own plan: the model found nothing better in time")
    else:
        res = IlpResult(
            {},
            "OPTIMAL" if problem.peak_bytes <= budget_bytes else "INFEASIBLE",
            0,
            0,
            0 if problem.peak_bytes <= budget_bytes else None,
            0.0,
            0,
            0,
            0,
        )
    figures = {
        "status": res.status,
        "optimality_gap": res.optimality_gap,
        "ilp_objective_ns": res.bound_ns,
        "simulated_extra_ns": res.best_ns,
        "solve_time_s": round(time.perf_counter() - t0, 4),
        "stages": len(stages),
        "op_level": stages.is_op_level,
        "candidates": len(cands),
        "variables": res.variables,
        "constraints": res.constraints,
        "rounds": res.rounds,
        "time_limit_s": time_limit_s,
        "notes": list(notes) + list(res.notes),
    }
    decisions = to_decisions(problem, budget_bytes, by_key, res.choices)
    return IlpPolicyResult(
        decisions, res.status, res.bound_ns, tuple(figures["notes"]), figures, solve=res
    )


def _warm_start(
    problem: Problem,
    budget_bytes: int,
    keys: set[Key],
    policy: str,
    notes: list[str],
    timeout_s: float | None = None,
) -> tuple[dict[Key, Choice] | None, dict[Key, int]]:
    """``policy``'s decisions as choices over ``keys`` and the in-triggers of its swaps; None
    when the policy is unknown, fails, or does not return within ``timeout_s`` seconds."""
    from ..registry import UnknownPolicyError, get_policy

    try:
        fn = get_policy(policy)
    except UnknownPolicyError:
        notes.append(f"no warm start: policy {policy!r} is not registered")
        return None, {}
    try:
        # the model's candidates are the problem's (persistent ones with their wrap-around gaps
        # included unless ``restricted()``): the warm start plans the same problem
        ds = _bounded(lambda: checked(policy, fn(problem, budget_bytes)), timeout_s)
    except _OutOfTime:
        notes.append(f"no warm start: policy {policy!r} took more than {timeout_s:.1f} s")
        return None, {}
    except Exception as exc:  # noqa: BLE001 - a warm start is optional
        notes.append(f"no warm start: policy {policy!r} failed ({type(exc).__name__}: {exc})")
        return None, {}
    hint: dict[Key, Choice] = {}
    triggers: dict[Key, int] = {}
    outside = 0
    for d in ds.decisions:
        k = (d.storage_id, d.evict_op)
        if k not in keys:
            outside += 1  # a gap covering no op over the budget: useless to the ILP
            continue
        hint[k] = Choice.SWAP if d.method == Method.SWAP else Choice.RECOMPUTE
        if d.method == Method.SWAP and d.trigger_op is not None:
            triggers[k] = d.trigger_op
    if outside:
        notes.append(
            f"warm start: {outside} of {policy!r}'s decisions cover no op over the "
            f"budget and were left out"
        )
    return hint, triggers


def _bounded(fn: Callable[[], Any], timeout_s: float | None) -> Any:
    """``fn()``, given at most ``timeout_s`` seconds (``_OutOfTime`` after that).

    A policy cannot be interrupted from inside, so with a timeout it runs in a forked child
    (which sees the parent's memory, e.g. the capuchin policy's cache of plans for this
    problem) and its result comes back pickled; the child is terminated when it runs late.
    Without ``fork`` (not POSIX), or in a daemonic process, ``fn`` runs here, unbounded."""
    import multiprocessing as mp

    if timeout_s is None or mp.current_process().daemon:  # a daemon may not have children
        return fn()
    try:
        ctx = mp.get_context("fork")
    except ValueError:  # pragma: no cover - platform dependent
        return fn()
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            out: tuple[str, Any] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out = ("error", f"{type(exc).__name__}: {exc}")
        send.send(out)

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(max(0.0, timeout_s)):
            raise _OutOfTime()
        kind, value = recv.recv()
    except EOFError:
        raise CapuchinError("the warm-start process ended without a result") from None
    finally:
        recv.close()
        if proc.is_alive():
            proc.terminate()
        proc.join()
    if kind == "error":
        raise CapuchinError(value)
    return value
