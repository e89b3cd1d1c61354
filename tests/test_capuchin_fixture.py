"""The plans of the ``capuchin``, ``swap`` and ``recompute`` policies on every bundled trace at
80/60/50% of its peak, compared decision by decision with a recorded fixture.

The fixture (``tests/data/capuchin_plans.json``) holds the decisions of the last regeneration.
It is a change detector, not a statement of optimality nor a test of the paper's choices (those
are tests/test_capuchin_algorithm.py): a change that alters a plan on purpose regenerates it
with ``python tests/test_capuchin_fixture.py --write`` and says why in its commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "capuchin_plans.json"
TRACES = sorted((ROOT / "traces").glob("*.trace.parquet"))
FRACTIONS = (0.8, 0.6, 0.5)
POLICIES = ("capuchin", "swap", "recompute")


def _decision(d) -> list:
    return [
        d.storage_id,
        d.method.value,
        d.size_bytes,
        d.evict_op,
        d.back_op,
        d.trigger_op,
        list(d.replay_ops),
        list(d.sources),
        list(d.keep),
    ]


def plans_of(path: Path) -> dict[str, list]:
    """``{"policy@fraction": [decision, ...]}`` for one trace, fresh (no cache shared with
    another trace)."""
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.tracer.reader import load_trace

    problem = Problem.from_trace(load_trace(path))
    out = {}
    for policy in POLICIES:
        for f in FRACTIONS:
            ds = get_policy(policy)(problem, int(problem.peak_bytes * f)).decisions
            out[f"{policy}@{f}"] = [_decision(d) for d in ds]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_plans_match_fixture(path):
    want = json.loads(FIXTURE.read_text())[path.name]
    got = plans_of(path)
    assert set(got) == set(want)
    for key in want:
        assert got[key] == want[key], f"{path.name} {key}: plan differs from the fixture"


def test_fixture_covers_every_bundled_trace():
    assert TRACES
    assert set(json.loads(FIXTURE.read_text())) == {p.name for p in TRACES}


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURE.write_text(
        json.dumps({p.name: plans_of(p) for p in TRACES}, indent=0, sort_keys=True) + "\n"
    )
    print(f"wrote {FIXTURE}")
