"""Multi-tensor ops run in groups (tracer/hooks.py Note [Multi-tensor op split]): per op family,
the split calls give results ``torch.equal`` to the whole op on random data; ops whose elements
are not independent, or whose arguments the rule cannot split, are kept whole; the tracer records
the groups as ops and training with foreach / fused AdamW and ``clip_grad_norm_`` under a plan is
bitwise identical to plain training."""

from __future__ import annotations

import copy

import pytest
import torch
from capuchin.tracer.hooks import join_outputs, split_calls

aten = torch.ops.aten
CAP = 300 * 4  # bytes per group in these tests: a few of the small elements, one large alone


def _lists(n_lists: int, seed: int = 0, positive: bool = False):
    """``n_lists`` lists of tensors of mixed sizes (small ones group, large ones stand alone)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 5), (40, 10), (2,), (9,), (500,), (4, 4), (1,)]
    out = []
    for _ in range(n_lists):
        ts = [torch.randn(s, generator=g) for s in shapes]
        out.append([t.abs() + 0.1 for t in ts] if positive else ts)
    return out


def _split_and_whole(func, args, kwargs=None, cap=CAP):
    """Run ``func`` whole on a deep copy of the arguments and in groups on another; return both
    results and both argument copies (in-place ops write into them)."""
    kwargs = kwargs or {}
    whole_args, whole_kwargs = copy.deepcopy((args, kwargs))
    split_args, split_kwargs = copy.deepcopy((args, kwargs))
    calls = split_calls(func, split_args, split_kwargs, cap=cap)
    assert calls is not None and len(calls) > 2, "the test data must split into several groups"
    # the groups are consecutive sub-lists of the split copy's own tensors, and idempotent
    for a, k in calls:
        assert split_calls(func, a, k, cap=cap) is None
    whole = func(*whole_args, **whole_kwargs)
    split = join_outputs([func(*a, **k) for a, k in calls])
    return (whole, whole_args, whole_kwargs), (split, split_args, split_kwargs)


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return []


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb) and len(fa) > 0
    for x, y in zip(fa, fb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "case",
    [
        "addcdiv_.ScalarList",
        "addcmul_.Scalar",
        "mul_.Tensor",
        "lerp_.Scalar",
        "sqrt",
        "add.List",
        "div_.ScalarList",
        "zero_",
        "norm",
        "mm",
    ],
)
def test_foreach_family_split_is_exact(case):
    a, b, c = _lists(3)
    p = _lists(1, seed=1, positive=True)[0]
    n = len(a)
    scalars = [0.1 * (i + 1) for i in range(n)]
    func, args = {
        "addcdiv_.ScalarList": (aten._foreach_addcdiv_.ScalarList, (a, b, p, scalars)),
        "addcmul_.Scalar": (aten._foreach_addcmul_.Scalar, (a, b, c, 0.3)),
        "mul_.Tensor": (aten._foreach_mul_.Tensor, (a, torch.tensor(0.7))),
        "lerp_.Scalar": (aten._foreach_lerp_.Scalar, (a, b, 0.1)),
        "sqrt": (aten._foreach_sqrt.default, (p,)),
        "add.List": (aten._foreach_add.List, (a, b)),
        "div_.ScalarList": (aten._foreach_div_.ScalarList, (a, scalars)),
        "zero_": (aten._foreach_zero_.default, (a,)),
        "norm": (aten._foreach_norm.Scalar, (a, 2)),
        "mm": (
            aten._foreach_mm.default,
            ([t.reshape(1, -1) for t in a], [t.reshape(-1, 1) for t in b]),
        ),
    }[case]
    whole, split = _split_and_whole(func, args)
    _assert_same(whole, split)  # results and every list argument (written in place or not)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize(
    "func", [aten._fused_adamw_.default, aten._fused_adam_.default, aten._fused_adam.default]
)
def test_fused_adam_split_is_exact(func, amsgrad):
    """Each element keeps its own step tensor (``state_steps``, different steps here); the
    scalars and ``grad_scale`` / ``found_inf`` go to every group unchanged; without amsgrad
    ``max_exp_avg_sqs`` is an empty list in every group."""
    params, grads, m = _lists(3, seed=2)
    v = [t.abs() for t in _lists(1, seed=3)[0]]
    vmax = [t.clone() + 0.5 for t in v] if amsgrad else []
    steps = [torch.tensor(float(i + 1)) for i in range(len(params))]
    kwargs = dict(
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.01,
        eps=1e-8,
        amsgrad=amsgrad,
        maximize=False,
        grad_scale=torch.tensor(2.0),
        found_inf=torch.tensor(0.0),
    )
    whole, split = _split_and_whole(func, (params, grads, m, v, vmax, steps), kwargs)
    _assert_same(whole, split)


def test_fused_adam_tensor_lr_and_sgd_split_is_exact():
    params, grads, m = _lists(3, seed=4)
    v = [t.abs() for t in m]
    steps = [torch.tensor(3.0) for _ in params]
    kw = dict(beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=True)
    whole, split = _split_and_whole(
        aten._fused_adamw_.tensor_lr,
        (params, grads, m, v, [], steps),
        {"lr": torch.tensor(0.1), **kw},
    )
    _assert_same(whole, split)
    kw = dict(weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0, nesterov=True)
    whole, split = _split_and_whole(
        aten._fused_sgd_.default,
        (params, grads, m),
        {**kw, "maximize": False, "is_first_step": False},
    )
    _assert_same(whole, split)


def test_amp_unscale_split_is_exact_and_finds_inf_in_any_group():
    for bad in (None, 1, 6):  # no non-finite value; in the first group; in a later group
        grads = _lists(1, seed=5)[0]
        if bad is not None:
            grads[bad].view(-1)[0] = float("inf")
        args = (grads, torch.tensor(0.0), torch.tensor(0.5))
        whole, split = _split_and_whole(
            aten._amp_foreach_non_finite_check_and_unscale_.default, args
        )
        _assert_same(whole[1], split[1])
        assert whole[1][1].item() == (0.0 if bad is None else 1.0)


def test_ops_kept_whole():
    a, b, _ = _lists(3)
    # not in the allow-list: ops that combine the list's elements
    assert split_calls(aten.cat.default, (a,), {}, cap=CAP) is None
    assert split_calls(aten.stack.default, (a,), {}, cap=CAP) is None
    # a per-element tensor that is not a list (one scalar per element in a 1-D tensor)
    scal = torch.rand(len(a))
    assert split_calls(aten._foreach_addcdiv_.Tensor, (a, b, b, scal), {}, cap=CAP) is None
    # lists of unequal lengths; one element; everything within one group
    assert split_calls(aten._foreach_add_.List, (a, b[:-1]), {}, cap=CAP) is None
    assert split_calls(aten._foreach_zero_.default, (a[:1],), {}, cap=CAP) is None
    assert split_calls(aten._foreach_zero_.default, (a,), {}, cap=1 << 30) is None
    # the grouping: consecutive elements within the cap, a larger element alone
    calls = split_calls(aten._foreach_zero_.default, (a,), {}, cap=CAP)
    sizes = [[t.numel() for t in c[0][0]] for c in calls]
    assert sizes == [[7, 15], [400], [2, 9], [500], [16, 1]]


# ---- traced and run ----------------------------------------------------------------------------
def _trace_mlp(tmp_path, optim: str, extra: tuple = ()):
    import contextlib
    import io

    import capuchin
    from capuchin.runmain import run_as_main
    from capuchin.testing.training import TRACES

    out = tmp_path / f"mlp-{optim}.trace.parquet"
    args = ["--steps", "3", "--batch", "512", "--optim", optim, *extra]
    with (
        contextlib.redirect_stdout(io.StringIO()),
        capuchin.Tracer(out, iterations=1, warmup=1, device="cpu", log=None),
    ):
        run_as_main(TRACES / "mlp.py", args)
    return out, args


@pytest.mark.slow
def test_foreach_and_fused_adamw_plan_like_the_loop_form(tmp_path):
    """AdamW with foreach=True and fused=True and ``clip_grad_norm_`` (its ``_foreach_norm``):
    no multi-tensor op of the trace reads more than one weight's worth of state, so the floor's
    working set is the loop form's, the fused form's smallest feasible budget is within 3 points
    of the loop form's (whole, its fused op read every state at once: 71% against 41%), and
    training under each plan at that budget is bitwise identical to plain training with every
    planned iteration within 1.05x the budget."""
    from capuchin.planner.api import make_plan, smallest_feasible_budget
    from capuchin.planner.problem import Problem
    from capuchin.planner.registry import get_policy
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import TRACES, run_example, state_mismatches
    from capuchin.tracer.reader import load_trace

    fn = get_policy("capuchin")
    res = {}
    for optim in ("adamw", "adamw-foreach", "adamw-fused"):
        path, args = _trace_mlp(tmp_path, optim, ("--clip", "1.0"))
        p = Problem.from_trace(load_trace(path))
        multi = [op for op in p.ops if op.name.startswith(("aten._foreach", "aten._fused"))]
        assert bool(multi) == (optim != "adamw")
        floor = p.floor_breakdown()
        budget = smallest_feasible_budget(p, fn, {}, start_bytes=p.floor_bytes(), steps=8)
        res[optim] = (budget / p.peak_bytes, floor["working_set_bytes"], path, args, budget)
    loop_ws = res["adamw"][1]
    for optim in ("adamw-foreach", "adamw-fused"):
        assert res[optim][1] <= 1.34 * loop_ws, (optim, res[optim][1], loop_ws)
    assert res["adamw-fused"][0] <= res["adamw"][0] + 0.03, res
    for optim in ("adamw-foreach", "adamw-fused"):
        _, _, path, args, budget = res[optim]
        plan = make_plan(path, budget=str(budget), policy="capuchin")
        assert any(d.wraps for d in plan.decisions)
        args = [*args[:1], "4", *args[2:]]
        ref = run_example(TRACES / "mlp.py", args)
        rt = Runtime(plan, measure_memory=True)
        got = run_example(TRACES / "mlp.py", args, rt)
        assert state_mismatches(ref, got) == []
        its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
        assert len(its) >= 3 and not any(s.diverged for s in its)
        for s in its:
            assert s.peak_bytes <= 1.05 * budget, (optim, s.iteration, s.peak_bytes, budget)
