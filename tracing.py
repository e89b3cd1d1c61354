"""Tracing composed with the runtime: ``capuchin.Tracer`` and ``trace_script`` under a budget.

The tracer (tracer/) records; the runtime (runtime/) keeps memory within a budget. A trace taken
under a memory cap needs both (Note [Tracing under a budget] in tracer/record.py), and the tracer
never imports the runtime, so they are put together here, one level above both.
"""

from __future__ import annotations

import os
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

    return Runtime(budget_bytes=budget_bytes, device=device, measure_memory=False, eviction="lru")


def host_calibration(nbytes: int, ns_per_byte: tuple[float, float]) -> tuple[dict, dict]:
    """The runtime's slow path, swaps and replays timed on this host now (Note [Calibration of
    the runtime's slow path] in runtime/calibrate.py), for the tracer's ``calibrate_host``."""
    from .runtime.calibrate import host_calibration as calibrate

    return calibrate(nbytes, ns_per_byte)


def runtime_probe(ops: list, leader: Any, path: str) -> Any:
    """The runtime over the script's own steps (Note [The runtime in the script's steps] in
    runtime/calibrate.py), for the tracer's ``runtime_probe``."""
    from .runtime.calibrate import runtime_probe as probe

    return probe(ops, leader, path)


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
    **kwargs: Any,
) -> Path:
    """``tracer.script.trace_script`` with the runtime as keeper when ``budget_bytes`` is given,
    and the runtime's host-cost calibration (``host_calibration``, ``runtime_probe``)."""
    kwargs.setdefault("calibrate_host", host_calibration)
    kwargs.setdefault("runtime_probe", runtime_probe)
    if budget_bytes is not None:
        kwargs.setdefault("keeper", budget_keeper)
    return _script.trace_script(script, args, budget_bytes=budget_bytes, **kwargs)
