"""The `capuchin` command. Each command parses flags and calls one library function; only this
module turns ``CapuchinError`` into a one-line message and an exit code. Nothing imports it.

Heavy modules (torch, the planner) are imported inside each command so `capuchin --help` is fast.
Exit codes (errors.py, docs/errors.md): 0 ok, 1 error, 2 budget cannot be met, 64 bad command line,
130 interrupted (SIGINT), 143 terminated (SIGTERM). A command that writes files checks every
output with ``outputs.check_output`` before it does any work and writes it with
``outputs.atomic_write`` (Note [Output files]).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from . import __version__
from .distributed import tagged
from .errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, CapuchinError, Terminated


class _Group(click.Group):
    """click's group with capuchin's exit codes: usage errors exit ``EXIT_USAGE`` (click's 2 is
    capuchin's "budget cannot be met"), SIGINT ``EXIT_INTERRUPTED``, SIGTERM ``EXIT_TERMINATED``
    (raised as ``Terminated`` so that temporary files are removed on the way out)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        from . import runmain
        from .outputs import raise_on_sigterm, restore_sigterm

        runmain.os_exit_requested = None
        previous = raise_on_sigterm()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as err:
            err.show()
            sys.exit(EXIT_USAGE)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo(tagged("capuchin: interrupted"), err=True)
            sys.exit(EXIT_INTERRUPTED)
        except Terminated:
            click.echo(tagged("capuchin: terminated"), err=True)
            sys.exit(EXIT_TERMINATED)
        finally:
            restore_sigterm(previous)
        code = rv if isinstance(rv, int) else 0
        _os_exit_if_asked(code)
        sys.exit(code)


def _os_exit_if_asked(code: int) -> None:
    """Note [os._exit in a script] (runmain.py): the script asked to end with ``os._exit`` and
    threads it left would keep the process alive: end so, now that the files are written."""
    import threading

    from . import runmain

    if runmain.os_exit_requested is None:
        return
    runmain.os_exit_requested = None
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _errors_to_exit(fn):
    """Turn a CapuchinError into `capuchin: <message>` on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CapuchinError as err:
            click.echo(tagged(f"capuchin: error: {err}"), err=True)
            sys.exit(err.exit_code)

    return wrapper


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="capuchin")
def main() -> None:
    """Train PyTorch models that do not fit in GPU memory: trace, plan, run (Capuchin, ASPLOS'20)."""


# ---- tracer -----------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "-o",
    "--output",
    type=click.Path(),  # a folder: check_output's one line
    default=None,
    help="Trace file to write [default: <script stem>.trace.parquet].",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Iterations to record.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=None,
    help="Iterations to run before recording [default: 1; 2 under torchrun].",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Device whose memory and timeline are traced.",
)
@click.option(
    "--budget",
    default=None,
    metavar="SIZE",
    help="Trace within SIZE of device memory (8G, 512MiB, bytes) by passive eviction; "
    "the trace still records the unmanaged program.",
)
@click.option(
    "--plain-steps",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="After the recorded iterations, time this many more without tracer or profiler "
    "(one more runs first as a warm-up); plans state their overhead against their median. "
    "0: stop right after the recorded iterations.",
)
@click.option(
    "--plan",
    "plan_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Compile with this plan's recompute tags inside compiled regions (capuchin plan "
    "--region-tags), once a verifying run finds them bitwise; else traced without them.",
)
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@_errors_to_exit
def trace(
    output, force, iterations, warmup, device, budget, plain_steps, plan_path, script, script_args
):
    """Record a tensor access trace of an unmodified training SCRIPT.

    SCRIPT runs as `python SCRIPT SCRIPT_ARGS...` would; iterations are delimited by optimizer
    steps (or capuchin.step()). After warm-up plus the recorded iterations the script is stopped
    and the trace written (after --plain-steps more, timed plain). Options after SCRIPT (or after `SCRIPT --`) are the script's.
    """
    from .tracer.script import default_output
    from .tracing import trace_script

    budget_bytes = None
    if budget is not None:
        from .planner.budget import BudgetError, parse_budget

        if str(budget).strip().endswith("%"):
            raise BudgetError(
                f"--budget {budget}: a percentage needs a peak, and tracing is what "
                "measures it; give a size (8G, 512MiB, bytes)"
            )
        budget_bytes = parse_budget(budget)
    if script_args[:1] == ("--",):  # `capuchin trace train.py -- --lr 0.1`: the separator is ours
        script_args = script_args[1:]
    out = output if output is not None else default_output(script)
    path = trace_script(
        script,
        list(script_args),
        output=out,
        iterations=iterations,
        warmup=warmup,
        device=device,
        force=force,
        budget_bytes=budget_bytes,
        plain_steps=plain_steps,
        plan=plan_path,
    )
    click.echo(tagged(f"capuchin: wrote {path}"), err=True)


# ---- show: a trace (.parquet) or a plan (.json) ---------------------------------------------
@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--plot",
    type=click.Path(),  # a folder: check_output's one line
    default=None,
    help="Plans: write the memory curve before/after as an image.",
)
@click.option(
    "--chrome",
    type=click.Path(),  # a folder: check_output's one line
    default=None,
    help="Plans: write a Chrome trace (chrome://tracing) of the simulated schedule.",
)
@click.option("--force", is_flag=True, help="Overwrite existing --plot / --chrome files.")
@_errors_to_exit
def show(path, as_json, plot, chrome, force):
    """Summarize a trace (.parquet) or a plan (.json)."""
    if not Path(path).exists():
        from .distributed import ranked_files

        ranks = ranked_files(path)
        if ranks:  # written under torchrun: one file per rank, none under the name given
            raise CapuchinError(
                f"{path}: no such file; it was written per rank: "
                f"{', '.join(str(f) for f in ranks.values())}; show one of them"
            )
    if not str(path).endswith(".parquet"):
        try:
            from .planner.report import show_plan
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("capuchin"):
                raise CapuchinError(
                    f"{path}: not a trace (.parquet), and this capuchin cannot "
                    "show plans (capuchin.planner.report is missing)"
                ) from None
            raise
        click.echo(show_plan(path, as_json=as_json, plot=plot, chrome=chrome, force=force))
        return
    if plot or chrome:
        raise CapuchinError(f"{path}: --plot and --chrome apply to plans, not to traces")
    from .tracer.reader import load_trace
    from .tracer.summary import format_summary, summarize

    trace = load_trace(path)
    summary = summarize(trace)
    floor = _floor(trace)  # what no plan can move off the device (Problem.floor_breakdown)
    if as_json:
        import json

        doc = json.loads(summary.to_json())
        if floor is not None:
            doc["floor"] = floor[0]
        click.echo(json.dumps(doc))
    else:
        click.echo(format_summary(summary) + (f"\n{floor[1]}" if floor is not None else ""))


def _floor(trace):
    """``(Problem.floor_breakdown(), one line)`` of the trace's steady iteration, or None when
    it has none to plan (irregular, empty)."""
    from .planner.api import floor_text
    from .planner.budget import format_bytes
    from .planner.problem import Problem

    try:
        problem = Problem.from_trace(trace)
    except CapuchinError:
        return None
    b = problem.floor_breakdown()
    pct = b["floor_bytes"] / problem.peak_bytes if problem.peak_bytes else 1.0
    return b, (
        f"floor {format_bytes(b['floor_bytes'])} ({pct:.0%} of the peak; no plan goes "
        f"below): {floor_text(problem)}"
    )


# ---- planner ----------------------------------------------------------------------
@main.command("plan")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "--budget",
    required=True,
    metavar="SIZE",
    help="Device memory budget: bytes, 8G / 8GiB (2^30), 8GB (10^9), 512M, or a share "
    "of the trace's peak: 60%.",
)
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(),  # a folder: check_output's one line
    help="Plan file to write (default: <trace stem>.plan.json here).",
)
@click.option(
    "--policy",
    default="capuchin",
    show_default=True,
    help="Registered policy (capuchin, swap, recompute, ...).",
)
@click.option(
    "--bandwidth",
    default=None,
    metavar="RATE",
    help="Override the trace's host<->device bandwidth, both ways (12GB/s, 16e9).",
)
@click.option(
    "--iteration",
    type=int,
    default=None,
    help="Recorded iteration to plan (default: the trace's steady one).",
)
@click.option(
    "--time-limit",
    "time_limit_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Wall-clock limit of the solve, for policies that search (ilp); ignored, "
    "with a note, by the others.",
)
@click.option(
    "--region-tags",
    is_flag=True,
    help="Propose recompute tags inside compiled regions (the trace's candidates); the plan "
    "then needs a retrace: capuchin trace --plan PLAN SCRIPT, and a plan of that trace.",
)
@click.option("--force", is_flag=True, help="Overwrite the output file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_errors_to_exit
def plan_cmd(
    trace, budget, output, policy, bandwidth, iteration, time_limit_s, region_tags, force, as_json
):
    """Compute the swap/recompute plan that fits TRACE's iteration into a memory budget.

    Exit status 2 when no plan of the policy fits the budget (the message names the smallest
    budget that works). With --policy ilp the summary gives the solver's status and optimality
    gap (--json: keys status, optimality_gap).
    """
    from .planner.api import plan_files

    # every rank's trace of a torchrun job: one plan each (Note [Per-rank files])
    for plan, path in plan_files(
        trace,
        budget,
        output,
        policy=policy,
        bandwidth=bandwidth,
        iteration=iteration,
        force=force,
        time_limit_s=time_limit_s,
        region_tags=region_tags,
    ):
        _print_plan(plan, path, as_json)


def _print_plan(plan, path, as_json: bool) -> None:
    import json

    from .planner.api import format_solver_report, plan_summary
    from .planner.report import format_summary

    if as_json:
        click.echo(json.dumps({**plan_summary(plan), "output": str(path)}))
    else:
        text = format_summary(plan, output=path)
        solver = format_solver_report(plan)
        if solver:  # before the "wrote ..." line
            head, sep, tail = text.rpartition("\nwrote ")
            text = f"{head}\n{solver}{sep}{tail}" if sep else f"{text}\n{solver}"
        click.echo(text)


# ---- peers: compare, import-dtr ---------------------------------------------------
@main.command("import-dtr")
@click.argument("log", type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(),  # a folder: check_output's one line
    default=None,
    help="Trace file to write (default: dtr-<model>-<batch>.trace.parquet here).",
)
@click.option(
    "--bandwidth",
    "bandwidth",
    default=None,
    metavar="RATE",
    help="Host<->device bandwidth for both directions, e.g. 12GB/s (10^9) or "
    "16e9 (bytes/s; default 12GB/s, the paper's PCIe 3.0 x16).",
)
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
@click.option(
    "--budget",
    "budgets",
    required=True,
    metavar="SIZE[,SIZE...]",
    help="Budgets: bytes or 8G, 512MiB, or a fraction of the peak: 60%.",
)
@click.option(
    "--policies",
    default=None,
    metavar="a,b,...",
    help="Policies to compare (default: every registered policy).",
)
@click.option(
    "--time-limit",
    "time_limit_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Time limit per solve for policies that take one (the ILP).",
)
@click.option("--no-search", is_flag=True, help="Skip the smallest-feasible-budget search.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of records instead.")
@click.option(
    "--plot",
    "plot",
    type=click.Path(),  # a folder: check_output's one line
    default=None,
    help="Also draw every policy's memory curve at the smallest budget into this PNG.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --plot file.")
@_errors_to_exit
def compare_cmd(
    trace: str,
    budgets: str,
    policies: str | None,
    time_limit_s: float | None,
    no_search: bool,
    as_json: bool,
    plot: str | None,
    force: bool,
) -> None:
    """Run every policy on TRACE at each budget through the one simulator; print a table.

    Per policy and budget: feasible, predicted peak, overhead, bytes swapped, ops recomputed,
    solve time (and the ILP's status and optimality gap). Then each policy's smallest feasible
    budget, found by bisection between the trace's floor (what must stay resident) and its peak.
    """
    from .outputs import IMAGE_SUFFIXES, check_output
    from .planner.api import load_problem
    from .planner.compare import compare_policies, format_comparison, records_to_json

    if plot:
        check_output(plot, force=force, inputs=[trace], suffixes=IMAGE_SUFFIXES)
    problem = load_problem(trace)  # once: the table and the plot use the same
    result = compare_policies(
        problem,
        budgets,
        policies=policies.split(",") if policies else None,
        time_limit_s=time_limit_s,
        search_smallest=not no_search,
    )
    click.echo(records_to_json(result) if as_json else format_comparison(result))
    if plot:
        from pathlib import Path

        from .planner.budget import format_bytes
        from .planner.views import plot_plans

        budget = min(r.budget_bytes for r in result.records)
        plans = {pol: pl for (pol, b), pl in result.plans.items() if b == budget and pl}
        out = plot_plans(
            plans,
            plot,
            problem=problem,
            title=f"{Path(trace).name}: every policy at {format_bytes(budget)}",
            force=force,
        )
        click.echo(f"wrote {out}", err=as_json)


# ---- runtime ----------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--plan",
    "plan",
    type=click.Path(dir_okay=False),
    default=None,
    help="Plan file (capuchin plan). Without it, --budget runs in dynamic mode.",
)
@click.option(
    "--budget",
    default=None,
    metavar="SIZE",
    help="Budget in bytes or 8G / 512MiB (default: the plan's).",
)
@click.option(
    "--report",
    "report",
    type=click.Path(),  # a folder: check_output's one line
    default=None,
    help="Write the per-iteration JSON report there.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing report.")
@click.option(
    "--no-measure", is_flag=True, help="Do not measure peaks with the profiler (faster on CPU)."
)
@click.option(
    "--eviction",
    type=click.Choice(["dtr", "lru"]),
    default="dtr",
    show_default=True,
    help="Where no plan applies: DTR's eviction and replay (dynamic mode) or "
    "swapping the least recently used storage.",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    metavar="auto|cpu|cuda[:N]",
    help="Device whose memory is managed (auto: the plan's; without a plan, cpu on a host "
    "without CUDA, else name it).",
)
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@_errors_to_exit
def run(plan, budget, report, force, no_measure, eviction, device, script, script_args):
    """Run SCRIPT [SCRIPT_ARGS]... to its end, unmodified, enforcing the plan; print a summary."""
    from .planner.budget import parse_budget
    from .runtime.launch import run_script

    budget_bytes = parse_budget(budget) if budget is not None else None
    if plan is None and budget_bytes is None:
        raise click.UsageError("give --plan PLAN (or --budget SIZE for dynamic mode)")
    rep = run_script(
        script,
        list(script_args),
        plan=plan,
        budget_bytes=budget_bytes,
        report_path=report,
        force=force,
        measure_memory=not no_measure,
        eviction=eviction,
        device=device,
    )
    click.echo(rep.summary())
    if report:
        from .distributed import per_rank

        click.echo(f"wrote {per_rank(report)}")


# ---- max-batch ------------------------------------------------------------------------------
@main.command(
    "max-batch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option(
    "--memory",
    required=True,
    metavar="SIZE",
    help="Device memory to fit: 8G / 8GiB (2^30), 8GB (10^9), 512M, bytes.",
)
@click.option(
    "--arg",
    "arg",
    required=True,
    metavar="NAME",
    help="The script's option to maximize, e.g. --batch (appended as NAME VALUE).",
)
@click.option(
    "--policy",
    default="capuchin",
    show_default=True,
    help="The chosen policy (its largest value is verified by a real run).",
)
@click.option(
    "--compare",
    default="checkpoint-sqrt,dtr,swap,recompute",
    show_default=True,
    metavar="P[,P...]",
    help="Comparison policies also searched ('' for none); also the runtime modes with no plan, "
    "dynamic and lru (every candidate run under the memory).",
)
@click.option(
    "--max-overhead",
    default=None,
    metavar="PCT",
    help="Largest predicted overhead accepted (20% or 20) [default: no limit].",
)
@click.option(
    "--min",
    "min_value",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Smallest value tried (the doubling starts here).",
)
@click.option(
    "--max",
    "max_value",
    type=click.IntRange(min=1),
    default=65536,
    show_default=True,
    help="Largest value tried.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=5,
    show_default=True,
    help="Optimizer steps of the verifying run.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Device whose memory is fitted.",
)
@click.option(
    "--time-all",
    is_flag=True,
    help="Also run every compared policy at its own largest value (time per sample).",
)
@click.option("--no-verify", is_flag=True, help="Skip the verifying run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@_errors_to_exit
def max_batch_cmd(
    memory,
    arg,
    policy,
    compare,
    max_overhead,
    min_value,
    max_value,
    steps,
    device,
    time_all,
    no_verify,
    as_json,
    script,
    script_args,
):
    """Find the largest value of SCRIPT's option --arg that trains within --memory.

    Each candidate is traced under the memory cap and planned at it; search by doubling, then
    bisection. Reports the largest value unmanaged, under each compared policy and under the
    chosen one, then verifies the chosen one with a real run (measured peak, time per sample vs
    unmanaged at its own largest value). Options after SCRIPT are the script's.
    """
    import json

    from .maxbatch import max_batch

    if max_value < min_value:
        raise click.UsageError(f"--min {min_value} is above --max {max_value}")
    overhead = None
    if max_overhead is not None:
        text = str(max_overhead).strip().rstrip("%")
        try:
            overhead = float(text) / 100
        except ValueError:
            raise CapuchinError(
                f"--max-overhead {max_overhead}: expected a percentage like 20% or 20"
            ) from None
    if script_args[:1] == ("--",):
        script_args = script_args[1:]
    result = max_batch(
        script,
        list(script_args),
        memory=memory,
        arg=arg,
        policy=policy,
        max_overhead=overhead,
        min_value=min_value,
        max_value=max_value,
        steps=steps,
        device=device,
        compare=[p for p in compare.split(",") if p.strip()],
        verify=not no_verify,
        time_all=time_all,
    )
    click.echo(json.dumps(result.to_dict(), sort_keys=True) if as_json else result.summary())


if __name__ == "__main__":
    main()
