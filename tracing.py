"""Tracing composed with the runtime: ``capuchin.Tracer`` and ``trace_script`` under a budget.

The tracer (tracer/) records; the runtime (runtime/) keeps memory within a budget. A trace taken
under a memory cap needs both (Note [Tracing under a budget] in tracer/record.py), and the tracer
never imports the runtime, so they are put together here, one level above both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .tracer import record
from .tracer import script as _script


def budget_keeper(budget_bytes: int, device: str) -> Any:
    """The runtime that keeps a traced run within ``budget_bytes`` on ``device``.

    LRU swapping, not dynamic mode: a dropped storage's replay pins its sources, which would make
    them die later than in the unmanaged program the trace records."""
    from .runtime.engine import Runtime

    return Runtime(  # the cap must hold: Note [Tracing under a budget] in tracer/record.py
        budget_bytes=budget_bytes,
        device=device,
        measure_memory=False,
        eviction="lru",
        lift_cap=False,
    )


def host_calibration(nbytes: int, ns_per_byte: tuple[float, float]) -> tuple[dict, dict]:
    """The runtime's slow path, swaps and replays timed on this host now (Note [Calibration of
    the runtime's slow path] in runtime/calibrate.py), for the tracer's ``calibrate_host``."""
    from .runtime.calibrate import host_calibration as calibrate

    return calibrate(nbytes, ns_per_byte)


def runtime_probe(ops: list, leader: Any, path: str, device: str = "cpu") -> Any:
    """The runtime over the script's own steps on the traced ``device`` (Note [The runtime in
    the script's steps] in runtime/calibrate.py), for the tracer's ``runtime_probe``."""
    from .runtime.calibrate import runtime_probe as probe

    return probe(ops, leader, path, device)


class Tracer(record.Tracer):
    """``tracer.record.Tracer`` with the runtime as its keeper when ``budget_bytes`` is given,
    and the runtime's host-cost calibration (``host_calibration``, ``runtime_probe``)."""

    def __init__(self, *args: Any, budget_bytes: int | None = None, **kwargs: Any):
        kwargs.setdefault("calibrate_host", host_calibration)
        kwargs.setdefault("runtime_probe", runtime_probe)
        if budget_bytes is not None:
            kwargs.setdefault("keeper", budget_keeper)
        super().__init__(*args, budget_bytes=budget_bytes, **kwargs)


def trace_script(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    budget_bytes: int | None = None,
    plan: str | os.PathLike | None = None,
    **kwargs: Any,
) -> Path:
    """``tracer.script.trace_script`` with the runtime as keeper when ``budget_bytes`` is given,
    and the runtime's host-cost calibration (``host_calibration``, ``runtime_probe``). ``plan``:
    trace the program compiled with that plan's recompute tags inside compiled regions, once a
    verifying run found them bitwise (``tags_for_trace``; Note [Region tags] in
    tracer/region_tags.py)."""
    kwargs.setdefault("calibrate_host", host_calibration)
    kwargs.setdefault("runtime_probe", runtime_probe)
    if budget_bytes is not None:
        kwargs.setdefault("keeper", budget_keeper)
    if plan is not None:
        from .runmain import check_script

        check_script(script)
        log = kwargs.get("log") or (lambda line: print(line, file=sys.stderr, flush=True))
        kwargs["region_tags"] = tags_for_trace(
            plan, script, list(args), log, kwargs.get("device", "auto")
        )
    return _script.trace_script(script, args, budget_bytes=budget_bytes, **kwargs)


VERIFY_STEPS = 2  # optimizer steps of each verifying run of region tags


def tags_for_trace(
    plan_path: str | os.PathLike, script, args: list[str], log, device: str = "auto"
) -> dict[str, list[str]] | None:
    """The region tags of the plan at ``plan_path`` that ``capuchin trace --plan`` compiles in:
    refused on CUDA and for a plan without tags; None (one line to ``log``) when the verifying
    run finds them not bitwise (Note [Region tags] in tracer/region_tags.py)."""
    import torch

    from .errors import RegionTagsRefused
    from .planner.plan import load_plan

    plan = load_plan(plan_path)
    if plan.region_tags is None or not plan.region_tags.tags:
        raise RegionTagsRefused(
            f"{plan_path}: the plan carries no region tags to trace with; make one with "
            "capuchin plan --region-tags"
        )
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    where = plan.provenance.device if plan.provenance.device != "cpu" else "cuda"
    if plan.provenance.device != "cpu" or cuda:
        raise RegionTagsRefused(
            f"{plan_path}: recompute tags inside compiled regions are refused on {where}: their "
            "bit-identity is checked by a verifying run, and none has run on a GPU"
        )
    tags = plan.region_tags.tags
    log(f"capuchin: verifying the region tags: {VERIFY_STEPS} steps untagged, then tagged")
    differ = verify_region_tags(script, args, tags)
    if differ:
        log(
            f"capuchin: warning: region tags dropped: {len(differ)} state tensor(s) differ "
            f"from the untagged program after {VERIFY_STEPS} steps (first: {differ[0]}); "
            "traced without them, so a plan swaps those activations instead"
        )
        return None
    return tags


def verify_region_tags(
    script, args: list[str], tags: dict[str, list[str]], steps: int = VERIFY_STEPS
) -> list[str]:
    """Run ``script``'s first ``steps`` optimizer steps untagged, then tagged, from the same
    RNG state, in this process: the names of the state tensors (parameters, gradients,
    optimizer state, buffers) that differ (Note [Region tags]). Both runs are the compiled
    script without capuchin's dispatch modes; the untagged one without its partitioner."""
    import contextlib

    import torch
    import torch._dynamo

    from .tracer import region_tags

    rng = torch.random.get_rng_state()

    def once(context) -> dict:
        torch.random.set_rng_state(rng)
        torch._dynamo.reset()
        return state_after_steps(script, args, steps, context)

    try:
        plain = once(contextlib.nullcontext())
        with_tags = once(region_tags.tagged(tags))
    finally:
        torch.random.set_rng_state(rng)
        torch._dynamo.reset()
    return region_tags.state_differences(plain, with_tags)


def state_after_steps(script, args: list[str], steps: int, context) -> dict:
    """The state after ``script``'s ``steps``-th optimizer step (or at its end), run inside
    ``context``: the parameters, gradients and optimizer state of the optimizers that stepped
    and the ``state_dict()`` of the script's global modules (runtime/snapshot.py). Found
    without global module hooks, which Dynamo would compile into the regions."""
    import contextlib
    import io

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from .runtime.launch import StopAfterSteps, run_under
    from .runtime.snapshot import state_of

    optimizers: list = []
    got: dict = {}

    def take(script_globals: dict) -> None:
        mods = [(k, v) for k, v in script_globals.items() if isinstance(v, torch.nn.Module)]
        got.update(state_of(optimizers, mods))

    count = [0]

    def stepped(opt, a, k):
        if opt not in optimizers:
            optimizers.append(opt)
        count[0] += 1
        if count[0] == steps:
            take(vars(sys.modules["__main__"]))  # runpy's module of the script, as it runs
            raise StopAfterSteps()

    handle = register_optimizer_step_post_hook(stepped)
    try:
        with contextlib.redirect_stdout(io.StringIO()), context:
            ran = run_under(None, script, args)
    finally:
        handle.remove()
    if not got and ran.globals is not None:  # the script ended before ``steps`` steps
        take(ran.globals)
    return got
