"""Run an unmodified training script as ``python SCRIPT ARGS...`` would, inside this process.

``trace_script`` is what ``capuchin trace`` calls: the ``Tracer`` context manager around
``runpy.run_path(script, run_name="__main__")`` with ``sys.argv`` rewritten and the script's folder
first on ``sys.path`` (memray's ``run`` command does the same).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..errors import CapuchinError, ScriptError
from .schema import FILE_SUFFIX


def default_output(script: str | os.PathLike) -> Path:
    """``<script stem>.trace.parquet`` in the current directory."""
    return Path(Path(script).stem + FILE_SUFFIX)


@contextmanager
def script_environment(script: Path, args: Sequence[str]):
    """``sys.argv = [script, *args]`` and the script's folder first on ``sys.path``, restored after."""
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        yield
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path


def run_script(script: str | os.PathLike, args: Sequence[str] = ()) -> None:
    """Run ``script`` as ``__main__`` with ``args``. ``sys.exit(0)``/``sys.exit()`` are a normal end;
    a non-zero exit raises ScriptError; any other exception propagates unchanged."""
    path = Path(script)
    if not path.is_file():
        raise ScriptError(f"{script}: no such script")
    with script_environment(path, args):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptError(f"{script}: the script exited with status {exc.code}") from None


def trace_script(script: str | os.PathLike, args: Sequence[str] = (), *,
                 output: str | os.PathLike | None = None, iterations: int = 3, warmup: int = 1,
                 device: str = "auto", force: bool = False,
                 log: Callable[[str], None] | None = None,
                 budget_bytes: int | None = None) -> Path:
    """Trace ``script`` (run with ``args``) into ``output`` (default ``<stem>.trace.parquet``).

    Returns the written path. Raises ScriptError when the script is missing, raises (its traceback
    is printed to stderr first), exits non-zero or never reaches a recorded iteration; no file is
    written then. ``budget_bytes``: trace under this memory cap (Note [Tracing under a budget] in
    tracer/record.py). See ``Tracer`` for the other arguments.
    """
    from .record import Tracer

    path = Path(script)
    if not path.is_file():
        raise ScriptError(f"{script}: no such script")
    out = Path(output) if output is not None else default_output(path)
    kwargs = {"log": log} if log is not None else {}
    tracer = Tracer(out, iterations=iterations, warmup=warmup, device=device, force=force,
                    script=str(script), argv=list(args), budget_bytes=budget_bytes, **kwargs)
    try:
        with tracer:
            run_script(path, args)
    except (CapuchinError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # the script itself failed
        _print_script_traceback(exc, path)
        raise ScriptError(f"{script} raised {type(exc).__name__}: {_first_line(exc)}; "
                          "no trace written") from None
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"


def _print_script_traceback(exc: BaseException, script: Path) -> None:
    """The script's traceback, without the frames of capuchin and runpy above it."""
    tb = exc.__traceback__
    target = str(script.resolve())
    frames = tb
    while frames is not None and os.path.abspath(frames.tb_frame.f_code.co_filename) != target:
        frames = frames.tb_next
    lines = traceback.format_exception(type(exc), exc, frames if frames is not None else tb)
    sys.stderr.write("".join(lines))
    sys.stderr.flush()
