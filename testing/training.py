"""Helpers for the runtime's tests and benchmarks: train a bundled example in-process and snapshot
its state, and hand-made plans that force one mechanism (swap only, recompute only, both).

The hand-made plans go through the planner's own ``build_plan`` (lineage, simulator, action table),
so they are real plans; they just pick *every* evictable storage with a back-access, which
exercises the runtime far more than a budget-driven policy would.
"""

from __future__ import annotations

import contextlib
import functools
import io
from pathlib import Path

import torch

from ..errors import PlanError
from ..planner.build import build_plan
from ..planner.plan import Decision, Method, Plan
from ..planner.problem import Problem
from ..runtime.launch import run_under

TRACES = Path(__file__).resolve().parent.parent / "traces"

# Note [Fixed op costs]
# A test that plans from a real trace and then asserts something of the plan (it evicts, it fits
# a budget, it trains within 1.05x of it) must check one plan, the same on every run. Op times
# measured while tracing move with the host's load, and the plan with them; so do the runtime's
# host costs the tracer measures in the script (``TraceMeta.host_costs``, Note [Calibrated host
# costs] in planner/costs.py), and the plain step the tracer times (to which the planner scales
# every op's duration: Note [Plain baseline] in planner/problem.py). So such tests plan from
# fixed costs: every op FIXED_OP_NS, copies at FIXED_BANDWIDTH, the host costs the planner's
# constants, no plain step.
FIXED_OP_NS = 100_000
FIXED_BANDWIDTH = "10GB/s"


def with_fixed_costs(trace):
    """``trace`` (a path or a loaded ``Trace``) with every op's duration ``FIXED_OP_NS``, no
    measured host costs and no plain step (Note [Fixed op costs]); plan it with
    ``bandwidth=FIXED_BANDWIDTH``. A loaded trace is changed in place and returned."""
    from ..tracer.reader import load_trace
    from ..tracer.schema import Col

    if not hasattr(trace, "events"):
        trace = load_trace(trace)
    trace.events.loc[trace.events[Col.OP] >= 0, Col.DURATION_NS] = FIXED_OP_NS
    trace.meta.host_costs = None  # the planner's constants, not the host's load when traced
    trace.meta.plain_iteration_ns = None  # durations as set, not scaled to a timed step
    return trace


def run_example(script: str | Path, args: list[str], context=None) -> dict[str, torch.Tensor]:
    """Run a training script in-process (optionally inside ``context``, e.g. a Runtime) and
    return its final state, keyed by a stable name: every parameter, gradient and optimizer
    state tensor, found through the optimizers that stepped, and the ``state_dict()`` (parameters
    and buffers: batch norm's running statistics) of every model that ran a forward, found by a
    global forward hook (the outermost modules that ran, in the order they first ran) or left
    in the script's globals. Deterministic scripts (they seed) give comparable dicts."""
    with contextlib.redirect_stdout(io.StringIO()):
        return run_under(context, script, args, keep_state=True).state


def train_tiny_bert(steps: int, batch: int = 8, seq: int = 64):
    """A Hugging Face BERT masked LM from a tiny config (random weights, nothing downloaded),
    dropout active, AdamW, trained ``steps`` steps on random ``batch`` x ``seq`` tokens from seed
    0; returns ``(model, optimizer)``. Needs ``transformers``."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=500,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = BertForMaskedLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return model, opt


STEPS = ("--steps", "3")  # the tests' training length for a bundled example


@functools.cache
def reference(name: str, extra: tuple = ()) -> dict[str, torch.Tensor]:
    """Final state of bundled example ``name`` trained without capuchin for ``STEPS`` (and
    ``extra`` arguments); computed once per process."""
    return run_example(TRACES / f"{name}.py", [*STEPS, *extra])


def train_mismatches(name: str, runtime, extra: tuple = ()) -> list[str]:
    """Train bundled example ``name`` for ``STEPS`` (and ``extra``) under ``runtime``; the names
    whose final tensors are not ``torch.equal`` to training without capuchin."""
    got = run_example(TRACES / f"{name}.py", [*STEPS, *extra], runtime)
    return state_mismatches(reference(name, extra), got)


def state_mismatches(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not ``torch.equal`` (or present in only one)."""
    bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    bad += [k for k in b if k not in a]
    return bad


def hand_plan(
    problem: Problem,
    method: str,
    budget_bytes: int | None = None,
    min_bytes: int = 4096,
    trigger_lead: int = 3,
    limit: int | None = None,
) -> Plan:
    """A plan evicting every evictable storage (>= ``min_bytes``) over its longest access gap
    that starts in forward and ends later. ``method``: "swap", "recompute" or "hybrid"
    (alternating by size rank). Decisions the simulator rejects are left out one by one."""
    cands = []
    for sid, s in problem.storages.items():
        if not s.evictable or s.size_bytes < min_bytes or s.alloc_op is None:
            continue
        gaps = s.gaps()
        if not gaps:
            continue
        a, b = max(gaps, key=lambda g: g[1] - g[0])
        cands.append((s.size_bytes, sid, a, b))
    cands.sort(reverse=True)
    if limit is not None:
        cands = cands[:limit]
    decisions = []
    for rank, (size, sid, a, b) in enumerate(cands):
        m = method
        if method == "hybrid":
            m = "swap" if rank % 2 == 0 else "recompute"
        if m == "swap":
            decisions.append(
                Decision(sid, Method.SWAP, size, a, b, trigger_op=max(a + 1, b - trigger_lead))
            )
        else:
            decisions.append(Decision(sid, Method.RECOMPUTE, size, a, b))
    budget = budget_bytes if budget_bytes is not None else problem.peak_bytes
    while True:
        try:
            plan, _ = build_plan(problem, decisions, policy=f"hand-{method}", budget_bytes=budget)
            return plan
        except PlanError as exc:
            bad = next((d for d in decisions if d.storage_id in str(exc)), None)
            if bad is None:
                raise
            decisions.remove(bad)
