"""The simulator's pass (planner/simulator.py, Note [Only the ops of decisions]) against the
oracle (tests/oracle_simulator.py, the model as one loop over every op): every ``SimResult``
field equal, on every pass the capuchin policy's search simulates on the bundled traces and a
DTR trace, and on random perturbations of those plans (subsets, other in-triggers, on-demand
restores, swaps for recomputations), with and without the runtime's host costs."""

from __future__ import annotations

import random
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from capuchin.errors import PlanError
from capuchin.planner import simulator
from capuchin.planner.costs import HostCost
from capuchin.planner.plan import Decision, Method
from capuchin.planner.problem import Problem
from capuchin.planner.registry import get_policy
from capuchin.tracer.reader import load_trace

sys.path.insert(0, str(Path(__file__).parent))
from oracle_simulator import oracle_pass, simulate_oracle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "traces").glob("*.trace.parquet"))
SCALARS = (
    "peak_bytes",
    "peak_op",
    "peak_time_ns",
    "time_ns",
    "baseline_time_ns",
    "baseline_peak_bytes",
    "outcomes",
    "stall_ns",
    "recompute_ns",
    "_carry",
)


def assert_same(fast, ref, what: str = "") -> None:
    """Every field of two results equal (the arrays with their dtypes; memory and spans as
    DataFrames; the outcomes' field order too, which ``outcomes_frame`` shows)."""
    for f in SCALARS:
        assert getattr(fast, f) == getattr(ref, f), f"{what}: {f} differs"
    for a, b in zip(fast.outcomes, ref.outcomes, strict=True):
        assert list(a.__dict__) == list(b.__dict__), f"{what}: outcome fields"
    for f in ("op_peak_bytes", "op_start_ns", "op_end_ns"):
        x, y = getattr(fast, f), getattr(ref, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{what}: {f} differs"
    assert fast.memory.equals(ref.memory), f"{what}: memory differs"
    assert fast.spans.equals(ref.spans), f"{what}: spans differ"


class Checked:
    """Wraps the simulator's pass: each pass also runs the oracle with the same carry and
    compares the two. Counts the passes, the decisions and the passes with a carry."""

    def __init__(self, fields: bool = False):
        self.fast = simulator._pass
        self.passes = self.decisions = self.carried = 0
        self.fields = fields  # also memory and spans (made again by the pass, with the carry)

    def __call__(self, problem, decisions, bw_out, bw_in, carry=None, **kw):
        try:
            ref = oracle_pass(problem, decisions, bw_out, bw_in, carry)
        except PlanError as e:
            with pytest.raises(PlanError) as got:
                self.fast(problem, decisions, bw_out, bw_in, carry, **kw)
            assert str(got.value) == str(e)
            raise
        res = self.fast(problem, decisions, bw_out, bw_in, carry, **kw)
        # nothing for reports is made during a search; only for ``memory``/``spans``, later
        assert (res._memory is None) != kw.get("detail", False)
        for f in SCALARS:
            assert getattr(res, f) == getattr(ref, f), f"{f} differs"
        for f in ("op_peak_bytes", "op_start_ns", "op_end_ns"):
            x, y = getattr(res, f), getattr(ref, f)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{f} differs"
        if self.fields:
            assert_same(res, ref)
        self.passes += 1
        self.decisions += len(decisions)
        self.carried += any(v != (0, 0) for v in (carry or {}).values())
        return res


def _search_checked(monkeypatch, problem: Problem, fractions, fields=False) -> Checked:
    check = Checked(fields)
    monkeypatch.setattr(simulator, "_pass", check)
    for f in fractions:
        get_policy("capuchin")(problem, int(problem.peak_bytes * f))
    return check


def _dtr_problem(name: str) -> Problem:
    from capuchin.tracer.dtr_import import dtr_logs_path, import_dtr_log, list_dtr_logs

    z = dtr_logs_path()
    if not Path(z).is_file():
        pytest.skip(f"no DTR logs at {z}")
    (member,) = [m for m in list_dtr_logs(z) if Path(m).name.startswith(name + "-")]
    return Problem.from_trace(load_trace(import_dtr_log(f"{z}/{member}", _tmp() / f"{name}.pq")))


def _tmp() -> Path:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="simulator."))
    return d


@pytest.mark.slow
@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_every_search_pass_equals_the_reference_on_bundled_traces(monkeypatch, path):
    problem = Problem.from_trace(load_trace(path))
    assert problem.host  # CPU traces: the host costs are charged
    check = _search_checked(monkeypatch, problem, (0.8, 0.5), fields=True)
    assert check.passes > 50 and check.decisions > 500


@pytest.mark.slow
def test_every_search_pass_equals_the_reference_on_a_dtr_trace(monkeypatch):
    problem = _dtr_problem("unet")
    check = _search_checked(monkeypatch, problem, (0.6,))
    assert check.passes > 500 and check.decisions > 20_000
    # and with the host costs of a CPU run charged on the same plans' problem
    hosted = replace(
        problem,
        host=HostCost(swap_ns=30_000, replay_op_ns=5_000, action_op_ns=7_000, drop_ns=9_000),
    )
    check = _search_checked(monkeypatch, hosted, (0.6,))
    assert check.passes > 500


def _perturbed(problem: Problem, decisions: list[Decision], rng: random.Random) -> list[Decision]:
    """A random variation of a plan: a subset, other in-triggers, on-demand restores."""
    out = []
    for d in decisions:
        r = rng.random()
        if r < 0.2:
            continue
        if d.method == Method.SWAP and not d.wraps and r < 0.5:
            trig = rng.choice([None, *range(d.evict_op + 1, d.back_op + 1)])
            d = replace(d, trigger_op=trig)
        out.append(d)
    return out


@pytest.mark.slow
def test_perturbed_plans_equal_the_reference():
    from capuchin.planner.build import complete_decisions

    problem = Problem.from_trace(load_trace(ROOT / "traces" / "transformer.trace.parquet"))
    hosts = [problem.host, HostCost()]
    rng = random.Random(7)
    n = carried = 0
    # 30%: plans whose wrap-around swaps carry across the iteration boundary (the plans at the
    # higher budgets carry none)
    for f in (0.8, 0.6, 0.45, 0.3):
        base = get_policy("capuchin")(problem, int(problem.peak_bytes * f)).decisions
        # and the swap-only plan with recomputations for some of its swaps
        swaps = get_policy("swap")(problem, int(problem.peak_bytes * f)).decisions
        mixed = [
            Decision(d.storage_id, Method.RECOMPUTE, d.size_bytes, d.evict_op, d.back_op)
            if not d.wraps and problem.storages[d.storage_id].evictable and rng.random() < 0.3
            else d
            for d in swaps
        ]
        try:
            mixed = complete_decisions(problem, mixed)
        except PlanError:
            mixed = swaps
        for plan in (base, swaps, mixed):
            for _ in range(12):
                ds = _perturbed(problem, plan, rng)
                for host in hosts:
                    p = replace(problem, host=host)
                    try:
                        ref = simulate_oracle(p, ds)
                    except PlanError as e:
                        with pytest.raises(PlanError, match=re.escape(str(e))):
                            simulator.simulate(p, ds)
                        continue
                    fast = simulator.simulate(p, ds)
                    assert fast._memory is None
                    assert_same(fast, ref, f"{f} {len(ds)} decisions")
                    carried += any(v != (0, 0) for v in ref._carry.values())
                    n += 1
    assert n > 150 and carried > 0
