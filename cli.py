"""The `capuchin` command. Each command parses flags and calls one library function; only this
module turns ``CapuchinError`` into a one-line message and an exit code. Nothing imports it.

Heavy modules (torch, the planner) are imported inside each command so `capuchin --help` is fast.
"""

from __future__ import annotations

import functools
import sys

import click

from . import __version__
from .errors import CapuchinError


def _errors_to_exit(fn):
    """Turn a CapuchinError into `capuchin: <message>` on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CapuchinError as err:
            click.echo(f"capuchin: error: {err}", err=True)
            sys.exit(err.exit_code)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="capuchin")
def main() -> None:
    """Train PyTorch models that do not fit in GPU memory: trace, plan, run (Capuchin, ASPLOS'20)."""


# ---- tracer (issue 2) -----------------------------------------------------------------------
# CLI-TRACE-BEGIN
# CLI-TRACE-END


# ---- show: a trace (.parquet) or a plan (.json) ---------------------------------------------
# CLI-SHOW-BEGIN
# CLI-SHOW-END


# ---- planner (issue 3) ----------------------------------------------------------------------
# CLI-PLAN-BEGIN
# CLI-PLAN-END


# ---- peers: compare, import-dtr (issue 4) ---------------------------------------------------
# CLI-COMPARE-BEGIN
# CLI-COMPARE-END


# ---- runtime (issue 5) ----------------------------------------------------------------------
# CLI-RUN-BEGIN
# CLI-RUN-END


if __name__ == "__main__":
    main()
