"""search Note [Pruned once per plan]: a plan pruned again for the same budget is not simulated
again, and gets the same decisions."""

from __future__ import annotations

from capuchin.planner import improve, search
from capuchin.planner.policies.capuchin import Capuchin
from capuchin.planner.problem import Problem
from capuchin.tracer.synthetic import trace_from_ops, transformer_ops


def _transformer() -> Problem:
    ops, sizes, persistent = transformer_ops(2, 12, hidden_bytes=1 << 16)
    return Problem.from_trace(
        trace_from_ops(ops, sizes, persistent=persistent, bandwidth_bytes_per_s=12e9)
    )


def test_a_plan_is_pruned_once(monkeypatch):
    p = _transformer()
    target = int(p.peak_bytes * 0.5)
    a = Capuchin("recompute")(p, target)
    assert a.sim is not None and a.sim.peak_bytes <= target
    budget = int(p.peak_bytes * 0.7)  # room to drop decisions again
    trials = []
    real = improve.simulate

    def counted(problem, decisions, **kw):
        trials.append(tuple(decisions))
        return real(problem, decisions, **kw)

    monkeypatch.setattr(improve, "simulate", counted)
    first = search.prune(p, a, budget)
    assert trials  # pruning tried plans (through the accept rule)
    assert len(first) < len(a.decisions)  # and dropped some
    n = len(trials)
    again = search.prune(p, a, budget)
    assert len(trials) == n  # remembered: no trial simulated again
    assert again == first and again is not first  # a list of its own for each caller
    # another budget is another key
    search.prune(p, a, int(p.peak_bytes * 0.8))
    assert len(trials) > n
