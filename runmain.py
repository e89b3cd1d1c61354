"""Run a user's script as ``python SCRIPT ARGS...`` would, inside this process: the one place that
does it (``capuchin trace``, ``capuchin run``, the runtime's test helpers, the benchmarks). No torch.

``runpy.run_path(script, run_name="__main__")`` with ``sys.argv`` rewritten and the script's folder
first on ``sys.path`` (memray's ``run`` command does the same), both restored after, with the
current directory.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import CapuchinError, ScriptError


@contextmanager
def script_environment(script: Path, args: Sequence[str]):
    """``sys.argv = [script, *args]`` and the script's folder first on ``sys.path``; both, and
    the current directory (a script may change it), restored after."""
    old_argv, old_path, old_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        yield
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path
        if os.getcwd() != old_cwd:
            os.chdir(old_cwd)


def run_as_main(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    run_name: str = "__main__",
    consequence: str = "",
) -> dict[str, Any]:
    """Run ``script`` with ``args`` as module ``run_name``; returns its globals.

    ``sys.exit(0)``/``sys.exit()`` are a normal end (globals then empty). A script that is
    missing, exits non-zero or raises gives ``ScriptError``; for an exception its traceback
    (from the script's own frame down) is printed to stderr first and the error is one line:
    ``SCRIPT raised TYPE: first line of the message``, then ``consequence`` (e.g. ``"; no trace
    written"``). ``CapuchinError`` (capuchin refusing something inside the script),
    KeyboardInterrupt and other BaseExceptions pass unchanged.
    """
    path = Path(script)
    if not path.is_file():
        raise ScriptError(f"{script}: no such script")
    with script_environment(path, args):
        try:
            return runpy.run_path(str(path), run_name=run_name)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptError(
                    f"{script}: the script exited with status {exc.code}{consequence}"
                ) from None
            return {}
        except CapuchinError:
            raise
        except Exception as exc:
            print_script_traceback(exc, path)
            raise ScriptError(
                f"{script} raised {type(exc).__name__}: {first_line(exc)}{consequence}"
            ) from None


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (at most 200 characters), marked when there are more."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return "(no message)"
    more = " (more in the traceback above)" if len(lines) > 1 or len(lines[0]) > 200 else ""
    return lines[0][:200] + more


def print_script_traceback(exc: BaseException, script: Path) -> None:
    """The script's traceback, without the frames of capuchin and runpy above it."""
    tb = exc.__traceback__
    target = str(script.resolve())
    frames = tb
    while frames is not None and os.path.abspath(frames.tb_frame.f_code.co_filename) != target:
        frames = frames.tb_next
    lines = traceback.format_exception(type(exc), exc, frames if frames is not None else tb)
    sys.stderr.write("".join(lines))
    sys.stderr.flush()
