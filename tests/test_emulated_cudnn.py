"""Out-of-memory errors caught inside an op (review defect 10, Note [Out-of-memory errors caught
inside an op] in runtime/device.py): cuDNN catches the error of its workspace under the cap and
switches algorithm, which capuchin cannot see. The allocator counts every error it raises and
capuchin every one it catches: a difference is reported in one warning naming the iteration,
and a plan with convolutions on CUDA is warned about up front."""

from __future__ import annotations

import pytest
import torch
from capuchin.planner.problem import Problem
from capuchin.runtime.device import OOMWatch, cudnn_problem
from capuchin.runtime.report import IterationStats
from capuchin.runtime.swap import SwapEngine
from capuchin.testing.emulated import emulated_cuda
from capuchin.testing.training import TRACES, hand_plan
from capuchin.tracer.reader import load_trace

pytestmark = pytest.mark.emulated

MIB = 1 << 20


def _cudnn_like(model, nbytes: int) -> bool:
    """What cuDNN's ``try_plans`` does with a workspace that does not fit: catch and go on."""
    try:
        model.free(model.malloc(nbytes))
        return True
    except torch.OutOfMemoryError:
        return False


def test_only_errors_that_never_reached_capuchin_count(monkeypatch):
    import capuchin.runtime.swap as swap

    with emulated_cuda(total_bytes=100 * MIB, workspace_bytes=0) as (model,):
        model.set_fraction(0.5)  # a 50 MiB cap
        watch = OOMWatch(torch.device("cuda", 0))
        held = [model.malloc(30 * MIB)]
        # capuchin's own: an on-demand restore meets the cap, makes room and retries
        eng = SwapEngine(backend=None)
        eng.stats = IterationStats(iteration=1)
        eng.make_room = lambda n, st: (model.free(held.pop()), 30 * MIB)[1]
        monkeypatch.setattr(swap, "resize", lambda st, n: model.malloc(n))
        eng._alloc(object(), 30 * MIB)
        assert model.num_ooms == 1 and watch.swallowed() == 0
        # a library's own: the error never leaves the op
        assert not _cudnn_like(model, 40 * MIB)
        assert model.num_ooms == 2 and watch.swallowed() == 1
        assert "by iteration 3, 1 out-of-memory error(s)" in watch.problem(3)
        assert watch.problem(4) is None  # once


def test_a_run_warns_at_the_iteration_where_an_op_swallowed_one(monkeypatch, capsys):
    import capuchin.runtime.engine as engine
    from capuchin.runtime.engine import Runtime
    from capuchin.testing.emulated import emulated_backend_for

    monkeypatch.setattr(engine, "backend_for", emulated_backend_for)
    with emulated_cuda(total_bytes=1 << 30, workspace_bytes=0) as (model,):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        with Runtime(budget_bytes=64 * MIB, device="cuda", measure_memory=False) as rt:
            for step in range(4):
                loss = lin(torch.randn(4, 8)).sum()
                if step == 2:  # a convolution whose workspace does not fit under the cap
                    assert not _cudnn_like(model, 1 << 30)
                loss.backward()
                opt.step()
                opt.zero_grad()
        assert rt.cap_bytes is not None
    err = [line for line in capsys.readouterr().err.splitlines() if "out-of-memory" in line]
    assert len(err) == 1 and "by iteration 2, 1 out-of-memory error(s)" in err[0], err


def test_a_plan_with_convolutions_under_a_cap_is_warned_up_front(monkeypatch):
    def ops(name):
        plan = hand_plan(Problem.from_trace(load_trace(TRACES / f"{name}.trace.parquet")), "swap")
        return [o[0] for o in plan.ops]

    cuda = torch.device("cuda", 0)
    assert "under an allocator cap of 64 MiB" in cudnn_problem(cuda, ops("cnn"), 64 * MIB)
    assert cudnn_problem(cuda, ops("mlp"), 64 * MIB) is None  # no convolution
    assert cudnn_problem(cuda, ops("cnn"), None) is None  # no cap
    assert cudnn_problem(torch.device("cpu"), ops("cnn"), 64 * MIB) is None
    monkeypatch.setattr(torch.backends.cudnn, "enabled", False)
    assert cudnn_problem(cuda, ops("cnn"), 64 * MIB) is None
