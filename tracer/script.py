"""Trace an unmodified training script: what ``capuchin trace`` calls.

``trace_script`` is the ``Tracer`` context manager around ``runmain.run_as_main(script)`` (the
script run as ``python SCRIPT ARGS...`` would, inside this process).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..runmain import check_script, run_as_main
from .schema import FILE_SUFFIX


def default_output(script: str | os.PathLike) -> Path:
    """``<script stem>.trace.parquet`` in the current directory."""
    return Path(Path(script).stem + FILE_SUFFIX)


def trace_script(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    output: str | os.PathLike | None = None,
    iterations: int = 3,
    warmup: int | None = None,
    device: str = "auto",
    force: bool = False,
    log: Callable[[str], None] | None = None,
    budget_bytes: int | None = None,
    plain_steps: int = 3,
    keeper: Callable | None = None,
    calibrate_host: Callable | None = None,
    runtime_probe: Callable | None = None,
    region_tags: dict | None = None,
) -> Path:
    """Trace ``script`` (run with ``args``) into ``output`` (default ``<stem>.trace.parquet``).

    Returns the written path. Raises ScriptError when the script is missing, raises (its traceback
    is printed to stderr first), exits non-zero or never reaches a recorded iteration; no file is
    written then. ``budget_bytes``: trace under this memory cap (Note [Tracing under a budget] in
    tracer/record.py), kept by ``keeper`` (capuchin/tracing.py supplies the runtime's, and its
    ``calibrate_host`` and ``runtime_probe``: Note [Calibrated host costs] in
    planner/costs.py). ``plain_steps``: Note [Plain step] there. ``region_tags``: compiled in
    (Note [Region tags] in tracer/region_tags.py; verified by the caller). See ``Tracer`` for
    the other arguments.
    """
    from .record import Tracer

    path = check_script(script)
    out = Path(output) if output is not None else default_output(path)
    kwargs = {"log": log} if log is not None else {}
    tracer = Tracer(
        out,
        iterations=iterations,
        warmup=warmup,
        device=device,
        force=force,
        script=str(script),
        argv=list(args),
        budget_bytes=budget_bytes,
        plain_steps=plain_steps,
        keeper=keeper,
        calibrate_host=calibrate_host,
        runtime_probe=runtime_probe,
        region_tags=region_tags,
        **kwargs,
    )
    with tracer:
        run_as_main(path, args, consequence="; no trace written")
    return tracer.path
