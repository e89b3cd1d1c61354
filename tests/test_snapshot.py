"""One state snapshot (runtime/snapshot.py) for every "trained the same" comparison: the tests'
``run_example`` and ``max-batch``'s verifying run both hold parameters, gradients, optimizer state
and module buffers (batch norm's running statistics), under the same names."""

from __future__ import annotations

import torch
from capuchin.maxbatch import run_steps
from capuchin.testing.training import TRACES, run_example


def test_max_batch_verifying_run_compares_buffers_as_the_tests_do():
    script = TRACES / "cnn.py"
    args = ["--steps", "2", "--batch", "4"]
    run = run_steps(script, args, 2, plan=None, keep_state=True)
    ran = run_example(script, args)
    buffers = [k for k in run.state if k.endswith(("running_mean", "running_var"))]
    assert buffers, sorted(run.state)[:8]
    assert any(k.endswith(".grad") for k in run.state)
    assert any(".state." in k for k in run.state)  # optimizer state
    assert run.state.keys() == ran.keys()
    assert all(torch.equal(run.state[k], ran[k]) for k in ran)


def test_run_under_stops_after_the_runtimes_own_step_and_keeps_the_state():
    """``run_under`` (runtime/launch.py), the one way a script runs under the runtime: stopped
    after 2 of 4 steps, the runtime has ended both iterations (its step hook ran before the
    stop), the state is the one of two plain steps, bitwise, and no globals come back."""
    from capuchin.runtime.engine import Runtime
    from capuchin.runtime.launch import run_under
    from capuchin.testing.training import state_mismatches

    script = TRACES / "mlp.py"
    rt = Runtime(budget_bytes=1 << 40, measure_memory=False)
    ran = run_under(rt, script, ["--steps", "4"], steps=2, keep_state=True)
    assert ran.steps == 2 and len(ran.stamps) == 2 and ran.globals is None
    assert [s.complete for s in rt.report.iterations] == [True, True]
    assert state_mismatches(run_example(script, ["--steps", "2"]), ran.state) == []
    whole = run_under(None, script, ["--steps", "1"])
    assert whole.globals and whole.steps == 0 and whole.state is None
