"""Multi-tensor optimizer steps per chunk of parameters (tracer/optimizer_chunks.py Note
[Multi-tensor optimizers per chunk]): every patched functional, chunked, trains bitwise like the
unpatched one for each option that matters; the patch is scoped to the tracer and the runtime;
and with it the foreach AdamW mlp plans within 3 points of the per-tensor loop and trains bitwise
at that budget."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from capuchin.tracer import optimizer_chunks
from capuchin.tracer.optimizer_chunks import CHUNKED, ChunkedOptimizers, chunk_bounds, patched
from torch.utils._python_dispatch import TorchDispatchMode

# sizes: float32 elements > SPLIT_GROUP_BYTES / 5 alone, small ones grouped
SHAPES = [(150, 120), (7,), (40, 40), (3,), (5, 5), (90, 130), (10,), (6, 6), (4,)]


class _ListLengths(TorchDispatchMode):
    """The longest tensor list any ``_foreach_`` op was called with, and how many such calls."""

    def __init__(self):
        super().__init__()
        self.longest = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_foreach_" in func.__name__:
            self.calls += 1
            for a in args:
                if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                    self.longest = max(self.longest, len(a))
        return func(*args, **(kwargs or {}))


def _train(cls, kwargs: dict, chunk: bool, steps: int = 4, skip=()):
    """``steps`` steps of ``cls(params, foreach=True, **kwargs)`` on random gradients (the
    parameters in ``skip`` get no gradient in the first step); the parameters, the optimizer and
    the longest foreach list seen (chunked runs)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = cls(params, foreach=True, **kwargs)
    spy = _ListLengths()
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (step == 0 and i in skip) else torch.randn_like(p)
        if chunk:
            with ChunkedOptimizers(), spy:
                opt.step()
        else:
            opt.step()
    return params, opt, spy


CASES = [
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.Adam, {"maximize": True, "amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"amsgrad": True, "maximize": True, "capturable": False}),
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
    (torch.optim.SGD, {"lr": torch.tensor(0.1), "momentum": 0.9, "dampening": 0.1}),
    (torch.optim.RMSprop, {}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"maximize": True}),
    (torch.optim.Adagrad, {"lr_decay": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"maximize": True}),
    (torch.optim.Adamax, {"weight_decay": 0.1}),
    (torch.optim.Adamax, {"maximize": True}),
    (torch.optim.NAdam, {"weight_decay": 0.1, "momentum_decay": 0.01}),
    (torch.optim.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.RAdam, {}),
    (torch.optim.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.Adadelta, {"weight_decay": 0.1}),
    (torch.optim.Adadelta, {"maximize": True}),
    (torch.optim.ASGD, {"t0": 1, "weight_decay": 0.1}),
    (torch.optim.Rprop, {}),
    (torch.optim.Rprop, {"maximize": True}),
]


def _differ(a, b) -> list[str]:
    (pa, oa, _), (pb, ob, _) = a, b
    bad = [
        f"param {i}" for i, (x, y) in enumerate(zip(pa, pb, strict=True)) if not torch.equal(x, y)
    ]
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        sa, sb = oa.state[x], ob.state[y]
        assert sa.keys() == sb.keys()
        for k, v in sa.items():
            if isinstance(v, torch.Tensor) and not torch.equal(v, sb[k]):
                bad.append(f"param {i} {k}")
    return bad


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_each_functional_per_chunk_trains_bitwise(cls, kwargs):
    """Chunked against the unpatched functional over 4 steps: every parameter and every state
    tensor ``torch.equal``, while no foreach op saw more than a chunk of the parameters."""
    whole = _train(cls, kwargs, chunk=False)
    chunked = _train(cls, kwargs, chunk=True)
    assert _differ(whole, chunked) == []
    spy = chunked[2]
    assert spy.calls > 0 and spy.longest < len(SHAPES), (spy.calls, spy.longest)
    assert spy.longest > 1  # the small elements share a chunk


def test_every_patched_functional_is_covered():
    """Each functional of ``CHUNKED`` has a case above (so a new entry needs its own check)."""
    covered = {cls.__module__.rsplit(".", 1)[-1] for cls, _ in CASES}
    assert {mod for mod, _, _ in CHUNKED} <= covered


def test_sgd_with_some_momentum_buffers_missing_runs_whole():
    """A parameter without a gradient in the first step has no momentum buffer in the second:
    SGD then takes its per-element path for the whole device group, so the call runs whole
    (``_sgd_exact``), and training stays bitwise; the first momentum buffers a chunk creates
    reach the optimizer's state (written back into the caller's list)."""
    kwargs = {"lr": 0.1, "momentum": 0.9}
    whole = _train(torch.optim.SGD, kwargs, chunk=False, skip=(2,))
    chunked = _train(torch.optim.SGD, kwargs, chunk=True, skip=(2,))
    assert _differ(whole, chunked) == []
    params, opt, _ = chunked
    assert all("momentum_buffer" in opt.state[p] for p in params)
    assert optimizer_chunks._sgd_exact((None, None, [None, torch.ones(1)]), {}) is False
    assert optimizer_chunks._sgd_exact((None, None, [None, None]), {}) is True
    assert optimizer_chunks._sgd_exact((None, None, []), {"has_sparse_grad": True}) is False


def test_adam_with_a_tensor_lr_fails_as_without_chunks():
    """foreach Adam refuses ``lr`` as a tensor without ``capturable``: the same error chunked."""
    from torch.optim.adam import adam

    def call():
        torch.manual_seed(0)
        ps = [torch.randn(s) for s in SHAPES]
        n = len(ps)
        adam(
            ps,
            [torch.randn_like(p) for p in ps],
            [torch.zeros_like(p) for p in ps],
            [torch.zeros_like(p) for p in ps],
            [],
            [torch.tensor(0.0) for _ in range(n)],
            foreach=True,
            amsgrad=False,
            beta1=0.9,
            beta2=0.999,
            lr=torch.tensor(1e-3),
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
        )

    with pytest.raises(RuntimeError) as plain:
        call()
    with ChunkedOptimizers(), pytest.raises(RuntimeError) as chunked:
        call()
    assert str(chunked.value) == str(plain.value)


def test_chunks_follow_the_split_byte_rule():
    """Chunks by the bytes of an element's tensors over all lists; an empty list goes to every
    chunk; unequal lengths or a single element: whole."""
    big, small = torch.zeros(100, 100), torch.zeros(4)  # 40,000 B and 16 B
    ps = [small, small, big, small]
    assert chunk_bounds((ps, ps, [], 0.1), {"lr": 0.1}) == [(0, 2), (2, 3), (3, 4)]
    assert chunk_bounds((ps, ps[:3]), {}) is None
    assert chunk_bounds(([big], [big]), {}) is None
    assert chunk_bounds(([small] * 8, [small] * 8), {}) is None  # fits in one chunk


def test_the_patch_is_scoped_nested_and_restored_on_error():
    from torch.optim import adam

    original = adam._multi_tensor_adam
    assert patched() == []
    with ChunkedOptimizers():
        assert "adam._multi_tensor_adam" in patched()
        wrapped = adam._multi_tensor_adam
        with ChunkedOptimizers():  # the tracer under a budget enters a runtime
            assert adam._multi_tensor_adam is wrapped
        assert adam._multi_tensor_adam is wrapped
    assert adam._multi_tensor_adam is original
    with pytest.raises(ValueError), ChunkedOptimizers():
        raise ValueError("the script failed")
    assert patched() == []


def test_a_functional_this_torch_lacks_is_left_alone(monkeypatch):
    """The GPU machine's torch may lack a functional: it is skipped, the others patched."""
    from torch.optim import radam

    monkeypatch.delattr(radam, "_multi_tensor_radam")
    with ChunkedOptimizers():
        assert "adam._multi_tensor_adam" in patched()
        assert not hasattr(radam, "_multi_tensor_radam")
    assert not hasattr(radam, "_multi_tensor_radam") and patched() == []


def test_step_hooks_fire_once_per_step():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen = []
    h = register_optimizer_step_post_hook(lambda o, a, k: seen.append(o))
    try:
        _train(torch.optim.AdamW, {}, chunk=True, steps=3)
    finally:
        h.remove()
    assert len(seen) == 3


def test_the_runtime_runs_foreach_steps_per_chunk():
    """The runtime installs the patch while entered (the tracer does so too: the slow test
    below plans a trace and runs it without divergence), and removes it on exit."""
    from capuchin.runtime.engine import Runtime

    with Runtime(None, budget_bytes=2**30, eviction="lru"):
        assert "adam._multi_tensor_adam" in patched()
    assert patched() == []


# ---- the foreach mlp plans as the loop form does ----------------------------------------------


def _fixed_cost_problem(trace):
    """Note [Fixed op costs] (capuchin/testing/training.py): not measured op times."""
    from capuchin.planner.problem import Problem
    from capuchin.testing.training import with_fixed_costs

    return Problem.from_trace(with_fixed_costs(trace)).with_bandwidth(10e9, 10e9)


@pytest.mark.slow
def test_foreach_adamw_plans_within_3_points_of_the_loop_form_and_trains_bitwise(tmp_path):
    """traces/mlp.py at batch 512 with AdamW: the smallest feasible budget (fixed op costs) of
    the foreach form is within 3 points of the per-tensor loop's; 5 steps under the plan at it
    train bitwise, without divergence, every iteration (0 included) within 1.05x the budget.
    Without chunks foreach AdamW sweeps its state several times per step and its smallest
    budget is far above the loop's (docs/persistent-state.md)."""
    import capuchin
    from capuchin.planner.api import make_plan, smallest_feasible_budget
    from capuchin.planner.registry import get_policy
    from capuchin.runmain import run_as_main
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import TRACES, run_example, state_mismatches

    fn = get_policy("capuchin")
    best = {}
    for optim in ("adamw", "adamw-foreach"):
        args = ["--batch", "512", "--optim", optim]
        trace = tmp_path / f"{optim}.trace.parquet"
        with (
            contextlib.redirect_stdout(io.StringIO()),
            capuchin.Tracer(trace, iterations=1, warmup=1, device="cpu", log=None),
        ):
            run_as_main(TRACES / "mlp.py", [*args, "--steps", "3"])
        p = _fixed_cost_problem(trace)
        b = smallest_feasible_budget(p, fn, {}, start_bytes=p.floor_bytes(dead=True), steps=10)
        best[optim] = (b / p.peak_bytes, p, args)
    loop, foreach = best["adamw"][0], best["adamw-foreach"][0]
    assert foreach <= loop + 0.03, (foreach, loop)
    _, p, args = best["adamw-foreach"]
    plan = make_plan(p, budget=str(int(foreach * p.peak_bytes)), policy="capuchin")
    run = [*args, "--steps", "5"]
    ref = run_example(TRACES / "mlp.py", run)
    rt = Runtime(plan, measure_memory=True)
    got = run_example(TRACES / "mlp.py", run, rt)
    assert state_mismatches(ref, got) == []
    its = [s for s in rt.report.iterations if s.complete]
    assert [s.iteration for s in its] == [0, 1, 2, 3, 4]
    assert not any(s.diverged for s in its[1:])
    for s in its:
        assert s.peak_bytes <= 1.05 * plan.budget_bytes, (s.iteration, s.peak_bytes)


@pytest.mark.slow
def test_a_trace_without_chunks_diverges_at_the_step_and_says_trace_again(
    tmp_path, monkeypatch, capsys
):
    """A trace recorded with the foreach step whole (as before the chunks) and run with them:
    each planned iteration diverges at the optimizer step, the warning says to trace again, and
    training stays bitwise."""
    import capuchin
    from capuchin.planner.api import make_plan
    from capuchin.runmain import run_as_main
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.training import TRACES, run_example, state_mismatches

    args = ["--batch", "64", "--optim", "adamw-foreach"]
    trace = tmp_path / "whole.trace.parquet"
    with monkeypatch.context() as m:
        m.setattr(optimizer_chunks, "CHUNKED", ())
        with (
            contextlib.redirect_stdout(io.StringIO()),
            capuchin.Tracer(trace, iterations=1, warmup=1, device="cpu", log=None),
        ):
            run_as_main(TRACES / "mlp.py", [*args, "--steps", "3"])
    p = _fixed_cost_problem(trace)
    plan = make_plan(p, budget=str(int(0.8 * p.peak_bytes)), policy="capuchin")
    run = [*args, "--steps", "3"]
    ref = run_example(TRACES / "mlp.py", run)
    capsys.readouterr()
    rt = Runtime(plan)
    got = run_example(TRACES / "mlp.py", run, rt)
    assert state_mismatches(ref, got) == []
    its = [s for s in rt.report.iterations if s.complete and s.iteration >= 1]
    assert its and all(s.diverged for s in its)
    err = capsys.readouterr().err
    assert "_foreach_" in err and "trace the script again" in err, err
