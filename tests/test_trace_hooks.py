"""tracer/hooks.py: iteration boundaries, phases, flattening, writes, seeded ops, ids and frees.

Small in-process models under a minimal dispatch mode that uses the indexer exactly as the tracer
and the runtime do (begin_op / end_op).
"""

from __future__ import annotations

import collections

import capuchin
import pytest
import torch
from capuchin.tracer.hooks import (
    OpIndexer,
    flatten_outputs,
    flatten_tensors,
    is_seeded,
    op_info,
    written_inputs,
)
from capuchin.tracer.schema import Phase
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _Log(TorchDispatchMode):
    """Records (iteration, index, phase, name, input ids, output ids, input storages, written,
    output_alloc, output_aliases) per op."""

    def __init__(self, indexer: OpIndexer):
        super().__init__()
        self.ix = indexer
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = self.ix.begin_op(func, args, kwargs)
        if op is None:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.ix.end_op(op, out)
        self.ops.append(
            (
                op.iteration,
                op.index,
                op.phase,
                op.info.name,
                tuple(op.input_ids),
                tuple(op.output_ids),
                tuple(r.name if r is not None else None for r in op.input_storages),
                op.written,
                tuple(op.output_alloc),
                tuple(op.output_aliases),
            )
        )
        return out


def _run(train, **callbacks):
    ix = OpIndexer(**callbacks).install()
    mode = _Log(ix)
    try:
        with mode:
            train()
        ix.finish()
    finally:
        ix.uninstall()
    return ix, mode.ops


def _per_iteration(ops):
    by = collections.defaultdict(list)
    for o in ops:
        by[o[0]].append(o)
    return by


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True), nn.Linear(16, 4)
    )


def test_two_optimizers_and_gradient_accumulation_are_one_iteration():
    m = _model()
    o1 = torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.Adam(list(m[1].parameters()) + list(m[3].parameters()))
    ends = []

    def train():
        for _ in range(4):
            o1.zero_grad()
            o2.zero_grad()
            for _ in range(3):  # gradient accumulation: 3 forward/backward per step
                m(torch.randn(32, 8)).square().mean().backward()
            o1.step()
            o2.step()

    ix, ops = _run(train, on_iteration_end=lambda it, last: ends.append(it))
    assert ends == [0, 1, 2, 3]
    by = _per_iteration(ops)
    for it in range(4):
        phases = [o[2] for o in by[it]]
        # forward/backward x3, then optimizer ops only at the end (both optimizers)
        first_opt = phases.index(Phase.OPTIMIZER)
        assert set(phases[first_opt:]) == {Phase.OPTIMIZER}
        assert phases.count(Phase.FORWARD) > 0 and phases.count(Phase.BACKWARD) > 0
        names = [o[3] for o in by[it][:first_opt]]
        assert names.count("aten.native_batch_norm.default") == 3  # three forward passes
    # steady iterations are identical, ids included (never addresses)
    assert [o[1:] for o in by[2]] == [o[1:] for o in by[3]]
    assert [o[1:] for o in by[1]] == [o[1:] for o in by[2]]


def test_capuchin_step_marks_iterations_without_an_optimizer():
    w = torch.randn(8, 8, requires_grad=True)

    def train():
        for _ in range(3):
            (torch.randn(4, 8) @ w).sum().backward()
            with torch.no_grad():
                w.sub_(0.1 * w.grad)
                w.grad = None
            capuchin.step()

    ends = []
    _, ops = _run(train, on_iteration_end=lambda it, last: ends.append((it, last)))
    assert [e[0] for e in ends] == [0, 1, 2]
    by = _per_iteration(ops)
    assert len(by[0]) == len(by[1]) == len(by[2]) == ends[0][1] + 1
    assert {o[2] for o in by[1]} == {Phase.FORWARD, Phase.BACKWARD}
    capuchin.step()  # no active indexer: a no-op, no error


def test_no_step_means_no_completed_iteration():
    def train():
        for _ in range(3):
            (torch.randn(4, 4, requires_grad=True) * 2).sum().backward()

    ends = []
    ix, ops = _run(train, on_iteration_end=lambda it, last: ends.append(it))
    assert ends == [] and ix.steps_seen == 0 and {o[0] for o in ops} == {0}


def test_batch_norm_running_stats_are_written_although_unannotated():
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    args = (x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5)
    func = torch.ops.aten.native_batch_norm.default
    assert "(a!)" not in str(func._schema)  # the reason for the explicit table
    flat = flatten_tensors(args, {})
    assert written_inputs(op_info(func), args, {}, flat) == (3, 4)
    args_eval = args[:5] + (False,) + args[6:]
    assert written_inputs(op_info(func), args_eval, {}, flat) == ()
    # annotated writes: add_ writes self, add.out writes the kwarg `out`
    a, b, out = torch.ones(2), torch.ones(2), torch.empty(2)
    assert written_inputs(op_info(torch.ops.aten.add_.Tensor), (a, b), {}, [a, b]) == (0,)
    kw = {"out": out}
    fl = flatten_tensors((a, b), kw)
    assert fl[2] is out
    assert written_inputs(op_info(torch.ops.aten.add.out), (a, b), kw, fl) == (2,)


def test_flattening_order_matches_pytree_and_outputs_expand_lists():
    from torch.utils._pytree import tree_flatten

    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    args = (a, [b, None, c], 3, None)
    kwargs = {"weight": c, "alpha": 2.0}
    expect = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    got = flatten_tensors(args, kwargs)
    assert len(got) == len(expect) and all(x is y for x, y in zip(got, expect, strict=True))
    outs = flatten_outputs((a, [b, c], 7))
    assert [x.numel() for x in outs] == [1, 2, 3]


def test_seeded_and_ignored_ops():
    assert is_seeded(torch.ops.aten.bernoulli_.float)
    assert is_seeded(torch.ops.aten.randn.default)
    assert not is_seeded(torch.ops.aten.mm.default)
    assert op_info(torch.ops.profiler._record_function_enter_new.default).ignored
    assert not op_info(torch.ops.aten.mm.default).ignored


def test_ids_follow_the_note_and_frees_are_reported_with_those_ids():
    w = nn.Parameter(torch.randn(16, 16))
    opt = torch.optim.SGD([w], lr=0.1)
    frees = []

    def train():
        for _ in range(4):
            opt.zero_grad()
            h = torch.randn(8, 16) @ w  # op 0 randn (fresh), op 1 mm reads the parameter
            h.relu_().sum().backward()
            opt.step()

    ix, ops = _run(train, on_free=lambda rec, name, it, k: frees.append((it, k, name)))
    by = _per_iteration(ops)
    randn, mm, relu = by[2][0], by[2][1], by[2][2]
    assert randn[3] == "aten.randn.default" and randn[5] == ("0:0",) and randn[8] == (True,)
    assert mm[4] == ("0:0", "x1:1")  # fresh tensor, then the parameter named at first access
    assert mm[6] == ("0:0", "x1:1")  # storages named after the tensor that first owned them
    # in-place: same storage, output aliases input 0, renamed to the op's output id
    assert relu[3] == "aten.relu_.default" and relu[7] == (0,)
    assert relu[8] == (False,) and relu[9] == (0,) and relu[5] == ("2:0",)
    assert relu[6] == ("1:0",)
    # the random input of iteration 1 is freed in iteration 1 under the same id as in iteration 2
    names1 = {n for it, k, n in frees if it == 1}
    names2 = {n for it, k, n in frees if it == 2}
    assert "0:0" in names2 and names1 == names2
    assert all(not n.startswith("0x") for n in names2)


def test_storage_identity_survives_views_and_python_references():
    ix = OpIndexer().install()
    try:
        mode = _Log(ix)
        with mode:
            x = torch.randn(4, 4)
            v = x.t()  # a view: same storage, output aliases input 0
            y = v + 1
            capuchin.step()
            z = x * 2  # next iteration: x is pre-existing now
        ix.finish()
    finally:
        ix.uninstall()
    t_op = mode.ops[1]
    assert t_op[3] == "aten.t.default" and t_op[9] == (0,) and t_op[8] == (False,)
    assert ix.storage_rec(v) is ix.storage_rec(x)
    mul = mode.ops[3]
    assert mul[0] == 1 and mul[4] == ("x0:0",)
    del y, z


@pytest.mark.parametrize("n", [3])
def test_finish_closes_a_final_step(n):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ends = []

    def train():
        for _ in range(n):
            opt.zero_grad()
            m(torch.randn(8, 8)).sum().backward()
            opt.step()

    _run(train, on_iteration_end=lambda it, last: ends.append(it))
    assert ends == list(range(n))  # the last one closed by finish()


@pytest.mark.parametrize("keyword", [False, True])
def test_closure_step_phases_and_boundaries(keyword):
    """optimizer.step(closure): the closure's ops are forward and backward (Note [Phases by the
    autograd engine]); each step's closure starts a new iteration."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    def train():
        for _ in range(3):
            opt.step(closure=closure) if keyword else opt.step(closure)

    _, ops = _run(train)
    by_it = collections.defaultdict(list)
    for it, _k, phase, *_ in ops:
        if not by_it[it] or by_it[it][-1] != phase:
            by_it[it].append(phase)
    assert dict(by_it) == {i: [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER] for i in range(3)}
