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
@main.command("import-dtr")
@click.argument("log", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default=None,
              help="Trace file to write (default: dtr-<model>-<batch>.trace.parquet here).")
@click.option("--bandwidth", "bandwidth", default=None, metavar="RATE",
              help="Host<->device bandwidth for both directions, e.g. 12GB/s (10^9) or "
                   "16e9 (bytes/s; default 12GB/s, the paper's PCIe 3.0 x16).")
@click.option("--force", is_flag=True, help="Overwrite the output file.")
@_errors_to_exit
def import_dtr_cmd(log: str, output: str | None, bandwidth: str | None, force: bool) -> None:
    """Convert a DTR log (JSON lines) into a trace.

    LOG is a log file or a path inside the zip, e.g. dtr-logs.zip/logs/resnet32-56-...log (a unique
    prefix of the log's name is enough: dtr-logs.zip/resnet32).
    """
    from .planner.budget import parse_rate
    from .tracer.dtr_import import PCIE3_X16_BYTES_PER_S, import_dtr_log

    rate = PCIE3_X16_BYTES_PER_S if bandwidth is None else parse_rate(bandwidth)
    path = import_dtr_log(log, output, bandwidth_bytes_per_s=rate, force=force)
    click.echo(f"wrote {path}")


@main.command("compare")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=str))
@click.option("--budget", "budgets", required=True, metavar="SIZE[,SIZE...]",
              help="Budgets: bytes or 8G, 512MiB, or a fraction of the peak: 60%.")
@click.option("--policies", default=None, metavar="a,b,...",
              help="Policies to compare (default: every registered policy).")
@click.option("--time-limit", "time_limit_s", type=float, default=None, metavar="SECONDS",
              help="Time limit per solve for policies that take one (the ILP).")
@click.option("--no-search", is_flag=True, help="Skip the smallest-feasible-budget search.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of records instead.")
@_errors_to_exit
def compare_cmd(trace: str, budgets: str, policies: str | None, time_limit_s: float | None,
                no_search: bool, as_json: bool) -> None:
    """Run every policy on TRACE at each budget through the one simulator; print a table."""
    from .planner.compare import compare_policies, format_comparison, records_to_json

    result = compare_policies(
        trace, budgets, policies=policies.split(",") if policies else None,
        time_limit_s=time_limit_s, search_smallest=not no_search)
    click.echo(records_to_json(result) if as_json else format_comparison(result))
# CLI-COMPARE-END


# ---- runtime (issue 5) ----------------------------------------------------------------------
# CLI-RUN-BEGIN
# CLI-RUN-END


if __name__ == "__main__":
    main()
