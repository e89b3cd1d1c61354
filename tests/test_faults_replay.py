"""A plan file is input: a replay chain that does not redo every write its storage received since
its producer (an edited, stale or foreign plan) must never train to other numbers. The runtime
checks each chain against its own per-storage write counters before dropping (rule R7 in
runtime/recompute.py) and swaps what it cannot replay exactly."""

from __future__ import annotations

import dataclasses

import pytest
from capuchin.planner.api import make_plan
from capuchin.planner.build import action_table
from capuchin.planner.plan import Method, Plan
from capuchin.runtime.engine import Runtime
from capuchin.testing.training import TRACES, train_mismatches


@pytest.fixture(scope="module")
def recompute_plan() -> Plan:
    return make_plan(
        TRACES / "cnn.trace.parquet", budget="50%", policy="recompute", allow_infeasible=True
    )


def _without_inplace(plan: Plan) -> tuple[Plan, list[str]]:
    """``plan`` with the trailing in-place op (ReLU after batch norm) cut from every chain that
    ends in one; the ids of the decisions changed."""
    changed, decisions = [], []
    for d in plan.decisions:
        names = [plan.ops[k][0] for k in d.replay_ops]
        if d.method is Method.RECOMPUTE and len(names) > 1 and names[-1] == "aten.relu_.default":
            d = dataclasses.replace(d, replay_ops=d.replay_ops[:-1])
            changed.append(d.storage_id)
        decisions.append(d)
    return dataclasses.replace(plan, decisions=decisions, actions=action_table(decisions)), changed


def test_a_chain_missing_an_inplace_write_is_swapped_and_trains_bitwise(recompute_plan, tmp_path):
    """The report's S1: batch norm's output, relu_'d in place afterwards, with the relu_ cut from
    its chain. Replaying it would give the pre-ReLU values (76 of 112 tensors differed)."""
    tampered, changed = _without_inplace(recompute_plan)
    assert changed, "the cnn's recompute plan has chains ending in an in-place ReLU"
    path = tampered.save(tmp_path / "tampered.plan.json")
    rt = Runtime(str(path), measure_memory=False)
    assert train_mismatches("cnn", rt) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and all(s.fallback_swaps >= len(changed) for s in its)
    assert all(s.recomputed_ops > 0 for s in its), "the untouched chains are still replayed"


def test_a_chain_that_does_not_produce_its_storage_is_swapped(recompute_plan):
    """A chain naming another producer (C14) is swapped too, before any drop."""
    decisions = []
    for d in recompute_plan.decisions:
        if d.storage_id == "15:0":
            d = dataclasses.replace(d, replay_ops=(3,))  # a convolution, but not this one
        decisions.append(d)
    plan = dataclasses.replace(recompute_plan, decisions=decisions, actions=action_table(decisions))
    rt = Runtime(plan, measure_memory=False)
    assert train_mismatches("cnn", rt) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and all(s.fallback_swaps >= 1 for s in its)
