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
