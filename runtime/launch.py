"""``capuchin run``: the unmodified script under a ``Runtime`` (``runpy``, ``sys.argv`` rewritten, as
``capuchin trace`` does)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from ..errors import CapuchinError, ScriptError
from .engine import Runtime
from .report import RunReport


def run_script(script: str | os.PathLike, script_args: list[str] | tuple[str, ...] = (), *,
               plan: str | os.PathLike | None = None, budget_bytes: int | None = None,
               report_path: str | os.PathLike | None = None, force: bool = False,
               measure_memory: bool = True) -> RunReport:
    """Run ``script`` to its end under the plan; returns the run's report (and writes it to
    ``report_path`` if given). Raises ``ScriptError`` if the script fails."""
    script = Path(script)
    if not script.is_file():
        raise ScriptError(f"{script}: no such script")
    if report_path is not None and Path(report_path).exists() and not force:
        raise CapuchinError(f"{report_path}: exists; pass --force to overwrite")
    rt = Runtime(plan, budget_bytes=budget_bytes, measure_memory=measure_memory)
    argv, path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        with rt:
            runpy.run_path(str(script), run_name="__main__")
    except CapuchinError:
        raise
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptError(f"{script}: exited with status {exc.code}") from None
    except Exception as exc:
        raise ScriptError(f"{script}: raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.argv = argv
        if sys.path and sys.path[0] == str(script.resolve().parent) and path0 != sys.path[0]:
            sys.path.pop(0)
    if rt.report is None:
        raise ScriptError(f"{script}: ended without a report")
    if report_path is not None:
        rt.report.save(report_path)
    return rt.report
