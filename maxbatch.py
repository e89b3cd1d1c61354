"""``capuchin max-batch`` / ``capuchin.max_batch``: the largest value of a script's option (its
batch size, sequence length, width...) that trains within a given memory, unmanaged and under each
policy, verified by a real run.

    result = capuchin.max_batch("train.py", memory="8G", arg="--batch")
    result.chosen, result.unmanaged_max, result.max_by_policy, result.verified_peak_bytes

# Note: [Max-batch search]
# A candidate value v is judged on one trace of the script run with ``ARG v``, recorded under the
# memory cap itself (``Tracer(budget_bytes=memory)``, Note [Tracing under a budget] in
# tracer/record.py), so a value that does not fit the device unmanaged can still be traced (on
# CUDA the cap is real; an out-of-memory error while tracing under it means the value does not
# fit at all). One trace serves every judge: unmanaged training fits when the trace's computed
# peak (the unmanaged program's) is <= memory; a policy fits when its plan at memory is feasible
# in the simulator and, with ``max_overhead``, its predicted overhead is at most that. Each judge
# is searched separately by doubling from ``min_value`` until it fails (or ``max_value``), then by
# bisection between the last value that fit and the first that did not, so each reports the exact
# largest value under the assumption that fitting is monotone in the value (traces and plans are
# cached per value, so the judges share them). The chosen policy's largest value is then verified
# by a ``capuchin run`` of ``steps`` optimizer steps under its plan: the allocator's measured peak
# (max over every iteration, the first, passive one included) against memory, and the time per
# sample (median step-to-step time / value, steps after the first) against plain training at
# unmanaged's own largest value.

# Note: [Runtime modes]
# ``compare`` may also name the runtime's modes that need no trace and no plan: ``dynamic``
# (``Runtime(budget_bytes=memory)``: DTR's eviction and replay, runtime/guards/dtr.py) and ``lru``
# (the paper's passive mode: ``eviction="lru"``). They answer "how large a batch fits with no
# plan at all". A mode has no prediction to judge, so every candidate value is *run*: ``steps``
# optimizer steps under the budget ``memory``; it fits when the run completes and its measured
# peak (every iteration, the first included) is within VERIFY_TOLERANCE of memory. The same
# doubling and bisection find its largest value, and the run at that value is its verifying run
# (``runs[mode]``: peak, time per sample).

# Note: [Verified, not only planned]
# The answer is a value that was *run*: when the verifying run's measured peak is more than
# VERIFY_TOLERANCE (5%, the runtime's own standard for a plan) over memory, the next smaller value
# whose plan fits is verified instead, up to VERIFY_TRIES runs; ``rejected`` lists the values
# given up and ``planned_max`` the value the plans alone allowed. Seen on the CPU runtime: a
# prefetch that arrives late makes the runtime move its in-trigger earlier for the next
# iteration (runtime/swap.py), which the plan's simulated peak does not include (+5.5% of memory
# on traces/hf_resnet.py at batch 13, in 2 of 3 runs at load 9).

# Note: [An option that does not change memory]
# The search assumes that memory grows with the value. A script that ignores the option, or
# parses with ``parse_known_args`` and so accepts any option without using it, gives the same
# unmanaged peak, to the byte, at every value: the doubling then runs to ``max_value`` and would
# report it as the largest value that fits. When every traced value (two at least) has the same
# peak, the search stops with an error naming the option instead of answering.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CapuchinError, ScriptError, Terminated
from .planner.budget import format_bytes

COMPARISON_POLICIES = ("checkpoint-sqrt", "dtr", "swap", "recompute")
RUNTIME_MODES = {"dynamic": "dtr", "lru": "lru"}  # Note [Runtime modes]: name -> Runtime eviction
VERIFY_TOLERANCE = 0.05  # Note [Verified, not only planned]
VERIFY_TRIES = 3
UNMANAGED = "unmanaged"


class MaxBatchError(CapuchinError):
    """max-batch cannot answer: bad option name, memory too small, the script fails."""


@dataclass
class Candidate:
    """What one traced value gave: the unmanaged peak, the measured peak while tracing under the
    cap, and per policy (feasible, predicted overhead, predicted peak)."""

    value: int
    fits_device: bool = True  # False: out of memory while tracing under the cap (CUDA)
    peak_bytes: int | None = None
    floor_bytes: int | None = None
    measured_peak_bytes: int | None = None
    iteration_time_s: float | None = None  # the trace's steady iteration (device timeline)
    trace_s: float = 0.0
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class PolicyRun:
    """A run of ``steps`` steps at one value: measured peak and time per sample."""

    value: int
    peak_bytes: int | None
    steady_peak_bytes: int | None
    time_per_sample_s: float | None
    step_times_s: list[float]
    report: dict | None = None
    steps: int = 0  # optimizer steps made (fewer than asked when the script stopped first)


@dataclass
class MaxBatchResult:
    script: str
    arg: str
    memory_bytes: int
    device: str
    policy: str
    chosen: int  # the chosen policy's largest value (0: none fits)
    unmanaged_max: int
    max_by_policy: dict[str, int]  # every judged policy (n/a ones left out) -> largest value
    not_applicable: dict[str, str]  # policy -> why it does not apply to this script
    max_overhead: float | None
    predicted_overhead: float | None  # the chosen policy's plan at its largest value
    verified_peak_bytes: int | None
    verified_steady_peak_bytes: int | None
    time_per_sample_s: float | None
    unmanaged_time_per_sample_s: float | None
    time_per_sample_ratio: float | None
    verify_steps: int
    verified_steps: int | None = None  # optimizer steps the verifying run made (script may stop)
    verified: bool | None = None  # the verifying run stayed within VERIFY_TOLERANCE of memory
    planned_max: int | None = None  # the chosen policy's largest value by its plans alone
    rejected: list[dict] = field(default_factory=list)  # values whose verifying run was over
    runs: dict[str, dict] = field(default_factory=dict)  # policy -> PolicyRun (time_all)
    candidates: list[dict] = field(default_factory=list)
    search_s: float = 0.0
    plan: Any = None  # the chosen policy's Plan at ``chosen`` (not in to_dict)
    verified_state: dict | None = None  # keep_state: the verifying run's final tensors

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("plan")
        d.pop("verified_state")
        return d

    def summary(self) -> str:
        mb = _mb
        lines = [
            f"max-batch: {self.script} {self.arg} within {mb(self.memory_bytes)} "
            f"({self.memory_bytes} B) on {self.device}"
            + (
                f", predicted overhead <= {self.max_overhead:.0%}"
                if self.max_overhead is not None
                else ""
            )
        ]
        rows = [(UNMANAGED, self.unmanaged_max)] + sorted(
            self.max_by_policy.items(), key=lambda kv: (kv[0] != self.policy, kv[0])
        )
        for name, v in rows:
            mark = "  <- chosen" if name == self.policy else ""
            x = (
                f" ({v / self.unmanaged_max:.2f}x unmanaged)"
                if self.unmanaged_max and name != UNMANAGED
                else ""
            )
            run = self.runs.get(name)
            t = (
                f", {run['time_per_sample_s'] * 1e3:.2f} ms/sample measured"
                if run and run.get("time_per_sample_s")
                else ""
            )
            lines.append(f"  {name:<16} {v:>7}{x}{t}{mark}")
        for name, why in self.not_applicable.items():
            lines.append(f"  {name:<16}     n/a ({why})")
        for rej in self.rejected:
            lines.append(
                f"rejected: {self.arg} {rej['value']} measured "
                f"{rej['peak_bytes'] / self.memory_bytes:.3f} x memory in its "
                "verifying run"
            )
        if self.verified_peak_bytes is not None:
            n = self.verified_steps if self.verified_steps is not None else self.verify_steps
            short = (
                f" (of --steps {self.verify_steps}: the script stopped)"
                if n < self.verify_steps
                else ""
            )
            lines.append(
                f"verified: {n} steps{short} at {self.arg} {self.chosen} under "
                f"the {self.policy} plan: measured peak {mb(self.verified_peak_bytes)} "
                f"= {self.verified_peak_bytes / self.memory_bytes:.3f} x memory"
                + ("" if self.verified else f" (NOT within {VERIFY_TOLERANCE:.0%} of memory)")
            )
        if self.time_per_sample_ratio is not None:
            lines.append(
                f"time per sample {self.time_per_sample_s * 1e3:.3f} ms vs "
                f"{self.unmanaged_time_per_sample_s * 1e3:.3f} ms unmanaged at "
                f"{self.arg} {self.unmanaged_max}: {self.time_per_sample_ratio:.2f}x"
            )
        return "\n".join(lines)


def _mb(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def max_batch(
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    *,
    memory: str | int,
    arg: str,
    policy: str = "capuchin",
    max_overhead: float | None = None,
    min_value: int = 1,
    max_value: int = 65536,
    steps: int = 5,
    device: str = "auto",
    compare: Sequence[str] | None = COMPARISON_POLICIES,
    verify: bool = True,
    time_all: bool = False,
    keep_state: bool = False,
    log: Callable[[str], None] | None = _stderr,
) -> MaxBatchResult:
    """Find the largest value of ``script``'s option ``arg`` that trains within ``memory``.

    memory: bytes or a size (``"8G"``, ``"512MiB"``; no percentage). arg: the option, e.g.
    ``"--batch"`` (a bare ``batch`` means ``--batch``); the script must accept ``ARG N``, which is
    appended to ``script_args``. policy: the chosen policy; compare: the comparison policies also
    searched (``capuchin.maxbatch.COMPARISON_POLICIES`` by default; a policy that does not apply
    to the script is reported in ``not_applicable``). max_overhead: largest predicted overhead
    accepted, as a fraction (0.2 = 20%). min_value / max_value: the search range. steps: optimizer
    steps of each verifying run. verify: run the chosen policy at its largest value (and plain
    training at unmanaged's) for ``steps`` steps; time_all: also every compared policy at its own
    largest value. keep_state: keep the verifying run's final parameters, gradients and optimizer
    state in ``verified_state``. log: progress lines (default stderr; None: quiet).

    Raises ``MaxBatchError`` (one line) when the script does not accept ``arg``, when even
    ``min_value`` fits neither unmanaged nor under ``policy``, or when the script fails for its
    own reasons at some value. See Note [Max-batch search].
    """
    from .planner.budget import BudgetError, parse_size
    from .planner.registry import get_policy
    from .tracer.record import resolve_device_now

    log = log or (lambda line: None)
    from .runmain import check_script

    path = check_script(script)
    if str(memory).strip().endswith("%"):
        raise BudgetError(f"memory {memory}: give a size (8G, 512MiB, bytes), not a percentage")
    memory_bytes = parse_size(memory, what="memory")
    if memory_bytes < 1:
        raise BudgetError(f"memory {memory!r}: must be at least 1 byte")
    flag = arg.strip() if arg.strip().startswith("-") else f"--{arg.strip()}"
    if not re.fullmatch(r"--?[A-Za-z0-9][\w.-]*", flag):
        raise MaxBatchError(f"--arg {arg!r}: expected an option name such as --batch or -b")
    if min_value < 1 or max_value < min_value:
        raise MaxBatchError(f"--min {min_value} / --max {max_value}: need 1 <= min <= max")
    if steps < 2:
        raise MaxBatchError(f"--steps {steps}: the verifying run needs at least 2 steps")
    if max_overhead is not None and (math.isnan(max_overhead) or max_overhead < 0):
        raise MaxBatchError(
            f"--max-overhead {max_overhead:.0%}: must be a percentage >= 0 (inf: no limit)"
        )
    get_policy(policy)  # an unknown name fails here, with the list of valid ones
    others = [p for p in (compare or ()) if p != policy]
    for p in others:
        if p not in RUNTIME_MODES:
            get_policy(p)
    dev = resolve_device_now(device, "max-batch traces each candidate under the memory cap")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="capuchin-max-batch-") as tmp:
        search = _Search(
            path, list(script_args), flag, memory_bytes, dev, Path(tmp), max_overhead, log, steps
        )
        first = search.candidate(min_value)
        if not first.fits_device:
            raise MaxBatchError(
                f"{script}: memory {format_bytes(memory_bytes)} ({memory_bytes} B) is below what "
                f"{flag} {min_value} needs: it ran out of memory while traced under that cap"
            )
        if (
            first.fits_device
            and first.floor_bytes is not None
            and first.floor_bytes > memory_bytes
            and first.peak_bytes > memory_bytes
        ):
            raise MaxBatchError(
                f"{script}: memory {format_bytes(memory_bytes)} ({memory_bytes} B) is below what "
                f"{flag} {min_value} needs: its peak is {format_bytes(first.peak_bytes)} unmanaged and no "
                f"plan can go below {format_bytes(first.floor_bytes)} (what must stay resident)"
            )
        best = {policy: search.largest(policy, min_value, max_value)}
        unmanaged = search.largest(UNMANAGED, min_value, max_value)
        search.check_memory_changes()  # Note [An option that does not change memory]
        if best[policy] == 0 and unmanaged == 0:
            why = search.candidate(min_value).plans.get(policy, {})
            raise MaxBatchError(
                f"{script}: memory {format_bytes(memory_bytes)} ({memory_bytes} B) is below what "
                f"{flag} {min_value} needs: its peak is {_mb(first.peak_bytes)} unmanaged and the "
                f"{policy} plan peaks at {_mb(why.get('predicted_peak_bytes'))}"
                + (f" (or costs more than {max_overhead:.0%})" if max_overhead is not None else "")
            )
        for p in others:
            best[p] = search.largest(p, min_value, max_value)
        na = {p: search.not_applicable[p] for p in others if p in search.not_applicable}
        for p in na:
            best.pop(p, None)
        mode_runs = {
            p: _run_dict(search.runs[best[p], p]) for p in others if (best[p], p) in search.runs
        }
        chosen = best[policy]
        plan = search.plan(chosen, policy) if chosen else None
        result = MaxBatchResult(
            script=str(script),
            arg=flag,
            memory_bytes=memory_bytes,
            device=dev,
            policy=policy,
            chosen=chosen,
            unmanaged_max=unmanaged,
            max_by_policy=best,
            not_applicable=na,
            max_overhead=max_overhead,
            predicted_overhead=(plan.predictions.predicted_overhead if plan is not None else None),
            verified_peak_bytes=None,
            verified_steady_peak_bytes=None,
            time_per_sample_s=None,
            unmanaged_time_per_sample_s=None,
            time_per_sample_ratio=None,
            verify_steps=steps,
            planned_max=chosen,
            plan=plan,
            runs=mode_runs,
        )
        if verify and chosen:
            run = None
            for attempt in range(VERIFY_TRIES):  # Note [Verified, not only planned]
                log(
                    f"max-batch: verifying: {steps} steps at {flag} {chosen} under the {policy} "
                    "plan"
                )
                run = run_steps(
                    path,
                    [*script_args, flag, str(chosen)],
                    steps,
                    plan=plan,
                    device=dev,
                    keep_state=keep_state,
                )
                log(
                    f"max-batch:   measured peak {_mb(run.peak_bytes)} "
                    f"({(run.peak_bytes or 0) / memory_bytes:.3f} x memory), "
                    f"{(run.time_per_sample_s or 0) * 1e3:.3f} ms/sample"
                )
                over = (
                    run.peak_bytes is not None
                    and run.peak_bytes > (1 + VERIFY_TOLERANCE) * memory_bytes
                )
                if not over or attempt == VERIFY_TRIES - 1:
                    break
                lower = chosen - 1
                while lower >= min_value and not search.fits(lower, policy):
                    lower -= 1
                if lower < min_value:
                    break
                result.rejected.append({"value": chosen, "peak_bytes": run.peak_bytes})
                log(
                    f"max-batch:   over memory by more than {VERIFY_TOLERANCE:.0%}: "
                    f"trying {flag} {lower}"
                )
                chosen = lower
                plan = search.plan(chosen, policy)
                result.plan = plan
                result.predicted_overhead = plan.predictions.predicted_overhead
            result.chosen = best[policy] = chosen
            result.verified = not over
            result.verified_steps = run.steps
            result.verified_peak_bytes = run.peak_bytes
            result.verified_steady_peak_bytes = run.steady_peak_bytes
            result.time_per_sample_s = run.time_per_sample_s
            result.verified_state = getattr(run, "state", None)
            result.runs[policy] = _run_dict(run)
            if unmanaged:
                log(f"max-batch: timing plain training: {steps} steps at {flag} {unmanaged}")
                base = run_steps(
                    path, [*script_args, flag, str(unmanaged)], steps, plan=None, device=dev
                )
                result.runs[UNMANAGED] = _run_dict(base)
                result.unmanaged_time_per_sample_s = base.time_per_sample_s
                if base.time_per_sample_s and run.time_per_sample_s:
                    result.time_per_sample_ratio = run.time_per_sample_s / base.time_per_sample_s
            if time_all:
                for p, v in best.items():
                    if p == policy or not v or p in RUNTIME_MODES:
                        continue
                    log(f"max-batch: timing {p}: {steps} steps at {flag} {v} under its plan")
                    result.runs[p] = _run_dict(
                        run_steps(
                            path,
                            [*script_args, flag, str(v)],
                            steps,
                            plan=search.plan(v, p),
                            device=dev,
                        )
                    )
        result.candidates = [asdict(c) for _, c in sorted(search.cache.items())]
    result.search_s = time.perf_counter() - t_start
    return result


def _run_dict(run: PolicyRun) -> dict:
    d = asdict(run)
    d.pop("report", None)
    d.pop("state", None)
    return d


class _Search:
    """Traces per value (cached), plans per (value, policy) (cached), the doubling/bisection."""

    def __init__(
        self,
        script: Path,
        args: list[str],
        flag: str,
        memory_bytes: int,
        device: str,
        tmp: Path,
        max_overhead: float | None,
        log,
        steps: int = 5,
    ):
        self.script = script
        self.steps = steps
        self.runs: dict[tuple[int, str], PolicyRun | None] = {}  # (value, runtime mode) -> run
        self.args = args
        self.flag = flag
        self.memory_bytes = memory_bytes
        self.device = device
        self.tmp = tmp
        self.max_overhead = max_overhead
        self.log = log
        self.cache: dict[int, Candidate] = {}
        self.problems: dict[int, Any] = {}
        self.plans: dict[tuple[int, str], Any] = {}
        self.not_applicable: dict[str, str] = {}

    # ---- judges ------------------------------------------------------------------------------
    def fits(self, value: int, policy: str) -> bool:
        if policy in RUNTIME_MODES:
            return self._mode_fits(value, policy)
        c = self.candidate(value)
        if not c.fits_device:
            return False
        if policy == UNMANAGED:
            return c.peak_bytes <= self.memory_bytes
        if policy in self.not_applicable:
            return False
        info = c.plans.get(policy)
        if info is None:
            plan = self.plan(value, policy)
            if plan is None:
                return False
            p = plan.predictions
            info = c.plans[policy] = {
                "feasible": bool(p.feasible),
                "predicted_overhead": float(p.predicted_overhead),
                "predicted_peak_bytes": int(p.predicted_peak_bytes),
            }
            self.log(
                f"max-batch:   {self.flag} {value} {policy}: "
                + (
                    f"fits, predicted overhead {p.predicted_overhead:+.1%}"
                    if p.feasible
                    else f"does not fit (plan peaks at {format_bytes(p.predicted_peak_bytes)})"
                )
            )
        ok = info["feasible"]
        if ok and self.max_overhead is not None:
            ok = info["predicted_overhead"] <= self.max_overhead
        return ok

    def _mode_fits(self, value: int, mode: str) -> bool:
        """Note [Runtime modes]: run ``steps`` steps at ``value`` in ``mode`` under the budget."""
        key = (value, mode)
        if key not in self.runs:
            args = [*self.args, self.flag, str(value)]
            try:
                run = run_steps(
                    self.script,
                    args,
                    self.steps,
                    device=self.device,
                    mode=mode,
                    budget_bytes=self.memory_bytes,
                )
            except CapuchinError as exc:
                if not _is_oom(exc) and "out of memory" not in str(exc).lower():
                    raise
                run = None  # CUDA: a real out-of-memory error under the cap
            self.runs[key] = run
            ok = (
                run is not None
                and run.peak_bytes is not None
                and (run.peak_bytes <= (1 + VERIFY_TOLERANCE) * self.memory_bytes)
            )
            self.log(
                f"max-batch:   {self.flag} {value} {mode}: "
                + (
                    "out of memory"
                    if run is None
                    else f"measured peak {_mb(run.peak_bytes)} "
                    f"({(run.peak_bytes or 0) / self.memory_bytes:.3f} x memory): "
                    + ("fits" if ok else "does not fit")
                )
            )
        run = self.runs[key]
        return (
            run is not None
            and run.peak_bytes is not None
            and (run.peak_bytes <= (1 + VERIFY_TOLERANCE) * self.memory_bytes)
        )

    def check_memory_changes(self) -> None:
        """Note [An option that does not change memory]."""
        traced = sorted((v, c.peak_bytes) for v, c in self.cache.items() if c.peak_bytes)
        if len(traced) >= 2 and len({p for _, p in traced}) == 1:
            values = ", ".join(str(v) for v, _ in traced)
            raise MaxBatchError(
                f"{self.script}: {self.flag} does not change the script's memory: its unmanaged "
                f"peak is {format_bytes(traced[0][1])} at every value traced ({values}); does "
                f"the script use {self.flag}? (one that parses with parse_known_args accepts any "
                "option)"
            )

    def largest(self, policy: str, lo_value: int, hi_value: int) -> int:
        """Doubling from ``lo_value`` then bisection (Note [Max-batch search]); 0 if none fits."""
        if not self.fits(lo_value, policy):
            return 0
        lo, hi = lo_value, None
        while hi is None:
            if lo >= hi_value:
                return lo
            nxt = min(lo * 2, hi_value)
            if self.fits(nxt, policy):
                lo = nxt
            else:
                hi = nxt
        from .planner.improve import bisect_monotone

        lo = bisect_monotone(lambda v: not self.fits(v, policy), lo, hi) - 1  # tol 1: hi - lo == 1
        self.log(f"max-batch: {policy}: largest {self.flag} {lo}")
        return lo

    # ---- traces and plans --------------------------------------------------------------------
    def candidate(self, value: int) -> Candidate:
        c = self.cache.get(value)
        if c is None:
            c = self.cache[value] = self._trace(value)
        return c

    def _trace(self, value: int) -> Candidate:
        from .planner.problem import Problem
        from .runmain import run_as_main
        from .tracer.reader import load_trace
        from .tracing import Tracer

        out = self.tmp / f"v{value}.trace.parquet"
        args = [*self.args, self.flag, str(value)]
        c = Candidate(value)
        t0 = time.perf_counter()
        gc.collect()
        tracer = Tracer(
            out,
            iterations=1,
            warmup=1,
            device=self.device,
            force=True,
            script=str(self.script),
            argv=args,
            log=None,
            budget_bytes=self.memory_bytes,
        )
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), tracer:
                run_as_main(self.script, args)
        except (KeyboardInterrupt, Terminated):
            raise  # the user's signal, not the script's failure (exit 130 / 143)
        except BaseException as exc:  # noqa: BLE001 - classified below, re-raised as one line
            if _is_oom(exc):
                c.fits_device = False
                c.trace_s = time.perf_counter() - t0
                self.log(
                    f"max-batch: {self.flag} {value}: out of memory while tracing under "
                    f"the cap: does not fit"
                )
                gc.collect()
                return c
            raise self._script_failure(value, exc, err.getvalue()) from None
        finally:
            del tracer
        trace = load_trace(out)
        # With the persistent candidates (parameters, gradients, optimizer state): iteration 0,
        # which follows no plan, keeps the budget by swapping them too (Note [Persistent state
        # under the guard] in runtime/guards/lru.py).
        problem = Problem.from_trace(trace)
        self.problems[value] = problem
        c.peak_bytes = int(problem.peak_bytes)
        c.floor_bytes = int(problem.floor_bytes(dead=True))
        c.measured_peak_bytes = trace.meta.measured_peak_bytes
        c.iteration_time_s = problem.time_ns / 1e9
        c.trace_s = time.perf_counter() - t0
        self.log(
            f"max-batch: {self.flag} {value}: unmanaged peak {_mb(c.peak_bytes)} "
            f"({'fits' if c.peak_bytes <= self.memory_bytes else 'over'} "
            f"{_mb(self.memory_bytes)}); traced under the cap in {c.trace_s:.1f} s, measured "
            f"{_mb(c.measured_peak_bytes)}"
        )
        return c

    def _script_failure(self, value: int, exc: BaseException, stderr: str) -> MaxBatchError:
        text = stderr.strip().splitlines()
        unknown = [ln for ln in text if "unrecognized arguments" in ln]
        if unknown and self.flag in unknown[-1]:
            return MaxBatchError(
                f"{self.script}: the script does not accept {self.flag} "
                f"(its own error: {unknown[-1].strip()})"
            )
        from .tracer.record import TooFewStepsError

        if isinstance(exc, TooFewStepsError):
            return MaxBatchError(
                f"{self.script}: at {self.flag} {value} the script made {exc.steps} optimizer "
                "step(s), too few to trace one after its warm-up step: does "
                f"{self.flag} set the number of steps rather than a size?"
            )
        if isinstance(exc, ScriptError):
            # runmain's "SCRIPT raised TYPE: message" (or "exited with status N"): name the value
            msg = str(exc)
            m = re.match(r"^(.*) raised ([\w.]+): (.*)$", msg)
            if m:
                return MaxBatchError(
                    f"{m.group(1)}: the script raised {m.group(2)} at "
                    f"{self.flag} {value}: {m.group(3)}"
                )
            return MaxBatchError(f"{msg} at {self.flag} {value}")
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "(no message)"
        return MaxBatchError(
            f"{self.script}: the script raised {type(exc).__name__} at {self.flag} {value}: {first}"
        )

    def plan(self, value: int, policy: str):
        """The policy's plan at memory for the value's trace (None: it does not apply)."""
        key = (value, policy)
        if key in self.plans:
            return self.plans[key]
        from .planner.build import run_policy

        problem = self.problems.get(value)
        if problem is None:
            return None
        try:
            plan, _, _ = run_policy(problem, policy, self.memory_bytes)
        except CapuchinError as exc:
            self.not_applicable[policy] = str(exc).splitlines()[0][:160]
            self.log(
                f"max-batch:   {self.flag} {value} {policy}: does not apply ({self.not_applicable[policy]})"
            )
            plan = None
        self.plans[key] = plan
        return plan


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover
        pass
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and _is_oom(cause)


def run_steps(
    script: Path,
    args: list[str],
    steps: int,
    *,
    plan=None,
    device: str = "cpu",
    keep_state: bool = False,
    mode: str | None = None,
    budget_bytes: int | None = None,
) -> PolicyRun:
    """Run ``script`` for ``steps`` optimizer steps (stopped after the last), under ``plan``
    (a ``capuchin.Runtime`` measuring the peak), in a runtime ``mode`` with no plan (``dynamic``
    or ``lru``, Note [Runtime modes]) under ``budget_bytes``, or plain. Step times are the wall
    time between consecutive optimizer steps (the script's own data preparation included, as a
    user sees it). The script's stdout is discarded."""
    from .runtime.engine import Runtime
    from .runtime.launch import run_under

    gc.collect()
    # the cap must hold: a batch that fits only with it lifted does not fit (Note [Lifting the
    # cap] in runtime/engine.py)
    if mode is not None:
        rt = Runtime(
            budget_bytes=budget_bytes,
            device=device,
            eviction=RUNTIME_MODES[mode],
            lift_cap=False,
        )
    else:
        rt = Runtime(plan, device=device, lift_cap=False) if plan is not None else None
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ran = run_under(rt, script, args, steps=steps, keep_state=keep_state)
    except (CapuchinError, KeyboardInterrupt, Terminated):
        raise
    except BaseException as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "(no message)"
        raise MaxBatchError(
            f"{script}: the script raised {type(exc).__name__} in the "
            f"verifying run ({' '.join(args)}): {first}"
        ) from None
    stamps = ran.stamps
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    value = int(args[-1])
    tps = statistics.median(times) / value if times else None
    peak = steady = None
    report = None
    if rt is not None and rt.report is not None:
        report = rt.report.to_dict()
        peaks = [s.peak_bytes for s in rt.report.iterations if s.peak_bytes is not None]
        peak = max(peaks) if peaks else None
        st = [s.peak_bytes for s in rt.report.steady if s.peak_bytes is not None]
        steady = max(st) if st else None
    run = PolicyRun(value, peak, steady, tps, times, report, ran.steps)
    if keep_state:
        run.state = ran.state  # parameters, gradients, optimizer state and module buffers
    return run


__all__ = [
    "max_batch",
    "MaxBatchResult",
    "MaxBatchError",
    "run_steps",
    "COMPARISON_POLICIES",
    "RUNTIME_MODES",
]
