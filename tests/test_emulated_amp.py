"""fp16-style ``GradScaler`` steps skipped on inf gradients still end an iteration (review L9,
Note [Skipped GradScaler steps] in tracer/hooks.py). The scaler runs on CPU here; the skip is
forced by an inf gradient, as fp16 overflow causes on a GPU."""

from __future__ import annotations

import pytest
import torch
from capuchin.tracer.hooks import OpIndexer

pytestmark = pytest.mark.emulated


def test_a_skipped_scaler_step_still_ends_the_iteration():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    plain_step = torch.amp.GradScaler.step
    ix = OpIndexer().install()
    skipped = 0
    try:
        for step in range(4):
            opt.zero_grad()
            loss = model(torch.randn(2, 8)).square().mean()
            scaler.scale(loss).backward()
            if step == 1:
                model.weight.grad[0, 0] = float("inf")  # an fp16 overflow
            before = model.weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            skipped += torch.equal(before, model.weight.detach())
    finally:
        ix.uninstall()
    assert skipped == 1  # the scaler did skip one optimizer.step()
    assert ix.steps_seen == 4  # ... and every step still ended its iteration
    assert torch.amp.GradScaler.step is plain_step  # unwrapped once no indexer is installed
