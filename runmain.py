"""Run a user's script as ``python SCRIPT ARGS...`` would, inside this process: the one place that
does it (``capuchin trace``, ``capuchin run``, the runtime's test helpers, the benchmarks). No torch.

``runpy.run_path(script, run_name="__main__")`` with ``sys.argv`` rewritten and the script's folder
first on ``sys.path`` (memray's ``run`` command does the same), both restored after, with the
current directory.

# Note: [os._exit in a script]
# Some scripts end with ``os._exit(0)`` (so that worker threads cannot hang the exit). Run inside
# capuchin, that would end the process before the trace or the report is written, with status 0
# and no word. While the script runs, ``os._exit`` called in the main thread raises ``_OsExit``
# instead, which ends the script like ``sys.exit``: status 0 is a normal end (capuchin then writes
# its files), another status a ``ScriptError``. ``os_exit_requested`` keeps the status, so that
# the command, once its files are written, ends with ``os._exit`` as the script asked when
# non-daemon threads would otherwise keep the process alive. Called from another thread it is
# the real ``os._exit``, after one line on stderr saying that nothing was written. In a process
# forked from the script's (DataLoader workers, which end with ``os._exit``), it is the real one:
# raising there would unwind the child into capuchin's own code (or a test runner's) and run it
# a second time.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import CapuchinError, ScriptError

os_exit_requested: int | None = None  # Note [os._exit in a script]


class _OsExit(BaseException):
    """``os._exit(status)`` called by the script in the main thread."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


@contextmanager
def _catch_os_exit(script):
    real = os._exit
    main = threading.main_thread()
    pid = os.getpid()

    def script_os_exit(status):
        if os.getpid() != pid:  # a forked child (DataLoader workers end with os._exit)
            real(status)
        if threading.current_thread() is main:
            raise _OsExit(int(status))
        sys.stderr.write(
            f"capuchin: error: {script}: the script called os._exit({status}) in a thread; "
            "the process ends now, nothing written\n"
        )
        sys.stderr.flush()
        real(status)

    os._exit = script_os_exit
    try:
        yield
    finally:
        os._exit = real


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


def check_script(script: str | os.PathLike) -> Path:
    """``script`` as a path to an existing file, else ``ScriptError``."""
    if str(script) == "-m":
        raise ScriptError(
            "-m: module mode (python -m MODULE) is not supported; give the module's file, e.g. "
            "capuchin trace path/to/module.py"
        )
    path = Path(script)
    if not path.is_file():
        raise ScriptError(f"{script}: no such script")
    return path


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
    global os_exit_requested
    path = check_script(script)
    with script_environment(path, args), _catch_os_exit(script):
        try:
            return runpy.run_path(str(path), run_name=run_name)
        except _OsExit as exc:  # Note [os._exit in a script]
            if exc.status != 0:
                raise ScriptError(
                    f"{script}: the script called os._exit({exc.status}){consequence}"
                ) from None
            os_exit_requested = 0
            return {}
        except SystemExit as exc:
            if exc.code in (None, 0):
                return {}
            if isinstance(exc.code, int):
                raise ScriptError(
                    f"{script}: the script exited with status {exc.code}{consequence}"
                ) from None
            # sys.exit("message"): Python prints the message and exits with status 1
            print(exc.code, file=sys.stderr, flush=True)
            raise ScriptError(
                f"{script}: the script exited with status 1 and the message above{consequence}"
            ) from None
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
    if frames is None:  # it never ran (a syntax error, a binary file): the error alone
        lines = traceback.format_exception_only(type(exc), exc)
    else:
        lines = traceback.format_exception(type(exc), exc, frames)
    sys.stderr.write("".join(lines))
    sys.stderr.flush()
